"""Cost model: how long a step takes under a schedule, with compute and both copy directions overlapped.

Three in-order streams, as on a GPU: compute runs the steps one after another; host-to-device copies
and device-to-host copies each run on their own stream. Dependencies:
  * a prefetch starts when its issue step starts (after the previous step ends), when the
    host-to-device stream is free, and when its host copy exists (its offload has completed);
  * a step starts after the previous one, after the prefetches it is the first use of, and after the
    offloads that must complete before it (``done_before_step``: their memory is what it runs in);
  * an offload starts after the step it follows, when the device-to-host stream is free.
The step ends when compute and every copy are done. The lower bound is
``max(compute, d2h_bytes / d2h_bandwidth, h2d_bytes / h2d_bandwidth)`` (ALGORITHM.md section 4).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from oocjax.schedule.moves import Move, Schedule
from oocjax.schedule.program import Program, Step


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """Sustained rates of one accelerator and its host link.

    Attributes:
      name: what it describes.
      flops_per_s: sustained arithmetic rate of real training kernels (not the datasheet peak).
      hbm_bytes_per_s: device memory bandwidth.
      h2d_bytes_per_s, d2h_bytes_per_s: measured host link bandwidth per direction.
      op_overhead_s: fixed cost of launching one operation.
      copy_latency_s: fixed cost of one copy.
      source: where the figures come from.
    """

    name: str
    flops_per_s: float
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    op_overhead_s: float = 5e-6
    copy_latency_s: float = 1e-5
    source: str = ""

    def compute_seconds(self, step: Step) -> float:
        return max(step.flops / self.flops_per_s, step.bytes_accessed / self.hbm_bytes_per_s) + self.op_overhead_s


_DATASHEET = "NVIDIA datasheet dense BF16 at 50% utilisation; link figures from ALGORITHM.md section 4"

_PCIE_LINK = (35e9, 50e9)  # host-to-device, device-to-host bytes/s


def _nvidia(
    name: str, flops_per_s: float, hbm_bytes_per_s: float, *, link: tuple[float, float] = _PCIE_LINK, note: str = ""
) -> DeviceProfile:
    h2d, d2h = link
    return DeviceProfile(
        name=name,
        flops_per_s=flops_per_s,
        hbm_bytes_per_s=hbm_bytes_per_s,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        source=_DATASHEET + note,
    )


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        _nvidia("h100-pcie", 378e12, 2.0e12),
        _nvidia("h100-sxm", 495e12, 3.35e12),
        _nvidia("h200", 495e12, 4.8e12),
        _nvidia("gh200", 495e12, 4.0e12, link=(410e9, 170e9), note=" (NVLink-C2C, D2H at the low end of 170-300 GB/s)"),
        # A rough figure for a 2-core x86 CI machine: XLA's CPU matmuls and memcpy between "memories".
        DeviceProfile(
            name="cpu",
            flops_per_s=50e9,
            hbm_bytes_per_s=10e9,
            h2d_bytes_per_s=5e9,
            d2h_bytes_per_s=5e9,
            op_overhead_s=2e-6,
            copy_latency_s=1e-6,
            source="rough estimate for a 2-core x86 machine, not measured per machine",
        ),
    )
}

DEFAULT_PROFILE: DeviceProfile = PROFILES["h100-pcie"]
"""The profile views use when none is named: the slower H100, so estimated step times err long."""


def resolve_profile(profile: DeviceProfile | str) -> DeviceProfile:
    """The device profile a value or a name means.

    A name is read without regard to case, with spaces and underscores as dashes. It means the
    profile of that name; else the one profile whose name starts with it (``"gh"``: ``gh200``);
    else, for a family name (the part before a dash) the family's first profile in ``PROFILES``
    (``"h100"``: ``h100-pcie``, the slower H100, so an estimate errs long). Anything else raises.

    Raises:
      ValueError: for a name that means no profile or several, listing the known names.

    >>> resolve_profile("H100").name, resolve_profile("gh").name, resolve_profile("h100 sxm").name
    ('h100-pcie', 'gh200', 'h100-sxm')
    """
    if isinstance(profile, DeviceProfile):
        return profile
    wanted = profile.strip().lower().replace("_", "-").replace(" ", "-")
    if wanted in PROFILES:
        return PROFILES[wanted]
    starting = [name for name in PROFILES if wanted and name.startswith(wanted)]
    family = [name for name in starting if name.split("-")[0] == wanted]
    if len(starting) == 1 or family:
        return PROFILES[(family or starting)[0]]
    known = ", ".join(PROFILES)
    if starting:
        raise ValueError(f"ambiguous device profile {profile!r}: it could be {' or '.join(starting)}; known: {known}")
    close = difflib.get_close_matches(wanted, PROFILES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown device profile {profile!r}; known: {known}{hint}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TimedResult:
    """What the timed simulation found.

    Attributes:
      step_time_s: from the first step's start to the end of the last step or copy.
      compute_time_s: the sum of the steps' compute times.
      exposed_transfer_s: ``step_time_s - compute_time_s``: time compute spent waiting for copies.
      lower_bound_s: ``max(compute, d2h / bandwidth, h2d / bandwidth)``.
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

    for k, step in enumerate(program.steps):
        for p in issued_at.get(k, ()):
            start = max(compute_free, h2d_free, host_ready.get(p.buffer, 0.0))
            h2d_free = start + profile.copy_latency_s + nbytes[p.buffer] / profile.h2d_bytes_per_s
            done[p] = h2d_free
            h2d_spans.append((start, h2d_free))
        start = max([compute_free, *(done[m] for m in waits_for.get(k, ()))])
        compute_free = start + profile.compute_seconds(step)
        compute_spans.append((start, compute_free))
        for o in offloaded_after.get(k, ()):
            begin = max(compute_free, d2h_free)
            d2h_free = begin + profile.copy_latency_s + nbytes[o.buffer] / profile.d2h_bytes_per_s
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
        lower_bound_s=max(compute, h2d / profile.h2d_bytes_per_s, d2h / profile.d2h_bytes_per_s),
        h2d_bytes=h2d,
        d2h_bytes=d2h,
        compute_spans=tuple(compute_spans),
        h2d_spans=tuple(h2d_spans),
        d2h_spans=tuple(d2h_spans),
    )
