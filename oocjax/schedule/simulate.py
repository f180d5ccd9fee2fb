"""Replays a schedule over a program: device and host memory per step, and everything wrong with it.

The rules mirror what XLA does with the rewritten program:
  * an input kept on the device occupies it for the whole step, unless donated, when its memory
    is free after its last read; a constant always occupies it;
  * a computed value occupies the device from the step that defines it;
  * a device copy is released after its last read, but not before its offload completes
    (``done_before_step``), and an output returned on the device is held to the end;
  * a prefetch takes memory from the step it is issued at.
This module is independent of the planners: it is the referee their plans are checked against.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate

from oocjax.schedule.moves import Offload, Prefetch, Schedule
from oocjax.schedule.program import Program, Uses, held_for_whole_step
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
    return _replay(program, schedule)[0]


def validate(program: Program, schedule: Schedule) -> tuple[Violation, ...]:
    """Every violation at once: reads of values not on the device, prefetches without a ready host
    copy, copies released before they complete, device bytes above the budget. Empty when valid."""
    return _replay(program, schedule)[1]


def _replay(program: Program, schedule: Schedule) -> tuple[MemoryTimeline, tuple[Violation, ...]]:
    n = len(program.steps)
    uses = program.uses
    violations: list[Violation] = []
    offload_of, prefetches_of = _moves_by_buffer(program, schedule, uses, violations)
    device_diff = [0] * (n + 1)
    host_diff = [0] * (n + 1)

    moved = offload_of.keys() | prefetches_of.keys() | schedule.host_inputs | schedule.host_outputs
    for b, buffer in enumerate(program.buffers):
        kept_input = held_for_whole_step(buffer, uses.read_at[b])
        if n and b not in moved:  # one span on the device
            start = uses.defined_at[b] or 0
            reads = uses.read_at[b]
            end = n - 1 if kept_input or buffer.is_output else max(start, reads[-1] if reads else 0)
            device_diff[start] += buffer.nbytes
            device_diff[end + 1] -= buffer.nbytes
            continue
        offload, prefetches = offload_of.get(b), prefetches_of.get(b)
        on_host = b in schedule.host_inputs
        _check_homes(program, schedule, b, offload, violations)
        if buffer.kind == "computed":
            starts = [uses.defined_at[b]]
        else:
            starts = [] if on_host else [0]
        reads = uses.read_at[b]
        device_output = buffer.is_output and b not in schedule.host_outputs
        prefetches = prefetches or []
        first_prefetch = len(starts)
        starts += [p.issue_step for p in prefetches]
        if reads and (not starts or reads[0] < starts[0]):
            violations.append(
                Violation(
                    kind="read-not-resident",
                    step=reads[0],
                    buffer=b,
                    message=f"step {reads[0]} reads buffer {b} ({buffer.label}), which is not on the device",
                )
            )
        for j, start in enumerate(starts):
            following = starts[j + 1] if j + 1 < len(starts) else n
            served = [r for r in reads if start <= r < following]
            end = max([start, *served])
            if offload is not None and start <= offload.after_step < following:
                done = offload.done_before_step
                end = max(end, n - 1 if done is None else done - 1)
            if (j == 0 and kept_input and not on_host) or (j == len(starts) - 1 and device_output):
                end = n - 1
            if j >= first_prefetch:
                _check_prefetch(prefetches[j - first_prefetch], served, b, buffer.label, violations)
            if j + 1 < len(starts) and end >= following:
                violations.append(
                    Violation(
                        kind="prefetch-while-resident",
                        step=following,
                        buffer=b,
                        message=f"buffer {b} ({buffer.label}) is prefetched at step {following} "
                        f"while its device copy is still held (until step {end})",
                    )
                )
            if n:
                device_diff[start] += buffer.nbytes
                device_diff[min(end, n - 1) + 1] -= buffer.nbytes

        host_span = _host_span(n, schedule, b, buffer.is_output, offload, prefetches)
        if host_span is not None:
            host_diff[host_span[0]] += buffer.nbytes
            host_diff[host_span[1] + 1] -= buffer.nbytes

    device = [live + step.transient_bytes for live, step in zip(accumulate(device_diff), program.steps)]
    host = list(accumulate(host_diff))[:n]
    peak = max(device, default=0)
    timeline = MemoryTimeline(
        device_bytes=tuple(device),
        host_bytes=tuple(host),
        peak_bytes=peak,
        peak_step=device.index(peak) if device else None,
        host_peak_bytes=max(host, default=0),
        h2d_bytes=sum(program.buffers[m.buffer].nbytes for m in schedule.prefetches),
        d2h_bytes=sum(program.buffers[m.buffer].nbytes for m in schedule.offloads),
    )
    if schedule.budget_bytes is not None:
        violations += _over_budget(device, schedule.budget_bytes)
    return timeline, tuple(violations)


def _moves_by_buffer(
    program: Program, schedule: Schedule, uses: Uses, violations: list[Violation]
) -> tuple[dict[int, Offload], dict[int, list[Prefetch]]]:
    n, count = len(program.steps), len(program.buffers)
    offload_of: dict[int, Offload] = {}
    prefetches_of: dict[int, list[Prefetch]] = defaultdict(list)
    for move in schedule.moves:
        b = move.buffer
        if not 0 <= b < count:
            violations.append(
                Violation(
                    kind="unknown-buffer", buffer=b, message=f"a move names buffer {b}, but the program has {count}"
                )
            )
            continue
        buffer = program.buffers[b]
        if isinstance(move, Offload):
            defined = uses.defined_at[b]
            done = move.done_before_step
            if buffer.kind != "computed":
                problem = f"is an {buffer.kind}: place it on host instead of copying it out"
            elif b in offload_of:
                problem = "is offloaded twice: a value never changes, one host copy serves every prefetch"
            elif defined is None or not defined <= move.after_step < n:
                problem = f"is offloaded after step {move.after_step}, outside steps {defined}..{n - 1} where it exists"
            elif done is not None and not move.after_step < done < n:
                problem = f"has its offload done before step {done}, not after it starts (step {move.after_step})"
            else:
                offload_of[b] = move
                continue
            violations.append(
                Violation(
                    kind="bad-offload", step=move.after_step, buffer=b, message=f"buffer {b} ({buffer.label}) {problem}"
                )
            )
        else:
            if not 0 <= move.issue_step <= move.use_step < n:
                violations.append(
                    Violation(
                        kind="bad-prefetch",
                        step=move.issue_step,
                        buffer=b,
                        message=f"buffer {b} ({buffer.label}) is prefetched at step "
                        f"{move.issue_step} for step {move.use_step}, outside 0..{n - 1}",
                    )
                )
                continue
            prefetches_of[b].append(move)
    for b, prefetches in prefetches_of.items():
        prefetches.sort(key=lambda p: p.issue_step)
        defined = uses.defined_at[b]
        for p in prefetches:
            buffer = program.buffers[b]
            offload = offload_of.get(b)
            done = None if offload is None else offload.done_before_step
            ready = b in schedule.host_inputs or (done is not None and done <= p.issue_step)
            if defined is not None and p.issue_step <= defined:
                why = f"before it is defined at step {defined}"
            elif buffer.kind == "constant":
                why = "but constants stay on the device"
            elif offload is None and b not in schedule.host_inputs:
                why = "but it was never offloaded"
            elif not ready:
                why = f"before its offload completes (step {offload.done_before_step})"
            else:
                continue
            violations.append(
                Violation(
                    kind="prefetch-without-host-copy",
                    step=p.issue_step,
                    buffer=b,
                    message=f"buffer {b} ({buffer.label}) is prefetched at step {p.issue_step} {why}",
                )
            )
    return offload_of, prefetches_of


def _check_homes(program: Program, schedule: Schedule, b: int, offload: Offload | None, out: list[Violation]) -> None:
    buffer = program.buffers[b]
    if b in schedule.host_inputs and buffer.kind != "input":
        out.append(
            Violation(
                kind="bad-home",
                buffer=b,
                message=f"buffer {b} ({buffer.label}) is placed on host but is a {buffer.kind}, not an input",
            )
        )
    if b in schedule.host_outputs and not (buffer.is_output and (b in schedule.host_inputs or offload is not None)):
        out.append(
            Violation(
                kind="bad-home",
                buffer=b,
                message=f"buffer {b} ({buffer.label}) is returned on host but is not an output with a host copy",
            )
        )


def _check_prefetch(prefetch: Prefetch, served: list[int], b: int, label: str, out: list[Violation]) -> None:
    if not served:
        out.append(
            Violation(
                kind="unused-prefetch",
                step=prefetch.issue_step,
                buffer=b,
                message=f"buffer {b} ({label}) is prefetched at step {prefetch.issue_step} but no read uses that copy",
            )
        )
    elif served[0] != prefetch.use_step:
        out.append(
            Violation(
                kind="bad-prefetch",
                step=prefetch.issue_step,
                buffer=b,
                message=f"buffer {b} ({label}) is prefetched for step {prefetch.use_step}, "
                f"but the first read it serves is at step {served[0]}",
            )
        )


def _host_span(
    n: int, schedule: Schedule, b: int, is_output: bool, offload: Offload | None, prefetches: list[Prefetch]
) -> tuple[int, int] | None:
    if n == 0:
        return None
    if b in schedule.host_inputs:
        return (0, n - 1)
    if offload is None:
        return None
    if is_output and b in schedule.host_outputs:
        return (offload.after_step, n - 1)
    last_use = max((p.issue_step for p in prefetches), default=offload.after_step)
    return (offload.after_step, max(last_use, offload.after_step))


def _over_budget(device: list[int], budget: int) -> list[Violation]:
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
