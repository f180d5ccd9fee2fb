"""``SettledPlan``: what planning settled on for one budget, the record a step's chain is built from.

``pipeline.StepPlanner`` makes it (plan, cut, compile and measure until the budget holds) and builds
the step from it; the plan cache (``oocjax.plan_cache``) keeps it, so that a later process builds
the same step without planning or compiling again."""

from __future__ import annotations

from dataclasses import dataclass

from oocjax.schedule.chain import Chain
from oocjax.schedule.hybrid import HybridPlan
from oocjax.schedule.moves import Schedule
from oocjax.schedule.program import Program
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.schedule.simulate import MemoryTimeline


@dataclass(frozen=True, slots=True, kw_only=True)
class SettledPlan:
    """A plan that holds its budget.

    Attributes:
      choice: the first plan of the budget (``schedule.plan_hybrid``): swap only, or recompute and
        swap; its ``rewrite`` says which values the step recomputes.
      program, schedule: the program as last planned (with the scratch its compiled segments
        measured) and its schedule.
      timeline: the schedule's memory, from its one replay (``schedule.replay``).
      segments: the segments the step runs as; empty when it runs as ``jax.jit``'s one program.
      chain: those segments with their transfers, in the order they run (``schedule.chain``):
        built once, checked, run by the executor and shown by the plan; None without segments.
      costs: per segment, its compiled program's own memory.
      attempts: the executed peak measured for each plan made, in order.
      peak: the chain's executed peak from those measurements (0 without segments).
      layers: ``(start, stop, kind)`` per run of a layer's steps in ``program`` (``transforms.layers``).
      step_time_s: the simulated step time of ``schedule`` on ``program``, with the rates the
        choice was made with (the choice's own where it was not planned again).
    """

    choice: HybridPlan
    program: Program
    schedule: Schedule
    timeline: MemoryTimeline
    segments: tuple[Segment, ...] = ()
    chain: Chain | None = None
    costs: tuple[SegmentCost, ...] = ()
    attempts: tuple[int, ...] = ()
    peak: int = 0
    layers: tuple[tuple[int, int, str], ...] = ()
    step_time_s: float | None = None
