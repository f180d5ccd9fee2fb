"""The closed loop's typed state (``pipeline.StepPlanner``): what a choice's rewrite makes of the
traced step, derived once, and each plan the loop made with what its compiled segments measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oocjax.schedule import (
    Chain,
    DeviceProfile,
    HybridPlan,
    MemoryTimeline,
    Program,
    Schedule,
    Segment,
    SegmentCost,
    SettledPlan,
    simulate_time,
)
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.recompute import apply_rewrite
from oocjax.transforms.shardings import Layout
from oocjax.transforms.trace import TracedStep


@dataclass(frozen=True, slots=True)
class Rewritten:
    """What a choice's rewrite makes of the traced step, derived once per choice: the flat program
    its segments run (with the recomputed copies), its layout on a mesh, and its buffers' labels."""

    flat: FlatProgram
    layout: Layout | None
    labels: tuple[str, ...]

    @classmethod
    def of(cls, traced: TracedStep, rewrite: Any, program: Program) -> Rewritten:
        recomputes = bool(rewrite.recomputed)
        flat = apply_rewrite(traced.flat, rewrite) if recomputes else traced.flat
        layout = traced.layout.for_rewrite(rewrite.origin_buffer) if recomputes and traced.layout else traced.layout
        return cls(flat, layout, tuple(buffer.label for buffer in program.buffers))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One plan of the closed loop, cut and compiled: what its segments measured."""

    program: Program
    schedule: Schedule
    timeline: MemoryTimeline
    segments: tuple[Segment, ...]
    chain: Chain
    costs: tuple[SegmentCost, ...]
    peak: int
    worst: int | None

    @staticmethod
    def settled(choice: HybridPlan, attempts: list[Attempt], layers, profile: DeviceProfile) -> SettledPlan:
        """What the loop settled on: its last attempt, with the peaks every attempt measured."""
        last = attempts[-1]
        step_time_s = None
        if last.schedule is not choice.schedule:  # planned again: the plan's time is its own
            step_time_s = simulate_time(last.program, last.schedule, profile).step_time_s
        return SettledPlan(
            choice=choice,
            program=last.program,
            schedule=last.schedule,
            timeline=last.timeline,
            segments=last.segments,
            chain=last.chain,
            costs=last.costs,
            attempts=tuple(a.peak for a in attempts),
            peak=last.peak,
            layers=layers,
            step_time_s=step_time_s,
        )
