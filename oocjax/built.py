"""The step that runs a settled plan (``build_step``): ``jax.jit``'s own program where nothing
moves, else the chain's executor, and the ``Plan`` that shows it, made from the one settled value."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.attempts import Rewritten
from oocjax.budget import Budget
from oocjax.plan import Plan
from oocjax.schedule import DeviceProfile, MemoryTimeline, SettledPlan
from oocjax.timings import Timings
from oocjax.transforms.account import DeviceAccess
from oocjax.transforms.execute import ChainExecutor, executable_chain
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.functions import chain_function, chain_jaxpr, segment_functions
from oocjax.transforms.shardings import Layout
from oocjax.transforms.trace import TracedStep


@dataclass(frozen=True, slots=True)
class BuiltStep:
    """What one signature runs: its plan and, when something moves, the chain's executor (else
    the step is ``jax.jit``'s own program)."""

    plan: Plan
    executor: ChainExecutor | None
    segment_functions: tuple[Callable, ...] = ()
    programs: tuple[Any, ...] = ()  # compiled, per segment
    flat: FlatProgram | None = None  # the flat program the segments run (with recomputed copies)
    layout: Layout | None = None  # on a mesh, its every value's sharding

    @property
    def input_kinds(self) -> tuple[str, ...]:
        return self.plan.input_kinds


@dataclass(frozen=True, slots=True, kw_only=True)
class StepContext:
    """What a step is built for, beside its settled plan: the step as traced with its in-core
    timeline, the budget, the profile planned for (None: this device) and the executor's device access."""

    traced: TracedStep
    in_core: MemoryTimeline
    budget: Budget
    profile: DeviceProfile | None = None
    access: DeviceAccess | None = None


def build_step(
    settled: SettledPlan,
    rewritten: Rewritten,
    context: StepContext,
    timings: Timings,
    programs: Sequence[Any] = (),
    functions: Sequence[Callable] = (),
) -> BuiltStep:
    """The step of ``settled``: the chain of ``programs`` (compiled, per segment) with its segments'
    ``functions`` where made; a plan made for a profile runs nothing."""
    chain, described = settled.chain, _description(settled, context)
    if chain is None:
        built = BuiltStep(Plan.build(jaxpr=context.traced.jaxpr, **described), None)
    else:
        built = _chain_step(settled, rewritten, context, described, programs, functions)
    timings.done("build")
    return dataclasses.replace(built, plan=dataclasses.replace(built.plan, timings=tuple(timings.stages)))


def _chain_step(settled, rewritten: Rewritten, context: StepContext, described: dict, programs, functions) -> BuiltStep:
    flat, labels, layout, chain = rewritten.flat, rewritten.labels, rewritten.layout, settled.chain
    functions = functions or tuple(segment_functions(flat, settled.segments, labels, layout))
    jaxpr = functools.partial(
        chain_jaxpr, chain_function(flat, chain, functions, labels), flat, described["input_kinds"]
    )
    measured = dict(chain=chain, segments=settled.segments, segment_costs=settled.costs)
    if context.profile is not None:  # estimated, not compiled: nothing to run
        return BuiltStep(Plan.build(jaxpr=jaxpr, executed_peak_bytes=None, **measured, **described), None)
    plan = Plan.build(jaxpr=jaxpr, attempts=settled.attempts, executed_peak_bytes=settled.peak, **measured, **described)
    executable = executable_chain(flat, chain, programs, settled.costs, labels, layout)
    executor = ChainExecutor(executable, context.budget.planned_bytes, functions, context.access)
    return BuiltStep(plan, executor, functions, tuple(programs), flat=flat, layout=layout)


def _description(settled: SettledPlan, context: StepContext) -> dict:
    """What a plan says whether or not anything moves (``Plan.build``'s shared keywords), for the
    device at hand or the profile it was planned for."""
    traced, choice, schedule, budget, profile = (
        context.traced,
        settled.choice,
        settled.schedule,
        context.budget,
        context.profile,
    )
    kinds = tuple("pinned_host" if b in schedule.host_inputs else "device" for b in range(traced.flat.num_inputs))
    return dict(
        program=settled.program,
        schedule=schedule,
        timeline=settled.timeline,
        baseline_timeline=context.in_core,
        source_jaxpr=traced.jaxpr,
        budget_bytes=budget.user_bytes,
        headroom_bytes=budget.headroom_bytes,
        rewrite=choice.rewrite if choice.rewrite.recomputed else None,
        step_time_s=choice.step_time_s if settled.step_time_s is None else settled.step_time_s,
        in_core_time_s=choice.in_core_time_s,
        swap_only_time_s=choice.swap_only_time_s,
        swap_only_moved_bytes=None if choice.swap_only is None else choice.swap_only.moved_bytes(traced.program),
        layer_policy=() if choice.layer_plan is None else tuple(choice.layer_plan.describe()),
        layer_alternatives=() if choice.layer_plan is None else tuple(choice.layer_plan.why()),
        loops=traced.flat.loops,
        input_kinds=kinds,
        device=jax.local_devices()[0].device_kind if profile is None else profile.name,
        compiled=profile is None,
        mesh="" if traced.layout is None else traced.layout.mesh,
        layers=settled.layers,
    )
