"""What compiled segments measured, fed back: the chain's peak from its programs' sizes, their
scratch beyond the estimate back into the program for the next plan, and the ranges the estimate
cut that are worth compiling whole to measure (``segments.cut_segments`` takes what they measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from oocjax.schedule.moves import Schedule
from oocjax.schedule.program import Program
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.schedule.simulate import simulate


def executed_peak(segments: tuple[Segment, ...], costs: tuple[SegmentCost, ...]) -> tuple[int, int | None]:
    """(peak device bytes, the segment that reaches it) of the chain with measured programs: per
    segment, what the executor holds when it launches it plus what launching it allocates."""
    peaks = [s.held_bytes + c.launch_bytes for s, c in zip(segments, costs, strict=True)]
    if not peaks:
        return 0, None
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    return peaks[worst], worst


def with_measured_scratch(
    program: Program, segments: tuple[Segment, ...], costs: tuple[SegmentCost, ...], budget_bytes: int
) -> Program:
    """``program`` with the memory its compiled segments need beyond the estimate added as scratch
    of their steps: planned again, less is held around them. Every underestimate is fed back, not
    only those that broke the budget, so that the next plan does not meet them one by one.

    A segment's excess is one amount, counted once by its estimate: a ``GatheringStep`` keeps its
    gathered scratch apart (``gathered_bytes``, summed over the segment), and the excess joins the
    scratch it holds only while it runs (the segment's peak over its steps), as for any step."""
    transient = [step.transient_bytes for step in program.steps]
    for segment, cost in zip(segments, costs, strict=True):
        excess = cost.launch_bytes - (segment.estimate_bytes - segment.held_bytes)
        if segment.held_bytes + cost.launch_bytes > budget_bytes:
            excess = max(excess, segment.held_bytes + cost.launch_bytes - budget_bytes)
        if excess <= 0:
            continue
        for k in range(segment.start, segment.stop):
            transient[k] += excess
    return _with_transient(program, transient)


def with_probed_scratch(
    program: Program, schedule: Schedule, probes: Sequence[Segment], launches: Sequence[int], budget_bytes: int
) -> Program | None:
    """``program`` with scratch that makes each probed range (``cut_and_probes``) that measured over
    the budget show its measured peak, what it holds at launch and what launching it allocates,
    on the step of the range where the plan has the most on the device: planned again, the
    planner frees the bytes over the budget there, before the range starts where what it frees is
    not read in the range. None where every probe fits.

    Spread over all the range's steps as ``with_measured_scratch`` does, a few KB over would not
    show: the plan's steps each hold far less than a program that runs the whole range."""
    over = [
        (probe, launch)
        for probe, launch in zip(probes, launches, strict=True)
        if probe.held_bytes + launch > budget_bytes
    ]
    if not over:
        return None
    device = simulate(program, schedule).device_bytes
    transient = [step.transient_bytes for step in program.steps]
    for probe, launch in over:
        k = max(range(probe.start, probe.stop), key=device.__getitem__)
        transient[k] += max(0, probe.held_bytes + launch - device[k])
    unchanged = all(extra == step.transient_bytes for step, extra in zip(program.steps, transient))
    return None if unchanged else _with_transient(program, transient)


def _with_transient(program: Program, transient: Sequence[int]) -> Program:
    """``program`` with each step's scratch replaced by ``transient``."""
    steps = tuple(
        step if extra == step.transient_bytes else replace(step, transient_bytes=extra)
        for step, extra in zip(program.steps, transient, strict=True)
    )
    return Program(steps=steps, buffers=program.buffers)


def estimated_costs(program: Program, segments: Sequence[Segment]) -> tuple[SegmentCost, ...]:
    """What launching each segment allocates by the planner's own estimate, in place of its compiled
    program's report, for a plan made without compiling (for a device profile): its results, and
    as scratch its estimated peak beyond what it holds and its results, those written in place of
    its arguments as aliased. A chain of such costs holds the budget by construction; a device that
    compiles the segments measures them, and may plan again."""
    costs = []
    for segment in segments:
        outputs = sum(program.buffers[b].nbytes for b in segment.outputs)
        scratch = segment.estimate_bytes - segment.held_bytes - outputs
        # Results beyond the estimate are written over the arguments they replace (new state over the old).
        costs.append(SegmentCost(temp_bytes=max(0, scratch), output_bytes=outputs, alias_bytes=max(0, -scratch)))
    return tuple(costs)
