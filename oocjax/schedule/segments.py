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
* **Cost.** A segment whose work is under ``min_segment_flops`` is merged with the next one where
  no offload would have to be waited for inside it and the merged segment still fits: launching a
  program costs tens of microseconds, which small segments cannot hide. A prefetch the merge leaves
  inside the segment is issued at its start if the segment reads it, else at the next boundary.

``executed_peak`` gives the peak of the chain from the programs' measured sizes, and
``check_segments`` replays the chain on a fake device to check that it runs at all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise

from oocjax.schedule.moves import Offload, Schedule
from oocjax.schedule.program import Program, Stay, Step
from oocjax.schedule.simulate import Violation


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
        segments, ``with_measured_scratch``) is held only while the step runs, as any step's is: a
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

    def split_to_fit(self, a: int, y: int, budget: int) -> list[tuple[int, int]]:
        if y - a <= 1 or self.estimate(a, y)[1] <= budget:
            return [(a, y)]
        middle = (a + y) // 2
        return self.split_to_fit(a, middle, budget) + self.split_to_fit(middle, y, budget)

    def segment(self, a: int, y: int, previous: int | None) -> Segment:
        defined_here = {b for step in self.program.steps[a:y] for b in step.writes}
        inputs = self._inputs(a, y)
        held, estimate = self.estimate(a, y)
        return Segment(
            start=a,
            stop=y,
            inputs=inputs,
            outputs=tuple(b for b in sorted(defined_here) if self.stays_of[b][0].needed_after(y)),
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


def cut_segments(
    program: Program,
    schedule: Schedule,
    *,
    budget_bytes: int,
    min_segment_flops: int = 0,
    min_segments: int = 1,
    cut_before: Iterable[int] = (),
    layers: Sequence[tuple[int, int, str]] = (),
    copies: Sequence[tuple[int, int]] = (),
) -> tuple[Segment, ...]:
    """Cuts a planned program into segments that each fit ``budget_bytes`` by the estimate.

    Args:
      program, schedule: the step and its plan.
      budget_bytes: the device budget every segment must fit, arguments and results included.
      min_segment_flops: merge a segment with less work into the next one where that still fits.
      min_segments: cut into at least this many segments (for measuring the executor's overhead).
      cut_before: steps that must start a segment, never merged away.
      layers: ``(start, stop, kind)`` per run of a layer's steps (``transforms.layers``): groups
        of layers alike start segments (``layer_cuts``), so that they share programs.
      copies: ``(original, copy)`` steps never to run in one segment (where the compiler would
        merge a recomputed value back into its original inside one program).

    >>> from oocjax.schedule import Program, keep_all
    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"])], {"x": 8, "y": 8, "z": 8},
    ...                      inputs=["x"], outputs=["z"])
    >>> [(s.start, s.stop, s.inputs, s.outputs) for s in cut_segments(p, keep_all(p), budget_bytes=64)]
    [(0, 2, (0,), (2,))]
    """
    n = len(program.steps)
    if n == 0:
        return ()
    cutter = _Segmenter(program, schedule)
    cuts = {0, *(m.issue_step for m in schedule.prefetches)}
    cuts |= {m.done_before_step for m in schedule.offloads if m.done_before_step is not None}
    if min_segments > 1:
        cuts |= {n * i // min_segments for i in range(min_segments)}
    hard = frozenset(cut_before) | layer_cuts(program, layers, min_segment_flops)
    bounds = [*sorted(c for c in cuts | hard if c < n), n]
    ranges = [r for a, y in pairwise(bounds) for r in cutter.split_to_fit(a, y, budget_bytes)]
    original_of = dict((c, o) for o, c in copies)
    ranges = [r for a, y in ranges for r in _apart(a, y, original_of)]
    if min_segments <= 1:
        ranges = _merge_small(cutter, ranges, budget_bytes, min_segment_flops, hard, original_of)
    starts = [None, *(a for a, _ in ranges)]
    return tuple(cutter.segment(a, y, previous) for (a, y), previous in zip(ranges, starts))


def layer_cuts(program: Program, layers: Sequence[tuple[int, int, str]], min_flops: int) -> frozenset[int]:
    """The steps where groups of layers alike begin, and where the last of them ends.

    In each pass (a kind's first word tells the backward's from the forward's), the runs of layers
    are taken in groups of whole periods of their kinds (``Conv, BatchNorm, Conv, BatchNorm``: 2),
    enough periods for ``min_flops`` of work. A group is cut out only where another group of the
    pass is alike (``_signature``: the same operations on the same sizes, keeping the same values
    for later), so that they run one compiled program; a group like no other is left to the cuts
    the plan needs. A cut that buys no sharing costs a launch, compiles a program more and moves
    where XLA rounds low-precision values.

    >>> from oocjax.schedule import Program
    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("f", ["y"], ["z"]), ("h", ["z"], ["w"])],
    ...                      {"x": 8, "y": 8, "z": 8, "w": 8}, inputs=["x"], outputs=["w"])
    >>> sorted(layer_cuts(p, [(0, 1, "Dense"), (1, 2, "Dense")], min_flops=0))  # two layers alike
    [0, 1, 2]
    >>> sorted(layer_cuts(p, [(0, 1, "Dense"), (1, 3, "Dense")], min_flops=0))  # the second is not
    []
    """
    cuts: set[int] = set()
    for runs in _passes(layers):
        kinds = [kind for _, _, kind in runs]
        period = next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[:-p] or p == len(kinds))
        blocks = [runs[i : i + period] for i in range(0, len(runs), period)]
        flops = sorted(sum(s.flops for a, y, _ in block for s in program.steps[a:y]) for block in blocks)
        per_group = period * max(1, -(-min_flops // max(flops[len(flops) // 2], 1)))
        starts = [runs[i][0] for i in range(0, len(runs), per_group)]
        bounds = [*starts, runs[-1][1]]
        signatures = [_signature(program, a, y) for a, y in pairwise(bounds)]
        shared = [signatures.count(sig) > 1 for sig in signatures]
        for i, start in enumerate(starts):
            if shared[i] or (i and shared[i - 1]):
                cuts.add(start)
        if shared[-1]:
            cuts.add(bounds[-1])
    return frozenset(cuts)


def _signature(program: Program, a: int, y: int) -> tuple:
    """What steps a..y-1 compile to, as far as the planner sees: each step's operation, its operands
    (a value defined in the range by position, else by size), its results' sizes and whether
    steps after the range read them."""
    local: dict[int, int] = {}
    spans, buffers = program.unmoved_spans, program.buffers
    signature = []
    for step in program.steps[a:y]:
        operands = tuple(local.get(b, -buffers[b].nbytes - 1) for b in step.reads)
        results = tuple((buffers[b].nbytes, spans[b][1] >= y) for b in step.writes)
        local.update((b, len(local)) for b in step.writes)
        signature.append((step.name, operands, results, step.flops))
    return tuple(signature)


def _passes(layers: Sequence[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """The layer runs split where the pass changes (forward, backward: the kind's first word)."""
    passes: list[list[tuple[int, int, str]]] = []
    phase = None
    for run in layers:
        kind = run[2]
        this = kind.split(" ")[0] if " " in kind else ""
        if not passes or this != phase:
            passes.append([])
            phase = this
        passes[-1].append(run)
    return passes


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
        fits = (
            not (original_of and _mixes(start, y, original_of))
            and cutter.fits_as_one(start, y)
            and cutter.estimate(start, y)[1] <= budget
        )
        if small and a not in hard and fits:
            merged[-1] = (start, y)
        else:
            merged.append((a, y))
    return merged


def executed_peak(segments: tuple[Segment, ...], costs: tuple[SegmentCost, ...]) -> tuple[int, int | None]:
    """(peak device bytes, the segment that reaches it) of the chain with measured programs: per
    segment, what the executor holds when it launches it plus what launching it allocates."""
    peaks = [s.held_bytes + c.launch_bytes for s, c in zip(segments, costs, strict=True)]
    if not peaks:
        return 0, None
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    return peaks[worst], worst


def with_measured_scratch(
    program: Program, segments: tuple[Segment, ...], costs: tuple[SegmentCost, ...], budget_bytes: int
) -> Program:
    """``program`` with the memory its compiled segments need beyond the estimate added as scratch
    of their steps: planned again, less is held around them. Every underestimate is fed back, not
    only those that broke the budget, so that the next plan does not meet them one by one.

    A segment's excess is one amount, counted once by its estimate: a ``GatheringStep`` keeps its
    gathered scratch apart (``gathered_bytes``, summed over the segment), and the excess joins the
    scratch it holds only while it runs (the segment's peak over its steps), as for any step."""
    transient = [step.transient_bytes for step in program.steps]
    for segment, cost in zip(segments, costs, strict=True):
        excess = cost.launch_bytes - (segment.estimate_bytes - segment.held_bytes)
        if segment.held_bytes + cost.launch_bytes > budget_bytes:
            excess = max(excess, segment.held_bytes + cost.launch_bytes - budget_bytes)
        if excess <= 0:
            continue
        for k in range(segment.start, segment.stop):
            transient[k] += excess
    steps = tuple(
        step if extra == step.transient_bytes else replace(step, transient_bytes=extra)
        for step, extra in zip(program.steps, transient)
    )
    return Program(steps=steps, buffers=program.buffers)


def check_segments(program: Program, schedule: Schedule, segments: Sequence[Segment]) -> tuple[Violation, ...]:
    """Every way the chain of ``segments`` would fail to run, found by running it on a fake device.

    The replay follows ``transforms.segment.chain_function`` and the executor: arguments start in
    host memory (``schedule.host_inputs``) or on the device, constants on the device; before each
    segment its waits and prefetches need a host copy; its launch reads ``segment.inputs`` from the
    device and consumes (deletes) the copies it donates; its outputs are then on the device, and
    its offloads need a live device copy. At the end each output must be in its memory (host for
    ``schedule.host_outputs``). A use of a copy that is missing or was donated is a violation naming
    the buffer, the segment and what happened. ``validate`` checks the plan's memory; this checks
    that its segments run. Linear in the segments' lists and the steps' reads. Empty when it runs.

    >>> from oocjax.schedule import Program, keep_all
    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"])], {"x": 8, "y": 8, "z": 8},
    ...                      inputs=["x"], outputs=["z"])
    >>> check_segments(p, keep_all(p), cut_segments(p, keep_all(p), budget_bytes=64))
    ()
    >>> lost = [replace(s, outputs=()) for s in cut_segments(p, keep_all(p), budget_bytes=64, min_segments=2)]
    >>> [v.message for v in check_segments(p, keep_all(p), lost)]  # doctest: +NORMALIZE_WHITESPACE
    ['buffer 1 (y) is read by segment 1 (step 1), but it is not on the device: it is not an output
      of any segment so far, and no prefetch brings it in',
     'buffer 2 (z) is returned on the device, but it is not on the device: it is not an output of
      any segment so far, and no prefetch brings it in']
    """
    replay = _ChainReplay(program, schedule, segments)
    replay.check_order()
    for i, segment in enumerate(segments):
        replay.run(i, segment)
    replay.check_returned()
    return tuple(replay.violations)


# The state of one copy (on the device, or on host) of a buffer during the replay. Only donation
# deletes a copy early: the executor drops a value after its last use in the chain, which by
# construction comes after every use the replay checks, so drops are not replayed.
_ABSENT, _LIVE, _DONATED = 0, 1, 2


class _ChainReplay:
    """The fake device and host of one replay: per buffer, the state of each copy."""

    __slots__ = ("device", "donated_by", "host", "owned", "program", "schedule", "segments", "violations")

    def __init__(self, program: Program, schedule: Schedule, segments: Sequence[Segment]):
        self.program, self.schedule, self.segments = program, schedule, segments
        count = len(program.buffers)
        self.device, self.host = [_ABSENT] * count, [_ABSENT] * count
        # Whether the executor owns the device copy, so a launch may consume it: it made it (a
        # result, a prefetch), or the caller donated the argument. A caller's kept argument or a
        # constant donated to a segment would be deleted under the caller or the next call.
        self.owned = [False] * count
        self.donated_by = [-1] * count  # the segment that consumed the device copy
        self.violations: list[Violation] = []
        for b, buffer in enumerate(program.buffers):
            if buffer.kind == "input" and b in schedule.host_inputs:
                self.host[b] = _LIVE
            elif buffer.kind != "computed":
                self.device[b], self.owned[b] = _LIVE, buffer.donated

    def check_order(self) -> None:
        """The segments must run every step once, in order."""
        stop, n = 0, len(self.program.steps)
        for i, segment in enumerate(self.segments):
            if segment.start != stop or segment.stop <= segment.start:
                what = f"{self._where(i)} should start at step {stop}, where the one before ends, and run a step"
                self.violations.append(Violation(kind="bad-segment", step=segment.start, message=what))
            stop = segment.stop
        if stop != n:
            what = f"the segments end before step {stop}, but the program has {n} steps"
            self.violations.append(Violation(kind="bad-segment", step=stop, message=what))

    def run(self, i: int, segment: Segment) -> None:
        """Segment ``i`` as the chain runs it: waits, prefetches, the launch, offloads."""
        for b in segment.waits:
            self._need_host(b, f"is waited for before {self._where(i)}", "no earlier segment offloads it", i)
        for b in segment.prefetches:
            why = "it is not a host input and no earlier segment offloads it"
            self._need_host(b, f"is prefetched before {self._where(i)}", why, i)
            # The copy counts as made even where it could not be, here and for offloads below: one
            # fault is reported once, not again at every later use of the copy.
            self.device[b], self.owned[b] = _LIVE, True
        self._check_body(i, segment)
        for b in segment.inputs:
            self._need_device(b, f"is read by {self._where(i)}", i)
        donated = set(segment.donated)
        for b in segment.inputs:  # the segment's function donates by argument position: inputs only
            if b not in donated:
                continue
            if self.device[b] == _LIVE and not self.owned[b]:
                what = f"is donated to {self._where(i)}, but its device copy is the caller's ({self._whose(b)})"
                self.violations.append(self._about("donates-caller-buffer", b, what, i))
            self.device[b], self.donated_by[b] = _DONATED, i
        for b in segment.outputs:
            self.device[b], self.owned[b] = _LIVE, True
        for b in segment.offloads:
            self._need_device(b, f"is offloaded after {self._where(i)}", i)
            self.host[b] = _LIVE

    def check_returned(self) -> None:
        """Each output must be where the step returns it: on host or on the device."""
        for b, buffer in enumerate(self.program.buffers):
            if not buffer.is_output:
                continue
            if b in self.schedule.host_outputs:
                self._need_host(b, "is returned on host", "it is not a host input and no segment offloads it")
            else:
                self._need_device(b, "is returned on the device")

    def _check_body(self, i: int, segment: Segment) -> None:
        """A segment's steps may read only its inputs and what its earlier steps define, and it can
        return only what it defines (``transforms.segment`` builds its function from these lists)."""
        steps, known = self.program.steps[segment.start : segment.stop], set(segment.inputs)
        for k, step in enumerate(steps, segment.start):
            for b in step.reads:
                if b not in known:
                    what = f"is read at step {k} in {self._where(i)}, which neither takes it as an input nor defines it"
                    self.violations.append(self._about("bad-segment", b, what, i))
            known.update(step.writes)
        defined = {b for step in steps for b in step.writes}
        for b in segment.outputs:
            if b not in defined:
                self.violations.append(
                    self._about("bad-segment", b, f"is an output of {self._where(i)}, which does not define it", i)
                )

    def _need_device(self, b: int, what: str, i: int | None = None) -> None:
        """A violation saying why, where ``b`` has no live device copy."""
        state = self.device[b]
        if state == _LIVE:
            return
        if state == _DONATED:
            why = f"{self._where(self.donated_by[b])} consumed its device copy (it was donated there)"
            self.violations.append(self._about("use-after-donation", b, f"{what}, but {why}", i))
        else:
            why = (
                "it lives in host memory and no prefetch brings it in"
                if self.host[b] == _LIVE and self.program.buffers[b].kind == "input"
                else "it is not an output of any segment so far, and no prefetch brings it in"
            )
            self.violations.append(
                self._about("missing-device-copy", b, f"{what}, but it is not on the device: {why}", i)
            )

    def _need_host(self, b: int, what: str, why: str, i: int | None = None) -> None:
        if self.host[b] != _LIVE:
            self.violations.append(self._about("missing-host-copy", b, f"{what}, but it has no host copy: {why}", i))

    def _about(self, kind: str, b: int, what: str, i: int | None) -> Violation:
        step = None if i is None else self.segments[i].start
        return Violation(kind=kind, step=step, buffer=b, message=f"buffer {b} ({self.program.buffers[b].label}) {what}")

    def _where(self, i: int) -> str:
        segment = self.segments[i]
        last = segment.stop - 1
        steps = f"step {segment.start}" if last <= segment.start else f"steps {segment.start}..{last}"
        return f"segment {i} ({steps})"

    def _whose(self, b: int) -> str:
        buffer = self.program.buffers[b]
        return "a constant" if buffer.kind == "constant" else "an argument the caller keeps"
