"""Segments as JAX functions: each segment's jitted function (``segment_functions``), and the chain
as one function of the step's arguments (``chain_function``).

``schedule.segments`` decides where a planned step is cut and ``schedule.chain`` in what order
its operations run (pure Python); ``transforms.compile`` compiles these functions and
``transforms.execute`` runs the chain. The chain's function is for people to read: its jaxpr
(``chain_jaxpr``, ``Plan.jaxpr``) has the chain's operations as top-level equations, in order:
waits for offloads (``ooc_wait``), prefetches (``device_put`` to device memory), segment calls
(``jit`` equations named ``segment_<i>``) and offloads (``device_put`` to host memory).

Segments receive their constants as arguments, so that two segments of the same shape (repeated
layers) have the same jaxpr and share one compiled program.

On a mesh (a ``transforms.shardings.Layout``), every segment is compiled with each input's and
output's sharding from the layout: compiled programs do not reshard their arguments, so every
segment must receive exactly the layout the previous one produced, and the step's results come out
as ``jax.jit``'s do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from oocjax.schedule.chain import OPERATION_NAMES, Chain, CopyIn, Launch, Wait
from oocjax.schedule.segments import Segment
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation, FlatProgram
from oocjax.transforms.memories import on_device, sharding, spec
from oocjax.transforms.shardings import Layout

Host = jax.memory.Space.Host
Device = jax.memory.Space.Device
# Operands that name a random stream rather than carry data: Flax folds each module's path into its
# key as a literal, which is all that tells one layer's program from the next. Passed as arguments,
# they let layers alike share one program.
LIFTED_LITERALS = frozenset({"random_fold_in"})


def segment_functions(
    flat: FlatProgram, segments: Sequence[Segment], labels: Sequence[str] = (), layout: Layout | None = None
) -> list[Callable]:
    """Per segment, a jitted function of its inputs' device values, then its lifted literals'
    (``segment_literals``), returning its outputs. ``labels`` (per buffer) name recomputed values
    in profiles: ``oocjax.recompute(<value>)``. With a ``layout`` (a mesh), each input and output
    has its buffer's sharding."""
    return [_segment_function(flat, i, segment, labels, layout) for i, segment in enumerate(segments)]


def segment_literals(flat: FlatProgram, segment: Segment) -> tuple[Any, ...]:
    """The literal operands a segment takes as arguments, after its inputs (``LIFTED_LITERALS``)."""
    return tuple(value for _, _, value in lifted_literals(flat.equations[segment.start : segment.stop]))


def lifted_literals(equations: Sequence[FlatEquation]) -> list[tuple[int, int, Any]]:
    """(position, operand, value) of each literal operand passed as an argument."""
    return [
        (position, j, r.val)
        for position, fe in enumerate(equations)
        if fe.eqn.primitive.name in LIFTED_LITERALS
        for j, r in enumerate(fe.inputs)
        if isinstance(r, jc.Literal)
    ]


def _segment_function(
    flat: FlatProgram, index: int, segment: Segment, labels: Sequence[str], layout: Layout | None = None
) -> Callable:
    equations = flat.equations[segment.start : segment.stop]
    barriers = _copy_barriers(equations)
    lifted = [(position, j) for position, j, _ in lifted_literals(equations)]

    def run(*values: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(zip(segment.inputs, values, strict=False))
        literals = dict(zip(lifted, values[len(segment.inputs) :], strict=True))
        fenced: dict[int, Any] = {}  # the current copy group's operands, through its barrier
        for position, fe in enumerate(equations):
            if fe.recompute_of is None:
                fenced = {}
            elif position in barriers:
                operands, anchor = barriers[position]
                through, _ = jax.lax.optimization_barrier(([env[b] for b in operands], [env[b] for b in anchor]))
                fenced = dict(zip(operands, through, strict=True))
            invals = [
                literals.get((position, j), r.val) if isinstance(r, jc.Literal) else fenced.get(r, env[r])
                for j, r in enumerate(fe.inputs)
            ]
            env.update(zip(fe.outputs, _bind(fe, invals, labels), strict=True))
        return tuple(env[b] for b in segment.outputs)

    run.__name__ = run.__qualname__ = f"segment_{index}"
    donated = tuple(i for i, b in enumerate(segment.inputs) if b in segment.donated)
    if layout is None:
        device = sharding("device")
        return jax.jit(run, donate_argnums=donated, in_shardings=device, out_shardings=device, keep_unused=True)
    inputs = (*(layout.shardings[b] for b in segment.inputs), *(layout.replicated for _ in lifted))
    outputs = tuple(layout.shardings[b] for b in segment.outputs)
    return jax.jit(run, donate_argnums=donated, in_shardings=inputs, out_shardings=outputs, keep_unused=True)


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
    flat: FlatProgram, chain: Chain, functions: Sequence[Callable], labels: Sequence[str] = ()
) -> Callable[..., tuple[Any, ...]]:
    """The chain as a function of the step's flat arguments (host inputs in host memory) that
    follows its operations: it waits, prefetches, calls each segment and offloads. Traced, it is
    the jaxpr ``Plan.jaxpr`` shows; the executor runs the same operations.

    Each transfer and wait is named (``oocjax.offload(<value>)``, from ``labels`` per buffer) in the
    equation's name stack, so the chain's jaxpr and profiler traces say what moves, and a
    ``device_put`` the step itself makes (inside a segment) is never taken for one of the plan's."""
    host = chain.host_offset

    def named(what: str, b: int) -> Any:
        label = labels[b] if b < len(labels) else f"buffer {b}"
        return jax.named_scope(f"oocjax.{what}({label.replace('/', '|')})")

    def run(*arguments: Any) -> tuple[Any, ...]:
        slots: list[Any] = [None] * chain.num_slots
        for b, value in flat.constants:
            slots[b] = value
        for slot, value in zip(chain.argument_slots, arguments, strict=True):
            slots[slot] = value
        literals = [on_device(segment_literals(flat, segment)) for segment in chain.segments]
        for op in chain.operations:
            if isinstance(op, Launch):
                results = functions[op.segment](*(slots[b] for b in op.inputs), *literals[op.segment])
                for b, x in zip(op.outputs, results, strict=True):
                    slots[b] = x
                continue
            for b in op.buffers:
                with named(OPERATION_NAMES[type(op)], b):
                    if isinstance(op, Wait):
                        slots[b + host] = jc.wait_p.bind(slots[b + host])
                    elif isinstance(op, CopyIn):
                        slots[b] = jax.device_put(slots[b + host], Device)
                    else:
                        slots[b + host] = jax.device_put(slots[b], Host)
        return tuple(_result(flat, chain, slots))

    return run


def _result(flat: FlatProgram, chain: Chain, slots: Sequence[Any]) -> Iterator[Any]:
    for r, slot in zip(flat.outputs, chain.result_slots, strict=True):
        yield r.val if slot is None else slots[slot]


def chain_jaxpr(chain: Callable, flat: FlatProgram, input_kinds: Sequence[str]) -> jc.ClosedJaxpr:
    """The chain traced over the step's flat argument types."""
    return jax.make_jaxpr(chain)(*(spec(aval, kind) for aval, kind in zip(flat.avals, input_kinds)))
