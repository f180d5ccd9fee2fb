"""Device profiles: the sustained rates of an accelerator and its host link.

The cost model (``schedule.cost``) and the lower bounds (``schedule.bounds``) price a step's compute
and each copy with these rates. ``PROFILES`` holds named datasheet figures; ``resolve_profile``
reads a profile or a name; ``profile_for`` is the published one of a device (``benchmarks/rates.py``
measures and fits profiles).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from oocjax.schedule.program import Step


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """Sustained rates of one accelerator and its host link.

    Attributes:
      name: what it describes.
      flops_per_s: sustained arithmetic rate of real training kernels (not the datasheet peak).
      hbm_bytes_per_s: device memory bandwidth.
      h2d_bytes_per_s, d2h_bytes_per_s: measured host link bandwidth per direction.
      op_overhead_s: fixed cost of launching one operation.
      copy_latency_s: fixed cost of one copy, in a direction without its own latency below.
      h2d_latency_s, d2h_latency_s: fixed cost of one copy host-to-device and device-to-host, where
        measured per direction (``benchmarks/rates.py``); None: ``copy_latency_s``.
      copies_overlap_compute: whether copies run beside compute (a GPU's copy engines) or take the
        same cores and memory bandwidth as compute (a CPU, where a copy is a memcpy): then compute
        waits while a copy runs.
      platform: the JAX platform of such a device (``"gpu"``, ``"cpu"``): a plan made for the
        profile takes that platform's defaults (``oocjax.options``: headroom, smallest segment) and
        host limits (XLA's pinned pool on a GPU).
      source: where the figures come from.
    """

    name: str
    flops_per_s: float
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    op_overhead_s: float = 5e-6
    copy_latency_s: float = 1e-5
    h2d_latency_s: float | None = None
    d2h_latency_s: float | None = None
    copies_overlap_compute: bool = True
    platform: str = "gpu"
    source: str = ""

    def compute_seconds(self, step: Step) -> float:
        return max(step.flops / self.flops_per_s, step.bytes_accessed / self.hbm_bytes_per_s) + self.op_overhead_s

    def h2d_seconds(self, nbytes: int) -> float:
        """How long one host-to-device copy of ``nbytes`` occupies its stream."""
        latency = self.copy_latency_s if self.h2d_latency_s is None else self.h2d_latency_s
        return latency + nbytes / self.h2d_bytes_per_s

    def d2h_seconds(self, nbytes: int) -> float:
        """How long one device-to-host copy of ``nbytes`` occupies its stream."""
        latency = self.copy_latency_s if self.d2h_latency_s is None else self.d2h_latency_s
        return latency + nbytes / self.d2h_bytes_per_s


_DATASHEET = "NVIDIA datasheet dense BF16 at 50% utilisation; publicly reported PCIe Gen5 and NVLink-C2C links"

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
        # Fitted (benchmarks/fit_profile.py) to the committed H200 runs: compute to the 23 segment
        # programs of segment_profile-nvidia-h200-2026-11-26.json and the 1.34B GPT's jax.jit step of
        # state_offload_gpu-nvidia-h200-2026-11-28.json, the link to every gpu*-nvidia-h200 run's
        # copies; it predicts the 29 runs it was not fitted to within 25% (fit_profile-h200-2026-12-01.json).
        # The memory rate is over the jaxpr's unfused bytes, so above the card's own; matmuls run as TF32.
        DeviceProfile(
            name="h200",
            flops_per_s=351e12,
            hbm_bytes_per_s=10.1e12,
            h2d_bytes_per_s=53.4e9,
            d2h_bytes_per_s=53.1e9,
            op_overhead_s=1.19e-6,
            h2d_latency_s=2.02e-4,
            d2h_latency_s=1.96e-4,
            source="fitted by benchmarks/fit_profile.py to the committed H200 runs (fit_profile-h200-2026-12-01.json)",
        ),
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
            # A copy here is a memcpy on the cores the step runs on, not a copy engine beside them
            # (benchmarks/hybrid.py measures what that costs: results/hybrid-cpu-*.json).
            copies_overlap_compute=False,
            platform="cpu",
            source="rough estimate for a 2-core x86 machine, not measured per machine",
        ),
    )
}

DEFAULT_PROFILE: DeviceProfile = PROFILES["h100-pcie"]
"""The profile views use when none is named: the slower H100, so estimated step times err long."""


def profile_for(platform: str, device_kind: str) -> DeviceProfile:
    """The published profile plans on a device are chosen with: ``PROFILES["cpu"]`` on a CPU, the
    matching NVIDIA part by its device kind (``jax.Device.device_kind``), else ``DEFAULT_PROFILE``.

    >>> profile_for("cpu", "cpu").name, profile_for("gpu", "NVIDIA H200").name
    ('cpu', 'h200')
    """
    if platform == "cpu":
        return PROFILES["cpu"]
    kind = device_kind.upper()
    for token, name in (("GH200", "gh200"), ("H200", "h200"), ("H100 PCIE", "h100-pcie"), ("H100", "h100-sxm")):
        if token in kind:
            return PROFILES[name]
    return DEFAULT_PROFILE


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
