"""Compiling a step's segments: one program per distinct segment, compiled in parallel threads.

Segments that run the same equations share a program (``segment_key`` below says which, read
off the equations without tracing), so that the programs to compile grow with the kinds of layers,
not with depth: on a CPU, XLA's compile time grows with the distinct programs, hardly with the
layers repeated inside one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.functions import lifted_literals, segment_literals
from oocjax.transforms.memories import spec
from oocjax.transforms.shardings import Layout


def compile_segments(
    flat: FlatProgram,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    cache: dict | None = None,
    layout: Layout | None = None,
    *,
    budget_bytes: int | None = None,
) -> tuple[list[Any], list[SegmentCost]]:
    """One compiled program per segment; segments with the same equations (``segment_key``),
    donation and (on a mesh, ``layout``) input and output shardings share one, also
    with the programs in ``cache`` (from an earlier plan of the same step), which gains the new
    ones. Only a new program's segment is traced. Distinct programs compile in parallel threads,
    each as soon as it is lowered (XLA releases the GIL while it compiles); random bits are
    lowered unrolled (``jc.unrolled_threefry``).

    With ``budget_bytes``, segments whose equations are alike but donate more of their inputs
    (the bottom layer, whose input nothing later reads) run the program of the alike segment that
    donates least, where it fits the budget there (``held_bytes`` plus what launching it
    allocates): one program to compile where donation made two. The executor still lets go of
    what the plan gave up after the launch."""
    cache = {} if cache is None else cache
    own = [(_equations_key(flat, segment, layout), donated_inputs(segment)) for segment in segments]
    donations: dict[tuple, set] = {}
    for equations, donated in own:
        donations.setdefault(equations, set()).add(donated)
    least = {equations: tuple(map(all, zip(*ways))) for equations, ways in donations.items()}
    shares = budget_bytes is not None
    keys = [(e, least[e]) if shares and least[e] in donations[e] else (e, d) for e, d in own]
    _compile_new(flat, segments, functions, cache, layout, keys)
    # Where the shared program does not fit the budget there, the segment compiles its own.
    keys = [
        key if key == mine or segment.held_bytes + _cost(cache[key]).launch_bytes <= budget_bytes else mine
        for key, mine, segment in zip(keys, own, segments, strict=True)
    ]
    _compile_new(flat, segments, functions, cache, layout, keys)
    programs = [cache[key] for key in keys]
    return programs, [_cost(program) for program in programs]


def _equations_key(flat: FlatProgram, segment: Segment, layout: Layout | None) -> tuple:
    key = segment_key(flat, segment)
    if layout is None:
        return key
    # The same equations on other layouts are another program.
    return key, tuple(layout.shardings[b] for b in (*segment.inputs, -1, *segment.outputs) if b >= 0)


def _compile_new(
    flat: FlatProgram,
    segments: Sequence[Segment],
    functions: Sequence[Callable],
    cache: dict,
    layout: Layout | None,
    keys: Sequence[tuple],
) -> None:
    """Compiles into ``cache`` the program of each key not there, from the first segment of that
    key whose donation is the key's."""
    compiling = {}
    with warnings.catch_warnings(), ThreadPoolExecutor() as pool, jc.unrolled_threefry():
        # A donated argument no output can reuse is still freed after the segment: not worth a warning.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for segment, function, key in zip(segments, functions, keys, strict=True):
            if key in cache or key in compiling or key[1] != donated_inputs(segment):
                continue
            traced = function.trace(*segment_specs(flat, segment, layout))
            # Compiled while the next segments are keyed, traced and lowered (Python, holding the GIL).
            compiling[key] = pool.submit(traced.lower().compile)
        cache.update((key, future.result()) for key, future in compiling.items())


def _cost(compiled: Any) -> SegmentCost:
    stats = compiled.memory_analysis()
    return SegmentCost(
        temp_bytes=int(stats.temp_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )


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
    lifted = {(position, j) for position, j, _ in lifted_literals(equations)}
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
