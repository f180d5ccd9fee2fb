"""The planner: a pure-Python model of a training step and the schedules that fit it in a budget.

Nothing here imports jax or numpy, so plans are cheap to compute and to test.
"""

from oocjax.schedule.baselines import fixed_lookahead, keep_all, swap_all_just_in_time
from oocjax.schedule.bounds import PressureBound, pressure_bound
from oocjax.schedule.chain import check_segments
from oocjax.schedule.cost import TimedResult, simulate_time
from oocjax.schedule.feasibility import check_feasible, required_bytes
from oocjax.schedule.moves import Move, Offload, Prefetch, Schedule
from oocjax.schedule.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile, resolve_profile
from oocjax.schedule.program import Buffer, Program, Stay, Step, Uses
from oocjax.schedule.recompute import choose_recompute
from oocjax.schedule.rewrite import Rewrite, recompute_program
from oocjax.schedule.simulate import MemoryTimeline, Violation, simulate, validate
from oocjax.schedule.units import MiB, format_bytes, parse_bytes
from oocjax.schedule.window import plan_window

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "Buffer",
    "DeviceProfile",
    "MemoryTimeline",
    "MiB",
    "Move",
    "Offload",
    "Prefetch",
    "PressureBound",
    "Program",
    "Rewrite",
    "Schedule",
    "Stay",
    "Step",
    "TimedResult",
    "Uses",
    "Violation",
    "check_feasible",
    "check_segments",
    "choose_recompute",
    "fixed_lookahead",
    "format_bytes",
    "keep_all",
    "parse_bytes",
    "plan_window",
    "pressure_bound",
    "recompute_program",
    "required_bytes",
    "resolve_profile",
    "simulate",
    "simulate_time",
    "swap_all_just_in_time",
    "validate",
]
