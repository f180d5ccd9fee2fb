"""The recompute rewrite: dropping a value after its early reads and computing it again for its late ones.

Recomputation removes bytes that swapping would have to move, at the price of running some
equations twice; ``schedule.recompute`` chooses which values, and this module rewrites the program
for a choice.

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

**Postponed, not copied.** A step whose every value is a target that only postponed steps read
early (a value made in the forward pass for the backward pass alone: the derivative of a GELU, a
LayerNorm's centred input) has nothing to do in its place: it is not run there, but where its
values are first needed, as the copy would be, writing its own buffers. Per-block remat does the
same: the forward pass of a rematerialised block computes only what its output needs.

Original buffers keep their ids and flags, and the original steps keep their order; copies are
appended as ``computed`` buffers labelled "recompute of <label>". ``Rewrite.origin_step`` and
``origin_buffer`` say what each new step runs and what each new buffer holds, so the transforms
layer can bind the original equations with remapped buffers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

from oocjax.schedule.gc_paused import gc_paused
from oocjax.schedule.program import Buffer, Program, Step

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
      postponed_steps: the new steps that are originals run where their values are first needed
        rather than where they were traced (ascending): placed, like copies, just before a need.
      recomputed: the original buffers that were dropped and recomputed, or postponed (ascending).
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
    postponed_steps: tuple[int, ...] = ()


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
        self.postponed = _postponed(program, last_early)  # original steps run where first needed
        self.postponed_values = {w for s in self.postponed for w in program.steps[s].writes}
        self.postponed_steps: list[int] = []
        self.extra_flops = 0

    def run(self) -> Skipped | None:
        """Writes the program; or stops at the first target whose copy may not run where needed."""
        for k, step in enumerate(self.program.steps):
            if k in self.postponed:
                continue
            dropped = [r for r in step.reads if self._dropped(r, k)]
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
            peak_bytes_before=max(self.program.in_core_bytes, default=0),
            peak_bytes=max(rewritten.in_core_bytes, default=0),
            postponed_steps=tuple(self.postponed_steps),
        )

    def _dropped(self, b: int, k: int) -> bool:
        """Whether the original of ``b`` is gone before step ``k`` (a target past its early life),
        or not yet made there (a postponed step's value)."""
        last = self.last_early.get(b)
        return last is not None and (k > last or b in self.postponed_values)

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
        if s in self.postponed:  # the original itself, run here: its own buffers
            self.copy_of.update((w, w) for w in step.writes)
            self.postponed_steps.append(len(self.steps))
            self._emit(s, replace(step, reads=tuple(self._version(i, k) for i in step.reads)), copy=False)
            return
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


def _postponed(program: Program, last_early: dict[int, int]) -> set[int]:
    """The original steps with nothing to do where they were traced: every value they write is a
    target whose early reads (up to its last early touch) are all by such steps. Decided from the
    last step back, since a value's readers come after its producer."""
    postponed: set[int] = set()
    read_at = program.uses.read_at
    for s in range(len(program.steps) - 1, -1, -1):
        writes = program.steps[s].writes
        if writes and all(
            w in last_early and all(r in postponed for r in read_at[w] if r <= last_early[w]) for w in writes
        ):
            postponed.add(s)
    return postponed


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


def runs_after(rewrite: Rewrite, runs: Sequence[tuple[int, int, str]]) -> tuple[tuple[int, int, str], ...]:
    """Runs ``(start, stop, kind)`` of the original program's steps (``transforms.layers``) as runs of
    the rewritten one: each from just after the original step before its first, so that the copies
    made for its steps join it (but not copies of steps outside every run that lead it), to just
    after its last. Runs found again in the rewritten program
    are not as good: copies a layer recomputes in its own way (its input's producer, at the bottom
    layer) break the repeats a search by structure looks for.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("m", ["c"], ["d"]),
    ...      ("k", ["a", "d"], ["y"])],
    ...     {"x": 1, "a": 8, "b": 1, "c": 8, "d": 1, "y": 1}, inputs=["x"], outputs=["y"])
    >>> r = recompute_program(p, [1], recomputable=lambda step: True)  # a made again before k
    >>> r.origin_step, runs_after(r, [(0, 2, "first"), (2, 4, "second"), (4, 5, "last")])
    ((0, 1, 2, 3, 0, 4), ((0, 2, 'first'), (2, 4, 'second'), (4, 6, 'last')))
    """
    at = _original_at(rewrite)
    outside = _outside_every_run(rewrite, runs)
    found = []
    for a, y, kind in runs:
        start = at[a - 1] + 1 if a else 0
        while start < at[a] and outside(start):  # copies of no layer's work lead it: not the layer's own
            start += 1
        found.append((start, at[y - 1] + 1, kind))
    return tuple(found)


def _original_at(rewrite: Rewrite) -> list[int]:
    """Per original step, its step in the rewritten program; for a postponed one, the step of the
    last original before it that stays in place (-1 for none): where it was traced."""
    placed = set(rewrite.copied_steps) | set(rewrite.postponed_steps)
    at = [-1] * (len(rewrite.origin_step) - len(rewrite.copied_steps))
    for i, s in enumerate(rewrite.origin_step):
        if i not in placed:
            at[s] = i
    for s in range(1, len(at)):
        at[s] = max(at[s], at[s - 1])
    return at


def _outside_every_run(rewrite: Rewrite, runs: Sequence[tuple[int, ...]]) -> Callable[[int], bool]:
    """Whether a step of the rewritten program is a copy of an original step that no run holds."""
    inside = [False] * (max((y for _, y, *_ in runs), default=0))
    for a, y, *_ in runs:
        inside[a:y] = [True] * (y - a)
    copied, origin = set(rewrite.copied_steps), rewrite.origin_step
    return lambda k: k in copied and not (origin[k] < len(inside) and inside[origin[k]])


def identity_rewrite(program: Program, skipped: Iterable[Skipped] = ()) -> Rewrite:
    """``program`` as it is: the rewrite that recomputes nothing."""
    peak = max(program.in_core_bytes, default=0)
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
