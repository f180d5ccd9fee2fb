"""How ``ooc_jit`` plans: its planner options as users give them, their defaults per device, and
what every process of a multi-process run must plan with alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from oocjax.budget import available_host_bytes, resolve_budget, resolve_bytes
from oocjax.schedule import MiB, resolve_profile
from oocjax.schedule.hybrid import RECOMPUTE_MODES

# A segment launch costs tens of microseconds of Python and runtime work: below this much work a
# segment is merged with the next one where memory allows (about a millisecond of work).
DEFAULT_MIN_SEGMENT_FLOPS = {"cpu": 10**8, "gpu": 4 * 10**11, "cuda": 4 * 10**11, "rocm": 4 * 10**11}
# Device memory a plan leaves free at first, as a fraction of the budget, for what the allocator
# takes beyond the arrays and programs it accounts for. On an H200 (XLA's BFC allocator) a chain
# planned to the byte ran 4-7% over its budget, almost all of it memory in use that no live array
# explained (fragmentation), growing over the step (benchmarks/results/gpu_gate-*.json). A CPU
# has no allocator statistics to learn from, and its runs are checked by their live arrays.
DEFAULT_HEADROOM = {"gpu": 0.08, "cuda": 0.08, "rocm": 0.08}
# XLA:CPU drops optimization barriers before its last common-subexpression pass, so inside one
# program a recomputed value is merged back into its original (read in its HLO pass dumps): there a
# copy must not run in one program with its original or another copy of it. XLA:GPU removes them
# only after scheduling.
MERGES_COPIES = {"cpu": True}
# Host memory a plan leaves to the rest of the machine when no host_budget is given, as a fraction
# of what is available when the step is planned.
HOST_MARGIN = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """How ``ooc_jit`` plans; see its docstring. ``None`` means the default for the budget/device."""

    window_bytes: int | None = None
    min_offload_bytes: int = MiB
    min_segment_flops: int = 10**11
    min_segments: int = 1
    headroom_bytes: int = 0
    host_budget: int | None = None  # None: what the machine has available when the step is planned
    recompute: Any = "auto"  # "auto", "off", "always" or a policy (schedule.hybrid.RecomputePolicy)
    rates: Any = None  # the DeviceProfile plans are chosen with; None: the device kind's published one
    given: tuple[tuple[str, Any], ...] = ()  # as the user gave them, for another platform's defaults

    @classmethod
    def read(cls, options: dict[str, Any], platform: str, budget_bytes: int) -> PlannerOptions:
        """Options as users give them: byte sizes as ints or with units (``"1MiB"``)."""
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"ooc_jit got unknown planner options {unknown}; it accepts {list(cls.__dataclass_fields__)}"
            )
        read = dict(
            min_segment_flops=DEFAULT_MIN_SEGMENT_FLOPS.get(platform, 10**11),
            headroom_bytes=int(budget_bytes * DEFAULT_HEADROOM.get(platform, 0)),
        )
        for name in ("window_bytes", "min_offload_bytes", "headroom_bytes", "host_budget"):
            if options.get(name) is not None:
                read[name] = resolve_bytes(name, options[name], allow_zero=name not in ("window_bytes", "host_budget"))
        if read["headroom_bytes"] >= budget_bytes:
            raise ValueError(f"headroom_bytes ({read['headroom_bytes']}) must be below the budget ({budget_bytes})")
        if options.get("recompute") is not None:
            if not callable(options["recompute"]) and options["recompute"] not in RECOMPUTE_MODES:
                raise ValueError(
                    f"recompute must be one of {RECOMPUTE_MODES} or a function (name, label) -> True/False/None; "
                    f"got {options['recompute']!r}"
                )
            read["recompute"] = options["recompute"]
        if options.get("rates") is not None:
            read["rates"] = resolve_profile(options["rates"])
        for name in ("min_segment_flops", "min_segments"):
            if name in options:
                read[name] = _count(name, options[name], smallest=0 if name == "min_segment_flops" else 1)
        return cls(**read, given=tuple(options.items()))

    def for_platform(self, platform: str, budget_bytes: int) -> PlannerOptions:
        """The options the user gave, over ``platform``'s defaults (a device profile's, planned for
        from another machine) rather than this device's."""
        return PlannerOptions.read(dict(self.given), platform, budget_bytes)

    @property
    def window(self) -> dict[str, int]:
        """The options ``plan_window`` takes."""
        window = {} if self.window_bytes is None else {"window_bytes": self.window_bytes}
        return window | {"min_offload_bytes": self.min_offload_bytes}


def read_settings(budget: int | float | str, planner_options: dict[str, Any]) -> tuple[int, PlannerOptions]:
    """``ooc_jit``'s budget in bytes and its planner options, on this process's first device, as
    every process agrees on them (``agreed_across_processes``)."""
    device = jax.local_devices()[0]  # in a multi-process run, jax.devices()[0] may be another process's
    budget_bytes = resolve_budget(budget, device)
    options = PlannerOptions.read(planner_options, device.platform, budget_bytes)
    return agreed_across_processes(budget_bytes, options)


def agreed_across_processes(budget_bytes: int, options: PlannerOptions) -> tuple[int, PlannerOptions]:
    """In a run of several processes, what every process must plan with alike: the least budget (a
    share of each device's memory may differ between hosts), the least host memory available (a
    plan refused in one process alone would leave the others waiting in their first collective).
    The rates plans are chosen with are the device kind's published ones, alike everywhere.
    Collective: ``ooc_jit`` calls it in every process when it wraps a step, so that planning later
    needs no other process."""
    if jax.process_count() == 1:
        return budget_bytes, options
    from jax.experimental import multihost_utils

    host = options.host_budget
    if host is None:
        host = int((available_host_bytes() or 0) * (1 - HOST_MARGIN))  # 0: unknown somewhere, no check
    # Byte counts as 30-bit words: without jax_enable_x64 a gathered int64 would be cut to 32 bits.
    words = np.array([[(value >> shift) & (2**30 - 1) for shift in (60, 30, 0)] for value in (budget_bytes, host)])
    gathered = np.asarray(multihost_utils.process_allgather(words.astype(np.int32)))
    budget_bytes, host = (
        min(sum(int(w) << s for w, s in zip(ws, (60, 30, 0))) for ws in gathered[:, i]) for i in range(2)
    )
    return budget_bytes, dataclasses.replace(options, host_budget=host or None)


def _count(name: str, value: Any, *, smallest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < smallest or value != int(value):
        raise ValueError(f"{name} must be a whole number >= {smallest}; got {value!r}")
    return int(value)
