"""Swap or recompute: dropping a value after its early reads and computing it again for its late ones.

Swapping alone cannot be fast when a program holds far more than the budget at one instant (the
turn from forward to backward): every byte over the budget there leaves the device before that
step and comes back after it, so the two link directions cannot overlap (``pressure_bound``).
Recomputation removes those bytes instead, at the price of running some equations twice. This is
the choice PoocH (Ito et al. 2019, arXiv 1907.05013) makes per layer and Capuchin (Peng et al.,
ASPLOS'20) makes per tensor, ranking candidates by bytes saved per second of recomputation.

**The rewrite** (``recompute_program``). Recomputation is a ``Program`` -> ``Program`` rewrite, made
before the window planner, so liveness, the planner, the simulator and the
executor need no change. For each *target* (a computed value), its touches (its definition, then
its reads) are split at one run of steps with no touch: by default the longest (the first on a
tie), or the one containing a given step. The reads before it are served by the original, which
therefore dies after the last of them (right after its definition when the run comes first). The
first step after the run that needs the value (a late read, or a copy for another target) gets a
copy of the producing step just before it, writing fresh buffers, and that copy serves every later
read. A split after the last read leaves only the second kind of need: the value is recomputed
only if another copy reads it. A copy's inputs follow the closure rule: an argument or constant, a
value that is not a target, or a target still in its early life is *available* and read as is (its
life extends); a target already dropped is read from its copy, made first (recursively) if there is
none yet. So each target is recomputed at most once, and only producers of targets are copied.
(Targets that feed each other are therefore recomputed once and kept: recomputing a whole chain at
its first late read holds it again from there.)

Original buffers keep their ids and flags, and the original steps keep their order; copies are
appended as ``computed`` buffers labelled "recompute of <label>". ``Rewrite.origin_step`` and
``origin_buffer`` say what each new step runs and what each new buffer holds, so the transforms
layer can bind the original equations with remapped buffers.

**The selector** (``choose_recompute``): the pressure phase of a swap-or-recompute choice,
greedy as in Capuchin. At the in-core peak step of the program rewritten so far, the candidates are
the original computed values live across it (not read there), not yet chosen, whose producer may be
recomputed. They are grouped into classes of identical layers (same operation, source label, FLOPs
and operand sizes, the same result of it), so repeated layers get one decision and keep sharing
compiled programs. A candidate whose producer reads values dead at the peak comes with its *chain*
(``_chain``): those inputs that may be recomputed join the targets too (dropped after their last
read, so they stay as they were early and are recomputed only by the candidate's copy), walked
back up to 8 values; without them the copy would hold them again across the peak (the attention
probabilities of a GPT: exp reads the 512 MiB shifted scores, dead at the turn, and is only worth
recomputing with them). A candidate's estimated saving is its size less the inputs that the
chain brings back to life across the peak (those that cannot join it); the class with the most
bytes saved per recompute-second (``DeviceProfile.compute_seconds`` of the chains' producers)
joins the targets, split across the peak, and
the *original* program is rewritten with all targets (so the closure rule sees every choice). The
pick is kept if it lowers the in-core peak, or keeps it and lowers the bytes over the budget summed
over the steps, and if it does not raise the smallest feasible budget (``required_bytes``) above
the budget when the original's was within it; a class that fails is not tried again. Each pick is
one rewrite and a few linear passes.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from operator import attrgetter

from oocjax.schedule._gc import gc_paused
from oocjax.schedule.baselines import keep_all
from oocjax.schedule.cost import DEFAULT_PROFILE, DeviceProfile, resolve_profile
from oocjax.schedule.program import Buffer, Program, Step
from oocjax.schedule.simulate import simulate
from oocjax.schedule.units import MiB
from oocjax.schedule.window import required_bytes

Recomputable = Callable[[int], bool]  # step index -> whether its equation may run twice (effect-free)


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    """A target that was not recomputed: the buffer (an id of the program asked about) and why."""

    buffer: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rewrite:
    """A program with recomputation, and how it maps back to the original.

    Attributes:
      program: the rewritten program.
      origin_step: per new step, the original step it runs (originals and copies alike).
      origin_buffer: per new buffer, the original buffer whose value it holds.
      copied_steps: the new steps that are copies (ascending); every other step is an original.
      recomputed: the original buffers that were dropped and recomputed (ascending).
      skipped: targets (or candidates) left alone, with the reason.
      extra_flops: the copies' arithmetic work.
      peak_bytes_before, peak_bytes: device peak with nothing moved, before and after.
    """

    program: Program
    origin_step: tuple[int, ...]
    origin_buffer: tuple[int, ...]
    copied_steps: tuple[int, ...]
    recomputed: tuple[int, ...]
    skipped: tuple[Skipped, ...]
    extra_flops: int
    peak_bytes_before: int
    peak_bytes: int

    @property
    def saved_peak_bytes(self) -> int:
        """How much lower the in-core peak is than the original's."""
        return self.peak_bytes_before - self.peak_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class PressureBound:
    """What any swap-only plan within a budget must at least move.

    Attributes:
      moved_bytes: a lower bound on host-to-device plus device-to-host bytes.
      step: the step that sets ``moved_bytes`` (None when nothing has to move).
      excess_bytes: in-core bytes over the budget at that step.
      step_time_s: with a device profile, a lower bound on the step's time; else None.
    """

    moved_bytes: int
    step: int | None
    excess_bytes: int
    step_time_s: float | None = None


def recompute_program(
    program: Program,
    targets: Iterable[int],
    *,
    recomputable: Recomputable,
    across: int | Mapping[int, int] | None = None,
) -> Rewrite:
    """Drops each target after its early reads and recomputes it before its late ones.

    Args:
      program: the step program.
      targets: computed buffers to recompute.
      recomputable: whether a step may be copied (effect-free equations only).
      across: where to split each target's touches: at the run of steps without a touch that
        contains this step (one step for all targets, or a step per target; a target missing from
        the mapping uses the default); None: at its longest such run. A target whose last read
        comes before that step is dropped after it, and recomputed only if another copy needs it.

    Returns:
      The rewrite. Targets that cannot be recomputed (an argument, an output, a value read at
      consecutive steps or at the split step, a producer that may not run twice, a copy that would
      read a donated input after its aliased output is written) are listed in ``skipped`` and
      left as they are; the rest are dropped and recomputed.

    Raises:
      ValueError: for a target that is not a buffer of the program.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("m", ["c"], ["d"]),
    ...      ("k", ["a", "d"], ["y"])],
    ...     {"x": 1, "a": 8, "b": 1, "c": 8, "d": 1, "y": 1}, inputs=["x"], outputs=["y"])
    >>> r = recompute_program(p, [1], recomputable=lambda step: True)
    >>> r.origin_step, r.program.buffers[-1].label, r.peak_bytes_before, r.peak_bytes
    ((0, 1, 2, 3, 0, 4), 'recompute of a', 18, 11)
    """
    with gc_paused():
        last_early, skipped = _plan_targets(program, targets, recomputable, across)
        rebuild = _rebuild_without_conflicts(program, last_early, skipped)
        unneeded = sorted(last_early.keys() - rebuild.copy_of.keys())
        skipped += [Skipped(buffer=t, reason="is not read after the split, and no copy needed it") for t in unneeded]
        skipped.sort(key=_BUFFER)
        return rebuild.rewrite(skipped) if rebuild.copy_of else identity_rewrite(program, skipped)


def _rebuild_without_conflicts(program: Program, last_early: dict[int, int], skipped: list[Skipped]) -> _Rebuild:
    """The rebuilt program, after leaving out (into ``skipped``) each target whose copy would read
    a donated input too late; each retry has one target fewer, so this ends."""
    while True:
        rebuild = _Rebuild(program, last_early)
        conflict = rebuild.run()
        if conflict is None:
            return rebuild
        del last_early[conflict.buffer]
        skipped.append(conflict)


_BUFFER = attrgetter("buffer")


def _plan_targets(
    program: Program, targets: Iterable[int], recomputable: Recomputable, across: int | Mapping[int, int] | None
) -> tuple[dict[int, int], list[Skipped]]:
    """Per accepted target, its last early touch (after which the original is dropped); the
    refused ones with their reasons. Refusing one target never makes another unsafe: a refused
    target stays, so copies read it as an available value."""
    last_early: dict[int, int] = {}
    skipped: list[Skipped] = []
    for t in sorted(set(targets)):
        if not 0 <= t < len(program.buffers):
            raise ValueError(f"target {t} is not a buffer of the program, which has {len(program.buffers)}")
        split = across.get(t) if isinstance(across, Mapping) else across
        gap = _gap(program, t, split)
        producer = program.uses.defined_at[t]
        if isinstance(gap, str):
            skipped.append(Skipped(buffer=t, reason=gap))
        elif not recomputable(producer):
            reason = f"its producer, step {producer} ({program.steps[producer].describe()}), may not be recomputed"
            skipped.append(Skipped(buffer=t, reason=reason))
        else:
            last_early[t] = gap
    return last_early, skipped


def _gap(program: Program, t: int, across: int | None) -> int | str:
    """The last touch before the run of steps the target is dropped across, or why there is none."""
    buffer, reads = program.buffers[t], program.uses.read_at[t]
    if buffer.kind != "computed":
        return f"is an {buffer.kind}, not a computed value: there is nothing to recompute it from"
    if buffer.is_output:
        return "is returned by the step: its device copy is held to the end, so dropping it saves nothing"
    if not reads:
        return "is never read"
    touches = (program.uses.defined_at[t], *reads)
    if across is None:
        i = max(range(len(reads)), key=lambda j: touches[j + 1] - touches[j])  # the first longest
    elif across <= touches[0]:
        return f"is not live across step {across}: it is defined at step {touches[0]}"
    elif across > touches[-1]:
        return touches[-1]  # no late read of its own: a copy is made only if another copy reads it
    else:
        i = bisect_left(touches, across) - 1
        if touches[i + 1] == across:
            return f"is read at step {across}"
    if touches[i + 1] - touches[i] < 2:
        return "is touched at consecutive steps: there is no step to drop it across"
    return touches[i]


class _Rebuild:
    """One forward pass writing the rewritten program: each original step, preceded by the copies
    that its reads of dropped targets need (made on first need, then reused)."""

    def __init__(self, program: Program, last_early: dict[int, int]):
        self.program, self.last_early = program, last_early
        self.alias_writer = _alias_writers(program)
        self.steps: list[Step] = []
        self.origin_step: list[int] = []
        self.copied_steps: list[int] = []
        self.buffers: list[Buffer] = list(program.buffers)
        self.origin_buffer: list[int] = list(range(len(program.buffers)))
        self.copy_of: dict[int, int] = {}  # dropped target -> the fresh buffer that now holds it
        self.extra_flops = 0

    def run(self) -> Skipped | None:
        """Writes the program; or stops at the first target whose copy may not run where needed."""
        last_early = self.last_early
        for k, step in enumerate(self.program.steps):
            dropped = [r for r in step.reads if r in last_early and k > last_early[r]]
            for r in dropped:
                conflict = self._ensure(r, k)
                if conflict is not None:
                    return conflict
            # Most steps read no dropped target: they are kept as they are (no new record).
            rewired = replace(step, reads=tuple(self._version(r, k) for r in step.reads)) if dropped else step
            self._emit(k, rewired, copy=False)
        return None

    def rewrite(self, skipped: Iterable[Skipped]) -> Rewrite:
        rewritten = Program(steps=tuple(self.steps), buffers=tuple(self.buffers))
        return Rewrite(
            program=rewritten,
            origin_step=tuple(self.origin_step),
            origin_buffer=tuple(self.origin_buffer),
            copied_steps=tuple(self.copied_steps),
            recomputed=tuple(sorted(self.copy_of)),
            skipped=tuple(skipped),
            extra_flops=self.extra_flops,
            peak_bytes_before=max(_in_core_bytes(self.program), default=0),
            peak_bytes=max(_in_core_bytes(rewritten), default=0),
        )

    def _dropped(self, b: int, k: int) -> bool:
        """Whether the original of ``b`` is gone before step ``k`` (a target past its early life)."""
        last = self.last_early.get(b)
        return last is not None and k > last

    def _version(self, b: int, k: int) -> int:
        return self.copy_of[b] if self._dropped(b, k) else b

    def _ensure(self, target: int, k: int) -> Skipped | None:
        """Copies, just before step ``k``, the producers of ``target`` and of every dropped target
        it depends on that has no copy yet. Iterative (a chain can be thousands of steps long),
        inputs in read order, so identical requests give identical programs."""
        defined_at, steps = self.program.uses.defined_at, self.program.steps
        stack = [target]
        while stack:
            v = stack[-1]
            if v in self.copy_of:
                stack.pop()
                continue
            producer = defined_at[v]
            missing = [i for i in steps[producer].reads if self._dropped(i, k) and i not in self.copy_of]
            if missing:
                stack.extend(reversed(missing))
                continue
            conflict = self._donation_conflict(v, producer, k)
            if conflict is not None:
                return conflict
            self._copy(producer, k)
            stack.pop()
        return None

    def _donation_conflict(self, v: int, producer: int, k: int) -> Skipped | None:
        """After the step that writes a donated input's aliased output, the output owns that memory:
        a copy before step ``k`` may not read the input then."""
        for x in self.program.steps[producer].reads:
            writer = self.alias_writer.get(x)
            if writer is not None and writer < k:
                label = self.program.buffers[x].label or "unlabelled"
                reason = (
                    f"recomputing it before step {k} would read donated input {x} ({label}) after step "
                    f"{writer} writes the output that takes over its memory"
                )
                return Skipped(buffer=v, reason=reason)
        return None

    def _copy(self, s: int, k: int) -> None:
        step = self.program.steps[s]
        writes = []
        for w in step.writes:
            fresh = len(self.buffers)
            self.buffers.append(Buffer(nbytes=self.buffers[w].nbytes, label=_copy_label(self.buffers[w].label, w)))
            self.origin_buffer.append(w)
            # Every write gets a fresh id (SSA); one that is not a dropped target is a dead value.
            if self._dropped(w, k) and w not in self.copy_of:
                self.copy_of[w] = fresh
            writes.append(fresh)
        reads = tuple(self._version(i, k) for i in step.reads)
        self._emit(s, replace(step, reads=reads, writes=tuple(writes)), copy=True)
        self.extra_flops += step.flops

    def _emit(self, origin: int, step: Step, *, copy: bool) -> None:
        if copy:
            self.copied_steps.append(len(self.steps))
        self.steps.append(step)
        self.origin_step.append(origin)


def _alias_writers(program: Program) -> dict[int, int]:
    """Per donated input that an output aliases, the first step defining such an output (-1 for an
    output that is itself an argument: its memory is taken from the start)."""
    writers: dict[int, int] = {}
    for b, buffer in enumerate(program.buffers):
        if buffer.aliased_input is not None:
            defined = program.uses.defined_at[b]
            step = -1 if defined is None else defined
            writers[buffer.aliased_input] = min(step, writers.get(buffer.aliased_input, step))
    return writers


def _copy_label(label: str, b: int) -> str:
    return f"recompute of {label or f'buffer {b}'}"


def identity_rewrite(program: Program, skipped: Iterable[Skipped] = ()) -> Rewrite:
    """``program`` as it is: the rewrite that recomputes nothing."""
    peak = max(_in_core_bytes(program), default=0)
    return Rewrite(
        program=program,
        origin_step=tuple(range(len(program.steps))),
        origin_buffer=tuple(range(len(program.buffers))),
        copied_steps=(),
        recomputed=(),
        skipped=tuple(skipped),
        extra_flops=0,
        peak_bytes_before=peak,
        peak_bytes=peak,
    )


def _in_core_bytes(program: Program) -> tuple[int, ...]:
    """Device bytes per step with nothing moved: ``Program``'s liveness rule, through the simulator.
    The selector asks it at every pick of the same original program and of each trial, twice (the
    rewrite's peak, then the pick's check): the last few answers are kept, by identity."""
    for kept, device in _RECENT_IN_CORE:
        if kept is program:
            return device
    device = simulate(program, keep_all(program)).device_bytes
    _RECENT_IN_CORE[:] = [*_RECENT_IN_CORE[-(_KEPT_IN_CORE - 1) :], (program, device)]
    return device


_KEPT_IN_CORE = 3  # the original, the rewrite kept, the trial: a few programs held at most
_RECENT_IN_CORE: list[tuple[Program, tuple[int, ...]]] = []


# The pools a byte over the budget at step p can be taken from, with the least it costs to move
# (bytes; and seconds before or after step p, where the two directions cannot overlap).
_FREE = 0  # an argument nothing reads: left on host, never fetched
_FETCHED_BEFORE = 1  # an argument held to the end but last read before p: one fetch, before p
_FETCH_AFTER = 2  # an argument read after p: one fetch, after p
_COPY_OUT = 3  # a computed output last read before p: one offload, done before p (returned on host)
_ROUND_TRIP = 4  # a computed value read after p: an offload done before p and a fetch after it
_POOLS = 5


def pressure_bound(
    program: Program,
    budget_bytes: int,
    *,
    profile: DeviceProfile | str | None = None,
    min_offload_bytes: int = MiB,
) -> PressureBound:
    """The least any swap-only plan within ``budget_bytes`` must move.

    At each step p, the in-core bytes over the budget must be off the device. A value off the
    device at p that it reads later left before p (an offload, unless it is an argument, which has
    a host copy) and comes back after p (a prefetch); an argument read earlier was fetched once;
    an output read earlier was copied out once; an argument nothing reads costs nothing. Filling
    the excess with the cheapest of those bytes first bounds the bytes moved; the time bound adds
    the link time that must finish before p and start after it to step p's own compute (the two
    directions cannot overlap there), and is at least the whole compute time. Values that never
    move (``Buffer.never_moves``) and step p's own operands are not available. The bound holds
    for every valid plan: for ``simulate``'s h2d + d2h bytes and ``simulate_time``'s step time.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c"], ["y"])],
    ...     {"x": MiB, "a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB, "y": MiB}, inputs=["x"], outputs=["y"])
    >>> [pressure_bound(p, budget * MiB).moved_bytes / MiB for budget in (13, 12, 9)]  # peak: 13 MiB
    [0.0, 1.0, 7.0]

    At 12 MiB, the argument ``x`` (read at step 0 only) can stay on host, fetched once; at 9 MiB,
    3 MiB more must come from ``a``, which step 3 reads: out and back, twice its bytes.
    """
    with gc_paused():
        device = _in_core_bytes(program)
        pools = _removable_pools(program, min_offload_bytes)
        bound = PressureBound(moved_bytes=0, step=None, excess_bytes=0)
        for p, live in enumerate(device):
            excess = live - budget_bytes
            if excess <= 0:
                continue
            free, before, after, out, round_trip = (pool[p] for pool in pools)
            moved = _cheapest_cover(excess, [(free, 0), (before + after + out, 1), (round_trip, 2)])
            if moved > bound.moved_bytes:
                bound = PressureBound(moved_bytes=int(moved), step=p, excess_bytes=excess)
        if profile is None:
            return bound
        return replace(bound, step_time_s=_time_bound(program, device, pools, budget_bytes, resolve_profile(profile)))


def _time_bound(
    program: Program, device: tuple[int, ...], pools: list[list[int]], budget: int, profile: DeviceProfile
) -> float:
    """Seconds no valid plan can beat: the whole compute, and at each step over the budget, the
    offloads that must finish before it, its compute, and the prefetches that start after it."""
    to_host, to_device = 1 / profile.d2h_bytes_per_s, 1 / profile.h2d_bytes_per_s
    best = sum(profile.compute_seconds(step) for step in program.steps)
    for p, live in enumerate(device):
        if live <= budget:
            continue
        free, before, after, out, round_trip = (pool[p] for pool in pools)
        pools_by_rate = [(free + before, 0.0), (after, to_device), (out, to_host), (round_trip, to_host + to_device)]
        link = _cheapest_cover(live - budget, pools_by_rate)
        best = max(best, link + profile.compute_seconds(program.steps[p]))
    return best


def _cheapest_cover(excess: int, pools: list[tuple[int, float]]) -> float:
    """The least cost of taking ``excess`` bytes from pools of (bytes, cost per byte), cheapest
    first: a fractional relaxation, so never above what any whole-buffer choice costs."""
    cost: float = 0
    for size, rate in sorted(pools, key=lambda pool: pool[1]):
        take = min(excess, size)
        cost += take * rate
        excess -= take
    return cost


def _removable_pools(program: Program, min_offload_bytes: int) -> list[list[int]]:
    """Per pool (``_FREE`` ...), the bytes per step that a plan could have off the device there:
    values in core at that step (``Program.unmoved_spans``) that may move and that the step does
    not touch. One difference array per pool: linear in steps plus reads."""
    n, uses = len(program.steps), program.uses
    diffs = [[0] * (n + 1) for _ in range(_POOLS)]

    def add(pool: int, first: int, last: int, nbytes: int, holes: Iterable[int] = ()) -> None:
        if first > last:
            return
        diff = diffs[pool]
        diff[first] += nbytes
        diff[last + 1] -= nbytes
        for r in holes:  # steps that read the value need it on the device
            diff[r] -= nbytes
            diff[r + 1] += nbytes

    for b, buffer in enumerate(program.buffers):
        if buffer.never_moves(min_offload_bytes) or not n:
            continue
        start, end = program.unmoved_spans[b]
        reads, size = uses.read_at[b], buffer.nbytes
        if buffer.kind == "input" and not reads:
            add(_FREE, start, end, size)
        elif buffer.kind == "input":
            add(_FETCH_AFTER, 0, reads[-1] - 1, size, reads[:-1])
            add(_FETCHED_BEFORE, reads[-1] + 1, end, size)
        else:
            last = reads[-1] if reads else start
            add(_ROUND_TRIP, start + 1, last - 1, size, reads[:-1])
            add(_COPY_OUT, last + 1, end, size)  # non-empty only for outputs (held to the end)
    return [list(accumulate(diff))[:n] for diff in diffs]


def choose_recompute(
    program: Program,
    budget_bytes: int,
    *,
    recomputable: Recomputable,
    profile: DeviceProfile | str | None = None,
    min_offload_bytes: int = MiB,
    max_picks: int = 1000,
    forced: Iterable[int] | Mapping[int, int] = (),
) -> Rewrite:
    """Chooses values to recompute so that the program holds less at its in-core peak.

    Greedy, per class of identical layers, by estimated bytes saved per recompute-second at the
    in-core peak (the module docstring has the rule), until the rewritten program fits the budget
    in core (then nothing has to move) or no class helps. A pick never raises the smallest feasible
    budget (``required_bytes``) above the budget when the original's was within it.

    Args:
      program: the step program.
      budget_bytes: the device budget.
      recomputable: whether a step of ``program`` may be copied (effect-free equations only).
      profile: device rates for the recompute time (a ``DeviceProfile`` or a name);
        default ``DEFAULT_PROFILE``.
      min_offload_bytes: the planner's threshold, for the ``required_bytes`` check.
      max_picks: a bound on the classes tried.
      forced: buffers to recompute whatever the costs say (split at their longest gap, or where a
        mapping says: buffer -> a step to split across), before
        the selector adds its own.

    Returns:
      The rewrite of ``program`` (the identity if it already fits, or nothing helps); ``skipped``
      lists the candidates of classes that were tried and not kept.

    >>> from oocjax.schedule.synthetic import layered_training_step
    >>> p = layered_training_step(3)
    >>> r = choose_recompute(p, 160 * MiB, recomputable=lambda step: p.steps[step].name != "adam")
    >>> r.peak_bytes_before // MiB, r.peak_bytes <= 160 * MiB
    (220, True)
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    profile = resolve_profile(DEFAULT_PROFILE if profile is None else profile)
    rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=min_offload_bytes)
    with gc_paused():
        return _greedy(program, budget_bytes, max_picks=max_picks, forced=forced, **rules)


def _greedy(
    program: Program,
    budget_bytes: int,
    *,
    recomputable: Recomputable,
    profile: DeviceProfile,
    min_offload_bytes: int,
    max_picks: int,
    forced: Iterable[int] | Mapping[int, int],
) -> Rewrite:
    """``choose_recompute``'s loop: one class of candidates a pick, until the step fits in core."""
    floor_fits = max(required_bytes(program, min_offload_bytes), default=0) <= budget_bytes
    targets: dict[int, int | None] = dict(forced) if isinstance(forced, Mapping) else dict.fromkeys(forced)
    chosen = (
        recompute_program(program, targets, recomputable=recomputable, across=targets)
        if targets
        else identity_rewrite(program)
    )
    rejected, skipped = set(), []
    device = _in_core_bytes(chosen.program)  # recomputed only when a pick is kept
    for _ in range(max_picks):
        if max(device, default=0) <= budget_bytes:
            break
        candidates = (
            _best_class(program, chosen, targets, p, recomputable, profile, rejected)
            for p in _pressure_points(device, budget_bytes)
        )
        pick = next(filter(None, candidates), None)
        if pick is None:
            break
        key, members, across = pick
        widened = {**targets, **dict.fromkeys(members, across)}
        trial = recompute_program(program, widened, recomputable=recomputable, across=widened)
        why_not, after = _why_not_kept(trial, members, device, budget_bytes, floor_fits, min_offload_bytes)
        if why_not is None:
            chosen, targets, device = trial, widened, after
        else:
            rejected.add(key)
            skipped += [Skipped(buffer=b, reason=why_not) for b in members]
    kept = set(chosen.recomputed)  # a chain member of a rejected class may join a later one
    return replace(chosen, skipped=(*chosen.skipped, *(s for s in skipped if s.buffer not in kept)))


def _pressure_points(device: Sequence[int], budget: int, most: int = 8) -> list[int]:
    """Steps to relieve, most loaded first: the peak, then the most loaded steps over the budget
    elsewhere (the peak may sit where nothing can be recomputed, such as the optimizer's update,
    while the forward/backward turn is over the budget too). One step per stretch of the program."""
    apart = max(1, len(device) // (4 * most))
    points: list[int] = []
    for k in sorted(range(len(device)), key=lambda k: -device[k]):
        if device[k] <= budget or len(points) == most:
            break
        if all(abs(k - p) >= apart for p in points):
            points.append(k)
    return points


def _why_not_kept(
    trial: Rewrite, members: list[int], device: tuple[int, ...], budget: int, floor_fits: bool, min_offload_bytes: int
) -> tuple[str | None, tuple[int, ...]]:
    """Why a trial rewrite does not help (None: keep it), and its bytes in core per step."""
    if not set(members) & set(trial.recomputed):
        return "no value of its class could be recomputed across the peak", ()
    after = _in_core_bytes(trial.program)
    over_before = sum(max(0, live - budget) for live in device)
    over_after = sum(max(0, live - budget) for live in after)
    if (max(after, default=0), over_after) >= (max(device, default=0), over_before):
        return "recomputing its class across the peak did not lower the in-core bytes over the budget", after
    if floor_fits and max(required_bytes(trial.program, min_offload_bytes), default=0) > budget:
        return "recomputing its class would make some step alone need more than the budget", after
    return None, after


ClassKey = tuple  # (name, label, flops, transient, read sizes, write sizes, which write)


def _best_class(
    program: Program,
    chosen: Rewrite,
    targets: Mapping[int, int],
    p: int,
    recomputable: Recomputable,
    profile: DeviceProfile,
    rejected: set[ClassKey],
) -> tuple[ClassKey, list[int], int] | None:
    """The class of candidates live across step ``p`` of the rewritten program with the most
    estimated bytes saved per recompute-second: its key, its members (buffers of ``program``) and
    the original step to split them across; None if there is none."""
    q = _next_original(chosen, p)
    rewritten = chosen.program
    uses = rewritten.uses
    classes: dict[ClassKey, tuple[list[int], list[float]]] = {}
    for b, buffer in enumerate(program.buffers):  # originals only: a copy serves a late group already
        reads, defined = uses.read_at[b], uses.defined_at[b]
        if b in targets or buffer.kind != "computed" or buffer.is_output or not reads or not defined < p:
            continue
        if reads[-1] <= q or reads[bisect_left(reads, p)] <= q or not recomputable(chosen.origin_step[defined]):
            continue  # dead at p, or read from p to the next original step: not droppable there
        step = rewritten.steps[defined]
        key = _class_key(rewritten, step, b)
        if key in rejected:
            continue
        chain, revived, seconds = _chain(program, chosen, targets, defined, p, recomputable, profile)
        if buffer.nbytes <= revived:
            continue
        members, totals = classes.setdefault(key, ([], [0.0, 0.0]))
        members += [b, *chain]
        totals[0] += buffer.nbytes - revived
        totals[1] += seconds
    if not classes:
        return None

    def rank(item: tuple[ClassKey, tuple[list[int], list[float]]]) -> tuple[float, int]:
        members, (saved, seconds) = item[1]
        return (saved / seconds if seconds > 0 else math.inf, -members[0])

    key, (members, _) = max(classes.items(), key=rank)
    return key, list(dict.fromkeys(members)), chosen.origin_step[q]


def _chain(
    program: Program,
    chosen: Rewrite,
    targets: Mapping[int, int],
    producer: int,
    p: int,
    recomputable: Recomputable,
    profile: DeviceProfile,
    most: int = 8,
) -> tuple[list[int], int, float]:
    """What recomputing the value that step ``producer`` (of the rewritten program) writes across
    step ``p`` takes: the inputs dead at ``p`` that the copy's chain recomputes too (values of
    ``program`` that may be recomputed, at most ``most``, walked back from the producer), the bytes
    of the other dead inputs (brought back to life across ``p``) and the chain's recompute-seconds.
    Inputs that are targets already are recomputed by their own copies."""
    rewritten = chosen.program
    spans, defined_at, steps = rewritten.unmoved_spans, rewritten.uses.defined_at, rewritten.steps
    chain: list[int] = []
    revived, seconds, todo = 0, profile.compute_seconds(steps[producer]), list(steps[producer].reads)
    while todo:
        i = todo.pop()
        if spans[i][0] <= p <= spans[i][1] or i in targets or i in chain:
            continue
        d = defined_at[i]
        joins = (
            len(chain) < most
            and i < len(program.buffers)
            and program.buffers[i].kind == "computed"
            and not program.buffers[i].is_output
            and d is not None
            and recomputable(chosen.origin_step[d])
        )
        if joins:
            chain.append(i)
            seconds += profile.compute_seconds(steps[d])
            todo += steps[d].reads
        else:
            revived += rewritten.buffers[i].nbytes
    return chain, revived, seconds


def _next_original(chosen: Rewrite, p: int) -> int:
    """The first step at or after ``p`` of the rewritten program that is an original (copies are
    placed just before one): the original step that a value dropped across ``p`` must skip."""
    copied = chosen.copied_steps
    i = bisect_left(copied, p)
    while i < len(copied) and copied[i] == p:
        p, i = p + 1, i + 1
    return p


def _class_key(program: Program, step: Step, b: int) -> ClassKey:
    """What identical layers share: the producer's operation, source and sizes, and which of its
    results the value is. Buffer labels are left out: they name the layer."""
    sizes = tuple(program.buffers[i].nbytes for i in step.reads), tuple(program.buffers[w].nbytes for w in step.writes)
    return (step.name, step.label, step.flops, step.transient_bytes, *sizes, step.writes.index(b))
