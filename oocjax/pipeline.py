"""The stages after tracing, for one signature: plan -> segment -> compile, closed on the budget.

  plan (``schedule.plan_window``) -> cut (``schedule.cut_segments``) -> segment functions and the
  chain jaxpr (``transforms.segment``) -> compile and measure (``transforms.execute``)

The compiled segments' own memory reports close the loop: when the chain's executed peak is over
the budget, the program learns each segment's measured excess as scratch and is planned again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from oocjax import plan_cache
from oocjax.budget import available_host_bytes, resolve_bytes
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.plan import Plan
from oocjax.schedule import MiB, Program, Schedule, format_bytes, plan_window, required_bytes, simulate, validate
from oocjax.schedule.hybrid import RECOMPUTE_MODES, HybridPlan, plan_hybrid
from oocjax.schedule.segments import (
    Segment,
    SegmentCost,
    check_segments,
    cut_segments,
    executed_peak,
    with_measured_scratch,
)
from oocjax.transforms import _compat as jc
from oocjax.transforms.analyse import FlatProgram
from oocjax.transforms.calibrate import measure_profile
from oocjax.transforms.execute import ChainExecutor
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.recompute import apply_rewrite, recomputable_steps
from oocjax.transforms.segment import build_chain, chain_function, chain_jaxpr, compile_segments, segment_functions
from oocjax.transforms.shardings import Layout
from oocjax.transforms.trace import TracedStep

MAX_REPLANS = 4  # closed loop on the budget: re-plans after the compiled segments came out too large
MAX_RUNTIME_REPLANS = 3  # plans made again after calls measured over the budget on the device
# A segment launch costs tens of microseconds of Python and runtime work: below this much work a
# segment is merged with the next one where memory allows (about a millisecond of work).
DEFAULT_MIN_SEGMENT_FLOPS = {"cpu": 10**8, "gpu": 4 * 10**11, "cuda": 4 * 10**11, "rocm": 4 * 10**11}
# Device memory a plan leaves free at first, as a fraction of the budget, for what the allocator
# takes beyond the arrays and programs it accounts for. On an H200 (XLA's BFC allocator) a chain
# planned to the byte ran 4-7% over its budget, almost all of it memory in use that no live array
# explained (fragmentation), growing over the step (benchmarks/results/gpu_gate-*.json). A CPU
# has no allocator statistics to learn from, and its runs are checked by their live arrays.
DEFAULT_HEADROOM = {"gpu": 0.08, "cuda": 0.08, "rocm": 0.08}
# Host memory a plan leaves to the rest of the machine when no host_budget is given, as a fraction
# of what is available when the step is planned.
HOST_MARGIN = 0.1
# Operations that run whole, as one step with their internal peak as scratch: when one of them sets
# the floor, the error says so.
OPAQUE_LOOPS = {
    jc.scan_p.name: "a scan",
    jc.while_p.name: "a while loop",
    jc.remat_p.name: "a remat (checkpoint) block",
}


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
        for name in ("min_segment_flops", "min_segments"):
            if name in options:
                read[name] = _count(name, options[name], smallest=0 if name == "min_segment_flops" else 1)
        return cls(**read)

    @property
    def window(self) -> dict[str, int]:
        """The options ``plan_window`` takes."""
        window = {} if self.window_bytes is None else {"window_bytes": self.window_bytes}
        return window | {"min_offload_bytes": self.min_offload_bytes}


@dataclass(frozen=True, slots=True)
class BuiltStep:
    """What one signature runs: its plan and, when something moves, the chain's executor (else
    the step is ``jax.jit``'s own program)."""

    plan: Plan
    executor: ChainExecutor | None
    segment_functions: tuple[Callable, ...] = ()
    programs: tuple[Any, ...] = ()  # compiled, per segment

    @property
    def input_kinds(self) -> tuple[str, ...]:
        return self.plan.input_kinds


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """What "budget" means for one plan, in one place.

    Attributes:
      user_bytes: the user's budget (``ooc_jit(budget=...)``): what a call may use on the device.
      headroom_bytes: left free within it for the device allocator's own overhead.
    """

    user_bytes: int
    headroom_bytes: int

    @property
    def planned_bytes(self) -> int:
        """What plans, segments and the executor's gate hold to."""
        return self.user_bytes - self.headroom_bytes


class StepPlanner:
    """One signature's plans: made, measured and made again, in one loop.

    * **Choose** (``schedule.plan_hybrid``): swap only, or recompute and swap, by simulated time
      with the device's measured rates.
    * **Compile and measure**: when compiled segments measure over the planned budget, their
      excess becomes scratch of their steps and the program is planned again (``MAX_REPLANS``).
    * **Run and measure** (``after_call``): a call the allocator measured over the user's budget
      is planned again with more headroom (``MAX_RUNTIME_REPLANS``).

    Compiled programs are shared by every plan it makes: a segment that did not change compiles once.
    ``held_by_caller`` marks the flat arguments the caller passes in device memory and keeps (not
    donated): they stay on the device, and every plan counts them there. ``host_bytes_in_use`` is
    host memory the arguments already take (in the plans' host peak, not in what is available).
    """

    def __init__(
        self,
        traced: TracedStep,
        budget_bytes: int,
        options: PlannerOptions,
        *,
        held_by_caller: tuple[bool, ...] = (),
        host_bytes_in_use: int = 0,
    ):
        self.traced, self.options, self.held_by_caller = traced, options, held_by_caller
        self.program = _with_held_by_caller(traced.program, held_by_caller)
        self.host_budget = _host_budget(options, host_bytes_in_use)
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
        if plan_cache.directory() is not None:  # printing the jaxpr takes time (0.2 s at 24 layers): only for a cache
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
            programs = [plan_cache.deserialize(p) for p in entry.pop("executables")]
            return self._finish(budget, **entry, programs=programs)
        built, entry = self._make(budget)
        if name is not None:
            executables = list({id(p): p for p in built.programs}.values())
            where = {id(p): i for i, p in enumerate(executables)}
            entry |= dict(program_index=tuple(where[id(p)] for p in built.programs))
            plan_cache.store(name, entry | dict(executables=[plan_cache.serialize(p) for p in executables]))
        return built

    def _make(self, budget: Budget) -> tuple[BuiltStep, dict]:
        """Plans, cuts and compiles until the compiled segments' measured peak holds the budget;
        the step, and what the plan cache keeps of it.

        Raises ``BudgetInfeasibleError`` when no plan fits, and ``OocError`` when the segments still
        measure over the budget after ``MAX_REPLANS`` plans, or a plan needs more host memory than
        ``host_budget``. Every plan and its chain of segments are checked by the simulator first."""
        options, traced = self.options, self.traced
        traced_layers = layer_runs(traced.flat)
        choice = _choose(self.program, traced.flat, traced_layers, budget, options)
        program, schedule, rewrite = choice.program, choice.schedule, choice.rewrite
        flat = apply_rewrite(traced.flat, rewrite) if rewrite.recomputed else traced.flat
        layout = _layout(traced, rewrite)
        layers = layer_runs(flat) if rewrite.recomputed else traced_layers  # copies move the layers
        history, worst_text, halved = [], "", set()
        while True:
            entry = dict(choice=choice, program=program, schedule=schedule)
            if schedule.moves_nothing and not rewrite.recomputed and options.min_segments <= 1:
                return self._finish(budget, **entry), entry
            _check_host_peak(program, schedule, self.host_budget, options.host_budget is None, self.local_copies)
            cuts = dict(min_segment_flops=options.min_segment_flops, min_segments=options.min_segments)
            cuts["layers"] = layers
            cuts["cut_before"] = tuple(halved)
            cuts["copies"] = _copies(flat) if _MERGES_COPIES.get(_platform()) else ()
            segments = cut_segments(program, schedule, budget_bytes=budget.planned_bytes, **cuts)
            _refuse_invalid("chain of segments", check_segments(program, schedule, segments))
            _refuse_tokens_between(segments, flat.avals)
            functions = tuple(segment_functions(flat, segments, _labels(program), layout))
            programs, costs = compile_segments(flat, segments, functions, self.compiled, layout)
            peak, worst = executed_peak(segments, costs)
            history.append((budget.planned_bytes, peak))
            if peak <= budget.planned_bytes:
                break
            worst_text = _worst_segment(program, segments[worst], costs[worst])
            if len(history) > MAX_REPLANS:
                smallest = max(required_bytes(program, options.min_offload_bytes))
                raise OocError(_over_budget_message(budget.planned_bytes, history, smallest) + worst_text)
            # Some compiled segments came out larger than estimated (XLA's scratch, padding): plan
            # again with that excess as scratch of their steps, so that less is held around them,
            # and cut the worst in two. Where no plan holds that much scratch on every step of a
            # long segment (its excess may be what merging its steps cost), the cut alone is tried.
            halved.add((segments[worst].start + segments[worst].stop) // 2)
            try:
                learnt = with_measured_scratch(program, segments, costs, budget.planned_bytes)
                program, schedule = learnt, _plan(learnt, budget, options, history, worst_text)
            except OocError:
                if segments[worst].stop - segments[worst].start <= 1:
                    raise
        entry |= dict(segments=segments, costs=tuple(costs), attempts=tuple(m for _, m in history), peak=peak)
        return self._finish(budget, **entry, programs=programs, functions=functions), entry

    def _finish(
        self,
        budget: Budget,
        *,
        choice: HybridPlan,
        program: Program,
        schedule: Schedule,
        segments: tuple[Segment, ...] = (),
        costs: tuple[SegmentCost, ...] = (),
        attempts: tuple[int, ...] = (),
        peak: int = 0,
        programs: Sequence[Any] = (),
        functions: Sequence[Callable] = (),
        program_index: tuple[int, ...] = (),
    ) -> BuiltStep:
        """The step that runs a plan: ``jax.jit``'s program when nothing moves, else the chain of
        ``programs`` (per distinct program, ``program_index`` per segment, when read from the cache)."""
        traced = self.traced
        _check_host_peak(program, schedule, self.host_budget, self.options.host_budget is None, self.local_copies)
        described = _description(traced, choice, schedule, budget)
        if not segments:
            return BuiltStep(Plan.build(program=program, jaxpr=traced.jaxpr, **described), None)
        if program_index:
            programs = [programs[i] for i in program_index]
        rewrite = choice.rewrite
        flat = apply_rewrite(traced.flat, rewrite) if rewrite.recomputed else traced.flat
        labels = _labels(program)
        layout = _layout(traced, rewrite)
        functions = functions or tuple(segment_functions(flat, segments, labels, layout))
        measured = dict(segments=segments, segment_costs=costs, executed_peak_bytes=peak)
        shown = functools.partial(
            chain_jaxpr, chain_function(flat, schedule, segments, functions, labels), flat, described["input_kinds"]
        )
        plan = Plan.build(program=program, jaxpr=shown, attempts=attempts, **measured, **described)
        chain = build_chain(flat, schedule, segments, programs, costs, labels, layout)
        return BuiltStep(plan, ChainExecutor(chain, budget.planned_bytes, functions), functions, tuple(programs))


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


def _description(traced: TracedStep, choice: HybridPlan, schedule: Schedule, budget: Budget) -> dict:
    """What a plan says whether or not anything moves (``Plan.build``'s shared keywords)."""
    kinds = tuple("pinned_host" if b in schedule.host_inputs else "device" for b in range(traced.flat.num_inputs))
    return dict(
        schedule=schedule,
        source_jaxpr=traced.jaxpr,
        budget_bytes=budget.user_bytes,
        headroom_bytes=budget.headroom_bytes,
        in_core_program=traced.program,
        rewrite=choice.rewrite if choice.rewrite.recomputed else None,
        step_time_s=choice.step_time_s,
        swap_only_time_s=choice.swap_only_time_s,
        recomputed_by_block=choice.by_block and bool(choice.rewrite.recomputed),
        loops=traced.flat.loops,
        input_kinds=kinds,
        device=jax.local_devices()[0].device_kind,
        mesh="" if traced.layout is None else traced.layout.mesh,
    )


def agreed_across_processes(budget_bytes: int, options: PlannerOptions) -> tuple[int, PlannerOptions]:
    """In a run of several processes, what every process must plan with alike: the least budget (a
    share of each device's memory may differ between hosts), the least host memory available (a
    plan refused in one process alone would leave the others waiting in their first collective),
    and process 0's device rates (``calibrate.measure_profile``). Collective: ``ooc_jit`` calls it
    in every process when it wraps a step, so that planning later needs no other process."""
    if jax.process_count() == 1:
        return budget_bytes, options
    from jax.experimental import multihost_utils

    measure_profile()
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


def _host_budget(options: PlannerOptions, host_bytes_in_use: int) -> int | None:
    """The user's host budget, else what the machine has available less a margin (None: unknown)."""
    if options.host_budget is not None:
        return options.host_budget
    available = available_host_bytes()
    return None if available is None else int(available * (1 - HOST_MARGIN)) + host_bytes_in_use


def _with_held_by_caller(program: Program, held: tuple[bool, ...]) -> Program:
    if not any(held):
        return program
    buffers = tuple(
        dataclasses.replace(buffer, held_by_caller=True) if b < len(held) and held[b] else buffer
        for b, buffer in enumerate(program.buffers)
    )
    return Program(steps=program.steps, buffers=buffers)


def _refuse_invalid(what: str, violations: tuple) -> None:
    """A plan the simulator rejects would lose data or break the budget at run time: never run it."""
    if violations:
        listed = "\n".join(f"  - {v.message}" for v in violations[:10])
        more = f"\n  ... and {len(violations) - 10} more" if len(violations) > 10 else ""
        raise OocError(
            f"oocjax made a {what} that its own simulator rejects ({len(violations)} problems), so it does not "
            f"run it: your arrays are untouched. This is a bug in oocjax; please report it with this message.\n"
            f"{listed}{more}\nUntil it is fixed, a slightly different budget or min_offload_bytes avoids it."
        )


def _check_host_peak(
    program: Program, schedule: Schedule, host_budget: int | None, default: bool, copies: int = 1
) -> None:
    """Host memory is finite too: a plan whose host copies would not fit is refused before it runs.
    The plan's figures are per device; this process holds them for each of its ``copies`` devices."""
    if host_budget is None:
        return
    host_peak = simulate(program, schedule).host_peak_bytes * copies
    if host_peak <= host_budget:
        return
    which = (
        f"the memory this machine has available less a {HOST_MARGIN:.0%} margin ({format_bytes(host_budget)})"
        if default
        else f"host_budget ({format_bytes(host_budget)})"
    )
    raise OocError(
        f"the plan needs {format_bytes(host_peak)} of host memory at its peak (host-kept state and copies of "
        f"values moved off the device), more than {which}.\n"
        "Fixes:\n  1. raise the device budget, so that less moves to host;\n"
        "  2. free host memory, or raise host_budget if the machine has more to give;\n"
        "  3. make the step smaller (a smaller batch or model)."
    )


def _refuse_tokens_between(segments: tuple[Segment, ...], avals: tuple) -> None:
    """Tokens order effects inside one program; separately compiled segments cannot pass them on."""
    crossing = sorted({b for s in segments for b in (*s.inputs, *s.outputs) if not hasattr(avals[b], "shape")})
    if crossing:
        raise OocError(
            f"a token value (from jax.lax.create_token or after_all; buffers {crossing}) lives across the separately "
            "compiled segments this plan cuts the step into, and tokens cannot be passed between programs.\n"
            "Fixes:\n  1. create and use each token within a small part of the step;\n"
            "  2. raise the budget to the in-core estimate, where the step runs as jax.jit's one program."
        )


def _choose(
    program: Program, flat: FlatProgram, runs: Sequence[tuple[int, int, str]], budget: Budget, options: PlannerOptions
) -> HybridPlan:
    """The first plan of a budget: swap only, or recompute and swap (``schedule.plan_hybrid``), timed
    with the device's measured rates (measured once per process)."""
    profile = measure_profile()  # swap-only plans are timed too: the plan says how fast either would run
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
            **options.window,
        )
    except BudgetInfeasibleError as error:
        _refuse_infeasible(program, error, budget, options)
    _refuse_invalid("plan", validate(choice.program, choice.schedule))
    return choice


def _planner(program: Program, budget_bytes: int, **window: Any) -> Schedule:
    return plan_window(program, budget_bytes, **window)  # looked up when called: tests replace it


def _plan(program: Program, budget: Budget, options: PlannerOptions, history: list, worst: str) -> Schedule:
    """A plan made again after the compiled segments measured over the budget."""
    try:
        schedule = plan_window(program, budget.planned_bytes, **options.window)
    except BudgetInfeasibleError as error:  # with what the compiled segments measured, the budget is too small
        message = _over_budget_message(budget.planned_bytes, history, error.required_bytes) + worst
        raise error.with_message(message) from error
    _refuse_invalid("plan", validate(program, schedule))
    return schedule


def _refuse_infeasible(program: Program, error: BudgetInfeasibleError, budget: Budget, options: PlannerOptions):
    """Raises the planner's error, saying what the user can do about it."""
    _refuse_for_held_arguments(program, error, options)
    loop = OPAQUE_LOOPS.get(program.steps[error.step].name)
    tried = (
        ""
        if options.recompute == "off"
        else (
            "\nThat figure is the floor of plans that move values; plans that also recompute values were tried "
            "and did not fit this budget either (near the figure one may)."
        )
    )
    if loop is None and not budget.headroom_bytes and not tried:
        raise error
    note = tried + (
        ""
        if loop is None
        else (
            f"\nThat operation is {loop}: oocjax runs it whole, as one operation holding all its iterations' "
            "values, so it sets the floor whatever the model's depth. A Python loop over the layers (or no "
            "remat) lets each layer be planned on its own."
        )
    )
    if budget.headroom_bytes:
        note += (
            f"\nThe plan leaves {format_bytes(budget.headroom_bytes)} of the budget free for the device "
            "allocator's own overhead (headroom_bytes): the budget must cover both."
        )
    raise error.with_message(str(error) + note) from None


def _refuse_for_held_arguments(program: Program, error: BudgetInfeasibleError, options: PlannerOptions) -> None:
    """When the arguments the caller keeps on the device make the budget infeasible, say which to
    donate or pass in host memory."""
    held = [b for b, buffer in enumerate(program.buffers) if buffer.held_by_caller]
    if not held:
        return
    buffers = tuple(dataclasses.replace(buffer, held_by_caller=False) for buffer in program.buffers)
    released = Program(steps=program.steps, buffers=buffers)
    if max(required_bytes(released, options.min_offload_bytes)) > error.budget_bytes:
        return  # infeasible anyway: the planner's own error says why
    largest = sorted(held, key=lambda b: -program.buffers[b].nbytes)
    listed = "\n".join(
        f"  - {program.buffers[b].label.removeprefix('argument ')} ({format_bytes(program.buffers[b].nbytes)})"
        for b in largest[:10]
    )
    more = f"\n  ... and {len(held) - 10} more" if len(held) > 10 else ""
    total = format_bytes(sum(program.buffers[b].nbytes for b in held))
    raise error.with_message(
        f"a budget of {format_bytes(error.budget_bytes)} cannot hold the step together with the arguments "
        f"you keep on the device ({total}: passed in device memory and not donated, so they stay there for the "
        f"whole step):\n{listed}{more}\n"
        "Fixes:\n  1. donate them (donate_argnums), so that the step may move them;\n"
        "  2. pass them in host memory: oocjax.to_host(x), or jax.device_put(x, jax.memory.Space.Host);\n"
        f"  3. raise the budget to at least {format_bytes(error.required_bytes, round_up=True)}."
    ) from None


def _count(name: str, value: Any, *, smallest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < smallest or value != int(value):
        raise ValueError(f"{name} must be a whole number >= {smallest}; got {value!r}")
    return int(value)


def _over_budget_message(budget: int, history: list[tuple[int, int]], smallest: int | None) -> str:
    tries = "; ".join(f"planned for {format_bytes(p)}, measured {format_bytes(c)}" for p, c in history)
    limit = "" if smallest is None else f" (the planner cannot go below {format_bytes(smallest, round_up=True)})"
    return (
        f"the compiled segments of the step do not fit the budget of {format_bytes(budget)}: {tries}{limit}.\n"
        "XLA adds memory the plan's estimate cannot see (padding, fusion scratch, its own rematerialisation).\n"
        "Fixes:\n  1. raise the budget;\n  2. lower min_offload_bytes so that more values may move."
    )


def _worst_segment(program: Program, segment: Segment, cost: SegmentCost) -> str:
    lines = list(dict.fromkeys(s.label for s in program.steps[segment.start : segment.stop] if s.label))
    shown = ", ".join(lines[:5]) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")
    return (
        f"\nThe largest segment runs equations {segment.start}..{segment.stop - 1} ({shown or 'no source lines'}): "
        f"it holds {format_bytes(segment.held_bytes)} when launched and its program allocates "
        f"{format_bytes(cost.launch_bytes)} more (scratch {format_bytes(cost.temp_bytes)}), "
        f"{format_bytes(segment.held_bytes + cost.launch_bytes)} in all."
    )
