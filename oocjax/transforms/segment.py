"""A segment on the JAX side: its jitted function, its compiled program, and the chain with what
running it takes.

``schedule.segments`` decides where a planned step is cut and ``schedule.chain`` in what order
its operations run (pure Python); this module turns the segments into programs, and the chain
into an ``ExecutableChain`` (programs, literals, constants, sizes, made once per plan, so that the
executor in ``transforms.execute`` decodes nothing per call) and into a function whose jaxpr
(``chain_jaxpr``) is for people to read: its top-level equations are the chain's operations in
order: waits for offloads (``ooc_wait``), prefetches (``device_put`` to device memory), segment
calls (``jit`` equations named ``segment_<i>``) and offloads (``device_put`` to host memory);
``Plan.jaxpr`` shows it.

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
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from oocjax.schedule.chain import OPERATION_NAMES, Chain, CopyIn, Launch, Operation, Wait
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation, FlatProgram
from oocjax.transforms.memories import sharding, spec
from oocjax.transforms.shardings import Layout, shard_bytes

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
    return tuple(value for _, _, value in _lifted(flat.equations[segment.start : segment.stop]))


def _lifted(equations: Sequence[FlatEquation]) -> list[tuple[int, int, Any]]:
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
    lifted = [(position, j) for position, j, _ in _lifted(equations)]

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
        literals = [_on_device(segment_literals(flat, segment)) for segment in chain.segments]
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


# -- compiled programs --------------------------------------------------------------------------


def segment_specs(flat: FlatProgram, segment: Segment, layout: Layout | None = None) -> list[jax.ShapeDtypeStruct]:
    """The segment's arguments' types, on the device: its inputs', then its lifted literals'
    (with a ``layout``: each with its sharding, the literals replicated)."""
    literals = segment_literals(flat, segment)
    if layout is None:
        return [spec(flat.avals[b], "device") for b in segment.inputs] + [spec(x, "device") for x in literals]
    placed = [(flat.avals[b], layout.shardings[b]) for b in segment.inputs]
    placed += [(jax.typeof(x), layout.replicated) for x in literals]
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s) for a, s in placed]


def segment_key(flat: FlatProgram, segment: Segment) -> tuple:
    """What a segment's function (``segment_functions``) compiles to, read off its equations
    without tracing it: its inputs' types; per equation its primitive, parameters, results' types,
    whether it is a copy (copies run behind a barrier), and its operands (a value by where the
    segment got it, a literal by its value, or by its type where it is passed as an argument);
    which values it returns. Segments with equal keys trace to the same jaxpr. Tracing each
    segment and printing its jaxpr for the key took 1.2 s of the test zoo's 24-layer transformer's
    first call on this project's 2-core CPU, where 7 of 36 segments are distinct programs."""
    equations = flat.equations[segment.start : segment.stop]
    lifted = {(position, j) for position, j, _ in _lifted(equations)}
    local = {b: i for i, b in enumerate(segment.inputs)}

    def operand(position: int, j: int, r: Any) -> Any:
        if not isinstance(r, jc.Literal):
            return local[r]
        return (r.aval,) if (position, j) in lifted else (r.aval, _frozen(r.val))

    body = []
    for position, fe in enumerate(equations):
        eqn = fe.eqn
        body.append(
            (
                eqn.primitive,
                tuple(operand(position, j, r) for j, r in enumerate(fe.inputs)),
                params_key(eqn),
                tuple(v.aval for v in eqn.outvars),
                fe.recompute_of is not None,
            )
        )
        local.update((b, len(local)) for b in fe.outputs)
    inputs = tuple(flat.avals[b] for b in segment.inputs)
    return inputs, tuple(body), tuple(local[b] for b in segment.outputs)


def program_key(jaxpr: jc.Jaxpr) -> tuple:
    """What a jaxpr computes, as a key (for jaxprs nested in parameters): every primitive,
    parameter, literal and type, and how values flow (variables numbered in order of appearance);
    constants not included."""
    numbers: dict = {}

    def atom(v: Any) -> Any:
        if type(v) is jc.Literal:
            return (v.aval, _frozen(v.val))
        return numbers.setdefault(v, len(numbers))

    head = tuple((atom(v), v.aval) for v in jaxpr.invars)
    body = tuple(
        (
            e.primitive,
            tuple(map(atom, e.invars)),
            params_key(e),
            tuple((atom(v), v.aval) for v in e.outvars),
        )
        for e in jaxpr.eqns
    )
    return head, body, tuple(map(atom, jaxpr.outvars))


# Parameters a compiled segment never uses: derivative rules (segments are not differentiated).
# Each equation has its own rule objects, so keyed they would keep alike layers from sharing.
_NOT_COMPILED = {
    "custom_jvp_call": frozenset({"jvp_jaxpr_fun"}),
    "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees"}),
}


def params_key(eqn: jc.JaxprEqn) -> tuple:
    """An equation's parameters as a key, less those no compiled segment uses (``_NOT_COMPILED``)."""
    unused = _NOT_COMPILED.get(eqn.primitive.name, ())
    return tuple((name, _frozen(value)) for name, value in eqn.params.items() if name not in unused)


_AS_IS = frozenset({int, str, type(None)})


def _frozen(value: Any) -> Any:
    """A parameter or literal as a hashable value equal only to equal ones (``-0.0`` is not ``0.0``,
    ``True`` is not ``1``, an array is its bytes); what has no value (a function) is itself."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is tuple or kind is list:
        return (kind, *map(_frozen, value))
    if kind is float or kind is bool:
        return (kind, repr(value))
    if kind is jc.ClosedJaxpr:
        return (kind, program_key(value.jaxpr), tuple(map(id, value.consts)))
    if kind is jc.Jaxpr:
        return (kind, program_key(value))
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        return (np.ndarray, array.dtype.str, array.shape, array.tobytes())
    if isinstance(value, dict):
        return (dict, *((k, _frozen(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return (kind, repr(value))
    return value


def donated_inputs(segment: Segment) -> tuple[bool, ...]:
    """Per input of ``segment``, whether its memory may be reused for the outputs."""
    return tuple(b in segment.donated for b in segment.inputs)


# -- the chain the executor runs ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutableChain:
    """A chain (``schedule.chain.Chain``) with what running it takes on JAX's side, all made once
    per plan so that the executor (``transforms.execute``) decodes nothing per call."""

    chain: Chain
    programs: tuple[Any, ...]  # per segment, its compiled program
    costs: tuple[SegmentCost, ...]  # per segment
    literals: tuple[tuple[Any, ...], ...]  # per segment, device arrays passed after its inputs
    names: tuple[str, ...]  # per operation, for profiles: ``oocjax.offload(<value>, ...)``, ``segment_3``
    constants: tuple[tuple[int, Any], ...]  # (slot, value)
    result_literals: tuple[Any, ...]  # per result of the step: its value where it is a literal
    slot_bytes: tuple[int, ...]  # per slot, the device bytes of its value, per device (0 for host slots)
    shardings: tuple[Any, ...] | None = None  # on a mesh: per buffer, its device sharding


def executable_chain(
    flat: FlatProgram,
    chain: Chain,
    programs: Sequence[Any],
    costs: Sequence[SegmentCost],
    labels: Sequence[str] = (),
    layout: Layout | None = None,
) -> ExecutableChain:
    """The chain with its compiled ``programs`` (per segment). With a ``layout`` (a mesh), sizes
    are per device, and constants and literals are placed on every device."""

    def name(op: Operation) -> str:
        if isinstance(op, Launch):
            return f"segment_{op.segment}"
        values = ", ".join(labels[b] if b < len(labels) else f"buffer {b}" for b in op.buffers)
        return f"oocjax.{OPERATION_NAMES[type(op)]}({values})"

    if layout is None:
        nbytes = [jc.nbytes(aval) for aval in flat.avals]
        constants, place = tuple(flat.constants), _on_device
    else:
        nbytes = [shard_bytes(aval, s) for aval, s in zip(flat.avals, layout.shardings, strict=True)]
        constants = tuple((b, jax.device_put(x, layout.shardings[b])) for b, x in flat.constants)

        def place(values: Sequence[Any]) -> tuple[Any, ...]:
            return tuple(jax.device_put(x, layout.replicated) for x in values)

    return ExecutableChain(
        chain=chain,
        programs=tuple(programs),
        costs=tuple(costs),
        literals=tuple(place(segment_literals(flat, s)) for s in chain.segments),
        names=tuple(map(name, chain.operations)),
        constants=constants,
        result_literals=tuple(r.val if isinstance(r, jc.Literal) else None for r in flat.outputs),
        slot_bytes=(*nbytes, *(0 for _ in nbytes)),
        shardings=None if layout is None else layout.shardings,
    )


def _on_device(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.device_put(x, sharding("device")) for x in values)
