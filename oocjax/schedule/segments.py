"""Cutting a planned step into segments: separately compiled programs with transfers between them.

Inside one XLA program a plan's transfers are not where the plan put them: XLA's scheduler moves
copies and decides how long every buffer lives (measured on an H200). So a
plan runs as a chain of programs over consecutive ranges of steps. Between two programs the
executor waits for offloads (oldest first), issues prefetches, and after a program issues the
offloads of what it produced. Memory is then decided at the boundaries, where the executor holds
exactly the arrays it references.

A segment trades timing fidelity for dispatch cost, and memory for both:

* **Cuts.** Every prefetch issue step and every step an offload must be done before is a cut: a
  prefetch issued earlier than planned would take memory early, and a wait cannot fall inside a
  compiled program.
* **Memory.** A segment's device memory is coarser than the per-step model: its arguments live
  through the whole program, its results are allocated when it is launched (new parameters
  written over donated old ones excepted: XLA updates those in place), and prefetches are issued
  at its start. ``segment_bytes`` counts exactly that; a segment over the budget is split
  in halves until it fits (a one-step segment is the per-step model, which the plan fits).
  That count adds values up step by step, where XLA reuses memory inside a program: a range the
  estimate splits but that might fit whole is compiled whole and measured first
  (``cut_and_probes``), and stays whole where its program measured within the budget.
* **Cost.** A segment whose work is under ``min_segment_flops`` is merged with the next one where
  no offload would have to be waited for inside it and the merged segment still fits: launching a
  program costs tens of microseconds, which small segments cannot hide. A prefetch the merge leaves
  inside the segment is issued at its start if the segment reads it, else at the next boundary.

``measured.executed_peak`` gives the peak of the chain from the programs' measured sizes; ``schedule.chain``
puts the segments in the order they run and checks that they run at all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate, pairwise

from oocjax.schedule.layer_cuts import layer_groups, segment_signature
from oocjax.schedule.moves import Offload, Schedule
from oocjax.schedule.program import Program, Stay, Step

# A range the estimate cuts is compiled whole, to be measured, only where it would fit with what it
# allocates estimated this much lower: XLA reuses memory inside a program that the estimate, adding
# up values step by step, cannot see (a decoder layer's backward pass measured 15% under it, its
# forward pass 35%), and a range far over is not worth a compile thrown away.
PROBE_SLACK = 0.25


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Steps ``start .. stop - 1`` run as one compiled program, with the transfers around it.

    Attributes:
      start, stop: the steps it runs.
      inputs: buffers it reads that exist before it, as its arguments, in order.
      outputs: buffers it defines that are needed after it (read later, offloaded or returned).
      donated: the inputs whose last device use it is: their memory may be reused for its outputs.
      waits: offloads waited for before it runs (their device copies are released), oldest first.
      prefetches: buffers copied to the device before it runs.
      offloads: buffers copied to host after it runs.
      held_bytes: device bytes referenced when it is launched, its arguments and prefetches included.
      estimate_bytes: ``held_bytes`` plus its outputs and the estimated peak of its temporaries.
      flops: its work.
    """

    start: int
    stop: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    donated: tuple[int, ...]
    waits: tuple[int, ...]
    prefetches: tuple[int, ...]
    offloads: tuple[int, ...]
    held_bytes: int
    estimate_bytes: int
    flops: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GatheringStep(Step):
    """A step whose scratch is a collective's (``transforms.shardings.collective_scratch``: a
    contraction over a sharded dimension gathers an operand whole or sums a whole result).

    Its scratch is not held only while it runs: inside one compiled program XLA schedules a
    collective as early as its operands allow, so every gather of a segment may be live at once
    (measured: an FSDP segment of three products over sharded weights allocated 513 KiB of scratch
    per device, two whole weights, where one product's gathers are 336 KiB). A segment's estimate
    counts the scratch of all its gathering steps together; a one-step segment is still the
    per-step model the plan fits.

    Attributes:
      gathered_bytes: the part of ``transient_bytes`` that is the collective's scratch, summed over
        a segment's gathering steps (by default all of it). The rest (scratch learnt from measured
        segments, ``measured.with_measured_scratch``) is held only while the step runs, as any step's is: a
        segment's excess counts once, not once per gathering step.
    """

    gathered_bytes: int = -1

    def __post_init__(self) -> None:
        if self.gathered_bytes < 0:
            object.__setattr__(self, "gathered_bytes", self.transient_bytes)

    @property
    def own_bytes(self) -> int:
        """Its scratch held only while it runs (``transient_bytes`` beyond the gathered part)."""
        return self.transient_bytes - self.gathered_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentCost:
    """A compiled segment's own device memory, as XLA reports it (``memory_analysis``)."""

    temp_bytes: int
    output_bytes: int
    alias_bytes: int

    @property
    def launch_bytes(self) -> int:
        """What launching it allocates beyond its arguments: outputs and scratch, less the donated
        argument memory its outputs reuse."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes


def issued_before(stay: Stay, a: int, y: int) -> bool:
    """Whether a prefetched stay that starts in steps a..y-1 is issued before that segment: where
    it was planned (its start is the segment's), or earlier where the segment reads it. A prefetch
    a merge left inside a segment that does not read it waits for the next boundary instead,
    which costs no memory and delays it by less than a small segment's work."""
    return stay.start == a or stay.first_use < y


class _Segmenter:
    """Measures candidate segments of one planned program."""

    def __init__(self, program: Program, schedule: Schedule):
        self.program, self.schedule = program, schedule
        n = self.n = len(program.steps)
        nbytes = self.nbytes = [b.nbytes for b in program.buffers]
        # Per buffer, its stays on the device as the executor holds them, in start order.
        self.stays_of = [schedule.device_stays(program, b) for b in range(len(program.buffers))]
        # Bytes held at a boundary before step a: stays begun before a that last to a or later.
        diff = [0] * (n + 2)
        self.started_at: list[list[Stay]] = [[] for _ in range(n + 1)]
        for stay in (stay for stays in self.stays_of for stay in stays):
            first, last = stay.start + 1, min(stay.end, n)
            if first <= last:
                diff[first] += nbytes[stay.buffer]
                diff[last + 1] -= nbytes[stay.buffer]
            if stay.start >= 0:
                self.started_at[stay.start].append(stay)
        self.held_before = list(accumulate(diff[: n + 1]))
        # Cuts that would part an old donated value's last read from the write of the result XLA
        # is to put in its place (an optimizer's new moment over the old): both would be held.
        uses = program.uses
        self.parting: set[int] = set()
        for b, buffer in enumerate(program.buffers):
            written, old = uses.defined_at[b], buffer.aliased_input
            if old is not None and written is not None:
                read = [k for k in uses.read_at[old] if k <= written]
                self.parting.update(range(read[-1] + 1, written + 1) if read else ())

    def fits_as_one(self, a: int, y: int) -> bool:
        """Whether no offload would have to be both issued and waited for inside steps a..y-1."""
        return not any(m.done_before_step is not None and m.done_before_step < y for m in self._offloads_issued(a, y))

    def _offloads_issued(self, a: int, y: int) -> list[Offload]:
        """The offloads issued after steps a..y-1, in the order they start (step by step, and in the
        schedule's order within a step)."""
        after_step = self.schedule.offloads_by_after_step
        return [m for k in range(a, y) for m in after_step.get(k, ())]

    def _waits(self, a: int, y: int) -> list[Offload]:
        """The offloads steps a..y-1 wait for, oldest first (in issue order)."""
        waits = [m for k in range(a, y) for m in self.schedule.waits_by_step.get(k, ()) if isinstance(m, Offload)]
        return sorted(waits, key=lambda m: m.after_step)

    def estimate(self, a: int, y: int) -> tuple[int, int]:
        """(held bytes at launch, estimated device peak) of steps a..y-1 as one segment.

        Its results needed later are allocated when it is launched, except those written in place
        of an argument donated to it (``_aliased_bytes``)."""
        nbytes, steps = self.nbytes, self.program.steps
        held = self.held_before[a]
        external = internal_peak = 0
        results: list[int] = []  # needed after it
        ending: dict[int, int] = defaultdict(int)  # step -> internal bytes freed after it
        live = gathered = 0
        for k in range(a, y):
            for stay in self.started_at[k]:
                size = nbytes[stay.buffer]
                if stay.prefetched:
                    if issued_before(stay, a, y):
                        held += size
                elif stay.needed_after(y):
                    external += size
                    results.append(stay.buffer)
                else:
                    live += size
                    ending[stay.end] += size
            step = steps[k]
            if isinstance(step, GatheringStep):  # its gathers are held for the whole program
                gathered += step.gathered_bytes
                internal_peak = max(internal_peak, live + step.own_bytes)
            else:
                internal_peak = max(internal_peak, live + step.transient_bytes)
            live -= ending.pop(k, 0)
        external -= self._aliased_bytes(a, y, results)
        return held, held + external + internal_peak + gathered

    def _aliased_bytes(self, a: int, y: int, results: list[int]) -> int:
        """Bytes of ``results`` of steps a..y-1 written over the memory of the step's arguments
        they replace (``Buffer.aliased_input``: new parameters over the old), where those are
        donated to this segment: XLA updates them in place. Other results of a donated argument's
        type may take its memory too, but inside a fused program XLA often computes them into
        scratch first (measured on the CPU), so no other result counts as in place."""
        replacing = [(b, i) for b in results if (i := self.program.buffers[b].aliased_input) is not None]
        if not replacing:
            return 0
        inputs = set(self._inputs(a, y))
        return sum(self.nbytes[b] for b, i in replacing if i in inputs and self._owned_and_last_used(i, a, y))

    def _inputs(self, a: int, y: int) -> tuple[int, ...]:
        """The buffers steps a..y-1 read that exist before them, in order of first read."""
        steps = self.program.steps[a:y]
        defined_here = {b for step in steps for b in step.writes}
        return tuple(dict.fromkeys(b for step in steps for b in step.reads if b not in defined_here))

    def prefetches(self, a: int, y: int, previous: int | None) -> tuple[int, ...]:
        """The buffers prefetched before steps a..y-1 run (``previous``: the start of the segment
        before, whose deferred prefetches come here)."""
        issued = [s for k in range(a, y) for s in self.started_at[k] if s.prefetched and issued_before(s, a, y)]
        if previous is not None:
            issued += [
                s for k in range(previous + 1, a) for s in self.started_at[k] if s.prefetched and s.first_use >= a
            ]
        return tuple(s.buffer for s in issued)

    def flops(self, a: int, y: int) -> int:
        return sum(s.flops for s in self.program.steps[a:y])

    def measured_launch(self, a: int, y: int, measured: Mapping[tuple, int] | None) -> int | None:
        """What launching the program of steps a..y-1 allocated (``measured``: launch bytes by
        ``segment_signature``), where it was measured."""
        return measured.get(segment_signature(self.program, a, y)) if measured else None

    def split_to_fit(self, a: int, y: int, budget: int, scale: float = 1.0) -> list[tuple[int, int]]:
        """Steps a..y-1 as few segments as fit ``budget`` by the estimate, what each allocates
        times ``scale``: from each start, the longest that fits, a step alone where none does.
        Each is a program to compile: halving instead cut the 4-layer test-zoo transformer's turn
        from forward to backward into 19 segments where 10 fit."""
        ranges = []
        while a < y:
            stop = self._longest_fitting(a, y, budget, scale)
            ranges.append((a, stop))
            a = stop
        return ranges

    def _longest_fitting(self, a: int, y: int, budget: int, scale: float) -> int:
        """The stop of a long segment from step ``a`` (before ``y``) that fits ``budget``, found by
        halving the whole rest of the range: the estimate is not monotone (a longer segment may
        hold less, where a result it returned becomes a value inside it), and a search that grows
        the segment from ``a`` stops at the first that does not fit (the 4-layer zoo transformer
        got 27 segments so, not 21). Each search costs the rest's length times a logarithm. Not
        where it would part an old donated value from the result written over it (``parting``),
        if a few steps less fit."""

        def fits(stop: int) -> bool:
            held, estimate = self.estimate(a, stop)
            return held + scale * (estimate - held) <= budget

        if y - a <= 1 or fits(y):
            return y
        lo, hi = a + 1, y - 1  # a step alone, whether it fits or not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo in self.parting:
            apart = next((k for k in range(lo - 1, max(a, lo - 16), -1) if k not in self.parting), None)
            if apart is not None and fits(apart):
                return apart
        return lo

    def segment(self, a: int, y: int, previous: int | None) -> Segment:
        # In the order they are made, not by id: alike layers number their values in another order
        # (an optimizer traced over a tree of parameters sorted by name) but make them alike.
        defined_here = [b for step in self.program.steps[a:y] for b in step.writes]
        inputs = self._inputs(a, y)
        held, estimate = self.estimate(a, y)
        return Segment(
            start=a,
            stop=y,
            inputs=inputs,
            outputs=tuple(b for b in defined_here if self.stays_of[b][0].needed_after(y)),
            donated=tuple(b for b in inputs if self._owned_and_last_used(b, a, y)),
            waits=tuple(m.buffer for m in self._waits(a, y)),
            prefetches=self.prefetches(a, y, previous),
            offloads=tuple(m.buffer for m in self._offloads_issued(a, y)),
            held_bytes=held,
            estimate_bytes=estimate,
            flops=self.flops(a, y),
        )

    def _owned_and_last_used(self, b: int, a: int, y: int) -> bool:
        """Whether the copy of input ``b`` that steps a..y-1 read may be donated to them: it is the
        executor's own (computed, prefetched, or an argument the caller donated) and nothing after
        them reads it."""
        stays = self.stays_of[b]
        prefetched_here = [s for s in stays if s.prefetched and a <= s.start < y]
        stay = prefetched_here[-1] if prefetched_here else next(s for s in stays if s.start < a <= s.end)
        buffer = self.program.buffers[b]
        owned = stay.prefetched or buffer.kind == "computed" or (buffer.kind == "input" and buffer.donated)
        return owned and not stay.needed_after(y)


@dataclass(frozen=True, slots=True, kw_only=True)
class CutOptions:
    """How a planned program is cut (``cut_segments``, ``cut_and_probes``): every segment fits
    ``budget_bytes``; one with less work than ``min_segment_flops`` joins the next where that
    fits; ``min_segments`` at least; ``cut_before`` steps start one; ``layers`` alike start
    segments, to share programs (``layer_groups``); ``copies`` (``(original, copy)`` steps) never
    share one; ``measured``: ``(segment_signature, launch bytes)`` of ranges compiled whole
    (``cut_and_probes``), which stay whole where they measured to fit."""

    budget_bytes: int
    min_segment_flops: int = 0
    min_segments: int = 1
    cut_before: frozenset[int] = frozenset()
    layers: tuple[tuple[int, int, str], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    measured: tuple[tuple[tuple, int], ...] = ()


def cut_segments(program: Program, schedule: Schedule, cut: CutOptions | None = None, **options) -> tuple[Segment, ...]:
    """Cuts a planned program into segments that each fit the budget by the estimate, as ``cut``
    says (or a ``CutOptions`` of ``options``).

    >>> from oocjax.schedule import Program, keep_all
    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"])], {"x": 8, "y": 8, "z": 8},
    ...                      inputs=["x"], outputs=["z"])
    >>> [(s.start, s.stop, s.inputs, s.outputs) for s in cut_segments(p, keep_all(p), budget_bytes=64)]
    [(0, 2, (0,), (2,))]
    """
    return cut_and_probes(program, schedule, cut or CutOptions(**options), probing=False)[0]


def cut_and_probes(
    program: Program, schedule: Schedule, cut: CutOptions, probing: bool = True
) -> tuple[tuple[Segment, ...], dict]:
    """``cut_segments``, and (``probing``) the ranges between ``cut``'s bounds that those segments cut
    into pieces by the estimate and that might fit whole, or keep whole and that might not
    (``PROBE_SLACK`` either way), each as one segment by its ``segment_signature``, one per signature
    not in ``cut.measured``: to compile and measure, then plan or cut again with what they measured.
    On the 4-layer decoder of ``examples/decoders.py`` at 30% of its in-core peak, a layer's backward
    pass estimated at 7.40 MB measured 6.28 MB (two of the four backward layers were cut into 6
    and 10 pieces by the estimate, each a program to compile); planned by layer, a backward layer
    with its update measured 3% over its estimate of 7.10 MB."""
    if not program.steps:
        return (), {}
    cutter, (bounds, hard) = _Segmenter(program, schedule), _bounds(program, schedule, cut)
    original_of, measured, budget_bytes = dict((c, o) for o, c in cut.copies), dict(cut.measured), cut.budget_bytes

    def split(a: int, y: int) -> list[tuple[int, int]]:
        launch = None if _mixes(a, y, original_of) else cutter.measured_launch(a, y, measured)
        if launch is None:
            return cutter.split_to_fit(a, y, budget_bytes)
        held, estimate = cutter.estimate(a, y)
        if cutter.fits_as_one(a, y) and held + launch <= budget_bytes:
            return [(a, y)]
        # Its program measured over the budget; where the estimate was high for the whole, it is
        # high for its parts too: they are cut by the estimate scaled as the whole measured (a
        # 4-layer decoder's top backward layer, 7 KB over, was cut into 8 by the estimate alone).
        return cutter.split_to_fit(a, y, budget_bytes, min(launch / max(estimate - held, 1), 1.0))

    ranges = [r for a, y in pairwise(bounds) for r in split(a, y)]
    ranges = [r for a, y in ranges for r in _apart(a, y, original_of)]
    if cut.min_segments <= 1:
        ranges = _merge_small(cutter, ranges, budget_bytes, cut.min_segment_flops, hard, original_of)
    starts = [None, *(a for a, _ in ranges)]
    segments = tuple(cutter.segment(a, y, previous) for (a, y), previous in zip(ranges, starts))
    if cut.min_segments > 1 or not probing:  # cut for a count: as the estimate says
        return segments, {}
    whole, probes = {(s.start, s.stop) for s in segments}, {}
    for a, y in pairwise(bounds):
        if not cutter.fits_as_one(a, y) or _mixes(a, y, original_of):
            continue
        held, estimate = cutter.estimate(a, y)
        low, high = (held + (1 + d) * (estimate - held) for d in (-PROBE_SLACK, PROBE_SLACK))
        if (low <= budget_bytes < estimate) if (a, y) not in whole else (estimate <= budget_bytes < high):
            signature = segment_signature(program, a, y)
            if signature not in measured:
                probes.setdefault(signature, cutter.segment(a, y, None))
    return segments, probes


def _bounds(program: Program, schedule: Schedule, cut: CutOptions) -> tuple[list[int], frozenset[int]]:
    """The steps segments must start at (the step count last), and those no merge may remove."""
    n = len(program.steps)
    groups = layer_groups(program, cut.layers, cut.min_segment_flops)
    cuts = {0, *schedule.copy_steps, *schedule.segment_starts}
    if cut.min_segments > 1:
        cuts |= {n * i // cut.min_segments for i in range(cut.min_segments)}
    hard = frozenset(cut.cut_before) | {bound for group in groups for bound in group}
    return [*sorted(c for c in cuts | hard if c < n), n], hard


def _apart(a: int, y: int, original_of: dict[int, int]) -> list[tuple[int, int]]:
    """Steps a..y-1 cut before every copy that would otherwise share its segment with its original
    or with another copy of it."""
    ranges, start = [], a
    for k in sorted(c for c in original_of if a <= c < y):
        if _mixes(start, k + 1, original_of):
            ranges.append((start, k))
            start = k
    return [*ranges, (start, y)]


def _mixes(a: int, y: int, original_of: dict[int, int]) -> bool:
    """Whether steps a..y-1 hold a copy together with its original or another copy of it."""
    seen: set[int] = set()
    for k in sorted(c for c in original_of if a <= c < y):
        original = original_of[k]
        if original >= a or original in seen:
            return True
        seen.add(original)
    return False


def _merge_small(
    cutter: _Segmenter,
    ranges: list[tuple[int, int]],
    budget: int,
    min_flops: int,
    hard: frozenset[int],
    original_of: dict[int, int],
) -> list[tuple[int, int]]:
    merged = [ranges[0]]
    for a, y in ranges[1:]:
        start, stop = merged[-1]
        small = cutter.flops(start, stop) < min_flops or cutter.flops(a, y) < min_flops
        if (
            small
            and a not in hard
            and not (original_of and _mixes(start, y, original_of))
            and cutter.fits_as_one(start, y)
            and cutter.estimate(start, y)[1] <= budget
        ):
            merged[-1] = (start, y)
        else:
            merged.append((a, y))
    return merged
