"""``Seams``: what a step's planner and executor call that tests and benchmarks replace (a fault
injected into a plan, a measurement forced over the budget, another machine, an allocator that
never has room), given to ``OocJitted`` and ``pipeline.StepPlanner`` as a constructor argument
(``oocjax.testing.with_seams``); every step uses the defaults otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from oocjax.budget import available_host_bytes
from oocjax.schedule import DeviceProfile, Schedule, check_chain, executed_peak, plan_window, profile_for
from oocjax.transforms.account import DeviceAccess
from oocjax.transforms.compile import compile_segments
from oocjax.transforms.trace import TracedStep, trace_arguments


def local_platform() -> str:
    return jax.local_devices()[0].platform


def published_profile() -> DeviceProfile:
    """The published profile of this process's first device (``schedule.profile_for``)."""
    device = jax.local_devices()[0]
    return profile_for(device.platform, device.device_kind)


@dataclass(frozen=True, slots=True)
class Seams:
    """The stages, in the order a first call meets them; ``keeps_programs`` None: the plan cache
    keeps compiled programs as ``plan_cache.KEEPS_PROGRAMS`` says for the platform;
    ``device_access`` None: the executor's defaults (``transforms.account.DeviceAccess``)."""

    trace: Callable[..., TracedStep] = trace_arguments
    plan_window: Callable[..., Schedule] = plan_window
    check_chain: Callable[..., tuple] = check_chain
    compile_segments: Callable[..., tuple] = compile_segments
    executed_peak: Callable[..., tuple[int, int | None]] = executed_peak
    platform: Callable[[], str] = local_platform
    available_host_bytes: Callable[[], int | None] = available_host_bytes
    keeps_programs: bool | None = None
    device_access: DeviceAccess | None = None
