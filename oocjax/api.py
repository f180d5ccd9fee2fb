"""``ooc_jit``: a drop-in for ``jax.jit`` that fits a training step in a device-memory budget.

Data flow, per argument signature (cached, so a second call with the same shapes neither traces
nor plans again):

  trace (``jax.jit(fun).trace``) -> analyse (``transforms.analyse``: flatten, size, label)
    -> plan (``schedule.plan_window``) -> segment (``schedule.cut_segments``, then
       ``transforms.segment``: one jitted program per segment, the chain as a jaxpr)
    -> execute (``transforms.execute``: compile each distinct segment once, run the chain with
       real transfers and waits).

The compiled segments' own memory reports close the loop: when the chain's executed peak is over
the budget, the step is planned again for a proportionally smaller one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.budget import resolve_budget
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.plan import Plan
from oocjax.schedule import Program, format_bytes, plan_window, required_bytes
from oocjax.schedule.segments import Segment, SegmentCost, cut_segments, executed_peak, with_measured_scratch
from oocjax.transforms.analyse import flatten, to_program
from oocjax.transforms.execute import ChainExecutor, compile_segments, segment_specs
from oocjax.transforms.memories import abstract, memory_kind, sharding, spec
from oocjax.transforms.segment import chain_function, chain_jaxpr, segment_functions

PLANNER_OPTIONS = ("window_bytes", "min_offload_bytes", "min_segment_flops", "min_segments")
MiB = 2**20
MAX_REPLANS = 4  # closed loop on the budget: re-plans after the compiled segments came out too large
# A segment launch costs tens of microseconds of Python and runtime work: below this much work a
# segment is merged with the next one where memory allows (about a millisecond of work).
DEFAULT_MIN_SEGMENT_FLOPS = {"cpu": 10**8, "gpu": 4 * 10**11, "cuda": 4 * 10**11, "rocm": 4 * 10**11}


def ooc_jit(
    fun: Callable,
    *,
    budget: int | float | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    **planner_options: Any,
) -> OocJitted:
    """Like ``jax.jit(fun)``, but the step keeps device memory within ``budget``.

    Trace the whole (already differentiated) training step: the step is planned, cut into
    separately compiled segments, and run with transfers to and from host memory between them.

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``.
      budget: device bytes the step may use: an int, a string with units (``"512MiB"``,
        ``"1.5GB"``, ``"12GiB"``), or a fraction of the device's memory (``0.8`` or ``"80%"``)
        where the device reports its size.
      static_argnums, static_argnames, donate_argnums: as for ``jax.jit``. Donate the training
        state: its device memory is then reused during the step, and state kept in host memory
        comes back there, ready for the next step.
      **planner_options: ``window_bytes`` (look-ahead in bytes, default 1.5x the budget),
        ``min_offload_bytes`` (smaller values never move, default 1 MiB), ``min_segment_flops``
        (smaller segments are merged where memory allows; default about a millisecond of work on
        the device) and ``min_segments`` (cut into at least this many segments even when nothing
        moves; for measuring the executor's overhead).

    Returns:
      A callable with ``plan(...)`` and ``lower(...)`` methods.

    >>> import jax.numpy as jnp
    >>> step = ooc_jit(lambda x: (x * 2).sum(), budget="1GiB")
    >>> float(step(jnp.ones(4)))
    8.0
    """
    unknown = sorted(set(planner_options) - set(PLANNER_OPTIONS))
    if unknown:
        raise TypeError(f"ooc_jit got unknown planner options {unknown}; it accepts {list(PLANNER_OPTIONS)}")
    device = jax.devices()[0]
    planner_options.setdefault("min_segment_flops", DEFAULT_MIN_SEGMENT_FLOPS.get(device.platform, 10**11))
    return OocJitted(
        fun,
        budget_bytes=resolve_budget(budget, device),
        static_argnums=_as_tuple(static_argnums),
        static_argnames=_as_tuple(static_argnames),
        donate_argnums=_as_tuple(donate_argnums),
        planner_options=planner_options,
    )


@dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one argument signature needs at call time."""

    plan: Plan
    run: Callable  # the chain executor over flat dynamic arguments, or jax.jit(fun) when nothing moves
    flat_call: bool
    out_tree: Any
    input_kinds: tuple[str, ...]  # memory kind each flat argument must arrive in
    donated: tuple[bool, ...] = ()  # per flat argument
    segment_functions: tuple[Callable, ...] = ()


class OocJitted:
    """The result of ``ooc_jit``: call it like the jitted step; ``plan`` and ``lower`` inspect it."""

    def __init__(self, fun, *, budget_bytes, static_argnums, static_argnames, donate_argnums, planner_options):
        self.fun = fun
        self.budget_bytes = budget_bytes
        self.static_argnums, self.static_argnames = _normalise_statics(fun, static_argnums, static_argnames)
        self.donate_argnums = donate_argnums
        self.planner_options = planner_options
        self._cache: dict[Any, _Compiled] = {}
        self._jit_kwargs = dict(
            static_argnums=self.static_argnums, static_argnames=self.static_argnames, donate_argnums=donate_argnums
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry = self._entry(args, kwargs)
        if not entry.flat_call:
            if any(memory_kind(x) == "pinned_host" for x in self._dynamic_leaves(args, kwargs)):
                # jax.jit refuses arithmetic on host memory: host-kept state goes to the device first.
                args, kwargs = self._map_dynamic(_device_if_on_host, args, kwargs)
            return entry.run(*args, **kwargs)
        leaves = self._dynamic_leaves(args, kwargs)
        moved = [_to_memory(x, kind) for x, kind in zip(leaves, entry.input_kinds)]
        copies = [leaf is not original for original, leaf in zip(leaves, moved)]
        _delete_donated_originals(leaves, copies, entry.donated)
        del leaves
        # The executor takes the list over and empties it, and deletes the copies made here at
        # their last use: nothing else may hold their device memory.
        return jax.tree.unflatten(entry.out_tree, entry.run(moved, copies))

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``s), without running the step.
        Its segments are compiled (once per signature, as a call would): their memory is measured."""
        return self._entry(args, kwargs).plan

    def lower(
        self, *args: Any, lowering_platforms: Sequence[str] | None = None, **kwargs: Any
    ) -> jax.stages.Lowered | tuple[jax.stages.Lowered, ...]:
        """Lowers the step, e.g. ``lowering_platforms=("cuda",)`` to read the GPU program on a
        CPU-only machine: ``jax.jit``'s one program when nothing moves, else one lowered program
        per segment, in execution order (transfers run between them)."""
        entry = self._entry(args, kwargs)
        if not entry.flat_call:
            specs = self._specs(args, kwargs)
            return entry.run.trace(*specs[0], **specs[1]).lower(lowering_platforms=lowering_platforms)
        return tuple(
            function.trace(*specs).lower(lowering_platforms=lowering_platforms)
            for function, specs in zip(entry.segment_functions, segment_specs(entry.plan.jaxpr))
        )

    # -- per-signature work -------------------------------------------------------------------

    def _entry(self, args: tuple, kwargs: dict) -> _Compiled:
        key = self._signature(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._build(args, kwargs)
        return self._cache[key]

    def _build(self, args: tuple, kwargs: dict) -> _Compiled:
        spec_args, spec_kwargs = self._specs(args, kwargs)
        traced = jax.jit(self.fun, **self._jit_kwargs).trace(*spec_args, **spec_kwargs)
        labelled = jax.tree_util.tree_flatten_with_path(traced.args_info)[0]
        labels = [self._argument_label(path, args) for path, _ in labelled]
        donated = [info.donated for _, info in labelled]
        flat = flatten(traced.jaxpr)
        program = to_program(flat, input_labels=labels, donated=donated)
        out_tree = jax.tree.structure(traced.out_info)
        options = dict(self.planner_options)
        min_segment_flops, min_segments = options.pop("min_segment_flops"), options.pop("min_segments", 1)
        planned_for, history, worst_text = self.budget_bytes, [], ""  # the budget stays; the program learns
        compiled_programs: dict = {}  # shared across re-plans: a segment that did not change compiles once
        while True:
            try:
                schedule = plan_window(program, planned_for, **options)
            except BudgetInfeasibleError as error:
                if not history:
                    raise
                raise OocError(
                    _over_budget_message(self.budget_bytes, history, error.required_bytes) + worst_text
                ) from error
            if schedule.moves_nothing and min_segments <= 1:
                plan = Plan.build(
                    program=program,
                    schedule=schedule,
                    jaxpr=traced.jaxpr,
                    source_jaxpr=traced.jaxpr,
                    input_kinds=("device",) * flat.num_inputs,
                )
                jitted = jax.jit(self.fun, **self._jit_kwargs)
                return _Compiled(plan, jitted, False, out_tree, ("device",) * flat.num_inputs)
            segments = cut_segments(
                program,
                schedule,
                budget_bytes=planned_for,
                min_segment_flops=min_segment_flops,
                min_segments=min_segments,
            )
            input_kinds = tuple(
                "pinned_host" if b in schedule.host_inputs else "device" for b in range(flat.num_inputs)
            )
            functions = segment_functions(flat, segments)
            chain = chain_jaxpr(chain_function(flat, schedule, segments, functions), flat, input_kinds)
            programs, costs = compile_segments(chain, functions, compiled_programs)
            peak, worst = executed_peak(segments, costs)
            history.append((planned_for, peak))
            if peak <= self.budget_bytes:
                break
            worst_text = _worst_segment(program, segments[worst], costs[worst])
            if len(history) > MAX_REPLANS:
                smallest = max(required_bytes(program, options.get("min_offload_bytes", MiB)))
                raise OocError(_over_budget_message(self.budget_bytes, history, smallest) + worst_text)
            # Some compiled segments came out larger than estimated (XLA's scratch, padding): plan
            # again with that excess as scratch of their steps, so that less is held around them.
            program = with_measured_scratch(program, segments, costs, self.budget_bytes)
        plan = Plan.build(
            program=program,
            schedule=schedule,
            jaxpr=chain,
            source_jaxpr=traced.jaxpr,
            budget_bytes=self.budget_bytes,
            segments=segments,
            segment_costs=tuple(costs),
            executed_peak_bytes=peak,
            attempts=tuple(measured for _, measured in history),
            input_kinds=input_kinds,
        )
        executor = ChainExecutor(chain, programs, costs, self.budget_bytes)
        return _Compiled(plan, executor, True, out_tree, input_kinds, tuple(donated), tuple(functions))

    def _signature(self, args: tuple, kwargs: dict) -> Any:
        statics = tuple(args[i] for i in self.static_argnums if i < len(args))
        statics += tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        leaves, tree = jax.tree.flatten(self._dynamic(args, kwargs))
        return statics, tree, tuple(abstract(x) for x in leaves)

    def _dynamic(self, args: tuple, kwargs: dict) -> tuple:
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return dynamic_args, {k: v for k, v in kwargs.items() if k not in self.static_argnames}

    def _dynamic_leaves(self, args: tuple, kwargs: dict) -> list:
        return jax.tree.leaves(self._dynamic(args, kwargs))

    def _map_dynamic(self, f: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(a if i in self.static_argnums else jax.tree.map(f, a) for i, a in enumerate(args))
        return args, {k: v if k in self.static_argnames else jax.tree.map(f, v) for k, v in kwargs.items()}

    def _specs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Abstract arguments on the device, whatever memory the real ones are in: a step traces the
        same for state kept on host as for state on the device."""
        return self._map_dynamic(lambda x: spec(x, "device"), args, kwargs)

    def _argument_label(self, path: tuple, args: tuple) -> str:
        """``state['params']['w']`` for a leaf of the first argument named ``state``."""
        group, first, rest = path[0], path[1], path[2:]
        if group.idx == 1:  # keyword arguments
            return f"{first.key}{jax.tree_util.keystr(rest)}"
        positions = [i for i in range(len(args)) if i not in self.static_argnums]
        position = positions[first.idx]
        names = _parameter_names(self.fun)
        name = names[position] if position < len(names) else f"args[{position}]"
        return f"{name}{jax.tree_util.keystr(rest)}"


def _delete_donated_originals(leaves: Sequence[Any], copies: Sequence[bool], donated: Sequence[bool]) -> None:
    """As ``jax.jit`` does with a donated argument: a donated array that was copied to the memory
    the plan wants it in is deleted (the copy has its own buffer)."""
    for original, copied, gave in zip(leaves, copies, donated):
        if copied and gave and isinstance(original, jax.Array):
            original.delete()


def _over_budget_message(budget: int, history: list[tuple[int, int]], smallest: int | None) -> str:
    tries = "; ".join(f"planned for {format_bytes(p)}, measured {format_bytes(c)}" for p, c in history)
    limit = "" if smallest is None else f" (the planner cannot go below {format_bytes(smallest)})"
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


def to_device(tree: Any) -> Any:
    """``tree`` with every leaf kept in host memory (state an ``ooc_jit`` plan keeps there) moved to
    device memory, e.g. to evaluate the trained parameters with ``jax.jit``.

    Raises ``OocError`` when the device reports less free memory than those leaves need: keep
    using them through ``ooc_jit`` then.

    >>> import jax.numpy as jnp
    >>> to_device({"w": jnp.ones(2)})["w"].sharding.memory_kind
    'device'
    """
    needed = sum(x.nbytes for x in jax.tree.leaves(tree) if memory_kind(x) == "pinned_host")
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats and needed > stats["bytes_limit"] - stats.get("bytes_in_use", 0):
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        raise OocError(
            f"to_device: the host-kept leaves need {format_bytes(needed)} on the device, which has "
            f"{format_bytes(free)} free. Keep using them through ooc_jit (a step that reads them in "
            "pieces), or free device memory first."
        )
    return jax.tree.map(_device_if_on_host, tree)


def _device_if_on_host(x: Any) -> Any:
    return jax.device_put(x, sharding("device")) if memory_kind(x) == "pinned_host" else x


def _to_memory(x: Any, kind: str) -> Any:
    """Moves an argument to the memory the plan expects it in, if it is elsewhere."""
    if memory_kind(x) == kind:
        return x
    return jax.device_put(x, sharding(kind))


def _as_tuple(x: int | str | Sequence) -> tuple:
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def _parameter_names(fun: Callable) -> list[str]:
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _normalise_statics(fun: Callable, argnums: tuple, argnames: tuple) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """As ``jax.jit`` does: a static argument may be named by position or by name."""
    names = _parameter_names(fun)
    nums = set(argnums) | {names.index(n) for n in argnames if n in names}
    return tuple(sorted(nums)), tuple(sorted(set(argnames) | {names[i] for i in argnums if i < len(names)}))
