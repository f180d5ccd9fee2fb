"""Host memory a plan may use: what the machine has available (or the user's ``host_budget``) and,
on a GPU, XLA's pool of pinned host memory, which every host copy comes from and which an
environment variable caps whatever the machine has."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from oocjax.options import HOST_MARGIN, PlannerOptions

# XLA's GPU client (xla/pjrt/gpu/gpu_helpers.cc, GetGpuHostAllocator) sizes its pinned host pool
# from this variable, read once when the client starts, as a whole number of GiB (1 << 30): 64 when
# it is unset or not a whole number. On a CPU, pinned_host is ordinary memory: no pool caps it.
PINNED_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_POOL_DEFAULT_GIB = 64
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_WHOLE_NUMBER = re.compile(r"^\s*\+?[0-9]+\s*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLimit:
    """The host memory a plan may use: the least of the figures that apply.

    Attributes:
      given_bytes: the user's ``host_budget``; None when not given.
      machine_bytes: without a ``host_budget``, what the machine has available less ``HOST_MARGIN``,
        plus what the arguments already take in host memory; None when given or unknown.
      pinned_pool_bytes: on a GPU, XLA's pinned host pool (``PINNED_POOL_VARIABLE``); None elsewhere.
      pinned_pool_reading: how the pool's size was read from the variable, for messages.
    """

    given_bytes: int | None = None
    machine_bytes: int | None = None
    pinned_pool_bytes: int | None = None
    pinned_pool_reading: str | None = None

    @property
    def memory_bytes(self) -> int | None:
        """The user's host budget, else what the machine has available (None: unknown)."""
        return self.machine_bytes if self.given_bytes is None else self.given_bytes

    @property
    def bytes(self) -> int | None:
        """What a plan's host peak must fit (None: nothing known to check against)."""
        figures = [b for b in (self.memory_bytes, self.pinned_pool_bytes) if b is not None]
        return min(figures, default=None)


def host_limit(options: PlannerOptions, host_bytes_in_use: int, platform: str, available: int | None) -> HostLimit:
    """The host memory plans on ``platform`` may use; ``host_bytes_in_use`` is what the arguments
    already take there (in a plan's host peak, not in what the machine has ``available``: None
    where unknown, as for a plan made for another machine, a device profile's). A ``host_budget``
    replaces what the machine has available; the pinned pool caps either."""
    pool = {}
    if platform in GPU_PLATFORMS:
        gib, reading = pinned_pool_gib(os.environ.get(PINNED_POOL_VARIABLE))
        pool = dict(pinned_pool_bytes=gib * 2**30, pinned_pool_reading=reading)
    if options.host_budget is not None:
        return HostLimit(given_bytes=options.host_budget, **pool)
    machine = None if available is None else int(available * (1 - HOST_MARGIN)) + host_bytes_in_use
    return HostLimit(machine_bytes=machine, **pool)


def pinned_pool_gib(setting: str | None) -> tuple[int, str]:
    """The pinned pool's size in GiB as XLA reads ``setting``, the variable's value, and how it read it."""
    if setting is None:
        return PINNED_POOL_DEFAULT_GIB, f"{PINNED_POOL_VARIABLE} unset: {PINNED_POOL_DEFAULT_GIB} GiB by default"
    if _WHOLE_NUMBER.match(setting):
        return int(setting), f"{PINNED_POOL_VARIABLE}={setting.strip()}"
    default = PINNED_POOL_DEFAULT_GIB
    return default, f"{PINNED_POOL_VARIABLE}={setting!r} is not a whole number of GiB: {default} GiB, as XLA reads it"
