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

``calibrate_program_costs`` fits the profile's compute rates to measured segment times, so that the
same model predicts what the device really does. The rates come from a ``DeviceProfile``
(``schedule.profiles``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from oocjax.schedule.bounds import pressure_bound
from oocjax.schedule.moves import Move, Schedule
from oocjax.schedule.profiles import DEFAULT_PROFILE, DeviceProfile, resolve_profile
from oocjax.schedule.program import Program, Step
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """A device profile whose compute rates were fitted to measured times of groups of steps.

    Attributes:
      profile: the prior profile with ``flops_per_s``, ``hbm_bytes_per_s`` and ``op_overhead_s``
        fitted (a rate the measurements cannot determine keeps the prior's value).
      launch_s: the fitted fixed cost of launching one group as a program (dispatch, argument
        handling), which per-step costs do not model; a whole step under ``jax.jit`` pays it once.
      measured_s: per group (segment), the measured seconds.
      predicted_s: per group, ``launch_s`` plus the summed ``compute_seconds`` of its steps.
      rounds: fits made until each step's bound (arithmetic or memory) stopped changing.
    """

    profile: DeviceProfile
    launch_s: float
    measured_s: tuple[float, ...]
    predicted_s: tuple[float, ...]
    rounds: int

    @property
    def total_ratio(self) -> float:
        """Predicted over measured seconds, summed over the groups."""
        return sum(self.predicted_s) / sum(self.measured_s)

    @property
    def relative_rms(self) -> float:
        """Root mean square of ``predicted / measured - 1`` over the groups."""
        errors = [(p / m - 1) ** 2 for p, m in zip(self.predicted_s, self.measured_s, strict=True)]
        return math.sqrt(sum(errors) / len(errors)) if errors else 0.0

    def predict_s(self, steps: Iterable[Step]) -> float:
        """The time of these steps run as one program."""
        return self.launch_s + sum(self.profile.compute_seconds(step) for step in steps)


def calibrate_program_costs(
    program: Program,
    segments: Iterable[tuple[Iterable[int], float]],
    *,
    prior: DeviceProfile | str = DEFAULT_PROFILE,
    max_rounds: int = 20,
) -> Calibration:
    """Fits a profile's compute rates so that the cost model matches measured segment times.

    A step costs ``max(flops / flops_per_s, bytes_accessed / hbm_bytes_per_s) + op_overhead_s``
    (``DeviceProfile.compute_seconds``), a segment the sum over its steps plus a launch cost. With
    each step's bound (arithmetic or memory) fixed, that is linear in four coefficients: seconds
    per flop, per byte, per step and per launch. They are fitted by non-negative least squares on
    seconds, the bounds reclassified under the fitted rates, and the fit repeated until no bound
    changes. Errors in seconds, not relative ones: the long segments make most of a step's time,
    and where the launch cost comes out positive the predicted total equals the measured one (the
    residuals of a fit with a constant term sum to zero); tiny segments, mostly launch and timing
    noise, would otherwise set the rates. The rates are effective ones: XLA fuses element-wise
    equations, so the memory rate absorbs the traffic that fusion saves.

    Args:
      program: the step program.
      segments: (steps, seconds) per measured segment, e.g. ``(range(s.start, s.stop), 0.012)``;
        at least four segments of different makeup determine every coefficient.
      prior: the profile to start from and to take the link figures from.
      max_rounds: a bound on the fits (each round is linear in the steps).

    Raises:
      ValueError: for a segment without steps, with a step outside the program, or with a time
        that is not positive and finite.

    >>> p = Program.from_ops([("dot", [], ["a"]), ("add", ["a"], ["b"])], {"a": 8, "b": 8}, flops={0: 10**9})
    >>> fit = calibrate_program_costs(p, [([0], 0.011), ([1], 0.001), ([0, 1], 0.012)], prior="cpu")
    >>> round(fit.profile.flops_per_s / 1e9, 3), round(fit.profile.op_overhead_s, 6), fit.relative_rms < 1e-9
    (100.0, 0.001, True)
    """
    groups = []
    for steps, seconds in segments:
        indices = list(steps)
        if not indices or not all(0 <= k < len(program.steps) for k in indices):
            raise ValueError(f"a segment must cover steps of the program (0 .. {len(program.steps) - 1}): {indices}")
        groups.append(([program.steps[k] for k in indices], seconds))
    return fit_step_costs(groups, prior=prior, max_rounds=max_rounds)


def fit_step_costs(
    groups: Sequence[tuple[Sequence[Step], float]],
    *,
    prior: DeviceProfile | str = DEFAULT_PROFILE,
    max_rounds: int = 20,
) -> Calibration:
    """``calibrate_program_costs`` for groups of steps that may come from several programs."""
    profile = start = resolve_profile(prior)
    measured = tuple(float(seconds) for _, seconds in groups)
    if not groups or not all(math.isfinite(t) and t > 0 for t in measured):
        raise ValueError(f"measured times must be positive and finite, one per group: {measured}")
    best: Calibration | None = None
    for rounds in range(1, max_rounds + 1):
        rows = [_cost_features(steps, profile) for steps, _ in groups]
        *per_step, launch = _nonnegative_least_squares(rows, measured)
        fitted = _with_coefficients(profile, per_step)
        predicted = tuple(launch + sum(fitted.compute_seconds(s) for s in steps) for steps, _ in groups)
        result = Calibration(profile=fitted, launch_s=launch, measured_s=measured, predicted_s=predicted, rounds=rounds)
        if best is None or _squared_error(result) < _squared_error(best):
            best = result
        if all(_cost_features(steps, fitted) == row for (steps, _), row in zip(groups, rows)):
            break  # every step keeps its bound: the fit is self-consistent
        profile = fitted
    assert best is not None
    source = f"{start.source or start.name}; rates fitted to {len(groups)} measured segment times"
    return replace(best, profile=replace(best.profile, source=source), rounds=rounds)


def _squared_error(fit: Calibration) -> float:
    return sum((p - m) ** 2 for p, m in zip(fit.predicted_s, fit.measured_s))


def _cost_features(steps: Sequence[Step], profile: DeviceProfile) -> tuple[float, float, float, float]:
    """The factors of the four coefficients in a group's time: flops of its arithmetic-bound steps,
    bytes of its memory-bound ones, its number of steps, one launch."""
    flops = nbytes = 0
    for step in steps:
        if step.flops / profile.flops_per_s >= step.bytes_accessed / profile.hbm_bytes_per_s:
            flops += step.flops
        else:
            nbytes += step.bytes_accessed
    return float(flops), float(nbytes), float(len(steps)), 1.0


def _with_coefficients(profile: DeviceProfile, coefficients: Sequence[float]) -> DeviceProfile:
    """The profile with fitted seconds per flop, per byte and per step. A zero per-flop or per-byte
    coefficient says the measurements cannot see that term: its rate stays the prior's (an
    infinite rate would make every step bound by the other term)."""
    per_flop, per_byte, per_step = coefficients
    return replace(
        profile,
        flops_per_s=1 / per_flop if per_flop > 0 else profile.flops_per_s,
        hbm_bytes_per_s=1 / per_byte if per_byte > 0 else profile.hbm_bytes_per_s,
        op_overhead_s=per_step,
    )


def _nonnegative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> tuple[float, ...]:
    """argmin ||rows x - targets|| over x >= 0, exactly, for a handful of unknowns.

    The optimum is the unconstrained least-squares fit on some subset of the columns whose
    coefficients all come out non-negative (its KKT conditions), so every subset is tried. Columns
    are scaled to a largest entry of 1 first: flops, bytes and counts differ by nine orders.
    """
    n = len(rows[0])
    scale = [max((abs(row[j]) for row in rows), default=0.0) or 1.0 for j in range(n)]
    scaled = [[row[j] / scale[j] for j in range(n)] for row in rows]
    best, best_residual = (0.0,) * n, _residual(scaled, targets, (0.0,) * n)
    for size in range(1, n + 1):
        for columns in combinations(range(n), size):
            solution = _least_squares([[row[j] for j in columns] for row in scaled], targets)
            if solution is None or min(solution) < 0:
                continue
            x = [0.0] * n
            for j, value in zip(columns, solution):
                x[j] = value
            residual = _residual(scaled, targets, x)
            if residual < best_residual:
                best, best_residual = tuple(x), residual
    return tuple(value / s for value, s in zip(best, scale))


def _residual(rows: Sequence[Sequence[float]], targets: Sequence[float], x: Sequence[float]) -> float:
    return sum((sum(a * b for a, b in zip(row, x)) - t) ** 2 for row, t in zip(rows, targets))


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float] | None:
    """The least-squares solution through the normal equations (Gaussian elimination with partial
    pivoting); None where the columns are (nearly) dependent."""
    n = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * t for r, t in zip(rows, targets))]
        for i in range(n)
    ]
    tiny = 1e-12 * max((a[i][i] for i in range(n)), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) <= tiny or a[pivot][col] == 0:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                factor = a[i][col] / a[col][col]
                a[i] = [x - factor * y for x, y in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]
