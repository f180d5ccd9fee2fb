"""The flattener: a traced step as one flat program (``transforms.flat``).

``flatten`` inlines nested ``jit`` calls and remat (``checkpoint``) blocks (the primitives whose
``PrimitiveRule`` names an ``inline_param``), so that the planner sees the real operations of the
step rather than a handful of calls, and numbers every value with one buffer id across the step. A top-level
``scan`` whose body does a layer's work is unrolled into one inlined body per iteration. It then
drops dead code: equations without effects whose results nobody reads (XLA would drop them too,
but the planner would have held their memory).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation, FlatProgram, LoopInfo, Ref
from oocjax.transforms.rules import registered_rule


def flatten(closed: jc.ClosedJaxpr, *, unroll: bool = True, max_unrolled: int | None = None) -> FlatProgram:
    """Inlines nested ``jit`` (and ``closed_call``) equations and remat blocks, unrolls the scans
    worth it (``unroll``: those doing a layer's work in at most ``max_unrolled`` equations
    unrolled, ``MAX_UNROLLED_EQUATIONS`` by default), gives every value a buffer id, and drops dead
    code (``without_dead_code``)."""
    flattener = _Flattener(unroll, MAX_UNROLLED_EQUATIONS if max_unrolled is None else max_unrolled)
    arguments = [flattener.new(var.aval) for var in closed.jaxpr.invars]
    outputs = [flattener.materialize(r) for r in flattener.inline(closed.jaxpr, closed.consts, arguments)]
    flat = FlatProgram(
        equations=tuple(flattener.equations),
        avals=tuple(flattener.avals),
        num_inputs=len(arguments),
        constants=tuple(flattener.constants),
        outputs=tuple(outputs),
        loops=tuple(flattener.loops),
        result_names=tuple(sorted(flattener.result_names.items())),
    )
    return without_dead_code(flat)


def without_dead_code(flat: FlatProgram) -> FlatProgram:
    """``flat`` without the equations whose results nobody reads, nor the constants only they read.

    An equation is dead when it has no effects and none of its results is read by a live equation
    or returned. One backward pass finds them all, so a chain of dead equations dies whole (the
    unused branch of a ``where`` built from a broadcast mask). The kept
    buffers are renumbered in their order, so arguments keep their ids and every id stays defined
    (``Program`` refuses a computed buffer nobody defines).

    >>> def f(x):
    ...     unused = jnp.exp(x)
    ...     return jnp.sin(x)
    >>> flat = flatten(jax.make_jaxpr(f)(1.0))
    >>> [fe.eqn.primitive.name for fe in flat.equations], flat.dead_equations
    (['sin'], 1)
    """
    read = {r for r in flat.outputs if isinstance(r, int)}
    live: list[int] = []
    for i in reversed(range(len(flat.equations))):
        fe = flat.equations[i]
        if fe.eqn.effects or not read.isdisjoint(fe.outputs):
            live.append(i)
            read.update(r for r in fe.inputs if isinstance(r, int))
    live.reverse()
    constants = [(b, value) for b, value in flat.constants if b in read]
    if len(live) == len(flat.equations) and len(constants) == len(flat.constants):
        return flat
    kept = [*range(flat.num_inputs), *(b for b, _ in constants), *(o for i in live for o in flat.equations[i].outputs)]
    new_id = {b: n for n, b in enumerate(sorted(kept))}
    new_index = {i: n for n, i in enumerate(live)}  # a copy's ``recompute_of`` follows its original

    def renumber(r: Ref) -> Ref:
        return new_id[r] if isinstance(r, int) else r

    def renumbered(fe: FlatEquation) -> FlatEquation:
        origin = None if fe.recompute_of is None else new_index.get(fe.recompute_of)
        return FlatEquation(fe.eqn, tuple(map(renumber, fe.inputs)), tuple(map(renumber, fe.outputs)), origin)

    return FlatProgram(
        equations=tuple(renumbered(flat.equations[i]) for i in live),
        avals=tuple(flat.avals[b] for b in sorted(kept)),
        num_inputs=flat.num_inputs,
        constants=tuple((new_id[b], value) for b, value in constants),
        outputs=tuple(map(renumber, flat.outputs)),
        loops=flat.loops,
        dead_equations=flat.dead_equations + len(flat.equations) - len(live),
        result_names=tuple((new_id[b], name) for b, name in flat.result_names if b in new_id),
    )


@dataclass(frozen=True, slots=True, eq=False)
class _Stacked:
    """The ``ys`` of an unrolled scan: one buffer per iteration, in index order. A stacked array is
    built only where something reads it whole; a later unrolled scan reads the parts."""

    parts: tuple[Ref, ...]
    source: jc.JaxprEqn  # the scan, for the stacking equation's source line


class _Flattener:
    """``flatten``'s state: every value's aval, the constants and the flat equations so far."""

    def __init__(self, unroll: bool, max_unrolled: int = 0):
        self.unroll, self.max_unrolled = unroll, max_unrolled
        self.avals: list[Any] = []
        self.constants: list[tuple[int, Any]] = []
        self.equations: list[FlatEquation] = []
        self.loops: list[LoopInfo] = []
        self.constant_ids: dict[int, int] = {}  # id(value) -> its buffer: a constant inlined twice is one value
        self.result_names: dict[int, str] = {}  # FlatProgram.result_names
        self.stacks: dict[int, int] = {}  # id(_Stacked) -> the buffer built for it

    def new(self, aval: Any) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def constant(self, aval: Any, value: Any) -> int:
        if id(value) not in self.constant_ids:
            self.constant_ids[id(value)] = self.new(aval)
            self.constants.append((self.constant_ids[id(value)], value))
        return self.constant_ids[id(value)]

    def inline(
        self,
        jaxpr: jc.Jaxpr,
        consts: Sequence[Any],
        operands: Sequence[Any],
        source: Any = None,
        caller: jc.JaxprEqn | None = None,
    ) -> list:
        """The equations of ``jaxpr`` on ``operands``; its results (buffers, literals or stacks).
        With ``source``, the equations take its source line (oocjax's own slicing and stacking); with
        ``caller`` (the equation whose body ``jaxpr`` is), its name stack goes before theirs."""
        env: dict[jc.Var, Any] = dict(zip(jaxpr.invars, operands, strict=True))
        env |= {var: self.constant(var.aval, value) for var, value in zip(jaxpr.constvars, consts, strict=True)}

        def value(atom: Any) -> Any:
            return atom if isinstance(atom, jc.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            if caller is not None:
                eqn = jc.nested_in(eqn, caller)
            rule = registered_rule(eqn.primitive.name)
            if rule is not None and rule.inline_param is not None:
                callee = eqn.params[rule.inline_param]  # a ClosedJaxpr, or a Jaxpr without consts (remat)
                jaxpr_, consts_ = getattr(callee, "jaxpr", callee), getattr(callee, "consts", ())
                first = len(self.avals)
                results = self.inline(jaxpr_, consts_, [value(a) for a in eqn.invars], source, caller=eqn)
                if eqn.primitive is jc.jit_p and (name := jc.called_function_name(eqn)):
                    # What the call made and returned is what the user called (an outer call's name wins).
                    self.result_names.update((r, name) for r in results if isinstance(r, int) and r >= first)
            elif eqn.primitive is jc.scan_p and self.unroll and _worth_unrolling(eqn, self.max_unrolled):
                results = self.unrolled_scan(eqn, [value(a) for a in eqn.invars])
            else:
                if eqn.primitive is jc.scan_p:
                    self.loops.append(LoopInfo(jc.source_line(eqn), int(eqn.params["length"]), unrolled=False))
                inputs = tuple(self.materialize(value(a)) for a in eqn.invars)
                results = [self.new(var.aval) for var in eqn.outvars]
                placed = eqn if source is None else jc.with_source_of(eqn, source)
                self.equations.append(FlatEquation(placed, inputs, tuple(results)))
            env |= {var: r for var, r in zip(eqn.outvars, results, strict=True) if not isinstance(var, jc.DropVar)}
        return [value(atom) for atom in jaxpr.outvars]

    def materialize(self, r: Any) -> Ref:
        """A buffer for ``r``: a stack of an unrolled scan's outputs is built here, once."""
        if not isinstance(r, _Stacked):
            return r
        if id(r) not in self.stacks:
            parts = [self.materialize(p) for p in r.parts]
            stack = _stack_jaxpr(tuple(self.avals[p] if isinstance(p, int) else p.aval for p in parts))
            (self.stacks[id(r)],) = self.inline(stack.jaxpr, stack.consts, parts, source=r.source)
        return self.stacks[id(r)]

    def unrolled_scan(self, eqn: jc.JaxprEqn, operands: list[Any]) -> list[Any]:
        """A scan as one inlined body per iteration: its ``xs`` sliced at the iteration's index (the
        index a constant operand, so every iteration's equations are alike and share compiled
        segments), its ``ys`` kept per iteration."""
        params, body = eqn.params, eqn.params["jaxpr"]
        length, consts_count, carry_count = int(params["length"]), params["num_consts"], params["num_carry"]
        self.loops.append(LoopInfo(jc.source_line(eqn), length, unrolled=True))
        consts, carry = operands[:consts_count], operands[consts_count : consts_count + carry_count]
        xs = operands[consts_count + carry_count :]
        ys: list[list[Any]] = [[None] * length for _ in range(len(body.jaxpr.outvars) - carry_count)]
        for i in reversed(range(length)) if params["reverse"] else range(length):
            index = self.constant(jax.typeof(_index_value(i)), _index_value(i))
            slices = [self.slice(x, i, index, eqn) for x in xs]
            results = self.inline(body.jaxpr, body.consts, [*consts, *carry, *slices], caller=eqn)
            carry = results[:carry_count]
            for y, result in zip(ys, results[carry_count:], strict=True):
                y[i] = result
        return [*carry, *(_Stacked(tuple(y), eqn) for y in ys)]

    def slice(self, x: Any, i: int, index: int, source: jc.JaxprEqn) -> Any:
        if isinstance(x, _Stacked):
            return x.parts[i]  # an earlier unrolled scan's iteration output: no stack, no slice
        x = self.materialize(x)
        aval = self.avals[x] if isinstance(x, int) else x.aval
        slicer = _index_jaxpr(tuple(aval.shape), aval.dtype)
        (part,) = self.inline(slicer.jaxpr, slicer.consts, [x, index], source=source)
        return part


# A scan is run per iteration when its body does a layer's work (a matrix product or a convolution)
# and unrolling it stays small enough to analyse; other scans (a cumulative sum, a sampler's steps)
# stay one opaque step with their internal peak as scratch.
_LAYER_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
MAX_UNROLLED_EQUATIONS = 200_000


def _worth_unrolling(eqn: jc.JaxprEqn, max_unrolled: int) -> bool:
    body = eqn.params["jaxpr"].jaxpr
    return int(eqn.params["length"]) * len(body.eqns) <= max_unrolled and _does_layer_work(body)


def _does_layer_work(jaxpr: jc.Jaxpr) -> bool:
    return any(
        eqn.primitive.name in _LAYER_PRIMITIVES
        or any(_does_layer_work(getattr(sub, "jaxpr", sub)) for _, sub in jc.sub_jaxprs(eqn.params))
        for eqn in jaxpr.eqns
    )


@functools.cache
def _index_value(i: int) -> Any:
    return jnp.asarray(i, jnp.int32)


@functools.cache
def _index_jaxpr(shape: tuple[int, ...], dtype: Any) -> jc.ClosedJaxpr:
    """``xs[i]`` along the leading axis, ``i`` an operand."""
    return jax.make_jaxpr(lambda xs, i: jax.lax.dynamic_index_in_dim(xs, i, 0, keepdims=False))(
        jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((), jnp.int32)
    )


@functools.lru_cache(maxsize=256)
def _stack_jaxpr(avals: tuple[Any, ...]) -> jc.ClosedJaxpr:
    return jax.make_jaxpr(lambda *parts: jnp.stack(parts))(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
