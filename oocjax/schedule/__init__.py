"""The planner: a pure-Python model of a training step and the schedules that fit it in a budget.

Nothing here imports jax or numpy, so plans are cheap to compute and to test.
"""

from oocjax.schedule.bounds import PressureBound, pressure_bound
from oocjax.schedule.chain import Chain, chain_of, check_chain, check_segments
from oocjax.schedule.cost import TimedResult, simulate_time
from oocjax.schedule.feasibility import check_feasible, required_bytes
from oocjax.schedule.hybrid import HybridPlan, plan_hybrid
from oocjax.schedule.layer_plan import LayerPlan, LayerPolicy, layer_schedule, plan_layers, replan_layers
from oocjax.schedule.measured import estimated_costs, executed_peak, with_measured_scratch, with_probed_scratch
from oocjax.schedule.moves import Move, Offload, Prefetch, Schedule, keep_all
from oocjax.schedule.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile, profile_for, resolve_profile
from oocjax.schedule.program import Buffer, Program, Stay, Step, Uses
from oocjax.schedule.recompute import choose_recompute
from oocjax.schedule.rewrite import Rewrite, recompute_program, runs_after
from oocjax.schedule.segments import CutOptions, Segment, SegmentCost, cut_and_probes, cut_segments
from oocjax.schedule.settled import SettledPlan
from oocjax.schedule.simulate import MemoryTimeline, Violation, replay, simulate, validate
from oocjax.schedule.units import MiB, format_bytes, parse_bytes
from oocjax.schedule.window import plan_window

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "Buffer",
    "Chain",
    "CutOptions",
    "DeviceProfile",
    "HybridPlan",
    "LayerPlan",
    "LayerPolicy",
    "MemoryTimeline",
    "MiB",
    "Move",
    "Offload",
    "Prefetch",
    "PressureBound",
    "Program",
    "Rewrite",
    "Schedule",
    "Segment",
    "SegmentCost",
    "SettledPlan",
    "Stay",
    "Step",
    "TimedResult",
    "Uses",
    "Violation",
    "chain_of",
    "check_chain",
    "check_feasible",
    "check_segments",
    "choose_recompute",
    "cut_and_probes",
    "cut_segments",
    "estimated_costs",
    "executed_peak",
    "format_bytes",
    "keep_all",
    "layer_schedule",
    "parse_bytes",
    "plan_hybrid",
    "plan_layers",
    "plan_window",
    "pressure_bound",
    "profile_for",
    "recompute_program",
    "replan_layers",
    "replay",
    "required_bytes",
    "resolve_profile",
    "runs_after",
    "simulate",
    "simulate_time",
    "validate",
    "with_measured_scratch",
    "with_probed_scratch",
]
