"""The stages after tracing, for one signature: plan -> segment -> compile, closed on the budget.

  plan (``schedule.plan_window``) -> cut (``schedule.cut_segments``) -> segment functions and the
  chain jaxpr (``transforms.segment``) -> compile and measure (``transforms.execute``)

The compiled segments' own memory reports close the loop: when the chain's executed peak is over
the budget, the program learns each segment's measured excess as scratch and is planned again.
What the loop settles on (``settled.SettledPlan``) is what the step is built from, and what the plan
cache keeps; why a step is refused is said in ``oocjax.refusals``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

import oocjax.plan_cache as plan_cache
from oocjax.budget import Budget
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.host_limit import host_limit
from oocjax.options import DEFAULT_HEADROOM, PlannerOptions
from oocjax.plan import Plan
from oocjax.refusals import (
    check_host_peak,
    over_budget_message,
    refuse_infeasible,
    refuse_invalid,
    refuse_tokens_between,
    worst_segment,
)
from oocjax.schedule import Program, Schedule, format_bytes, plan_window, required_bytes, simulate_time, validate
from oocjax.schedule.chain import check_segments
from oocjax.schedule.hybrid import HybridPlan, plan_hybrid
from oocjax.schedule.measured import (
    estimated_costs,
    executed_peak,
    unfitted_ranges,
    with_measured_scratch,
    with_probed_scratch,
)
from oocjax.schedule.profiles import DeviceProfile
from oocjax.schedule.rewrite import runs_after
from oocjax.schedule.segments import Segment, SegmentCost, cut_segments
from oocjax.schedule.simulate import frees_host_state_early
from oocjax.settled import SettledPlan
from oocjax.transforms.calibrate import default_profile
from oocjax.transforms.compile import compile_segments
from oocjax.transforms.execute import ChainExecutor
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.recompute import apply_rewrite, recomputable_steps
from oocjax.transforms.segment import (
    chain_function,
    chain_jaxpr,
    executable_chain,
    flat_chain,
    segment_functions,
)
from oocjax.transforms.shardings import Layout
from oocjax.transforms.trace import TracedStep

__all__ = ["DEFAULT_HEADROOM", "MAX_REPLANS", "MAX_RUNTIME_REPLANS", "BuiltStep", "StepPlanner"]

MAX_REPLANS = 4  # closed loop on the budget: re-plans after the compiled segments came out too large
MAX_RUNTIME_REPLANS = 3  # plans made again after calls measured over the budget on the device


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


class StepPlanner:
    """One signature's plans: made, measured and made again, in one loop.

    * **Choose** (``schedule.plan_hybrid``): swap only, or recompute and swap, by simulated time
      with the device kind's published rates (``calibrate.default_profile``).
    * **Compile and measure**: when compiled segments measure over the planned budget, their
      excess becomes scratch of their steps and the program is planned again (``MAX_REPLANS``).
    * **Run and measure** (``after_call``): a call the allocator measured over the user's budget
      is planned again with more headroom (``MAX_RUNTIME_REPLANS``).

    Compiled programs are shared by every plan it makes: a segment that did not change compiles once.
    ``held_by_caller`` marks the flat arguments the caller passes in device memory and keeps (not
    donated): they stay on the device, and every plan counts them there. ``host_bytes_in_use`` is
    host memory the arguments already take (in the plans' host peak, not in what is available).

    With a ``profile``, the step is planned for that device from any machine: with its rates and its
    platform's host limits, and each segment's memory estimated (``measured.estimated_costs``)
    instead of compiled. Nothing is compiled or allocated, and the step it builds does not run.
    """

    def __init__(
        self,
        traced: TracedStep,
        budget_bytes: int,
        options: PlannerOptions,
        *,
        held_by_caller: tuple[bool, ...] = (),
        host_bytes_in_use: int = 0,
        profile: DeviceProfile | None = None,
    ):
        if profile is not None:  # the defaults of the profile's platform, not this machine's
            options = options.for_platform(profile.platform, budget_bytes)
        self.traced, self.options, self.held_by_caller = traced, options, held_by_caller
        self.profile = profile
        self.platform = _platform() if profile is None else profile.platform
        self.program = _with_held_by_caller(traced.program, held_by_caller)
        self.host_limit = host_limit(options, host_bytes_in_use, self.platform, here=profile is None)
        # On a mesh every byte figure is per device, and this process keeps host copies for each of its devices.
        self.local_copies = 1 if traced.layout is None else len(traced.layout.replicated.addressable_devices)
        self.compiled: dict = {}
        self.runtime_replans = 0
        self.budget = Budget(user_bytes=budget_bytes, headroom_bytes=options.headroom_bytes)
        self.built = self._build(self.budget)

    def after_call(self, measured_peak_bytes: int | None) -> str | None:
        """After a call: if the device measured it over the budget (the allocator's overhead, which no
        estimate sees), plans again with that much more headroom, up to ``MAX_RUNTIME_REPLANS``
        times. Returns what to warn about (that call did go over), or None."""
        budget = self.budget
        if measured_peak_bytes is None or measured_peak_bytes <= budget.user_bytes:
            return None
        over = measured_peak_bytes - budget.user_bytes
        message = (
            f"measured {format_bytes(measured_peak_bytes)} on the device, {format_bytes(over)} over its budget "
            f"of {format_bytes(budget.user_bytes)}"
        )
        if self.runtime_replans >= MAX_RUNTIME_REPLANS:
            return f"{message}; planned again {self.runtime_replans} times already: raise headroom_bytes"
        if jax.process_count() > 1:
            # Another plan here alone would launch other programs than the other processes, whose
            # collectives would then wait forever: this measurement is this process's own.
            return (
                f"{message}; not planned again, because every process of a multi-process run must run the "
                f"same plan: pass headroom_bytes={budget.headroom_bytes + over + over // 4} to ooc_jit"
            )
        self.runtime_replans += 1
        headroom = min(budget.headroom_bytes + over + over // 4, budget.user_bytes - 1)
        try:
            more = Budget(user_bytes=budget.user_bytes, headroom_bytes=headroom)
            self.built, self.budget = self._build(more), more
        except OocError as error:  # the call itself succeeded: keep what ran, and say why it stays over
            return f"{message}; a plan with {format_bytes(headroom)} of headroom fails: {error}"
        return f"{message}; planned again with {format_bytes(headroom)} of headroom"

    def _build(self, budget: Budget) -> BuiltStep:
        """The step's plan and chain for ``budget``: read from the plan cache where an earlier
        process made them (``oocjax.plan_cache``), else made (``_make``) and stored there."""
        options, traced = self.options, self.traced
        name = None
        if plan_cache.directory() is not None and self.profile is None:  # printing the jaxpr: 0.2 s at 24 layers
            name = plan_cache.key(
                str(traced.jaxpr),
                traced.donated,
                self.held_by_caller,
                budget,
                options,
                options.recompute,
                _placement(traced),
            )
        entry = plan_cache.load(name)
        if entry is not None:
            programs = entry.programs()
            if programs is None and entry.settled.segments:  # the plan alone: its segments compiled again
                return self._compiled_again(budget, entry.settled)
            return self._finish(budget, entry.settled, programs or ())
        built, settled = self._make(budget)
        if name is not None:
            plan_cache.store(name, plan_cache.Entry.of(settled, built.programs, self.platform))
        return built

    def _compiled_again(self, budget: Budget, settled: SettledPlan) -> BuiltStep:
        """The step of a plan read from the plan cache without its programs: they compile again."""
        rewrite = settled.choice.rewrite
        flat, layout = _flat_of(self.traced, rewrite), _layout(self.traced, rewrite)
        functions, programs, _ = self._compiled(flat, settled.segments, settled.program, layout, budget.planned_bytes)
        return self._finish(budget, settled, programs, functions, flat)

    def _make(self, budget: Budget) -> tuple[BuiltStep, SettledPlan]:
        """Plans, cuts and compiles until the compiled segments' measured peak holds the budget;
        the step, and what the plan cache keeps of it. Ranges of steps the estimate cuts into
        pieces but that might fit whole (``unfitted_ranges``) are compiled whole first: where their
        programs measure within the budget they stay whole, one program where there were several.

        Raises ``BudgetInfeasibleError`` when no plan fits, and ``OocError`` when the segments still
        measure over the budget after ``MAX_REPLANS`` plans, or a plan needs more host memory than
        it may use (``host_limit``). Every plan and its chain of segments are checked by the simulator first."""
        options, traced = self.options, self.traced
        traced_layers = layer_runs(traced.flat)
        profile = self.profile or default_profile()  # the device's published rates: one plan everywhere
        choice = _choose(self.program, traced.flat, traced_layers, budget, options, profile)
        program, schedule, rewrite = choice.program, choice.schedule, choice.rewrite
        flat = _flat_of(traced, rewrite)
        layout = _layout(traced, rewrite)
        layers = runs_after(rewrite, traced_layers)  # the copies join the layers they are made for
        history, worst_text, halved = [], "", set()
        launched: dict[tuple, int] = {}  # what compiled ranges of steps allocate, by their signature
        while True:
            if schedule.moves_nothing and not rewrite.recomputed and options.min_segments <= 1:
                settled = SettledPlan(choice=choice, program=program, schedule=schedule, layers=layers)
                return self._finish(budget, settled), settled
            check_host_peak(program, schedule, self.host_limit, self.local_copies)
            cuts = dict(min_segment_flops=options.min_segment_flops, min_segments=options.min_segments, layers=layers)
            cuts["cut_before"] = tuple(halved)
            cuts["copies"] = _copies(flat) if _MERGES_COPIES.get(self.platform) else ()
            cuts |= dict(budget_bytes=budget.planned_bytes, measured=launched)
            program, schedule, segments = self._cut(program, schedule, cuts, flat, layout, budget)
            refuse_invalid("chain of segments", check_segments(program, schedule, segments))
            refuse_tokens_between(segments, flat.avals)
            functions, programs, costs = self._compiled(flat, segments, program, layout, budget.planned_bytes)
            peak, worst = executed_peak(segments, costs)
            history.append((budget.planned_bytes, peak))
            if peak <= budget.planned_bytes:
                break
            worst_text = worst_segment(program, segments[worst], costs[worst])
            if len(history) > MAX_REPLANS:
                smallest = max(required_bytes(program, options.min_offload_bytes))
                raise OocError(over_budget_message(budget.planned_bytes, history, smallest) + worst_text)
            # Some compiled segments came out larger than estimated (XLA's scratch, padding): plan
            # again with that excess as scratch of their steps, so that less is held around them,
            # and cut the worst in two. Where no plan holds that much scratch on every step of a
            # long segment (its excess may be what merging its steps cost), the cut alone is tried.
            halved.add((segments[worst].start + segments[worst].stop) // 2)
            try:
                learnt = with_measured_scratch(program, segments, costs, budget.planned_bytes)
                program, schedule = learnt, _plan(learnt, budget, options, layers, history, worst_text)
            except OocError:
                if segments[worst].stop - segments[worst].start <= 1:
                    raise
        measured = dict(segments=segments, costs=tuple(costs), attempts=tuple(m for _, m in history), peak=peak)
        if schedule is not choice.schedule:  # planned again: the plan's time is its own
            measured["step_time_s"] = simulate_time(program, schedule, profile).step_time_s
        settled = SettledPlan(choice=choice, program=program, schedule=schedule, layers=layers, **measured)
        return self._finish(budget, settled, programs, functions, flat), settled

    def _cut(
        self, program: Program, schedule: Schedule, cuts: dict, flat: FlatProgram, layout: Any, budget: Budget
    ) -> tuple[Program, Schedule, tuple[Segment, ...]]:
        """The plan cut into segments. Ranges the estimate cuts but that might fit whole
        (``unfitted_ranges``) are compiled whole first and measured (``cuts["measured"]`` keeps
        what they allocate). Where one measured over the budget only with what the plan holds when
        it starts, the step is planned again once, its peak shown to the planner on the step that
        held the most (``with_probed_scratch``): less is then held there and it runs whole, as the
        layers alike do, rather than in pieces that each compile (a 4-layer decoder's top backward
        layer, 7 KB over, was two more programs)."""
        for replan in (True, False):
            segments = cut_segments(program, schedule, **cuts)
            # A profile's plan measures nothing: a probe would only repeat the estimate.
            probes = {} if self.profile is not None else unfitted_ranges(program, schedule, segments, **cuts)
            if not probes:
                break
            launches = [cost.launch_bytes for cost in self._compiled(flat, tuple(probes.values()), program, layout)[2]]
            cuts["measured"] |= zip(probes, launches)
            learnt = with_probed_scratch(program, schedule, tuple(probes.values()), launches, budget.planned_bytes)
            if replan and learnt is not None:
                try:
                    program, schedule = learnt, _plan(learnt, budget, self.options, cuts["layers"], [], "")
                    continue
                except OocError:
                    pass
            segments = cut_segments(program, schedule, **cuts)
            break
        return program, schedule, segments

    def _compiled(
        self, flat: FlatProgram, segments: Sequence[Segment], program: Program, layout: Any, budget_bytes=None
    ) -> tuple[tuple, Sequence[Any], Sequence[SegmentCost]]:
        """Per segment its function, its program compiled (into ``self.compiled``, sharing where
        ``budget_bytes`` allows: ``compile_segments``) and what launching it allocates; for a
        profile, no functions or programs and each segment's estimate (``estimated_costs``)."""
        if self.profile is not None:
            return (), (), estimated_costs(program, segments)
        functions = tuple(segment_functions(flat, segments, _labels(program), layout))
        programs, costs = compile_segments(flat, segments, functions, self.compiled, layout, budget_bytes=budget_bytes)
        return functions, programs, costs

    def _finish(
        self,
        budget: Budget,
        settled: SettledPlan,
        programs: Sequence[Any] = (),
        functions: Sequence[Callable] = (),
        flat: FlatProgram | None = None,
    ) -> BuiltStep:
        """The step that runs a settled plan: ``jax.jit``'s program when nothing moves, else the
        chain of ``programs`` (compiled, per segment), with its segments' ``functions`` and the
        rewritten ``flat`` program they run where made."""
        traced, choice, program, schedule = self.traced, settled.choice, settled.program, settled.schedule
        segments, costs, attempts, peak = settled.segments, settled.costs, settled.attempts, settled.peak
        check_host_peak(program, schedule, self.host_limit, self.local_copies)
        described = _description(traced, settled, budget, self.profile)
        if not segments:
            return BuiltStep(Plan.build(program=program, jaxpr=traced.jaxpr, **described), None)
        rewrite = choice.rewrite
        if flat is None:
            flat = _flat_of(traced, rewrite)
        labels = _labels(program)
        layout = _layout(traced, rewrite)
        functions = functions or tuple(segment_functions(flat, segments, labels, layout))
        measured = dict(segments=segments, segment_costs=costs, executed_peak_bytes=peak)
        given_up = traced.donated if frees_host_state_early(program, schedule) else ()
        chain = flat_chain(flat, schedule, segments, given_up)  # one value: what runs is what is shown
        shown = functools.partial(
            chain_jaxpr, chain_function(flat, chain, functions, labels), flat, described["input_kinds"]
        )
        if self.profile is not None:  # estimated, not compiled: nothing to run
            measured["executed_peak_bytes"] = None
            return BuiltStep(Plan.build(program=program, jaxpr=shown, attempts=(), **measured, **described), None)
        plan = Plan.build(program=program, jaxpr=shown, attempts=attempts, **measured, **described)
        executable = executable_chain(flat, chain, programs, costs, labels, layout)
        executor = ChainExecutor(executable, budget.planned_bytes, functions)
        return BuiltStep(plan, executor, functions, tuple(programs), flat=flat, layout=layout)


def _flat_of(traced: TracedStep, rewrite: Any) -> FlatProgram:
    """The flat program a plan runs: the traced one, with the rewrite's copies where it recomputes."""
    return apply_rewrite(traced.flat, rewrite) if rewrite.recomputed else traced.flat


def _layout(traced: TracedStep, rewrite: Any) -> Layout | None:
    """The shardings of the flat program a plan runs (a recomputed copy lives as its original)."""
    if traced.layout is None or not rewrite.recomputed:
        return traced.layout
    return traced.layout.for_rewrite(rewrite.origin_buffer)


def _placement(traced: TracedStep) -> tuple | None:
    """What a stored plan of a step on a mesh was compiled for: every buffer's sharding, the mesh's
    devices in order, and this process (compiled programs name their devices)."""
    if traced.layout is None:
        return None
    mesh = traced.layout.replicated.mesh
    devices = tuple(d.id for d in mesh.devices.flat)
    return repr(traced.layout.shardings), devices, jax.process_index(), jax.process_count()


def _labels(program: Program) -> list[str]:
    return [buffer.label for buffer in program.buffers]


# XLA:CPU drops optimization barriers before its last common-subexpression pass, so inside one
# program a recomputed value is merged back into its original (read in its HLO pass dumps): there a
# copy must not run in one program with its original or another copy of it. XLA:GPU removes them
# only after scheduling.
_MERGES_COPIES = {"cpu": True}


def _platform() -> str:
    return jax.local_devices()[0].platform


def _copies(flat: FlatProgram) -> tuple[tuple[int, int], ...]:
    """(original, copy) per recomputed equation."""
    return tuple((fe.recompute_of, k) for k, fe in enumerate(flat.equations) if fe.recompute_of is not None)


def _description(traced: TracedStep, settled: SettledPlan, budget: Budget, profile: DeviceProfile | None) -> dict:
    """What a plan says whether or not anything moves (``Plan.build``'s shared keywords), for the
    device at hand or the ``profile`` it was planned for."""
    choice, schedule = settled.choice, settled.schedule
    kinds = tuple("pinned_host" if b in schedule.host_inputs else "device" for b in range(traced.flat.num_inputs))
    return dict(
        schedule=schedule,
        source_jaxpr=traced.jaxpr,
        budget_bytes=budget.user_bytes,
        headroom_bytes=budget.headroom_bytes,
        in_core_program=traced.program,
        rewrite=choice.rewrite if choice.rewrite.recomputed else None,
        step_time_s=choice.step_time_s if settled.step_time_s is None else settled.step_time_s,
        in_core_time_s=choice.in_core_time_s,
        swap_only_time_s=choice.swap_only_time_s,
        swap_only_moved_bytes=None if choice.swap_only is None else choice.swap_only.moved_bytes(traced.program),
        recomputed_by_block=choice.by_block and bool(choice.rewrite.recomputed),
        loops=traced.flat.loops,
        input_kinds=kinds,
        device=jax.local_devices()[0].device_kind if profile is None else profile.name,
        compiled=profile is None,
        mesh="" if traced.layout is None else traced.layout.mesh,
        layers=settled.layers,
    )


def _with_held_by_caller(program: Program, held: tuple[bool, ...]) -> Program:
    if not any(held):
        return program
    buffers = tuple(
        dataclasses.replace(buffer, held_by_caller=True) if b < len(held) and held[b] else buffer
        for b, buffer in enumerate(program.buffers)
    )
    return Program(steps=program.steps, buffers=buffers)


def _choose(
    program: Program, flat: FlatProgram, runs: Sequence, budget: Budget, options: PlannerOptions, profile: DeviceProfile
) -> HybridPlan:
    """The first plan of a budget: swap only, or recompute and swap (``schedule.plan_hybrid``), timed
    with ``profile``'s rates (the device kind's published ones, or the profile planned for).
    Swap-only plans are timed too: the plan says how fast either would run."""
    backward = [a for a, _, kind in runs if kind.startswith("transpose")]
    blocks = tuple((a, y) for a, y, kind in runs if backward and not kind.startswith("transpose") and y <= backward[0])
    try:
        choice = plan_hybrid(
            program,
            budget.planned_bytes,
            recomputable=recomputable_steps(flat).__getitem__,
            profile=profile,
            recompute=options.recompute,
            planner=_planner,
            blocks=blocks,
            backward_start=backward[0] if backward else 0,
            layers=tuple((a, y) for a, y, _ in runs),
            **options.window,
        )
    except BudgetInfeasibleError as error:
        refuse_infeasible(program, error, budget, options)
    refuse_invalid("plan", validate(choice.program, choice.schedule))
    return choice


def _planner(program: Program, budget_bytes: int, **window: Any) -> Schedule:
    return plan_window(program, budget_bytes, **window)  # looked up when called: tests replace it


def _plan(program: Program, budget: Budget, options: PlannerOptions, layers, history: list, worst: str) -> Schedule:
    """A plan made again after the compiled segments measured over the budget."""
    try:
        schedule = plan_window(program, budget.planned_bytes, **options.window, layers=[(a, y) for a, y, _ in layers])
    except BudgetInfeasibleError as error:  # with what the compiled segments measured, the budget is too small
        message = over_budget_message(budget.planned_bytes, history, error.required_bytes) + worst
        raise error.with_message(message) from error
    refuse_invalid("plan", validate(program, schedule))
    return schedule
