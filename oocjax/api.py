"""``ooc_jit``: a drop-in for ``jax.jit`` that fits a training step in a device-memory budget.

This module is the face; each stage has its own module. Per argument signature (cached, so a
second call with the same shapes neither traces nor plans again):

  arguments (``oocjax.arguments``: statics, signature, labels)
    -> trace (``transforms.trace``; ``transforms.analyse`` sizes and labels every value)
    -> plan -> segment -> compile (``oocjax.pipeline``: ``schedule.plan_window``,
       ``schedule.cut_segments``, ``transforms.segment``, ``transforms.execute``), closed on the budget
    -> execute (``transforms.execute.ChainExecutor``: real transfers and waits).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oocjax.arguments import ArgumentSpec
from oocjax.budget import resolve_budget
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.pipeline import MAX_RUNTIME_REPLANS, PlannerOptions, StepPlanner, agreed_across_processes
from oocjax.plan import Plan
from oocjax.schedule import format_bytes
from oocjax.transforms.execute import segment_specs
from oocjax.transforms.memories import layout, memory_kind, put, sharding
from oocjax.transforms.shardings import array_shard_bytes
from oocjax.transforms.trace import TracedStep, trace_arguments

__all__ = ["MAX_RUNTIME_REPLANS", "OocJitted", "Plan", "ooc_jit", "to_device", "to_host"]

# Warned once per ``ooc_jit`` step called with traced arguments (inside jax.jit, jax.grad, jax.vmap).
NESTED_WARNING = (
    "oocjax: {name} was called inside a jax transformation (jax.jit, jax.grad, jax.vmap, ...): it is traced "
    "inline there, as a nested jax.jit is, and its budget of {budget} does not apply. The budget holds only "
    "where an ooc_jit function is called at the top level, on arrays; an outer jit, grad or vmap decides the "
    "memory of the whole itself. To keep the budget, wrap the whole (differentiated) step in ooc_jit, e.g. "
    "ooc_jit(jax.value_and_grad(loss), budget=...) rather than jax.grad(ooc_jit(loss, budget=...))."
)

# Added to the error of a call that holds on the device leaves an earlier call took in host memory.
STATE_RETURNED_ON_THE_DEVICE = (
    "Why they are on the device: an earlier call of {name} took these {count} leaves ({names}) in host memory, "
    "and this call passes them in device memory. Without donation a step returns its results in device "
    "memory, as jax.jit does: `state, metrics = step(state, batch)` brings a state passed as "
    "oocjax.to_host(state) onto the device, and the next call holds it there for the whole step.\n"
    "Fix: donate the state, ooc_jit(..., {donate}): the leaves the plan keeps in host memory then come back "
    "there, ready for the next call (or pass oocjax.to_host(state) on every call, a copy each time)."
)

# For a plan that keeps state in host memory between steps: how to evaluate that state. ``jax.jit``
# refuses operations on host memory ("memory_space of all inputs passed to 'gather' must be the same").


def ooc_jit(
    fun: Callable | None = None,
    *,
    budget: int | float | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    **planner_options: Any,
) -> OocJitted | Callable[[Callable], OocJitted]:
    """Like ``jax.jit(fun)``, but the step keeps device memory within ``budget``.

    Trace the whole (already differentiated) training step: the step is planned, cut into
    separately compiled segments, and run with transfers to and from host memory between them.
    Without ``fun``, returns a decorator (``@ooc_jit(budget="12GiB")``), as ``functools.partial``
    of ``jax.jit`` would.

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``.
      budget: device bytes the step may use on each device (of its shards, on a mesh): an int,
        a string with units (``"512MiB"``, ``"1.5GB"``, ``"12GiB"``), or a fraction of the
        device's memory (``0.8``, ``"0.8"`` or ``"80%"``) where the device reports its size.
      static_argnums, static_argnames, donate_argnums: as for ``jax.jit``. Donate the training
        state: its device memory is then reused during the step, and state kept in host memory
        comes back there, ready for the next step (evaluate it with an ``ooc_jit`` step, or
        ``to_device`` it first). A successful call deletes every donated array, as ``jax.jit``.
      **planner_options: ``window_bytes`` (look-ahead in bytes, default 1.5x the budget),
        ``min_offload_bytes`` (smaller values never move, default 1 MiB), ``headroom_bytes`` (left
        free within the budget for the device allocator's own overhead: 8% of the budget on GPUs
        at first, grown when a call measures over the budget; 0 on CPUs), as ints or with
        units; ``min_segment_flops`` (smaller segments are merged where memory allows; default
        about a millisecond of work on the device) and ``min_segments`` (cut into at least this
        many segments even when nothing moves; for measuring the executor's overhead);
        ``host_budget`` (host bytes the plan may use; default what the machine has available);
        ``recompute``: ``"auto"`` (default: keep, move or recompute each value, whichever the
        device's measured rates say is faster), ``"off"`` (move only: the adaptive window
        planner alone), ``"always"`` (take the recomputing plan whenever it finds values to
        recompute), or a function ``(operation_name, value_label) -> True | False | None`` that
        forces (True) or forbids (False) recomputing a value and leaves the rest (None) to the
        costs, e.g. ``lambda name, label: True if name == "lt" else None`` for dropout masks.

    Returns:
      A callable with ``plan(...)`` and ``lower(...)`` methods. Called inside ``jax.jit``,
      ``jax.grad`` or ``jax.vmap`` (with traced arguments), it is traced inline as a nested
      ``jax.jit`` is and its budget does not apply (a warning says so, once): wrap the whole
      differentiated step in ``ooc_jit`` to keep the budget.

    >>> import jax.numpy as jnp
    >>> step = ooc_jit(lambda x: (x * 2).sum(), budget="1GiB")
    >>> float(step(jnp.ones(4)))
    8.0
    """
    device = jax.local_devices()[0]  # in a multi-process run, jax.devices()[0] may be another process's
    budget_bytes = resolve_budget(budget, device)
    options = PlannerOptions.read(planner_options, device.platform, budget_bytes)
    budget_bytes, options = agreed_across_processes(budget_bytes, options)
    settings = dict(budget_bytes=budget_bytes, options=options)
    statics = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums)
    if fun is None:
        return lambda fun: OocJitted(ArgumentSpec.of(fun, **statics), **settings)
    if not callable(fun):
        raise TypeError(f"ooc_jit expects a function to wrap (or none, as a decorator factory); got {fun!r}")
    return OocJitted(ArgumentSpec.of(fun, **statics), **settings)


class OocJitted:
    """The result of ``ooc_jit``: call it like the jitted step; ``plan`` and ``lower`` inspect it."""

    def __init__(self, arguments: ArgumentSpec, *, budget_bytes: int, options: PlannerOptions):
        self.arguments = arguments
        self.fun = arguments.fun
        self.budget_bytes = budget_bytes
        self.options = options
        self._traces: dict[Any, TracedStep] = {}  # per signature
        self._planners: dict[Any, StepPlanner] = {}  # per signature and arguments held by the caller
        # One call at a time per step: a plan holds the budget for one call, and what one call
        # leaves in flight is counted by the next; two calls at once would each take the budget.
        # Different steps have their own locks, and their budgets do not add up.
        self._lock = threading.RLock()
        self._jitted = jax.jit(self.fun, **arguments.jit_kwargs)
        self._warned_nested = False  # called inside jax.jit / grad / vmap: said once per step
        functools.update_wrapper(self, self.fun, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self.arguments.dynamic_leaves(args, kwargs)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._inline(args, kwargs)
        with self._lock:
            return self._call(args, kwargs, leaves)

    def _inline(self, args: tuple, kwargs: dict) -> Any:
        """Called inside ``jax.jit``, ``jax.grad``, ``jax.vmap`` (traced arguments): traced inline as a
        nested ``jax.jit`` is, at every budget; the outer transformation decides the memory."""
        with self._lock:
            warn, self._warned_nested = not self._warned_nested, True
        if warn:
            message = NESTED_WARNING.format(name=_name(self.fun), budget=format_bytes(self.budget_bytes))
            warnings.warn(message, stacklevel=_user_stacklevel())
        return self._jitted(*args, **kwargs)

    def _call(self, args: tuple, kwargs: dict, leaves: list) -> Any:
        traced, planner = self._entry(args, kwargs, leaves)
        built = planner.built
        # As jax.jit does, a successful call deletes every donated argument, except one the step
        # returns as it is; until then, a failed or interrupted call leaves those not yet consumed intact.
        donated = [x for x, gave in zip(leaves, traced.donated) if gave]
        if built.executor is None:
            if any(_on_host(x) for x in leaves):
                # jax.jit refuses arithmetic on host memory: host-kept state goes to the device first.
                args, kwargs = self.arguments.map_dynamic(_device_if_on_host, args, kwargs)
            del leaves
            results = self._jitted(*args, **kwargs)
            _delete_unreturned(donated, jax.tree.leaves(results))
            return results
        if traced.layout is None:
            moved = [_to_memory(x, kind) for x, kind in zip(leaves, built.input_kinds)]
        else:  # compiled segments do not reshard: every argument goes exactly where they expect it
            targets = traced.layout.shardings
            moved = [_to_memory(x, kind, target) for x, kind, target in zip(leaves, built.input_kinds, targets)]
        copies = [leaf is not original for original, leaf in zip(leaves, moved)]
        deleted = _delete_donated_originals(leaves, copies, traced.donated)
        del leaves
        # The executor takes the list over and empties it, and deletes the copies made here at
        # their last use: nothing else may hold their device memory.
        try:
            results = built.executor(moved, copies)
        except BaseException as error:
            consumed = sorted({*deleted, *built.executor.consumed_arguments})
            if consumed:
                error.add_note(_consumed_note(traced, consumed))
            raise
        warning = planner.after_call(built.executor.measured_peak_bytes)
        if warning:
            warnings.warn(f"oocjax: a call of {_name(self.fun)} {warning}", stacklevel=3)
        _delete_unreturned(donated, results)
        return jax.tree.unflatten(traced.out_tree, results)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``s), without running the step.
        Its segments are compiled (once per signature, as a call would): their memory is measured."""
        with self._lock:
            return self._entry(args, kwargs)[1].built.plan

    def lower(
        self, *args: Any, lowering_platforms: Sequence[str] | None = None, **kwargs: Any
    ) -> jax.stages.Lowered | tuple[jax.stages.Lowered, ...]:
        """Lowers the step, e.g. ``lowering_platforms=("cuda",)`` to read the GPU program on a
        CPU-only machine: ``jax.jit``'s one program when nothing moves, else one lowered program
        per segment, in execution order (transfers run between them)."""
        with self._lock:
            built = self._entry(args, kwargs)[1].built
        if built.executor is None:
            specs = self.arguments.device_specs(args, kwargs)
            return self._jitted.trace(*specs[0], **specs[1]).lower(lowering_platforms=lowering_platforms)
        # Types alone: each segment function places its arguments itself (on a mesh, in its layout).
        return tuple(
            function.trace(*(_unplaced(s) for s in specs)).lower(lowering_platforms=lowering_platforms)
            for function, specs in zip(built.segment_functions, segment_specs(built.plan.jaxpr))
        )

    def _entry(self, args: tuple, kwargs: dict, leaves: list | None = None) -> tuple[TracedStep, StepPlanner]:
        """The call's trace and its planner (made on first use), per signature and which arguments
        the caller holds on the device; ``leaves`` are the arguments' dynamic leaves, if the caller
        has flattened them already."""
        with self._lock:
            signature = self.arguments.signature(args, kwargs)
            if signature not in self._traces:
                self._traces[signature] = trace_arguments(self.arguments, args, kwargs)
            traced = self._traces[signature]
            if leaves is None:
                leaves = self.arguments.dynamic_leaves(args, kwargs)
            held = tuple(not gave and not _on_host(x) for x, gave in zip(leaves, traced.donated))
            key = signature, held
            if key not in self._planners:
                on_host = sum(_nbytes(x) for x in leaves if _on_host(x))
                try:
                    planner = StepPlanner(
                        traced, self.budget_bytes, self.options, held_by_caller=held, host_bytes_in_use=on_host
                    )
                except OocError as error:
                    self._refuse_state_returned_on_the_device(error, signature, held, args, kwargs)
                    raise
                self._planners[key] = planner
            return traced, self._planners[key]

    def _refuse_state_returned_on_the_device(
        self, error: OocError, signature: Any, held: tuple[bool, ...], args: tuple, kwargs: dict
    ) -> None:
        """When no plan fits with arguments the caller holds on the device, and an earlier call took
        those same leaves in host memory, they are most likely that call's results (``state =
        step(state, batch)`` without donation, after ``to_host(state)``): say so, and to donate them."""
        earlier = [h for (s, h) in self._planners if s == signature]
        moved = [i for i, now in enumerate(held) if now and any(not h[i] for h in earlier)]
        if not moved:
            return
        paths = [path for path, _ in jax.tree.flatten_with_path(self.arguments.dynamic(args, kwargs))[0]]
        positions = sorted({self.arguments.position(paths[i], len(args)) for i in moved}, key=str)
        names = ", ".join(dict.fromkeys(self.arguments.label(paths[i][:2], len(args)) for i in moved))
        donate = ", ".join(str(p) for p in positions if p is not None)
        message = STATE_RETURNED_ON_THE_DEVICE.format(
            name=_name(self.fun),
            count=len(moved),
            names=names,
            donate=f"donate_argnums=({donate},)" if donate else "donate_argnums (pass it positionally)",
        )
        if isinstance(error, BudgetInfeasibleError):
            raise error.with_message(f"{error}\n{message}") from None
        error.add_note(message)


def _unplaced(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype, weak_type=spec.weak_type)


def _name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or repr(fun)


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(jax.__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller at the first frame outside
    oocjax and jax: the user's line that called the transformation, not jax's internals."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _delete_donated_originals(leaves: Sequence[Any], copies: Sequence[bool], donated: Sequence[bool]) -> list[int]:
    """As ``jax.jit`` does with a donated argument: a donated array that was copied to the memory
    the plan wants it in is deleted (the copy has its own buffer). Returns their positions."""
    deleted = []
    for i, (original, copied, gave) in enumerate(zip(leaves, copies, donated)):
        if copied and gave and isinstance(original, jax.Array):
            original.delete()
            deleted.append(i)
    return deleted


def _delete_unreturned(donated: Sequence[Any], results: Sequence[Any]) -> None:
    """After a successful call, every donated argument is deleted, as ``jax.jit`` deletes donated
    arguments, whether a segment consumed it, the call copied it or neither (then old and new state
    would otherwise both stay alive, in device or host memory). One that the step returns as it is stays."""
    returned = {id(x) for x in results}
    for x in donated:
        if id(x) not in returned and isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def _consumed_note(traced: TracedStep, consumed: Sequence[int]) -> str:
    names = [traced.program.buffers[i].label.removeprefix("argument ") for i in consumed]
    shown = ", ".join(names)  # every one: the caller must know exactly which leaves to rebuild
    return (
        f"oocjax: the failed call had already consumed {len(names)} donated argument(s) kept in device memory; "
        f"their buffers are gone: {shown}. Donated arguments kept in host memory are intact."
    )


def _on_host(x: Any) -> bool:
    return memory_kind(x) == "pinned_host"


def _nbytes(x: Any) -> int:
    """The bytes this process holds of ``x``: on a mesh, a shard on each of its own devices."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        return array_shard_bytes(x) * len(x.sharding.addressable_devices)
    return int(getattr(x, "nbytes", 0))


def to_host(tree: Any) -> Any:
    """``tree`` with every array leaf moved to host memory (``pinned_host``): state an ``ooc_jit``
    step may stream in, and that the device does not hold between steps.

    >>> import jax.numpy as jnp
    >>> to_host({"w": jnp.ones(2)})["w"].sharding.memory_kind
    'pinned_host'
    """
    return jax.tree.map(lambda x: _to_memory(x, "pinned_host") if isinstance(x, jax.Array) else x, tree)


def to_device(tree: Any) -> Any:
    """``tree`` with every leaf kept in host memory (state an ``ooc_jit`` plan keeps there) moved to
    device memory, e.g. to evaluate the trained parameters with ``jax.jit``, which refuses to compute
    on host memory.

    Raises ``OocError`` when the device reports less free memory than those leaves need: evaluate
    them where they are then, with an ``ooc_jit`` step under the training budget.

    >>> import jax.numpy as jnp
    >>> to_device({"w": jnp.ones(2)})["w"].sharding.memory_kind
    'device'
    """
    on_host = [x for x in jax.tree.leaves(tree) if memory_kind(x) == "pinned_host"]
    needed = sum(array_shard_bytes(x) for x in on_host)  # on each device: its shards
    free = _free_device_bytes()
    if free is not None and needed > free:
        raise OocError(
            f"to_device: the {len(on_host)} leaves kept in host memory need {format_bytes(needed)} on the device, "
            f"which has {format_bytes(free)} free.\n"
            "Fixes:\n"
            "  1. evaluate them where they are, with an ooc_jit step under the training budget (it streams them "
            "in): ooc_jit(eval_step, budget=...)(state, batch), without donating the state;\n"
            "  2. move only what you need, e.g. to_device(state['params']) without the optimizer state;\n"
            "  3. free device memory first (delete arrays you no longer need)."
        )
    return jax.tree.map(_device_if_on_host, tree)


def _free_device_bytes() -> int | None:
    """What the device's allocator has left; None where the device does not say (a CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _device_if_on_host(x: Any) -> Any:
    """``x`` in device memory, in its own layout (never gathered onto one device)."""
    return put([x], x.sharding.with_memory_kind("device"))[0] if memory_kind(x) == "pinned_host" else x


def _to_memory(x: Any, kind: str, target: Any = None) -> Any:
    """Moves an argument to the memory the plan expects it in, if it is elsewhere; with a
    ``target`` sharding (a step on a mesh), also to that layout, if it is in another."""
    if target is None:
        if memory_kind(x) == kind:
            return x
        placed = layout(x)
        return put([x], sharding(kind) if placed is None else placed.with_memory_kind(kind))[0]
    target, current = target.with_memory_kind(kind), getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and current.is_equivalent_to(target, x.ndim):
        return x
    if isinstance(x, jax.Array) and len(current.device_set) == 1 < len(target.device_set):
        # A replicated copy of a one-device array keeps the original's buffer as one of its shards,
        # even with may_alias=False (jax 0.10.2): deleting a donated original would delete that shard.
        x = x.copy()
    return put([x], target)[0]
