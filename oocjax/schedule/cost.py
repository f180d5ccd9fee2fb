"""Cost model: how long a step takes under a schedule, with compute and both copy directions overlapped.

Three in-order streams, as on a GPU: compute runs the steps one after another; host-to-device copies
and device-to-host copies each run on their own stream. Dependencies:
  * a prefetch starts when its issue step starts (after the previous step ends), when the
    host-to-device stream is free, and when its host copy exists (its offload has completed);
  * a step starts after the previous one, after the prefetches it is the first use of, and after the
    offloads that must complete before it (``done_before_step``: their memory is what it runs in);
  * an offload starts after the step it follows, when the device-to-host stream is free.
A copy costs a fixed latency plus its bytes over the link's bandwidth, per direction: small eager
copies run far below the link's rate (measured on an H200). The step ends
when compute and every copy are done. The lower bound is the largest of the compute time, each
direction's bytes over its bandwidth, and, for a schedule made for a budget,
the pressure bound (``bounds.pressure_bound``): the bytes over the budget at the forward/backward
turn leave before it and come back after it, so the two directions cannot overlap there.

The rates come from a ``DeviceProfile`` (``schedule.profiles``; ``benchmarks/rates.py`` fits them
to timed segments).
"""

from __future__ import annotations

from dataclasses import dataclass

from oocjax.schedule.bounds import pressure_bound
from oocjax.schedule.moves import Move, Schedule
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.schedule.program import Program
from oocjax.schedule.simulate import simulate


@dataclass(frozen=True, slots=True, kw_only=True)
class TimedResult:
    """What the timed simulation found.

    Attributes:
      step_time_s: from the first step's start to the end of the last step or copy.
      compute_time_s: the sum of the steps' compute times.
      exposed_transfer_s: ``step_time_s - compute_time_s``: time compute spent waiting for copies.
      lower_bound_s: a time this schedule cannot beat: the largest of the compute time, each
        direction's bytes over its bandwidth, and, for a schedule made for a budget, the pressure
        bound's step time (which no plan within that budget beats).
      h2d_bytes, d2h_bytes: bytes copied each way.
      compute_spans, h2d_spans, d2h_spans: (start, end) seconds of each step and copy, for plots.
    """

    step_time_s: float
    compute_time_s: float
    exposed_transfer_s: float
    lower_bound_s: float
    h2d_bytes: int
    d2h_bytes: int
    compute_spans: tuple[tuple[float, float], ...]
    h2d_spans: tuple[tuple[float, float], ...]
    d2h_spans: tuple[tuple[float, float], ...]


def simulate_time(program: Program, schedule: Schedule, profile: DeviceProfile | str) -> TimedResult:
    """Runs the schedule on three streams with a device profile (a value, or a name that
    ``resolve_profile`` reads)."""
    profile = resolve_profile(profile)
    issued_at, offloaded_after = schedule.prefetches_by_issue_step, schedule.offloads_by_after_step
    waits_for = schedule.waits_by_step
    done: dict[Move, float] = {}  # completion time of each copy
    host_ready: dict[int, float] = {}  # buffer -> when its host copy is complete
    compute_spans, h2d_spans, d2h_spans = [], [], []
    compute_free = h2d_free = d2h_free = 0.0
    nbytes = [b.nbytes for b in program.buffers]

    serial = not profile.copies_overlap_compute  # a copy holds the compute stream too
    for k, step in enumerate(program.steps):
        for p in issued_at.get(k, ()):
            start = max(compute_free, h2d_free, host_ready.get(p.buffer, 0.0))
            h2d_free = start + profile.h2d_seconds(nbytes[p.buffer])
            compute_free = h2d_free if serial else compute_free
            done[p] = h2d_free
            h2d_spans.append((start, h2d_free))
        start = max([compute_free, *(done[m] for m in waits_for.get(k, ()))])
        compute_free = start + profile.compute_seconds(step)
        compute_spans.append((start, compute_free))
        for o in offloaded_after.get(k, ()):
            begin = max(compute_free, d2h_free)
            d2h_free = begin + profile.d2h_seconds(nbytes[o.buffer])
            compute_free = d2h_free if serial else compute_free
            done[o] = host_ready[o.buffer] = d2h_free
            d2h_spans.append((begin, d2h_free))

    compute = sum(end - start for start, end in compute_spans)
    h2d = sum(nbytes[p.buffer] for p in schedule.prefetches)
    d2h = sum(nbytes[o.buffer] for o in schedule.offloads)
    total = max(compute_free, h2d_free, d2h_free)
    return TimedResult(
        step_time_s=total,
        compute_time_s=compute,
        exposed_transfer_s=total - compute,
        lower_bound_s=_lower_bound(program, schedule, profile, compute),
        h2d_bytes=h2d,
        d2h_bytes=d2h,
        compute_spans=tuple(compute_spans),
        h2d_spans=tuple(h2d_spans),
        d2h_spans=tuple(d2h_spans),
    )


def _lower_bound(program: Program, schedule: Schedule, profile: DeviceProfile, compute_s: float) -> float:
    """Seconds this schedule cannot beat (``TimedResult.lower_bound_s``). The link terms leave the
    copies' latencies out (adding them would still be a bound)."""
    nbytes = [b.nbytes for b in program.buffers]
    h2d = sum(nbytes[p.buffer] for p in schedule.prefetches) / profile.h2d_bytes_per_s
    d2h = sum(nbytes[o.buffer] for o in schedule.offloads) / profile.d2h_bytes_per_s
    if not profile.copies_overlap_compute:  # everything takes the same cores, one after another
        return compute_s + h2d + d2h
    return max(compute_s, h2d, d2h, _pressure_seconds(program, schedule, profile))


def _pressure_seconds(program: Program, schedule: Schedule, profile: DeviceProfile) -> float:
    """``bounds.pressure_bound``'s step time for the schedule's budget; 0 without a budget.

    That bound holds for plans within its budget that move only values of at least
    ``min_offload_bytes``. So the budget is raised to the schedule's own simulated peak (a plan over
    its budget still has that much less on the device), and the threshold lowered to the smallest
    value the schedule moves. A schedule that moves nothing holds the in-core peak: only compute.
    """
    moved = {m.buffer for m in schedule.moves} | schedule.host_inputs | schedule.host_outputs
    if schedule.budget_bytes is None or not moved:
        return 0.0
    threshold = min(program.buffers[b].nbytes for b in moved)
    budget = max(schedule.budget_bytes, simulate(program, schedule).peak_bytes)
    return pressure_bound(program, budget, profile=profile, min_offload_bytes=threshold).step_time_s or 0.0
