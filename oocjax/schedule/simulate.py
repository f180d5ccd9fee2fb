"""Replays a schedule over a program: device and host memory per step, and everything wrong with it.

The rules mirror what XLA does with the rewritten program:
  * an input kept on the device occupies it for the whole step, unless donated, when its memory
    is free after its last read; a constant always occupies it;
  * a computed value occupies the device from the step that defines it;
  * a device copy is released after its last read, but not before its offload completes
    (``done_before_step``), and an output returned on the device is held to the end;
  * a prefetch takes memory from the step it is issued at.
``Program.device_stays`` states these rules once (the executor's segments use them too); this
module sums the stays per step and checks every move against them. It is independent of the
planners: it is the referee their plans are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

from oocjax.schedule.gc_paused import gc_paused
from oocjax.schedule.moves import Move, Offload, Prefetch, Schedule
from oocjax.schedule.program import Buffer, Program, Stay
from oocjax.schedule.units import format_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTimeline:
    """Bytes in use while each step runs.

    Attributes:
      device_bytes: device bytes during each step, transient scratch included.
      host_bytes: host bytes (host inputs and host copies) during each step.
      peak_bytes: the largest device figure; ``peak_step`` is the first step that reaches it
        (None for a program without steps).
      host_peak_bytes: the largest host figure.
      h2d_bytes, d2h_bytes: bytes copied each way.
    """

    device_bytes: tuple[int, ...]
    host_bytes: tuple[int, ...]
    peak_bytes: int
    peak_step: int | None
    host_peak_bytes: int
    h2d_bytes: int
    d2h_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Violation:
    """One thing wrong with a schedule: what (``kind``), where, and a sentence for people."""

    kind: str
    message: str
    step: int | None = None
    buffer: int | None = None


def simulate(program: Program, schedule: Schedule) -> MemoryTimeline:
    """Device and host bytes per step under ``schedule``."""
    return replay(program, schedule)[0]


def validate(program: Program, schedule: Schedule) -> tuple[Violation, ...]:
    """Every violation at once: reads of values not on the device, prefetches without a ready host
    copy, copies released before they complete, device bytes above the budget. Empty when valid."""
    return replay(program, schedule)[1]


def replay(program: Program, schedule: Schedule) -> tuple[MemoryTimeline, tuple[Violation, ...]]:
    """``schedule`` followed on ``program`` once: its memory timeline and its violations."""
    with gc_paused():
        return _replay(program, schedule)


def _replay(program: Program, schedule: Schedule) -> tuple[MemoryTimeline, tuple[Violation, ...]]:
    n = len(program.steps)
    violations: list[Violation] = []
    checked = _checked_moves(program, schedule, violations)
    _check_host_copies(program, checked, violations)
    device_diff = [0] * (n + 1)
    host_diff = [0] * (n + 1)
    moved = checked.offload_by_buffer.keys() | checked.prefetches_by_buffer.keys()
    moved |= schedule.host_inputs | schedule.host_outputs
    unmoved_spans = program.unmoved_spans
    early = frees_host_state_early(program, schedule)
    for b, buffer in enumerate(program.buffers):
        if n and b not in moved:  # most buffers: one precomputed span, no stays built
            start, end = unmoved_spans[b]
            device_diff[start] += buffer.nbytes
            device_diff[end + 1] -= buffer.nbytes
            continue
        if b in schedule.host_inputs or b in schedule.host_outputs:
            _check_homes(program, checked, b, violations)
        for start, end in _device_spans(program, checked, b, violations) if n else ():
            device_diff[start] += buffer.nbytes
            device_diff[end + 1] -= buffer.nbytes
        host_span = _host_span(n, checked, b, buffer, early)
        if host_span is not None:
            host_diff[host_span[0]] += buffer.nbytes
            host_diff[host_span[1] + 1] -= buffer.nbytes
    timeline = _timeline(program, schedule, device_diff, host_diff)
    if schedule.budget_bytes is not None:
        violations += _over_budget(timeline.device_bytes, schedule.budget_bytes)
    return timeline, tuple(violations)


def _about(program: Program, kind: str, b: int, what: str, step: int | None = None) -> Violation:
    """A violation about buffer ``b``; its message names the buffer, then says ``what``."""
    return Violation(kind=kind, step=step, buffer=b, message=f"buffer {b} ({program.buffers[b].label}) {what}")


def _checked_moves(program: Program, schedule: Schedule, violations: list[Violation]) -> Schedule:
    """``schedule`` with only the moves that name a buffer and steps the program has (and one offload
    per buffer); a violation for each other move, in the order of the moves."""
    n, count = len(program.steps), len(program.buffers)
    accepted: list[Move] = []
    offloaded: set[int] = set()
    for move in schedule.moves:
        b = move.buffer
        if not 0 <= b < count:
            message = f"a move names buffer {b}, but the program has {count}"
            violations.append(Violation(kind="unknown-buffer", buffer=b, message=message))
            continue
        if isinstance(move, Offload):
            problem = _offload_problem(program, move, b in offloaded)
            if problem:
                violations.append(_about(program, "bad-offload", b, problem, move.after_step))
                continue
            offloaded.add(b)
        elif not 0 <= move.issue_step <= move.use_step < n:
            where = f"is prefetched at step {move.issue_step} for step {move.use_step}, outside 0..{n - 1}"
            violations.append(_about(program, "bad-prefetch", b, where, move.issue_step))
            continue
        accepted.append(move)
    if len(accepted) == len(schedule.moves):
        return schedule  # valid moves: its own move index serves
    return replace(schedule, moves=tuple(accepted))


def _offload_problem(program: Program, offload: Offload, offloaded_before: bool) -> str | None:
    n, b = len(program.steps), offload.buffer
    buffer, defined = program.buffers[b], program.uses.defined_at[b]
    after, done = offload.after_step, offload.done_before_step
    if buffer.kind == "constant":
        return "is a constant: constants stay on the device, they are never copied out"
    if buffer.kind != "computed":
        return f"is an {buffer.kind}: place it on host instead of copying it out"
    if offloaded_before:
        return "is offloaded twice: a value never changes, one host copy serves every prefetch"
    if defined is None or not defined <= after < n:
        return f"is offloaded after step {after}, outside steps {defined}..{n - 1} where it exists"
    if done is not None and not after < done < n:
        return f"has its offload done before step {done}, not after it starts (step {after})"
    return None


def _check_host_copies(program: Program, checked: Schedule, out: list[Violation]) -> None:
    """A prefetch needs a host copy when it is issued: a host input, or a completed offload."""
    for b, prefetches in checked.prefetches_by_buffer.items():
        defined = program.uses.defined_at[b]
        offload = checked.offload_by_buffer.get(b)
        done = None if offload is None else offload.done_before_step
        on_host = b in checked.host_inputs
        for p in prefetches:
            if defined is not None and p.issue_step <= defined:
                why = f"before it is defined at step {defined}"
            elif program.buffers[b].kind == "constant":
                why = "but constants stay on the device"
            elif offload is None and not on_host:
                why = "but it was never offloaded"
            elif not (on_host or (done is not None and done <= p.issue_step)):
                why = f"before its offload completes (step {done})"
            else:
                continue
            what = f"is prefetched at step {p.issue_step} {why}"
            out.append(_about(program, "prefetch-without-host-copy", b, what, p.issue_step))


def _device_spans(program: Program, checked: Schedule, b: int, out: list[Violation]) -> list[tuple[int, int]]:
    """The steps each device copy of a moved buffer occupies; violations for reads and prefetches
    that its stays do not explain."""
    last_step = len(program.steps) - 1
    reads = program.uses.read_at[b]
    stays = checked.device_stays(program, b)
    if reads and (not stays or reads[0] < stays[0].start):
        message = f"step {reads[0]} reads buffer {b} ({program.buffers[b].label}), which is not on the device"
        out.append(Violation(kind="read-not-resident", step=reads[0], buffer=b, message=message))
    spans = []
    for stay in stays:
        start = max(stay.start, 0)  # a stay from before the first step or past the last occupies
        spans.append((start, max(start, min(stay.end, last_step))))  # the first or the last step
    if len(stays) > 1 or (stays and stays[0].prefetched):
        _check_fetched_stays(program, checked, stays, spans, out)
    return spans


def _check_fetched_stays(
    program: Program, checked: Schedule, stays: list[Stay], spans: list[tuple[int, int]], out: list[Violation]
) -> None:
    """Each prefetch must serve a read, first the one it names, and come after the copy before it."""
    prefetches = iter(checked.prefetches_by_buffer.get(stays[0].buffer, ()))
    for j, (stay, (_, end)) in enumerate(zip(stays, spans)):
        if stay.prefetched:
            _check_prefetch(program, next(prefetches), stay.served, out)
        if j + 1 < len(stays) and end >= stays[j + 1].start:
            following = stays[j + 1].start
            what = f"is prefetched at step {following} while its device copy is still held (until step {end})"
            out.append(_about(program, "prefetch-while-resident", stay.buffer, what, following))


def _check_homes(program: Program, checked: Schedule, b: int, out: list[Violation]) -> None:
    buffer = program.buffers[b]
    if b in checked.host_inputs and buffer.kind != "input":
        what = f"is placed on host but is a {buffer.kind}, not an input"
        out.append(_about(program, "bad-home", b, what))
    host_copy = b in checked.host_inputs or b in checked.offload_by_buffer
    if b in checked.host_outputs and not (buffer.is_output and host_copy):
        out.append(_about(program, "bad-home", b, "is returned on host but is not an output with a host copy"))


def _check_prefetch(program: Program, prefetch: Prefetch, served: tuple[int, ...], out: list[Violation]) -> None:
    b, issued = prefetch.buffer, prefetch.issue_step
    if not served:
        what = f"is prefetched at step {issued} but no read uses that copy"
        out.append(_about(program, "unused-prefetch", b, what, issued))
    elif served[0] != prefetch.use_step:
        what = f"is prefetched for step {prefetch.use_step}, but the first read it serves is at step {served[0]}"
        out.append(_about(program, "bad-prefetch", b, what, issued))


def frees_host_state_early(program: Program, schedule: Schedule) -> bool:
    """Whether the donated arguments a plan keeps in host memory are deleted at their last prefetch,
    rather than when the call ends: where the donated state is larger than the device budget, so
    that the host does not hold the old state beside the new. Elsewhere a failed call leaves them
    intact, to be called again."""
    budget = schedule.budget_bytes
    return bool(schedule.host_inputs) and budget is not None and program.donated_bytes > budget


def _host_span(n: int, checked: Schedule, b: int, buffer: Buffer, early: bool) -> tuple[int, int] | None:
    if n == 0:
        return None
    if b in checked.host_inputs:
        fetched = [p.issue_step for p in checked.prefetches_by_buffer.get(b, ())]
        # Deleted at its last prefetch (``frees_host_state_early``), unless the step returns it as it is.
        gone = early and buffer.donated and fetched and not buffer.is_output
        return (0, max(fetched) if gone else n - 1)
    offload = checked.offload_by_buffer.get(b)
    if offload is None:
        return None
    if buffer.is_output and b in checked.host_outputs:
        return (offload.after_step, n - 1)
    last_use = max((p.issue_step for p in checked.prefetches_by_buffer.get(b, ())), default=offload.after_step)
    return (offload.after_step, max(last_use, offload.after_step))


def _timeline(program: Program, schedule: Schedule, device_diff: list[int], host_diff: list[int]) -> MemoryTimeline:
    device = [live + step.transient_bytes for live, step in zip(accumulate(device_diff), program.steps)]
    host = list(accumulate(host_diff))[: len(program.steps)]
    peak = max(device, default=0)
    # Every move's bytes, checked or not; a move naming a buffer the program lacks moves nothing
    # (validate reports it as unknown-buffer).
    count = len(program.buffers)

    def moved(moves: tuple) -> int:
        return sum(program.buffers[m.buffer].nbytes for m in moves if 0 <= m.buffer < count)

    return MemoryTimeline(
        device_bytes=tuple(device),
        host_bytes=tuple(host),
        peak_bytes=peak,
        peak_step=device.index(peak) if device else None,
        host_peak_bytes=max(host, default=0),
        h2d_bytes=moved(schedule.prefetches),
        d2h_bytes=moved(schedule.offloads),
    )


def _over_budget(device: tuple[int, ...], budget: int) -> list[Violation]:
    violations, k = [], 0
    while k < len(device):
        if device[k] <= budget:
            k += 1
            continue
        first = k
        while k < len(device) and device[k] > budget:
            k += 1
        worst = max(range(first, k), key=device.__getitem__)
        where = f"step {first}" if k - first == 1 else f"steps {first}..{k - 1}"
        violations.append(
            Violation(
                kind="over-budget",
                step=worst,
                message=f"device bytes exceed the budget of {format_bytes(budget)} at {where} "
                f"(peak {format_bytes(device[worst])} at step {worst})",
            )
        )
    return violations
