"""``ooc_jit``: a drop-in for ``jax.jit`` that fits a training step in a device-memory budget.

This module is the face; each stage has its own module. Per argument signature (cached: a second
call with the same shapes neither traces nor plans again): trace (``transforms.trace``) -> plan,
segment, compile, closed on the budget (``oocjax.pipeline``) -> execute (``transforms.execute``).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oocjax.arguments import ArgumentSpec
from oocjax.donation import consumed_note, delete_donated_originals, delete_unreturned
from oocjax.errors import OocError
from oocjax.nested import warn_nested
from oocjax.options import PlannerOptions, read_settings
from oocjax.pipeline import MAX_RUNTIME_REPLANS, Seams, StepPlanner
from oocjax.placement import device_if_on_host, on_host, place_arguments, process_bytes, to_device, to_host
from oocjax.plan import Plan
from oocjax.refusals import state_returned_on_the_device
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.timings import Timings
from oocjax.transforms.compile import segment_specs
from oocjax.transforms.trace import TracedStep

__all__ = ["MAX_RUNTIME_REPLANS", "OocJitted", "Plan", "ooc_jit", "to_device", "to_host"]


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
        ``host_budget`` (host bytes the plan may use, within XLA's pinned pool on GPUs; default: all available);
        ``rates`` (the device rates plans are chosen with: a profile name such as ``"h200"`` or
        a ``DeviceProfile``; default: the device kind's published ones);
        ``recompute``: ``"auto"`` (default: keep, move or recompute each value, whichever the
        rates say is faster), ``"off"`` (move only: the adaptive window
        planner alone), ``"always"`` (take the recomputing plan whenever it finds values to
        recompute), or a function ``(operation_name, value_label) -> True | False | None`` that
        forces (True) or forbids (False) recomputing a value and leaves the rest (None) to the
        costs, e.g. ``lambda name, label: True if name == "lt" else None`` for dropout masks.

    Returns:
      A callable with ``plan(...)`` and ``lower(...)`` methods. Called inside ``jax.jit``, ``grad``
      or ``vmap`` (traced arguments), it is traced inline as a nested ``jax.jit`` is, its budget
      not applied (a warning says so once): wrap the whole differentiated step to keep the budget.

    >>> import jax.numpy as jnp
    >>> step = ooc_jit(lambda x: (x * 2).sum(), budget="1GiB")
    >>> float(step(jnp.ones(4)))
    8.0
    """
    budget_bytes, options = read_settings(budget, planner_options)
    settings = dict(budget_bytes=budget_bytes, options=options)
    statics = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums)
    if fun is None:
        return lambda fun: OocJitted(ArgumentSpec.of(fun, **statics), **settings)
    if not callable(fun):
        raise TypeError(f"ooc_jit expects a function to wrap (or none, as a decorator factory); got {fun!r}")
    return OocJitted(ArgumentSpec.of(fun, **statics), **settings)


class OocJitted:
    """The result of ``ooc_jit``: call it like the jitted step; ``plan`` and ``lower`` inspect it."""

    def __init__(self, arguments: ArgumentSpec, *, budget_bytes: int, options: PlannerOptions, seams: Seams = None):
        self.arguments, self.seams = arguments, seams or Seams()  # seams: the planner's stages, for tests to replace
        self.fun = arguments.fun
        self.budget_bytes = budget_bytes
        self.options = options
        self._traces: dict[Any, TracedStep] = {}  # per signature
        self._planners: dict[Any, StepPlanner] = {}  # per signature, arguments held by the caller, profile
        self._calls: dict[Any, tuple[TracedStep, StepPlanner]] = {}  # per ``ArgumentSpec.call_key``
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
        """Under ``jax.jit``, ``grad`` or ``vmap``: traced inline as a nested ``jax.jit`` is."""
        with self._lock:
            warn, self._warned_nested = not self._warned_nested, True
        if warn:
            warn_nested(_step_name(self.fun), self.budget_bytes)
        return self._jitted(*args, **kwargs)

    def _call(self, args: tuple, kwargs: dict, leaves: list) -> Any:
        key = self.arguments.call_key(args, kwargs, leaves)  # None where a leaf is not an array
        if (found := self._calls.get(key)) is None:
            found = self._entry(args, kwargs, leaves)
            if key is not None:
                self._calls[key] = found
        traced, planner = found
        built = planner.built
        # As jax.jit does, a successful call deletes every donated argument, except one the step
        # returns as it is; until then, a failed or interrupted call leaves those not yet consumed intact.
        donated = [x for x, gave in zip(leaves, traced.donated) if gave]
        if built.executor is None:
            if any(on_host(x) for x in leaves):
                # jax.jit refuses arithmetic on host memory: host-kept state goes to the device first.
                args, kwargs = self.arguments.map_dynamic(device_if_on_host, args, kwargs)
            del leaves
            results = self._jitted(*args, **kwargs)
            delete_unreturned(donated, jax.tree.leaves(results))
            return results
        moved = place_arguments(leaves, built.input_kinds, traced.layout)
        copies = [leaf is not original for original, leaf in zip(leaves, moved)]
        deleted = delete_donated_originals(leaves, copies, traced.donated)
        del leaves

        # The executor takes the list over, deleting the copies made here at their last use.
        def consumed(by_launches: list[int]) -> str | None:
            return consumed_note(traced, sorted({*deleted, *by_launches})) if deleted or by_launches else None

        run = built.executor(moved, copies, on_failure=consumed)
        if warning := planner.after_call(run.measured_peak_bytes):
            warnings.warn(f"oocjax: a call of {_step_name(self.fun)} {warning}", stacklevel=3)
        results = run.results
        delete_unreturned(donated, results)
        return jax.tree.unflatten(traced.out_tree, results)

    def plan(self, *args: Any, profile: DeviceProfile | str | None = None, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``s), without running the step.
        Its segments are compiled (once per signature, as a call would): their memory is measured.
        With ``profile`` (a name in ``oocjax.schedule.PROFILES`` such as ``"h200"``, or a
        ``DeviceProfile``) it is planned for that device from any machine, with the profile's rates
        and its platform's defaults, each segment's memory estimated: nothing is compiled or
        allocated (``plan.compiled`` is False). A step's own ``profile`` keyword goes positionally."""
        profile = None if profile is None else resolve_profile(profile)
        return self._entry(args, kwargs, profile=profile)[1].built.plan

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
            function.trace(*map(_unplaced, segment_specs(built.flat, segment, built.layout))).lower(
                lowering_platforms=lowering_platforms
            )
            for function, segment in zip(built.segment_functions, built.plan.segments)
        )

    def _entry(self, args: tuple, kwargs: dict, leaves=None, profile=None) -> tuple[TracedStep, StepPlanner]:
        """The call's trace and its planner (made on first use, each stage timed), per signature,
        arguments the caller holds on the device and profile planned for (None: this device)."""
        with self._lock:
            timings = Timings()
            signature = self.arguments.signature(args, kwargs)
            if signature not in self._traces:
                self._traces[signature] = self.seams.trace(self.arguments, args, kwargs)
                timings.done("trace")
            traced = self._traces[signature]
            if leaves is None:
                leaves = self.arguments.dynamic_leaves(args, kwargs)
            held = tuple(not gave and not on_host(x) for x, gave in zip(leaves, traced.donated))
            key = signature, held, profile
            if key not in self._planners:
                in_use = sum(process_bytes(x) for x in leaves if on_host(x))
                settings = dict(held_by_caller=held, host_bytes_in_use=in_use, profile=profile, timings=timings)
                try:
                    planner = StepPlanner(traced, self.budget_bytes, self.options, **settings, seams=self.seams)
                except OocError as error:  # says so where the held leaves came back from an earlier call
                    earlier = [h for (s, h, p) in self._planners if s == signature and p == profile]
                    state_returned_on_the_device(
                        error, _step_name(self.fun), self.arguments, earlier, held, (args, kwargs)
                    )
                    raise
                self._planners[key] = planner
            return traced, self._planners[key]


def _unplaced(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype, weak_type=spec.weak_type)


def _step_name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or repr(fun)
