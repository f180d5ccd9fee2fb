"""Device rates: the published ``DeviceProfile`` plans are chosen with (``default_profile``), and the
measurements that check and fit such profiles: a device's own rates (``measure_profile``) and the
segment timings that calibrate the cost model against it.

The planner's cost model (``schedule.cost``) prices a step by its flops and bytes at a device's
sustained rates and a transfer by a per-copy latency plus its bytes over the link's bandwidth.
Plans are chosen with the device kind's published profile, not with rates a process measures: the
same step, budget and device then get the same plan in every process (measured rates moved by
tens of percent between processes on a loaded machine, and with them the plan). Measuring
(``measure_profile``: a matmul rate, a memory rate, the link per direction as bandwidth *and*
latency; eager 4 MiB copies ran at 12-14 GB/s on an H200 where 256 MiB ones ran at 50 GB/s) and
fitting the per-step estimates to the times of compiled segments (``time_segments``, then
``schedule.cost.calibrate_program_costs``) are for benchmarks that make and check profiles.

``measure_profile`` takes about a second on a 2-core CPU and is cached per device kind in the
process; sizes grow with the device (a few milliseconds of work per timed call on each).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oocjax.schedule.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile
from oocjax.schedule.segments import Segment
from oocjax.schedule.units import MiB
from oocjax.transforms.segment import segment_functions
from oocjax.transforms.trace import TracedStep

_GiB = 1024 * MiB
_MEASURED: dict[tuple[str, str], DeviceProfile] = {}  # (platform, device kind) -> its measured profile


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


def default_profile(device: Any = None) -> DeviceProfile:
    """The published profile that best describes ``device`` (default: the first device):
    ``PROFILES["cpu"]`` on a CPU, the matching NVIDIA part by its device kind, else
    ``DEFAULT_PROFILE``."""
    device = jax.local_devices()[0] if device is None else device
    if device.platform == "cpu":
        return PROFILES["cpu"]
    kind = device.device_kind.upper()
    for token, name in (("GH200", "gh200"), ("H200", "h200"), ("H100 PCIE", "h100-pcie"), ("H100", "h100-sxm")):
        if token in kind:
            return PROFILES[name]
    return DEFAULT_PROFILE


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
        source=f"measured by oocjax.transforms.calibrate.measure_profile on {device} ({sizes})",
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
    ``schedule.cost.calibrate_program_costs(traced.program, ...)`` fits.

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
