"""A segment on the JAX side: its jitted function, its compiled program, and the chain of records
the executor runs.

``schedule.segments`` decides where a planned step is cut (pure Python); this module turns those
segments into programs and into the chain: one ``SegmentRun`` record per segment, built once per
plan, holding everything a launch needs (the program, the argument slots, the transfers and waits
around it, the slots it lets go of), so that the executor (``transforms.execute``) does no
decoding per call. The chain's jaxpr (``chain_jaxpr``) is for people to read: its top-level
equations are, in execution order, the waits for offloads (``ooc_wait``), the prefetches
(``device_put`` to device memory), the segment calls (``jit`` equations named ``segment_<i>``)
and the offloads (``device_put`` to host memory); ``Plan.jaxpr`` shows it.

Segments receive their constants as arguments, so that two segments of the same shape (repeated
layers) have the same jaxpr and share one compiled program.

On a mesh (a ``transforms.shardings.Layout``), every segment is compiled with each input's and
output's sharding from the layout: compiled programs do not reshard their arguments, so every
segment must receive exactly the layout the previous one produced, and the step's results come out
as ``jax.jit``'s do.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from oocjax.schedule import Schedule
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.transforms import _compat as jc
from oocjax.transforms.analyse import FlatEquation, FlatProgram
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
        literals = [_on_device(segment_literals(flat, segment)) for segment in segments]
        for segment, function, lifted in zip(segments, functions, literals, strict=True):
            for b in segment.waits:
                with named("wait", b):
                    host[b] = jc.wait_p.bind(host[b])
            for b in segment.prefetches:
                with named("prefetch", b):
                    device[b] = jax.device_put(host[b], Device)
            results = function(*(device[b] for b in segment.inputs), *lifted)
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


def compile_segments(
    flat: FlatProgram,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    cache: dict | None = None,
    layout: Layout | None = None,
) -> tuple[list[Any], list[SegmentCost]]:
    """One compiled program per segment; segments with the same equations (``segment_key``),
    donation and (on a mesh, ``layout``) input and output shardings share one, also
    with the programs in ``cache`` (from an earlier plan of the same step), which gains the new
    ones. Only a new program's segment is traced. Distinct programs compile in parallel threads,
    each as soon as it is lowered (XLA releases the GIL while it compiles); random bits are
    lowered unrolled (``jc.unrolled_threefry``)."""
    cache = {} if cache is None else cache
    keys, compiling = [], {}
    with warnings.catch_warnings(), ThreadPoolExecutor() as pool, jc.unrolled_threefry():
        # A donated argument no output can reuse is still freed after the segment: not worth a warning.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for segment, function in zip(segments, functions, strict=True):
            key = (segment_key(flat, segment), _donated(segment))
            if layout is not None:  # the same equations on other layouts are another program
                key += (tuple(layout.shardings[b] for b in (*segment.inputs, -1, *segment.outputs) if b >= 0),)
            if key not in cache and key not in compiling:
                traced = function.trace(*segment_specs(flat, segment, layout))
                # Compiled while the next segments are keyed, traced and lowered (Python, holding the GIL).
                compiling[key] = pool.submit(traced.lower().compile)
            keys.append(key)
        cache.update((key, future.result()) for key, future in compiling.items())
    programs = [cache[key] for key in keys]
    return programs, [_cost(program) for program in programs]


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


def _donated(segment: Segment) -> tuple[bool, ...]:
    return tuple(b in segment.donated for b in segment.inputs)


def _cost(compiled: Any) -> SegmentCost:
    stats = compiled.memory_analysis()
    return SegmentCost(
        temp_bytes=int(stats.temp_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )


# -- the chain the executor runs ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentRun:
    """One segment as the executor runs it, with the transfers and waits around it.

    Values live in slots: buffer ``b``'s device copy in slot ``b``, its host copy in slot
    ``b + Chain.host_offset``. Around the launch, in order: wait for ``waits`` (host slots: offloads
    whose device memory the launch needs), copy ``prefetches`` (buffers) to the device in one
    batch (one ``device_put`` of many arrays costs a fraction of one call per array), drop
    ``dropped_after_prefetches`` (host slots the waits or prefetches read for the last time), launch ``program`` on the
    ``inputs`` slots (``donated`` per input) into the ``outputs`` slots, drop ``dropped_after_launch``
    (device slots read for the last time), then copy ``offloads`` (buffers) to host in one batch, dropping each
    one's device copy where ``dropped_after_offload`` says it was its last use.
    """

    index: int
    program: Any
    cost: SegmentCost
    waits: tuple[int, ...]
    prefetches: tuple[int, ...]
    dropped_after_prefetches: tuple[int, ...]
    inputs: tuple[int, ...]
    donated: tuple[bool, ...]
    outputs: tuple[int, ...]
    dropped_after_launch: tuple[int, ...]
    offloads: tuple[int, ...]
    dropped_after_offload: tuple[bool, ...]
    literals: tuple[Any, ...]  # device arrays passed after the inputs (``segment_literals``)
    prefetch_bytes: int  # what the prefetches allocate on the device
    names: tuple[str, str, str]  # of its waits, prefetches and offloads: ``oocjax.offload(<value>, ...)``


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """A planned step as the executor runs it: its segments in order, and where the step's
    arguments, constants and results live (slots, as in ``SegmentRun``)."""

    runs: tuple[SegmentRun, ...]
    host_offset: int
    argument_slots: tuple[int, ...]
    constants: tuple[tuple[int, Any], ...]  # (slot, value)
    results: tuple[Any, ...]  # per result of the step: its slot, or a ``Literal``
    slot_bytes: tuple[int, ...]  # per slot, the device bytes of its value, per device (0 for host slots)
    shardings: tuple[Any, ...] | None = None  # on a mesh: per buffer, its device sharding

    @property
    def num_slots(self) -> int:
        return 2 * self.host_offset


def build_chain(
    flat: FlatProgram,
    schedule: Schedule,
    segments: Sequence[Segment],
    programs: Sequence[Any],
    costs: Sequence[SegmentCost],
    labels: Sequence[str] = (),
    layout: Layout | None = None,
) -> Chain:
    """The records the executor runs: ``chain_function``'s order of waits, prefetches, launches and
    offloads, with every slot's last use found once here rather than per call. With a ``layout``
    (a mesh), sizes are per device, and constants and literals are placed on every device."""
    host = len(flat.avals)
    results = tuple(
        r if isinstance(r, jc.Literal) else r + host if r in schedule.host_outputs else r for r in flat.outputs
    )
    last_reads = _last_reads(segments, host, {r for r in results if not isinstance(r, jc.Literal)})

    def name(what: str, buffers: Sequence[int]) -> str:
        return f"oocjax.{what}({', '.join(labels[b] if b < len(labels) else f'buffer {b}' for b in buffers)})"

    if layout is None:
        nbytes = [jc.nbytes(aval) for aval in flat.avals]
        constants, place = tuple(flat.constants), _on_device
    else:
        nbytes = [shard_bytes(aval, s) for aval, s in zip(flat.avals, layout.shardings, strict=True)]
        constants = tuple((b, jax.device_put(x, layout.shardings[b])) for b, x in flat.constants)

        def place(values: Sequence[Any]) -> tuple[Any, ...]:
            return tuple(jax.device_put(x, layout.replicated) for x in values)

    runs = tuple(
        SegmentRun(
            index=i,
            program=program,
            cost=cost,
            waits=tuple(host + b for b in s.waits),
            prefetches=s.prefetches,
            dropped_after_prefetches=tuple(sorted(last[0] | last[1])),
            inputs=s.inputs,
            donated=_donated(s),
            outputs=s.outputs,
            dropped_after_launch=tuple(b for b in dict.fromkeys(s.inputs) if b in last[2]),
            offloads=s.offloads,
            dropped_after_offload=tuple(b in last[3] for b in s.offloads),
            literals=place(segment_literals(flat, s)),
            prefetch_bytes=sum(nbytes[b] for b in s.prefetches),
            names=(name("wait", s.waits), name("prefetch", s.prefetches), name("offload", s.offloads)),
        )
        for i, (s, program, cost, last) in enumerate(zip(segments, programs, costs, last_reads, strict=True))
    )
    return Chain(
        runs=runs,
        host_offset=host,
        argument_slots=tuple(b + host if b in schedule.host_inputs else b for b in range(flat.num_inputs)),
        constants=constants,
        results=results,
        slot_bytes=(*nbytes, *(0 for _ in nbytes)),
        shardings=None if layout is None else layout.shardings,
    )


def _last_reads(segments: Sequence[Segment], host: int, returned: set[int]) -> list[list[set[int]]]:
    """Per segment, per phase (waits, prefetches, launch, offloads), the slots read for the last
    time there, found walking the chain back from the slots the step returns."""
    live, found = set(returned), []
    for s in reversed(segments):
        phases = [
            ([host + b for b in s.waits], []),
            ([host + b for b in s.prefetches], list(s.prefetches)),
            (list(s.inputs), list(s.outputs)),
            (list(s.offloads), [host + b for b in s.offloads]),
        ]
        last = []
        for reads, writes in reversed(phases):
            live.difference_update(writes)
            last.append({r for r in reads if r not in live})
            live.update(reads)
        found.append(last[::-1])
    return found[::-1]


def _on_device(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.device_put(x, sharding("device")) for x in values)
