"""The chain: a cut step's segments in the order they run, with the waits, transfers and drops
around each launch, as one pure value.

A plan carries one such value (``Plan.chain``), built once, and every reader of that order reads
it: the executor (``transforms.execute``) runs its operations, the view
(``transforms.functions.chain_function``, the jaxpr ``Plan.jaxpr`` shows) traces them, the replay
(``check_chain``) follows them on a fake device, and the printer (``jaxpr_view``) lists them. The
order at a segment boundary is therefore written once, here, in ``build_chain``:

    wait (offloads whose device memory the launch needs), prefetch, launch, offload

Values live in slots: buffer ``b``'s device copy in slot ``b``, its host copy in slot
``b + host_offset``. Each operation drops (``dropped``) the slots it reads for the last time, so
that no value outlives its last use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import TYPE_CHECKING

from oocjax.schedule.simulate import Violation, frees_host_state_early

if TYPE_CHECKING:
    from oocjax.schedule.moves import Schedule
    from oocjax.schedule.program import Program
    from oocjax.schedule.segments import Segment


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the offloads of ``buffers`` to end: the launch after it needs their device memory."""

    segment: int
    buffers: tuple[int, ...]
    dropped: tuple[int, ...] = ()  # host slots read here for the last time


@dataclass(frozen=True, slots=True)
class CopyIn:
    """Copy ``buffers`` from host to the device, in one batch (the plan's prefetches at a boundary)."""

    segment: int
    buffers: tuple[int, ...]
    dropped: tuple[int, ...] = ()  # host slots read here for the last time
    # Of those, the caller's donated arguments: deleted here where the state kept on host is larger
    # than the device (``frees_host_state_early``), so that it does not stay beside the new state
    # (before the first segment: once it is launched, so that a call stopped before leaves it whole).
    deleted: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Launch:
    """Run segment ``segment``'s program on the ``inputs`` slots (``donated`` per input: its memory
    may be reused for the outputs) into the ``outputs`` slots."""

    segment: int
    inputs: tuple[int, ...]
    donated: tuple[bool, ...]
    outputs: tuple[int, ...]
    dropped: tuple[int, ...] = ()  # device slots read here for the last time


@dataclass(frozen=True, slots=True)
class CopyOut:
    """Copy ``buffers`` from the device to host, in one batch (the plan's offloads after a launch)."""

    segment: int
    buffers: tuple[int, ...]
    dropped: tuple[int, ...] = ()  # device slots whose last use is their copy to host


Operation = Wait | CopyIn | Launch | CopyOut
# What each operation is called in profiles and in the chain's jaxpr: ``oocjax.prefetch(<value>)``.
OPERATION_NAMES = {Wait: "wait", CopyIn: "prefetch", Launch: "launch", CopyOut: "offload"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """A cut step as it runs: its operations in order, and where the step's arguments and
    results live (slots; a result that is a literal has none)."""

    operations: tuple[Operation, ...]
    segments: tuple[Segment, ...]  # what each launch runs
    host_offset: int  # the number of buffers: buffer b's host copy is in slot b + host_offset
    argument_slots: tuple[int, ...]
    result_slots: tuple[int | None, ...]

    @property
    def num_slots(self) -> int:
        return 2 * self.host_offset

    def by_segment(self) -> Iterator[tuple[int, tuple[Operation, ...]]]:
        """(segment, its operations in order) per segment."""
        for segment, operations in groupby(self.operations, key=attrgetter("segment")):
            yield segment, tuple(operations)


def build_chain(
    segments: Sequence[Segment],
    *,
    num_buffers: int,
    arguments: Sequence[int],
    host_inputs: frozenset[int] | set[int],
    results: Sequence[int | None],
    host_outputs: frozenset[int] | set[int],
    donated: frozenset[int] | set[int] = frozenset(),
) -> Chain:
    """The chain of ``segments``: ``arguments`` are the step's argument buffers in order (those in
    ``host_inputs`` arrive in host memory; those in ``donated`` the caller gave up), ``results``
    its result buffers in order (None for a literal; those in ``host_outputs`` are returned from
    host memory)."""
    host = num_buffers
    argument_slots = tuple(b + host if b in host_inputs else b for b in arguments)
    result_slots = tuple(None if r is None else r + host if r in host_outputs else r for r in results)
    last = _last_reads(segments, host, {r for r in result_slots if r is not None})
    operations: list[Operation] = []
    for i, (s, (waited, fetched, launched, offloaded)) in enumerate(zip(segments, last, strict=True)):
        if s.waits:
            operations.append(Wait(i, tuple(s.waits), _ordered_slots(waited, (host + b for b in s.waits))))
        if s.prefetches:
            dropped = _ordered_slots(fetched, (host + b for b in s.prefetches))
            given = tuple(slot for slot in dropped if slot - host in donated and slot - host in host_inputs)
            operations.append(CopyIn(i, tuple(s.prefetches), dropped, given))
        reused = set(s.donated)  # inputs whose memory the launch may reuse
        operations.append(
            Launch(
                i,
                tuple(s.inputs),
                tuple(b in reused for b in s.inputs),
                tuple(s.outputs),
                _ordered_slots(launched, s.inputs),
            )
        )
        if s.offloads:
            operations.append(CopyOut(i, tuple(s.offloads), _ordered_slots(offloaded, s.offloads)))
    return Chain(
        operations=tuple(operations),
        segments=tuple(segments),
        host_offset=host,
        argument_slots=argument_slots,
        result_slots=result_slots,
    )


def chain_of(
    program: Program, schedule: Schedule, segments: Sequence[Segment], results: Sequence[int | None] | None = None
) -> Chain:
    """The chain of a planned program cut into ``segments``: its inputs are its arguments in buffer
    order, its ``results`` the step's result buffers in order (None for a literal; by default its
    outputs in buffer order)."""
    buffers = program.buffers
    return build_chain(
        segments,
        num_buffers=len(buffers),
        arguments=[b for b, buffer in enumerate(buffers) if buffer.kind == "input"],
        host_inputs=schedule.host_inputs,
        results=[b for b, buffer in enumerate(buffers) if buffer.is_output] if results is None else results,
        host_outputs=schedule.host_outputs,
        donated=_given_up(program, schedule),
    )


def _given_up(program: Program, schedule: Schedule) -> set[int]:
    """The donated arguments the chain deletes at their last prefetch (``frees_host_state_early``)."""
    if not frees_host_state_early(program, schedule):
        return set()
    return {b for b, buffer in enumerate(program.buffers) if buffer.kind == "input" and buffer.donated}


def _ordered_slots(slots: set[int], order: Iterator[int] | Sequence[int]) -> tuple[int, ...]:
    return tuple(slot for slot in dict.fromkeys(order) if slot in slots)


def _last_reads(segments: Sequence[Segment], host: int, returned: set[int]) -> list[list[set[int]]]:
    """Per segment, per operation (wait, prefetch, launch, offload), the slots read for the last
    time there, found walking the chain back from the slots the step returns."""
    live, found = set(returned), []
    for s in reversed(segments):
        phases = [
            ([host + b for b in s.waits], []),
            ([host + b for b in s.prefetches], list(s.prefetches)),
            (list(s.inputs), list(s.outputs)),
            (list(s.offloads), [host + b for b in s.offloads]),
        ]
        last = []
        for reads, writes in reversed(phases):
            live.difference_update(writes)
            last.append({r for r in reads if r not in live})
            live.update(reads)
        found.append(last[::-1])
    return found[::-1]


# -- the replay: does the chain run? ------------------------------------------------------------

# The state of one copy (on the device, or on host) of a buffer during the replay. Only donation
# deletes a copy early: an operation drops a slot after its last use in the chain, which by
# construction comes after every use the replay checks, so drops are not replayed.
_ABSENT, _LIVE, _DONATED = 0, 1, 2


def check_segments(program: Program, schedule: Schedule, segments: Sequence[Segment]) -> tuple[Violation, ...]:
    """Every way the chain of ``segments`` would fail to run, found by running its operations
    (``chain_of``) on a fake device.

    Arguments start in host memory (``schedule.host_inputs``) or on the device, constants on the
    device; a wait or a prefetch needs a host copy; a launch reads its inputs from the device and
    consumes (deletes) the copies it donates; its outputs are then on the device, and an offload
    needs a live device copy. At the end each result must be in its memory. A use of a copy that
    is missing or was donated is a violation naming the buffer, the segment and what happened.
    ``validate`` checks the plan's memory; this checks that its segments run. Linear in the
    segments' lists and the steps' reads. Empty when it runs.

    >>> from oocjax.schedule import Program, keep_all
    >>> from oocjax.schedule.segments import cut_segments
    >>> from dataclasses import replace
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
    return check_chain(program, chain_of(program, schedule, segments))


def check_chain(program: Program, chain: Chain) -> tuple[Violation, ...]:
    """Every way ``chain`` would fail to run (``check_segments``): the replay of that very value."""
    replay = _ChainReplay(program, chain)
    replay.check_order()
    for operation in chain.operations:
        replay.follow(operation)
    replay.check_returned()
    return tuple(replay.violations)


class _ChainReplay:
    """The fake device and host of one replay: per buffer, the state of each copy."""

    __slots__ = ("chain", "device", "donated_by", "host", "owned", "program", "segments", "violations")

    def __init__(self, program: Program, chain: Chain):
        self.program, self.chain, self.segments = program, chain, chain.segments
        count = len(program.buffers)
        self.device, self.host = [_ABSENT] * count, [_ABSENT] * count
        # Whether the executor owns the device copy, so a launch may consume it: it made it (a
        # result, a prefetch), or the caller donated the argument. A caller's kept argument or a
        # constant donated to a segment would be deleted under the caller or the next call.
        self.owned = [False] * count
        self.donated_by = [-1] * count  # the segment that consumed the device copy
        self.violations: list[Violation] = []
        for slot in chain.argument_slots:
            if slot >= count:
                self.host[slot - count] = _LIVE
            else:
                self.device[slot], self.owned[slot] = _LIVE, program.buffers[slot].donated
        for b, buffer in enumerate(program.buffers):
            if buffer.kind == "constant":
                self.device[b] = _LIVE

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

    def follow(self, operation: Operation) -> None:
        i = operation.segment
        if isinstance(operation, Wait):
            for b in operation.buffers:
                self._need_host(b, f"is waited for before {self._where(i)}", "no earlier segment offloads it", i)
        elif isinstance(operation, CopyIn):
            for b in operation.buffers:
                why = "it is not a host input and no earlier segment offloads it"
                self._need_host(b, f"is prefetched before {self._where(i)}", why, i)
                # The copy counts as made even where it could not be, here and for offloads below:
                # one fault is reported once, not again at every later use of the copy.
                self.device[b], self.owned[b] = _LIVE, True
        elif isinstance(operation, Launch):
            self._launch(operation)
        else:
            for b in operation.buffers:
                self._need_device(b, f"is offloaded after {self._where(i)}", i)
                self.host[b] = _LIVE

    def _launch(self, launch: Launch) -> None:
        i = launch.segment
        self._check_body(i, self.segments[i])
        for b in launch.inputs:
            self._need_device(b, f"is read by {self._where(i)}", i)
        for b, donated in zip(launch.inputs, launch.donated, strict=True):
            if not donated:
                continue
            if self.device[b] == _LIVE and not self.owned[b]:
                what = f"is donated to {self._where(i)}, but its device copy is the caller's ({self._whose(b)})"
                self.violations.append(self._about("donates-caller-buffer", b, what, i))
            self.device[b], self.donated_by[b] = _DONATED, i
        for b in launch.outputs:
            self.device[b], self.owned[b] = _LIVE, True

    def check_returned(self) -> None:
        """Each result must be where the step returns it: on host or on the device."""
        host = self.chain.host_offset
        for slot in self.chain.result_slots:
            if slot is None:
                continue
            if slot >= host:
                why = "it is not a host input and no segment offloads it"
                self._need_host(slot - host, "is returned on host", why)
            else:
                self._need_device(slot, "is returned on the device")

    def _check_body(self, i: int, segment: Segment) -> None:
        """A segment's steps may read only its inputs and what its earlier steps define, and it can
        return only what it defines (``transforms.functions`` builds its function from these lists)."""
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
