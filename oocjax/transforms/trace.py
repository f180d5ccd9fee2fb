"""Stage 1, trace: the step as ``jax.jit`` traces it, flattened and turned into the planner's program.

Arguments are traced as abstract device values (``ArgumentSpec.device_specs``), so state kept in
host memory traces exactly as state on the device does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.arguments import ArgumentSpec
from oocjax.schedule import Program
from oocjax.schedule.gc_paused import gc_paused
from oocjax.transforms import compat as jc
from oocjax.transforms.analyse import to_program
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.flatten import flatten
from oocjax.transforms.reorder import reorder_tail
from oocjax.transforms.shardings import Layout, check_one_mesh, is_sharded, per_device_sizes, step_layout


@dataclass(frozen=True, slots=True)
class TracedStep:
    """One signature of a step, traced.

    Attributes:
      jaxpr: the step as ``jax.jit`` traced it.
      flat: the same with nested ``jit`` calls inlined and every value numbered.
      program: the planner's model of it (sizes, lifetimes, labels, flops).
      out_tree: the structure of its results.
      donated: per flat argument, whether it is donated.
      layout: on a mesh, every flat buffer's sharding (``program`` then sizes buffers per device);
        None on one device.
    """

    jaxpr: jc.ClosedJaxpr
    flat: FlatProgram
    program: Program
    out_tree: Any
    donated: tuple[bool, ...]
    layout: Layout | None = None


def trace_step(
    fun: Callable,
    *args: Any,
    static_argnums: Any = (),
    static_argnames: Any = (),
    donate_argnums: Any = (),
    **kwargs: Any,
) -> TracedStep:
    """Traces ``fun(*args, **kwargs)`` (arrays or ``jax.ShapeDtypeStruct``s) as ``ooc_jit`` does.

    >>> import jax.numpy as jnp
    >>> len(trace_step(lambda x: jnp.sin(x) * 2, jnp.ones(3)).program.steps)
    2
    """
    spec = ArgumentSpec.of(fun, static_argnums, static_argnames, donate_argnums)
    return trace_arguments(spec, args, kwargs)


@gc_paused()  # tracing and analysing make many small objects, few in cycles
def trace_arguments(
    spec: ArgumentSpec, args: tuple, kwargs: dict, *, reorder: bool = True, max_unrolled: int | None = None
) -> TracedStep:
    """``trace_step`` for arguments already split by an ``ArgumentSpec``; where ``reorder``, the
    optimizer's updates after their gradients where the state is donated, else grouped by layer
    (``transforms.reorder``). ``max_unrolled``: ``flatten``'s, for the scans it unrolls."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(spec.dynamic(args, kwargs))[0]
    arguments = [x for _, x in paths_leaves]
    check_one_mesh(arguments, [spec.label(path, len(args)) for path, _ in paths_leaves])
    spec_args, spec_kwargs = spec.device_specs(args, kwargs)
    traced = jax.jit(spec.fun, **spec.jit_kwargs).trace(*spec_args, **spec_kwargs)
    leaves = jax.tree_util.tree_flatten_with_path(traced.args_info)[0]
    labels = [spec.label(path, len(args)) for path, _ in leaves]
    donated = tuple(info.donated for _, info in leaves)
    results = jax.tree_util.tree_flatten_with_path(traced.out_info)[0]
    output_labels = [f"result{jax.tree_util.keystr(path)}" for path, _ in results]
    flat = flatten(traced.jaxpr, max_unrolled=max_unrolled)
    flat = reorder_tail(flat, donated) if reorder else flat
    program = to_program(flat, input_labels=labels, donated=donated, output_labels=output_labels)
    layout = step_layout(flat, arguments) if is_sharded(arguments, flat) else None
    if layout is not None:
        program = per_device_sizes(program, flat, layout)  # the budget is per device
    return TracedStep(traced.jaxpr, flat, program, jax.tree.structure(traced.out_info), donated, layout)
