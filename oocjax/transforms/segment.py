"""From segments back to JAX: one jitted function per segment, and the chain as a jaxpr people read.

The chain's jaxpr is the step as it runs: its top-level equations are, in execution order, the
waits for offloads (``ooc_wait``), the prefetches (``device_put`` to device memory), the segment
calls (``jit`` equations named ``segment_<i>``, each holding its part of the step), and the
offloads (``device_put`` to host memory). ``transforms.execute`` runs it; ``Plan.jaxpr`` shows it.

Segments receive their constants as arguments, so that two segments of the same shape (repeated
layers) have the same jaxpr and can share one compiled program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oocjax.schedule import Schedule
from oocjax.schedule.segments import Segment
from oocjax.transforms import _compat as jc
from oocjax.transforms.analyse import FlatEquation, FlatProgram
from oocjax.transforms.memories import sharding, spec

Host = jax.memory.Space.Host
Device = jax.memory.Space.Device


def segment_functions(flat: FlatProgram, segments: Sequence[Segment], labels: Sequence[str] = ()) -> list[Callable]:
    """Per segment, a jitted function of its inputs' device values returning its outputs.
    ``labels`` (per buffer) name recomputed values in profiles: ``oocjax.recompute(<value>)``."""
    return [_segment_function(flat, i, segment, labels) for i, segment in enumerate(segments)]


def _segment_function(flat: FlatProgram, index: int, segment: Segment, labels: Sequence[str]) -> Callable:
    equations = flat.equations[segment.start : segment.stop]
    barriers = _copy_barriers(equations)

    def run(*values: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(zip(segment.inputs, values, strict=True))
        fenced: dict[int, Any] = {}  # the current copy group's operands, through its barrier
        for position, fe in enumerate(equations):
            if fe.recompute_of is None:
                fenced = {}
            elif position in barriers:
                operands, anchor = barriers[position]
                through, _ = jax.lax.optimization_barrier(([env[b] for b in operands], [env[b] for b in anchor]))
                fenced = dict(zip(operands, through, strict=True))
            invals = [r.val if isinstance(r, jc.Literal) else fenced.get(r, env[r]) for r in fe.inputs]
            env.update(zip(fe.outputs, _bind(fe, invals, labels), strict=True))
        return tuple(env[b] for b in segment.outputs)

    run.__name__ = run.__qualname__ = f"segment_{index}"
    donated = tuple(i for i, b in enumerate(segment.inputs) if b in segment.donated)
    device = sharding("device")
    return jax.jit(run, donate_argnums=donated, in_shardings=device, out_shardings=device, keep_unused=True)


def _bind(fe: FlatEquation, invals: list[Any], labels: Sequence[str]) -> list[Any]:
    """The equation on values, under its user source line; a copy also under
    ``oocjax.recompute(<value>)``, so that profiles and the compiled program's metadata tell it
    from its original and say what it computes again."""
    scope = contextlib.nullcontext()
    if fe.recompute_of is not None:
        b = fe.outputs[0] if fe.outputs else None
        value = labels[b].removeprefix("recompute of ") if b is not None and b < len(labels) else ""
        scope = jax.named_scope(f"oocjax.recompute({value.replace('/', '|')})" if value else "oocjax.recompute")
    with jc.equation_context(fe.eqn), scope:
        try:
            return jc.bind_equation(fe.eqn, invals)
        except FloatingPointError as error:  # jax_debug_nans / _infs, run one equation at a time
            where = jc.source_line(fe.eqn)
            error.add_note(f"oocjax: in {fe.eqn.primitive.name}" + (f" at {where}" if where else ""))
            raise


def _copy_barriers(equations: Sequence[FlatEquation]) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per copy group (a run of recomputed equations, ``FlatEquation.recompute_of``), at its first
    position: the operands it reads from outside the group, and the first result of the equation
    before it (an anchor; none at the segment's start).

    Both pass through one ``optimization_barrier`` before the group runs, and the group reads the
    barrier's results. Without it XLA's common-subexpression elimination sees the copy compute what
    its original computed, and keeps the original's result alive instead: the recomputation and
    the memory it saves are gone. The anchor keeps XLA from hoisting the copies above the step
    the planner put them after (its result is not used otherwise).
    """
    barriers: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    start = None
    for position, fe in enumerate((*equations, None)):
        if fe is not None and fe.recompute_of is not None:
            start = position if start is None else start
            continue
        if start is not None:
            group = equations[start:position]
            written = {o for g in group for o in g.outputs}
            operands = dict.fromkeys(r for g in group for r in g.inputs if isinstance(r, int) and r not in written)
            anchor = equations[start - 1].outputs[:1] if start > 0 else ()
            barriers[start] = (tuple(operands), anchor)
        start = None
    return barriers


def chain_function(
    flat: FlatProgram,
    schedule: Schedule,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    labels: Sequence[str] = (),
) -> Callable[..., tuple[Any, ...]]:
    """The step as a chain: a function of the flat arguments (host inputs in host memory) that
    waits, prefetches, calls each segment and offloads, as planned. Trace it to read the chain;
    ``transforms.execute`` runs that trace.

    Each transfer and wait is named (``oocjax.offload(<value>)``, from ``labels`` per buffer) in the
    equation's name stack, so the chain's jaxpr and profiler traces say what moves, and a
    ``device_put`` the step itself makes (inside a segment) is never taken for one of the plan's."""

    def named(what: str, b: int) -> Any:
        label = labels[b] if b < len(labels) else f"buffer {b}"
        return jax.named_scope(f"oocjax.{what}({label.replace('/', '|')})")

    def run(*arguments: Any) -> tuple[Any, ...]:
        device: dict[int, Any] = dict(flat.constants)
        host: dict[int, Any] = {}
        for b, value in enumerate(arguments):
            (host if b in schedule.host_inputs else device)[b] = value
        for segment, function in zip(segments, functions, strict=True):
            for b in segment.waits:
                with named("wait", b):
                    host[b] = jc.wait_p.bind(host[b])
            for b in segment.prefetches:
                with named("prefetch", b):
                    device[b] = jax.device_put(host[b], Device)
            results = function(*(device[b] for b in segment.inputs))
            device.update(zip(segment.outputs, results, strict=True))
            for b in segment.offloads:
                with named("offload", b):
                    host[b] = jax.device_put(device[b], Host)
        return tuple(
            r.val if isinstance(r, jc.Literal) else host[r] if r in schedule.host_outputs else device[r]
            for r in flat.outputs
        )

    return run


def chain_jaxpr(chain: Callable, flat: FlatProgram, input_kinds: Sequence[str]) -> jc.ClosedJaxpr:
    """The chain traced over the step's flat argument types."""
    return jax.make_jaxpr(chain)(*(spec(aval, kind) for aval, kind in zip(flat.avals, input_kinds)))
