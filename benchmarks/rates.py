"""A device's own rates, measured, and the cost model's rates fitted to timed segments: how the
published profiles (``oocjax.schedule.profiles``) are made and checked. Plans are chosen with the
device kind's published profile, not with rates a process measures (measured rates moved by tens
of percent between processes on a loaded machine, and with them the plan), so measuring belongs
here, beside the benchmarks that make and check profiles.

``measure_profile`` times a matmul rate, a memory rate and the link per direction as bandwidth
*and* latency (eager 4 MiB copies ran at 12-14 GB/s on an H200 where 256 MiB ones ran at 50 GB/s),
in about a second on a 2-core CPU, cached per device kind in the process; sizes grow with the device
(a few milliseconds of work per timed call on each). ``time_segments`` times compiled segments, and
``calibrate_program_costs`` (``fit_step_costs`` across programs) fits the profile's compute rates to
those times, so that the same model predicts what the device really does.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import combinations
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # imported from a script in benchmarks/: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oocjax.schedule import DEFAULT_PROFILE, DeviceProfile, MiB, Program, Segment, Step, profile_for, resolve_profile
from oocjax.testing import TracedStep, segment_functions

_GiB = 1024 * MiB
_MEASURED: dict[tuple[str, str], DeviceProfile] = {}  # (platform, device kind) -> its measured profile


def default_profile(device: Any = None) -> DeviceProfile:
    """The published profile of ``device`` (default: the first device)."""
    device = jax.local_devices()[0] if device is None else device
    return profile_for(device.platform, device.device_kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSizes:
    """How big the timed operations are on one device.

    Attributes:
      matmul_n: side of the square float32 matrices multiplied.
      matmul_repeats: products timed back to back, each on the last one's result.
      elementwise_bytes: size of the float32 array an element-wise op reads (and writes as much).
      elementwise_repeats: passes timed back to back, each over the last one's result.
      copy_bytes: the two copy sizes the link's latency and bandwidth are fitted from.
    """

    matmul_n: int
    matmul_repeats: int = 1
    elementwise_bytes: int
    elementwise_repeats: int = 1
    copy_bytes: tuple[int, int]

    @classmethod
    def for_device(cls, device: Any, within_bytes: int | None = None) -> ProbeSizes:
        """Sizes for ``device``. A CPU keeps them cache- and page-fault-friendly (a 64 MiB result
        is written at a third of the 16 MiB rate there, for fresh pages). An accelerator gets a few
        milliseconds of work per timed call (a product of two 8192 x 8192 matrices, 4 GiB read and
        written), made of repeated smaller operations where they must fit ``within_bytes``: the
        budget of the step about to be planned, of which the probes hold an eighth at most, so that
        measuring the device does not raise its peak above that budget (the 2 GiB array an H200's
        memory probe held took a 4 GiB step's peak to 4.10 GiB)."""
        if device.platform == "cpu":
            return cls(matmul_n=512, elementwise_bytes=16 * MiB, copy_bytes=(MiB, 16 * MiB))
        limit = (device.memory_stats() or {}).get("bytes_limit", 16 * _GiB)
        room = limit // 8 if within_bytes is None else min(limit // 8, within_bytes // 8)
        n = next((n for n in (8192, 4096, 2048, 1024) if 3 * n * n * 4 <= room), 512)  # a, a product, the next
        elementwise = max(MiB, min(2 * _GiB, room // 3) // MiB * MiB)  # an input, its result, the next result
        return cls(
            matmul_n=n,
            matmul_repeats=(8192 // n) ** 3,
            elementwise_bytes=elementwise,
            elementwise_repeats=-(-2 * _GiB // elementwise),
            copy_bytes=(MiB, max(2 * MiB, min(64 * MiB, room // 2 // MiB * MiB))),
        )


def measure_profile(
    device: Any = None, *, budget_s: float = 1.0, refresh: bool = False, within_bytes: int | None = None
) -> DeviceProfile:
    """The rates of ``device`` (default: the first device), measured once per device kind.

    Times, best of a few calls each: a jitted float32 matmul at the default precision, as a
    float32 training step runs it (TF32 on recent NVIDIA GPUs) (``flops_per_s``); a jitted
    element-wise op over a large array (``hbm_bytes_per_s``, bytes read plus written); eager
    ``jax.device_put`` to ``pinned_host`` and back at two sizes, fitted per direction as a
    latency plus bytes over bandwidth. ``op_overhead_s`` is the published profile's
    (``default_profile``). The rates are what one large, well-shaped kernel reaches, so they err
    fast: a training step's smaller matmuls, convolutions and unfused estimates run slower, and
    ``calibrate_program_costs`` on timed segments (``time_segments``) fits that.

    Args:
      device: a ``jax.Device``.
      budget_s: seconds of repeated timing allowed beyond compiling (split over the four
        measurements; each still runs at least twice).
      refresh: measure again even if this process already measured this kind of device.
      within_bytes: device memory the probes must fit in (a step's budget): they hold an eighth
        of it at most (``ProbeSizes.for_device``).

    >>> profile = measure_profile()
    >>> profile.flops_per_s > 0 and profile.h2d_latency_s >= 0 and measure_profile() is profile
    True
    """
    device = jax.local_devices()[0] if device is None else device
    key = (device.platform, device.device_kind)
    if key in _MEASURED and not refresh:
        return _MEASURED[key]
    sizes, share = ProbeSizes.for_device(device, within_bytes), budget_s / 4
    # One device's rates, measured on that device alone: a mesh the caller set (jax.set_mesh) would
    # refuse these one-device arrays.
    with _on_device_alone(device):
        d2h, h2d = _link_fits(device, sizes.copy_bytes, share)
        flops_per_s = _matmul_rate(device, sizes.matmul_n, sizes.matmul_repeats, share)
        hbm_bytes_per_s = _memory_rate(device, sizes.elementwise_bytes, sizes.elementwise_repeats, share)
    measured = replace(
        default_profile(device),
        name=f"measured {device.device_kind}",
        flops_per_s=flops_per_s,
        hbm_bytes_per_s=hbm_bytes_per_s,
        h2d_bytes_per_s=h2d.bytes_per_s,
        d2h_bytes_per_s=d2h.bytes_per_s,
        copy_latency_s=(h2d.latency_s + d2h.latency_s) / 2,
        h2d_latency_s=h2d.latency_s,
        d2h_latency_s=d2h.latency_s,
        source=f"measured by benchmarks/rates.py's measure_profile on {device} ({sizes})",
    )
    _MEASURED[key] = measured
    return measured


def _on_device_alone(device: Any) -> Any:
    """A context without the caller's mesh (``jax.set_mesh``), where one-device arrays compute."""
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        return contextlib.nullcontext()
    return jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("device",)))


def _best_seconds(call: Callable[[], Any], budget_s: float, *, least: int = 2, most: int = 20) -> float:
    """The fastest of repeated timed calls (after one untimed call that compiles and warms up):
    the least disturbed run is the closest to the device's rate."""
    jax.block_until_ready(call())
    best, spent, runs = math.inf, 0.0, 0
    while runs < least or (spent < budget_s and runs < most):
        started = time.perf_counter()
        jax.block_until_ready(call())
        elapsed = time.perf_counter() - started
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def _matmul_rate(device: Any, n: int, repeats: int, budget_s: float) -> float:
    a = jax.device_put(np.full((n, n), 1 / n, np.float32), device)  # a @ a == a: repeated products stay finite
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 * repeats / _best_seconds(lambda: _repeated(lambda x: matmul(x, a), a, repeats), budget_s)


def _memory_rate(device: Any, nbytes: int, repeats: int, budget_s: float) -> float:
    x = jax.device_put(np.ones((nbytes // 4,), np.float32), device)
    halve = jax.jit(lambda v: v * 0.5 + 0.5)  # one fused loop: reads and writes each element once; ones stay ones
    return 2 * x.nbytes * repeats / _best_seconds(lambda: _repeated(halve, x, repeats), budget_s)


def _repeated(function: Callable[[Any], Any], x: Any, repeats: int) -> Any:
    """``function`` applied ``repeats`` times, each on the last result: enqueued back to back, the
    device runs them without waiting for the host, and each result frees the one before."""
    for _ in range(repeats):
        x = function(x)
    return x


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """One direction of the host link: a copy of ``n`` bytes takes ``latency_s + n / bytes_per_s``."""

    bytes_per_s: float
    latency_s: float

    @classmethod
    def through(cls, small: tuple[int, float], large: tuple[int, float]) -> LinkFit:
        """The line through two (bytes, seconds) points. Where timing noise makes it meaningless
        (not rising, or reaching zero time above zero bytes), the line through the origin and the
        large copy instead: no latency, its average rate (the large copy is the one to get right)."""
        (n0, t0), (n1, t1) = small, large
        rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        latency = t0 - n0 / rate if rate > 0 else -1.0
        if latency < 0:
            return cls(bytes_per_s=n1 / t1, latency_s=0.0)
        return cls(bytes_per_s=rate, latency_s=latency)


def _link_fits(device: Any, copy_bytes: tuple[int, int], budget_s: float) -> tuple[LinkFit, LinkFit]:
    """(device-to-host, host-to-device) fits from eager copies to ``pinned_host`` and back."""
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    points: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
    for nbytes in copy_bytes:
        x = jax.device_put(np.ones((nbytes // 4,), np.float32), on_device)
        h = jax.block_until_ready(jax.device_put(x, on_host))
        points["d2h"].append((x.nbytes, _best_seconds(partial(jax.device_put, x, on_host), budget_s / 2)))
        points["h2d"].append((x.nbytes, _best_seconds(partial(jax.device_put, h, on_device), budget_s / 2)))
    return LinkFit.through(*points["d2h"]), LinkFit.through(*points["h2d"])


def time_segments(
    traced: TracedStep, flat_args: Sequence[Any], segments: Sequence[Segment], *, repeats: int = 5
) -> list[tuple[range, float]]:
    """Per segment, its steps and the median seconds of its compiled program, run on real values.

    The segments run in order once (that also compiles them), each on the results of the ones
    before, then each is timed ``repeats`` times more on the same arguments. Nothing is donated,
    so that a segment can run again on its arguments. The result is what
    ``calibrate_program_costs(traced.program, ...)`` fits.

    Args:
      traced: the step (``trace.trace_step``).
      flat_args: its arguments as the flat leaves it was traced with (for positional arguments
        without static ones, ``jax.tree.leaves(args)``), as arrays.
      segments: consecutive segments of ``traced.program`` from its first step
        (``schedule.segments.cut_segments``).
      repeats: timed runs per segment.

    Raises:
      ValueError: for a number of arguments other than the traced step's.
    """
    flat = traced.flat
    if len(flat_args) != flat.num_inputs:
        raise ValueError(f"the traced step takes {flat.num_inputs} flat arguments, got {len(flat_args)}")
    kept = [replace(segment, donated=()) for segment in segments]  # timing reruns a segment on its arguments
    values: dict[int, Any] = {**dict(enumerate(flat_args)), **dict(flat.constants)}
    timings = []
    for segment, function in zip(kept, segment_functions(flat, kept), strict=True):
        arguments = [values[b] for b in segment.inputs]
        values.update(zip(segment.outputs, jax.block_until_ready(function(*arguments)), strict=True))
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(function(*arguments))
            seconds.append(time.perf_counter() - started)
        timings.append((range(segment.start, segment.stop), statistics.median(seconds)))
    return timings


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
