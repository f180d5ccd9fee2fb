"""The stages after tracing, for one signature, closed on the budget: plan (``schedule.plan_hybrid``)
-> cut (``schedule.cut_segments``) -> compile and measure (``transforms.compile``) -> build
(``oocjax.built``). When the compiled segments' own memory reports put the chain over the budget,
the program learns each one's excess as scratch and is planned again. What the loop settles on
(``schedule.SettledPlan``) is what the step is built from and what the plan cache keeps; why a step
is refused is said in ``oocjax.refusals``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

import oocjax.plan_cache as plan_cache
from oocjax.attempts import Attempt, Rewritten
from oocjax.budget import Budget
from oocjax.built import BuiltStep, StepContext, build_step
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.host_limit import host_limit
from oocjax.options import DEFAULT_HEADROOM, MERGES_COPIES, PlannerOptions
from oocjax.refusals import (
    check_host_peak,
    over_budget_message,
    refuse_infeasible,
    refuse_invalid,
    refuse_tokens_between,
    worst_segment,
)
from oocjax.schedule import (
    CutOptions,
    DeviceProfile,
    HybridPlan,
    MemoryTimeline,
    Program,
    Schedule,
    SettledPlan,
    chain_of,
    cut_and_probes,
    cut_segments,
    estimated_costs,
    format_bytes,
    keep_all,
    plan_hybrid,
    replan_layers,
    replay,
    required_bytes,
    runs_after,
    simulate,
    with_measured_scratch,
    with_probed_scratch,
)
from oocjax.schedule.gc_paused import gc_paused
from oocjax.seams import Seams, published_profile
from oocjax.timings import Timings
from oocjax.transforms.functions import segment_functions
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.recompute import recomputable_steps
from oocjax.transforms.trace import TracedStep

__all__ = ["DEFAULT_HEADROOM", "MAX_REPLANS", "MAX_RUNTIME_REPLANS", "BuiltStep", "Seams", "StepPlanner"]

MAX_REPLANS = 4  # closed loop on the budget: re-plans after the compiled segments came out too large
MAX_RUNTIME_REPLANS = 3  # plans made again after calls measured over the budget on the device


class StepPlanner:
    """One signature's plans: made, measured and made again, in one loop.

    * **Choose** (``schedule.plan_hybrid``): swap only, or recompute and swap, by simulated time
      with the device kind's published rates (``schedule.profile_for``).
    * **Compile and measure**: when compiled segments measure over the planned budget, their
      excess becomes scratch of their steps and the program is planned again (``MAX_REPLANS``).
    * **Run and measure** (``after_call``): a call the allocator measured over the user's budget
      is planned again with more headroom (``MAX_RUNTIME_REPLANS``).

    Compiled programs are shared by every plan it makes: a segment that did not change compiles once.
    ``held_by_caller`` marks the flat arguments the caller passes in device memory and keeps (not
    donated): they stay on the device, and every plan counts them there. ``host_bytes_in_use`` is
    host memory the arguments already take (in the plans' host peak, not in what is available).

    With a ``profile``, the step is planned for that device from any machine, with its rates and its
    platform's host limits, each segment's memory estimated (``schedule.estimated_costs``): nothing
    is compiled, allocated or run. ``timings`` holds the stages so far; each stage here joins them.
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
        timings: Timings | None = None,
        seams: Seams | None = None,
    ):
        if profile is not None:  # the defaults of the profile's platform, not this machine's
            options = options.for_platform(profile.platform, budget_bytes)
        seams = seams or Seams()
        self.traced, self.options, self.held_by_caller, self.seams = traced, options, held_by_caller, seams
        self.profile = profile
        self.platform = seams.platform() if profile is None else profile.platform
        self.program = traced.program.with_held_by_caller(held_by_caller)
        self.in_core = simulate(traced.program, keep_all(traced.program))
        available = seams.available_host_bytes() if profile is None else None  # a profile's machine: unknown
        self.host_limit = host_limit(options, host_bytes_in_use, self.platform, available)
        # On a mesh every byte figure is per device, and this process keeps host copies for each of its devices.
        self.local_copies = 1 if traced.layout is None else len(traced.layout.replicated.addressable_devices)
        self.compiled, self.runtime_replans = {}, 0  # programs by key, shared by every plan; re-plans after calls
        self.budget = Budget(user_bytes=budget_bytes, headroom_bytes=options.headroom_bytes)
        self.built = self._build(self.budget, timings or Timings())

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
            self.built, self.budget = self._build(more, Timings()), more
        except OocError as error:  # the call itself succeeded: keep what ran, and say why it stays over
            return f"{message}; a plan with {format_bytes(headroom)} of headroom fails: {error}"
        return f"{message}; planned again with {format_bytes(headroom)} of headroom"

    @gc_paused()  # planning makes many small objects, few in cycles, beside the tracer's
    def _build(self, budget: Budget, timings: Timings) -> BuiltStep:
        """The step's plan and chain for ``budget``: read from the plan cache where an earlier
        process made them (``oocjax.plan_cache``), else made (``_make``) and stored there."""
        options, traced = self.options, self.traced
        name = None
        if plan_cache.directory() is not None and self.profile is None:  # printing the jaxpr: 0.2 s at 24 layers
            parts = (str(traced.jaxpr), traced.donated, self.held_by_caller, budget, options, options.recompute)
            name = plan_cache.key(*parts, plan_cache.placement(traced.layout))
        entry = plan_cache.load(name)
        if entry is not None:
            timings.done("read the plan from the plan cache")
            settled, programs, functions = entry.settled, entry.programs(), ()
            rewritten = Rewritten.of(traced, settled.choice.rewrite, settled.program)
            if programs is None and settled.segments:  # the plan alone: its segments compiled again
                functions, programs, _ = self._compiled(rewritten, settled.segments, settled.program, budget, timings)
            return self._finish(budget, settled, rewritten, programs or (), functions, timings)
        built, settled = self._make(budget, timings)
        if name is not None:
            keeps = self.seams.keeps_programs
            keeps = plan_cache.KEEPS_PROGRAMS.get(self.platform, True) if keeps is None else keeps
            plan_cache.store(name, plan_cache.Entry.of(settled, built.programs if keeps else ()))
        return built

    def _make(self, budget: Budget, timings: Timings) -> tuple[BuiltStep, SettledPlan]:
        """Plans, cuts and compiles until the compiled segments' measured peak holds the budget
        (an ``Attempt`` per plan); the step, and what the plan cache keeps of it. Raises
        ``BudgetInfeasibleError`` when no plan fits, and ``OocError`` when the segments still measure
        over the budget after ``MAX_REPLANS`` plans, or a plan needs more host memory than it may."""
        options, traced = self.options, self.traced
        traced_layers = layer_runs(traced.flat)
        timings.done("layers")
        profile = self.profile or options.rates or published_profile()  # published rates: one plan everywhere
        choice = self._choose(traced_layers, budget, profile)
        program, schedule = choice.program, choice.schedule
        timeline = self._replayed(program, schedule)
        timings.done("plan")
        rewritten = Rewritten.of(traced, choice.rewrite, program)
        layers = runs_after(choice.rewrite, traced_layers)  # the copies join the layers they are made for
        if schedule.moves_nothing and not choice.rewrite.recomputed and options.min_segments <= 1:
            settled = SettledPlan(choice=choice, program=program, schedule=schedule, timeline=timeline, layers=layers)
            return self._finish(budget, settled, rewritten, timings=timings), settled
        cut = CutOptions(
            budget_bytes=budget.planned_bytes,
            min_segment_flops=options.min_segment_flops,
            min_segments=options.min_segments,
            layers=layers,
            copies=rewritten.flat.recomputed_pairs if MERGES_COPIES.get(self.platform) else (),
        )
        attempts: list[Attempt] = []
        while True:
            choice, program, schedule, timeline, cut, segments = self._cut(
                choice, program, schedule, timeline, cut, rewritten, budget, timings
            )
            chain = chain_of(program, schedule, segments, rewritten.flat.result_buffers)
            refuse_invalid("chain of segments", self.seams.check_chain(program, chain))
            refuse_tokens_between(segments, rewritten.flat.avals)
            timings.done("cut")
            functions, programs, costs = self._compiled(rewritten, segments, program, budget, timings)
            peak, worst = self.seams.executed_peak(segments, costs)
            attempts.append(Attempt(program, schedule, timeline, segments, chain, tuple(costs), peak, worst))
            timings.done("measure")
            if peak <= budget.planned_bytes:
                break
            history = [(budget.planned_bytes, a.peak) for a in attempts]
            worst_text = worst_segment(program, segments[worst], costs[worst])
            if len(attempts) > MAX_REPLANS:
                smallest = max(required_bytes(program, options.min_offload_bytes))
                raise OocError(over_budget_message(budget.planned_bytes, history, smallest) + worst_text)
            choice, program, schedule, timeline, cut = self._learnt(
                choice, attempts[-1], cut, budget, history, worst_text
            )
            timings.done(f"re-plan {len(attempts)}: measured {format_bytes(peak)}")
        settled = Attempt.settled(choice, attempts, layers, profile)
        return self._finish(budget, settled, rewritten, programs, functions, timings), settled

    def _learnt(self, choice: HybridPlan, attempt: Attempt, cut: CutOptions, budget: Budget, history, worst: str):
        """After an attempt's compiled segments came out larger than estimated (XLA's scratch,
        padding): the step planned again with that excess as scratch of their steps, so that less
        is held around them, and each segment over the budget cut in two (a plan by layer cuts its
        layers alike itself). Where no plan holds that much scratch on every step of a long segment
        (its excess may be what merging its steps cost), the cuts alone are tried: alike layers
        measure alike, and are cut alike. The choice, plan and cut to try next."""
        program, schedule, timeline = attempt.program, attempt.schedule, attempt.timeline
        over = zip(attempt.segments, attempt.costs, strict=True)
        middle = {(s.start + s.stop) // 2 for s, c in over if s.held_bytes + c.launch_bytes > budget.planned_bytes}
        try:
            learnt = with_measured_scratch(program, attempt.segments, attempt.costs, budget.planned_bytes)
            schedule, choice = self._plan(learnt, budget, choice, history, worst)
            program, timeline = learnt, self._replayed(learnt, schedule)
            middle = middle if choice.layer_plan is None else set()
        except OocError:
            if attempt.segments[attempt.worst].stop - attempt.segments[attempt.worst].start <= 1:
                raise
        return choice, program, schedule, timeline, dataclasses.replace(cut, cut_before=cut.cut_before | middle)

    def _cut(self, choice, program, schedule, timeline, cut: CutOptions, rewritten: Rewritten, budget: Budget, timings):
        """Before the plan is cut: the ranges the estimate cuts but that might fit whole
        (``cut_and_probes``) are compiled whole and measured (``cut.measured`` keeps what they
        allocate). Where one measured over the budget only with what the plan holds when it
        starts, the step is planned again once, its peak shown to the planner on the step that held
        the most (``with_probed_scratch``): less is then held there and it runs whole, as the
        layers alike do, rather than in pieces that each compile (a 4-layer decoder's top backward
        layer, 7 KB over, was two more programs). Returns the plan, how it is cut, and its segments."""
        check_host_peak(timeline.host_peak_bytes, self.host_limit, self.local_copies)
        for replan in (True, False):
            # A profile's plan measures nothing: a probe would only repeat the estimate.
            segments, probes = cut_and_probes(program, schedule, cut, probing=self.profile is None)
            refuse_tokens_between(segments, rewritten.flat.avals)
            if not probes:
                return choice, program, schedule, timeline, cut, segments
            # The plan's own segments compile beside the probes, in parallel: where the probes fit,
            # the plan runs them as they are, compiled already.
            costs = self._compiled(rewritten, (*probes.values(), *segments), program, budget, timings, "probe")[2]
            launches = [cost.launch_bytes for cost in costs[: len(probes)]]
            cut = dataclasses.replace(cut, measured=(*cut.measured, *zip(probes, launches)))
            learnt = with_probed_scratch(program, schedule, tuple(probes.values()), launches, budget.planned_bytes)
            if not replan or learnt is None:
                break
            try:
                schedule, choice = self._plan(learnt, budget, choice, [], "")
                program, timeline = learnt, self._replayed(learnt, schedule)
            except OocError:
                break
        return choice, program, schedule, timeline, cut, cut_segments(program, schedule, cut)

    def _compiled(self, rewritten: Rewritten, segments, program: Program, budget: Budget | None, timings, what=""):
        """Per segment its function, its program compiled (into ``self.compiled``, sharing where
        the ``budget`` allows: ``compile_segments``) and what launching it allocates; for a
        profile, no functions or programs and each segment's estimate (``estimated_costs``)."""
        if self.profile is not None:
            return (), (), estimated_costs(program, segments)
        functions = tuple(segment_functions(rewritten.flat, segments, rewritten.labels, rewritten.layout))
        known, limit = len(self.compiled), None if budget is None else budget.planned_bytes
        programs, costs = self.seams.compile_segments(
            rewritten.flat, segments, functions, self.compiled, rewritten.layout, budget_bytes=limit
        )
        timings.done(f"compile {len(self.compiled) - known} {what} programs".replace("  ", " "))
        return functions, programs, costs

    def _finish(self, budget, settled: SettledPlan, rewritten: Rewritten, programs=(), functions=(), timings=None):
        """The step that runs a settled plan (``built.build_step``), its host memory checked first."""
        check_host_peak(settled.timeline.host_peak_bytes, self.host_limit, self.local_copies)
        context = StepContext(
            traced=self.traced,
            in_core=self.in_core,
            budget=budget,
            profile=self.profile,
            access=self.seams.device_access,
        )
        return build_step(settled, rewritten, context, timings, programs, functions)

    def _choose(self, runs: Sequence, budget: Budget, profile: DeviceProfile) -> HybridPlan:
        """The first plan of a budget: swap only, or recompute and swap (``schedule.plan_hybrid``),
        timed with ``profile``'s rates (the device kind's published ones, or the profile planned
        for). Swap-only plans are timed too: the plan says how fast either would run."""
        try:
            return plan_hybrid(
                self.program,
                budget.planned_bytes,
                recomputable=recomputable_steps(self.traced.flat).__getitem__,
                profile=profile,
                recompute=self.options.recompute,
                planner=self.seams.plan_window,
                runs=tuple(runs),
                **self.options.window,
            )
        except BudgetInfeasibleError as error:
            refuse_infeasible(self.program, error, budget, self.options)

    def _plan(self, program: Program, budget: Budget, choice: HybridPlan, history: list, worst: str):
        """A plan made again after compiled segments measured over the budget, and the choice it
        keeps: by layer where ``choice`` planned by layer (``schedule.replan_layers``)."""
        try:
            if choice.layer_plan is None:
                return self.seams.plan_window(program, budget.planned_bytes, **self.options.window), choice
            layered = replan_layers(program, choice.layer_plan, budget.planned_bytes, **self.options.window)
            return layered.schedule, dataclasses.replace(choice, layer_plan=layered)
        except BudgetInfeasibleError as error:  # with what the compiled segments measured, the budget is too small
            message = over_budget_message(budget.planned_bytes, history, error.required_bytes) + worst
            raise error.with_message(message) from error

    @staticmethod
    def _replayed(program: Program, schedule: Schedule) -> MemoryTimeline:
        """The plan's memory, from its one replay; refused where the simulator finds it wrong."""
        timeline, violations = replay(program, schedule)
        refuse_invalid("plan", violations)
        return timeline
