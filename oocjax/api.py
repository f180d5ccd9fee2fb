"""``ooc_jit``: a drop-in for ``jax.jit`` that fits a training step in a device-memory budget.

Data flow, per argument signature (cached, so a second call with the same shapes neither traces
nor plans again):

  trace (``jax.jit(fun).trace``) -> analyse (``transforms.analyse``: flatten, size, label)
    -> plan (``schedule.plan_window``) -> rewrite (``transforms.rewrite``: transfers and barriers)
    -> compile (``jax.jit`` of the rewritten step, host-resident arguments and results in pinned
       host memory).
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
from oocjax.schedule import Schedule, format_bytes, plan_window
from oocjax.transforms.analyse import FlatProgram, flatten, to_program
from oocjax.transforms.rewrite import rewritten_step

PLANNER_OPTIONS = ("window_bytes", "min_offload_bytes")
MAX_REPLANS = 4  # closed loop on the budget: re-plans after XLA's compiled peak came out too large


def ooc_jit(
    fun: Callable,
    *,
    budget: int | float | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    check_compiled_peak: bool | None = None,
    **planner_options: Any,
) -> OocJitted:
    """Like ``jax.jit(fun)``, but the compiled step keeps device memory within ``budget``.

    Trace the whole (already differentiated) training step: transfers are inserted into the
    step's jaxpr, never into a function that is differentiated afterwards.

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``.
      budget: device bytes the step may use: an int, a string with units (``"512MiB"``,
        ``"1.5GB"``, ``"12GiB"``), or a fraction of the device's memory (``0.8`` or ``"80%"``)
        where the device reports its size.
      static_argnums, static_argnames, donate_argnums: as for ``jax.jit``. Donate the training
        state so that state kept in host memory stays there across steps without extra copies.
      check_compiled_peak: compile each plan and compare XLA's own peak (``memory_analysis``) with
        the budget; if it is over, plan again for a proportionally smaller budget (at most
        ``MAX_REPLANS`` times). Default: on for GPUs and TPUs, off on CPUs, whose compiled memory
        report does not count temporaries.
      **planner_options: ``window_bytes`` (look-ahead in bytes, default 1.5x the budget) and
        ``min_offload_bytes`` (smaller values never move, default 1 MiB).

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
    if check_compiled_peak is None:
        check_compiled_peak = device.platform != "cpu"
    return OocJitted(
        fun,
        budget_bytes=resolve_budget(budget, device),
        check_compiled_peak=check_compiled_peak,
        static_argnums=_as_tuple(static_argnums),
        static_argnames=_as_tuple(static_argnames),
        donate_argnums=_as_tuple(donate_argnums),
        planner_options=planner_options,
    )


@dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one argument signature needs at call time."""

    plan: Plan
    jitted: Callable  # over flat dynamic arguments, or the user's own signature when nothing moves
    flat_call: bool
    out_tree: Any
    input_kinds: tuple[str, ...]  # memory kind each flat argument must arrive in


class OocJitted:
    """The result of ``ooc_jit``: call it like the jitted step; ``plan`` and ``lower`` inspect it."""

    def __init__(
        self,
        fun,
        *,
        budget_bytes,
        static_argnums,
        static_argnames,
        donate_argnums,
        planner_options,
        check_compiled_peak=False,
    ):
        self.fun = fun
        self.budget_bytes = budget_bytes
        self.check_compiled_peak = check_compiled_peak
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
            return entry.jitted(*args, **kwargs)
        leaves = [_to_memory(x, kind) for x, kind in zip(self._dynamic_leaves(args, kwargs), entry.input_kinds)]
        return jax.tree.unflatten(entry.out_tree, entry.jitted(*leaves))

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``s), without running the step."""
        return self._entry(args, kwargs).plan

    def lower(self, *args: Any, lowering_platforms: Sequence[str] | None = None, **kwargs: Any) -> jax.stages.Lowered:
        """Lowers the rewritten step, e.g. ``lowering_platforms=("cuda",)`` to read the GPU program on a
        CPU-only machine. When anything moves, the lowered program takes the flattened dynamic
        arguments (``jax.tree.leaves`` of the non-static arguments), in order."""
        entry = self._entry(args, kwargs)
        if not entry.flat_call:
            return entry.jitted.trace(*args, **kwargs).lower(lowering_platforms=lowering_platforms)
        specs = [_spec(x, kind) for x, kind in zip(self._dynamic_leaves(args, kwargs), entry.input_kinds)]
        return entry.jitted.trace(*specs).lower(lowering_platforms=lowering_platforms)

    # -- per-signature work -------------------------------------------------------------------

    def _entry(self, args: tuple, kwargs: dict) -> _Compiled:
        key = self._signature(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._build(args, kwargs)
        return self._cache[key]

    def _build(self, args: tuple, kwargs: dict) -> _Compiled:
        traced = jax.jit(self.fun, **self._jit_kwargs).trace(*args, **kwargs)
        labelled = jax.tree_util.tree_flatten_with_path(traced.args_info)[0]
        labels = [self._argument_label(path, args) for path, _ in labelled]
        donated = [info.donated for _, info in labelled]
        flat = flatten(traced.jaxpr)
        program = to_program(flat, input_labels=labels, donated=donated)
        out_tree = jax.tree.structure(traced.out_info)
        planned_for, history = self.budget_bytes, []
        while True:
            try:
                schedule = plan_window(program, planned_for, **self.planner_options)
            except BudgetInfeasibleError as error:
                if not history:
                    raise
                raise OocError(_over_budget_message(self.budget_bytes, history, error.required_bytes)) from error
            if schedule.moves_nothing:
                jitted = jax.jit(self.fun, **self._jit_kwargs)
                lowered_args, input_kinds = (args, kwargs), ("device",) * flat.num_inputs
                rewritten = traced.jaxpr
            else:
                jitted, input_kinds = _compile_rewritten(flat, schedule, donated)
                lowered_args = ([_spec(aval, kind) for aval, kind in zip(flat.avals, input_kinds)], {})
                rewritten = jitted.trace(*lowered_args[0]).jaxpr
            compiled_peak = None
            if self.check_compiled_peak:
                compiled_peak = _compiled_peak_bytes(
                    jitted.trace(*lowered_args[0], **lowered_args[1]).lower().compile()
                )
                history.append((planned_for, compiled_peak))
                if compiled_peak > self.budget_bytes and len(history) <= MAX_REPLANS:
                    # XLA's program came out larger than planned (padding, scratch the estimate
                    # cannot see): plan again for a budget smaller by that factor, with a margin.
                    planned_for = int(planned_for * self.budget_bytes / compiled_peak * 0.98)
                    continue
                if compiled_peak > self.budget_bytes:
                    raise OocError(_over_budget_message(self.budget_bytes, history, None))
            plan = Plan.build(
                program=program,
                schedule=schedule,
                jaxpr=rewritten,
                source_jaxpr=traced.jaxpr,
                budget_bytes=self.budget_bytes,
                compiled_peak_bytes=compiled_peak,
            )
            return _Compiled(plan, jitted, not schedule.moves_nothing, out_tree, input_kinds)

    def _signature(self, args: tuple, kwargs: dict) -> Any:
        statics = tuple(args[i] for i in self.static_argnums if i < len(args))
        statics += tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        leaves, tree = jax.tree.flatten(self._dynamic(args, kwargs))
        return statics, tree, tuple(_abstract(x) for x in leaves)

    def _dynamic(self, args: tuple, kwargs: dict) -> tuple:
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return dynamic_args, {k: v for k, v in kwargs.items() if k not in self.static_argnames}

    def _dynamic_leaves(self, args: tuple, kwargs: dict) -> list:
        return jax.tree.leaves(self._dynamic(args, kwargs))

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


def _compiled_peak_bytes(compiled: jax.stages.Compiled) -> int:
    """XLA's own device-memory peak for a compiled step."""
    stats = compiled.memory_analysis()
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    if peak:
        return int(peak)
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )


def _over_budget_message(budget: int, history: list[tuple[int, int]], smallest: int | None) -> str:
    tries = "; ".join(f"planned for {format_bytes(p)}, compiled to {format_bytes(c)}" for p, c in history)
    limit = "" if smallest is None else f" (the planner cannot go below {format_bytes(smallest)})"
    return (
        f"XLA's compiled step does not fit the budget of {format_bytes(budget)}: {tries}{limit}.\n"
        "XLA adds memory the plan's estimate cannot see (padding, fusion scratch, its own rematerialisation).\n"
        "Fixes:\n  1. raise the budget;\n  2. lower min_offload_bytes so that more values may move;\n"
        "  3. pass check_compiled_peak=False to accept the estimate as the budget's measure."
    )


def _compile_rewritten(flat: FlatProgram, schedule: Schedule, donated: Sequence[bool]) -> tuple[Any, tuple]:
    input_kinds = tuple("pinned_host" if b in schedule.host_inputs else "device" for b in range(flat.num_inputs))
    output_kinds = tuple(
        "pinned_host" if isinstance(r, int) and r in schedule.host_outputs else "device" for r in flat.outputs
    )
    # Every argument and result gets an explicit sharding: left unspecified, an uncommitted first
    # argument and a committed second one would compile the step twice.
    # Donation across memory kinds is not honoured (and aborts the process on jax 0.10.2): donate
    # only arguments that stay on the device.
    donate = tuple(b for b in range(flat.num_inputs) if donated[b] and b not in schedule.host_inputs)
    jitted = jax.jit(
        rewritten_step(flat, schedule),
        in_shardings=tuple(map(_sharding, input_kinds)),
        out_shardings=tuple(map(_sharding, output_kinds)),
        donate_argnums=donate,
    )
    return jitted, input_kinds


def _sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def _to_memory(x: Any, kind: str) -> Any:
    """Moves an argument to the memory the plan expects it in, if it is elsewhere."""
    if getattr(getattr(x, "sharding", None), "memory_kind", None) == kind:
        return x
    return jax.device_put(x, _sharding(kind))


def _spec(x: Any, kind: str) -> jax.ShapeDtypeStruct:
    shape, dtype, weak_type = _abstract(x)
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=_sharding(kind))


def _abstract(x: Any) -> tuple:
    """Shape, dtype and weak type of an array, a Python scalar, an aval or a ``ShapeDtypeStruct``."""
    if not hasattr(x, "weak_type"):
        x = jax.typeof(x)
    return tuple(x.shape), x.dtype, bool(x.weak_type)


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
