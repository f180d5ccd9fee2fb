"""From a traced training step to the planner's program.

Two passes, each one loop over equations:

* ``flatten`` inlines nested ``jit`` calls and remat (``checkpoint``) blocks, so that the planner
  sees the real operations of the step rather than a handful of calls, and numbers every value
  with a global buffer id. It then drops dead code: equations without effects whose results
  nobody reads (XLA would drop them too, but the planner would have held their memory).
* ``to_program`` sizes every buffer from its aval and turns each flat equation into a planner step.
  It labels every value as its user would name it: arguments and results by their pytree paths
  (``argument state['w']``, ``result[0]['w']``), other values by the scope they were made in (a
  Flax module path), the operation as users call it (``user_name_rules``) and the user's line.
  Other higher-order primitives (``scan``, ``while``, ``cond``, ``custom_jvp_call``,
  ``custom_vjp_call``) stay one opaque step each, whose own peak becomes the step's scratch
  (``transient_bytes``) and whose work its flops.

What each primitive needs is one ``PrimitiveRule`` in ``primitive_rules``, keyed by primitive name:
the call ``flatten`` inlines, the bodies an opaque call runs and how their costs combine (a ``cond``
runs one branch, a ``while`` its condition and body once per trip, a ``scan`` its body ``length``
times), or a first-order primitive's flops. A primitive without a rule gets ``_default_rule``: one
flop per output element, unless it is higher-order, which is an error: guessing its memory could
break the budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import jax
import jax.numpy as jnp

from oocjax.errors import UnsupportedPrimitiveError
from oocjax.schedule import Buffer, Program, Step, keep_all, simulate
from oocjax.schedule._gc import gc_paused
from oocjax.transforms import _compat as jc

Ref = int | jc.Literal  # a buffer id, or a literal operand


@dataclass(frozen=True, slots=True)
class FlatEquation:
    """One equation of the flattened step: its operands and results as buffer ids."""

    eqn: jc.JaxprEqn
    inputs: tuple[Ref, ...]
    outputs: tuple[int, ...]
    recompute_of: int | None = None  # for a copy (``transforms.recompute``): the equation it runs again


@dataclass(frozen=True, slots=True)
class FlatProgram:
    """A step with nested ``jit`` calls inlined. Buffer ids ``0 .. num_inputs-1`` are its arguments."""

    equations: tuple[FlatEquation, ...]
    avals: tuple[Any, ...]
    num_inputs: int
    constants: tuple[tuple[int, Any], ...]  # (buffer id, value)
    outputs: tuple[Ref, ...]
    loops: tuple[LoopInfo, ...] = ()  # top-level scans, unrolled or not
    dead_equations: int = 0  # equations ``flatten`` dropped because nobody reads their results
    # (buffer, name) for each buffer an inlined call of a named function returned (``jax.nn.silu``'s
    # jit): the name its user calls it by, for its label.
    result_names: tuple[tuple[int, str], ...] = ()


def flatten(closed: jc.ClosedJaxpr, *, unroll: bool = True) -> FlatProgram:
    """Inlines nested ``jit`` (and ``closed_call``) equations and remat blocks, unrolls the scans
    worth it (``unroll``), gives every value a buffer id, and drops dead code (``without_dead_code``)."""
    flattener = _Flattener(unroll)
    with gc_paused():
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


@dataclass(frozen=True, slots=True)
class LoopInfo:
    """A top-level ``scan``: where it is, its length, and whether it runs one iteration at a time."""

    label: str
    length: int
    unrolled: bool


class _Flattener:
    """``flatten``'s state: every value's aval, the constants and the flat equations so far."""

    def __init__(self, unroll: bool):
        self.unroll = unroll
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
            rule = primitive_rules.get(eqn.primitive.name)
            if rule is not None and rule.inline_param is not None:
                callee = eqn.params[rule.inline_param]  # a ClosedJaxpr, or a Jaxpr without consts (remat)
                jaxpr_, consts_ = getattr(callee, "jaxpr", callee), getattr(callee, "consts", ())
                first = len(self.avals)
                results = self.inline(jaxpr_, consts_, [value(a) for a in eqn.invars], source, caller=eqn)
                if eqn.primitive is jc.jit_p and (name := jc.called_function_name(eqn)):
                    # What the call made and returned is what the user called (an outer call's name wins).
                    self.result_names.update((r, name) for r in results if isinstance(r, int) and r >= first)
            elif eqn.primitive is jc.scan_p and self.unroll and _worth_unrolling(eqn):
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


def _worth_unrolling(eqn: jc.JaxprEqn) -> bool:
    body = eqn.params["jaxpr"].jaxpr
    return int(eqn.params["length"]) * len(body.eqns) <= MAX_UNROLLED_EQUATIONS and _does_layer_work(body)


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


def _dot_general_flops(eqn: jc.JaxprEqn) -> int:
    (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(lhs.shape[d] for d in lhs_contracting)


def _conv_flops(eqn: jc.JaxprEqn) -> int:
    rhs = eqn.invars[1].aval
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(rhs.shape) // max(out_features, 1)


def _elementwise_flops(eqn: jc.JaxprEqn) -> int:
    """Element-wise work: one operation per output element."""
    return sum(prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)


def _once(fe: FlatEquation) -> int:
    return 1


def _scan_length(fe: FlatEquation) -> int:
    return int(fe.eqn.params["length"])


def _while_trip_count(fe: FlatEquation) -> int:
    """How many times a ``while`` runs, when its operands say so before it runs; else 1.

    A loop that ends on data cannot be known before it runs: counting it once makes its flops a
    lower bound, which is still better than none (the planner uses flops only to estimate time).
    """
    trips = _counted_loop_trips(fe)
    return 1 if trips is None else trips


@dataclass(frozen=True, kw_only=True, slots=True)
class PrimitiveRule:
    """How the analysis treats one primitive.

    Attributes:
      inline_param: the param holding a callee that ``flatten`` inlines (``jit``, ``closed_call``):
        the planner sees the callee's equations instead of the call.
      body_params: params holding the jaxprs an opaque call runs; a tuple param (``cond``'s
        ``branches``) gives one body per item. Its bodies never run at the same time, so the
        call's scratch is the largest body's. Empty for a first-order primitive.
      combine_flops: one trip's flops from its bodies': ``sum`` where every body runs (a ``while``'s
        condition and body), ``max`` where one does (a ``cond`` runs one branch: count the largest).
      trip_count: how many trips the call makes, from its equation and operands (a ``scan``: its length).
      flops: a first-order primitive's own flops.
    """

    inline_param: str | None = None
    body_params: tuple[str, ...] = ()
    combine_flops: Callable[[Iterable[int]], int] = sum
    trip_count: Callable[[FlatEquation], int] = _once
    flops: Callable[[jc.JaxprEqn], int] = _elementwise_flops


_FIRST_ORDER = PrimitiveRule()

primitive_rules: dict[str, PrimitiveRule] = {
    jc.jit_p.name: PrimitiveRule(inline_param="jaxpr"),
    jc.closed_call_p.name: PrimitiveRule(inline_param="call_jaxpr"),
    jc.scan_p.name: PrimitiveRule(body_params=("jaxpr",), trip_count=_scan_length),
    jc.while_p.name: PrimitiveRule(body_params=("cond_jaxpr", "body_jaxpr"), trip_count=_while_trip_count),
    jc.cond_p.name: PrimitiveRule(body_params=("branches",), combine_flops=max),
    # A remat (checkpoint) block is planned through: its equations become steps, so its internal
    # peak is planned rather than reserved whole. The recomputation stays (its own equations), and
    # the forward and the recomputation land in separate segments, so XLA cannot merge them.
    jc.remat_p.name: PrimitiveRule(inline_param="jaxpr"),
    jc.custom_jvp_call_p.name: PrimitiveRule(body_params=("call_jaxpr",)),
    jc.custom_vjp_call_p.name: PrimitiveRule(body_params=("call_jaxpr",)),
    # A shard_map call runs whole, its body's per-device peak as its scratch: the body's avals are
    # already one device's (``transforms.shardings`` sizes its outputs from ``out_specs``).
    "shard_map": PrimitiveRule(body_params=("jaxpr",)),
    "dot_general": PrimitiveRule(flops=_dot_general_flops),
    "conv_general_dilated": PrimitiveRule(flops=_conv_flops),
    # Their jaxpr params are scalar combiners (how to add two elements), not calls: they need no
    # scratch beyond their operands and results.
    **{primitive.name: _FIRST_ORDER for primitive in jc.combiner_primitives},
}


def _default_rule(eqn: jc.JaxprEqn) -> PrimitiveRule:
    """A primitive without a rule is first-order, or refused: a call's memory cannot be guessed."""
    held = dict.fromkeys(name for name, _ in jc.sub_jaxprs(eqn.params))
    if not held:
        return _FIRST_ORDER
    name, where = eqn.primitive.name, jc.source_line(eqn) or "an unknown source line"
    raise UnsupportedPrimitiveError(
        f"oocjax has no rule for the higher-order primitive {name!r} (at {where}).\n"
        "It cannot size the memory such a call uses inside, and guessing could break the budget.\n"
        "Fixes:\n  1. move the call out of the function given to ooc_jit, or\n"
        "  2. add a rule; if the call runs each of its jaxprs once:\n"
        f"     oocjax.transforms.analyse.primitive_rules[{name!r}] = "
        f"oocjax.transforms.analyse.PrimitiveRule(body_params={tuple(held)!r})"
    )


def _rule_for(eqn: jc.JaxprEqn) -> PrimitiveRule:
    rule = primitive_rules.get(eqn.primitive.name)
    return rule if rule is not None else _default_rule(eqn)


# The name users call an operation by, where jax's primitive name is not it: per primitive, a name or
# a function of the equation (None: no better name); ``_default_user_name_rule`` otherwise.
user_name_rules: dict[str, str | Callable[[jc.JaxprEqn], str | None]] = {
    "add_any": "add",  # jax's sum of two cotangents
    "gt": ">",
    "ge": ">=",
    "lt": "<",
    "le": "<=",
    "eq": "==",
    "ne": "!=",
    "max": "maximum",  # element-wise, as jnp.maximum; the reductions are jnp.max and friends
    "min": "minimum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_sum": "sum",
    "reduce_prod": "prod",
    "select_n": "where",
    "logistic": "sigmoid",
    "convert_element_type": "astype",
    jc.custom_jvp_call_p.name: jc.called_function_name,  # jax.nn.relu's custom_jvp_call: relu
    jc.custom_vjp_call_p.name: jc.called_function_name,
}


def _default_user_name_rule(eqn: jc.JaxprEqn) -> str:
    return eqn.primitive.name


def _user_name(eqn: jc.JaxprEqn) -> str:
    rule = user_name_rules.get(eqn.primitive.name, _default_user_name_rule)
    name = rule if isinstance(rule, str) else rule(eqn)
    return name or _default_user_name_rule(eqn)


def _bodies(eqn: jc.JaxprEqn, rule: PrimitiveRule) -> Iterator[Any]:
    for param in rule.body_params:
        value = eqn.params[param]
        # A tuple param may hold unused places (``custom_linear_solve``'s jaxprs without a transpose).
        yield from (body for body in (value if isinstance(value, tuple) else (value,)) if body is not None)


@dataclass(frozen=True, slots=True)
class _BodyCost:
    scratch_bytes: int
    flops: int


class _Analysis:
    """Sizes, labels and costs of one step; bodies of opaque calls are analysed once each."""

    def __init__(self) -> None:
        self.bodies: dict[int, _BodyCost] = {}
        # id(eqn) -> (eqn, its source line): looked up once per equation. The equation is kept so that
        # its id is not reused (``flatten`` makes equations of inlined bodies anew).
        self.lines: dict[int, tuple[jc.JaxprEqn, str]] = {}

    def source_line(self, eqn: jc.JaxprEqn) -> str:
        key = id(eqn)
        if key not in self.lines:
            self.lines[key] = eqn, jc.source_line(eqn)
        return self.lines[key][1]

    def value_label(self, eqn: jc.JaxprEqn, called: str | None = None, root: str = "") -> str:
        """``"Block_2/Dense_0: output of dot_general from model.py:42 (__call__)"``: the scope (Flax
        module path) the value was made in, where there is one, then what made it, as its user calls
        it (``called``: the named function an inlined call of which returned it, else
        ``user_name_rules``), and the user's source line. ``root`` is left out of the scope."""
        what = f"output of {called or _user_name(eqn)}"
        where = self.source_line(eqn)
        if where:
            what += f" from {where}"
        scope = jc.scope_path(eqn)
        if root and (scope == root or scope.startswith(root + "/")):
            scope = scope[len(root) + 1 :]
        return f"{scope}: {what}" if scope else what

    def program(
        self,
        flat: FlatProgram,
        *,
        input_labels: Sequence[str],
        donated: Sequence[bool],
        output_labels: Sequence[str] = (),
    ) -> Program:
        constant_ids = {b for b, _ in flat.constants}
        defined_by: dict[int, jc.JaxprEqn] = {o: fe.eqn for fe in flat.equations for o in fe.outputs}
        outputs = [r for r in flat.outputs if isinstance(r, int)]
        aliases = _donation_aliases(flat, outputs, donated)
        returned = set(outputs)
        # A result is named by where the step returns it, as an argument is by where it is given
        # (``result[0]['params']['w']``, jax's own spelling): that is the state leaf it becomes.
        result_labels: dict[int, str] = {}
        for r, label in zip(flat.outputs, output_labels):
            if isinstance(r, int) and r in defined_by:
                result_labels.setdefault(r, label)
        called = dict(flat.result_names)
        root = _common_root(jc.scope_path(fe.eqn) for fe in flat.equations)
        buffers = []
        for b, aval in enumerate(flat.avals):
            if b < flat.num_inputs:
                kind, label = "input", f"argument {input_labels[b]}"
            elif b in constant_ids:
                kind, label = "constant", f"constant {aval.str_short()}"
            else:
                kind = "computed"
                label = result_labels.get(b) or self.value_label(defined_by[b], called.get(b), root)
            buffers.append(
                Buffer(
                    nbytes=jc.nbytes(aval),
                    kind=kind,
                    is_output=b in returned,
                    donated=b < flat.num_inputs and bool(donated[b]),
                    aliased_input=aliases.get(b),
                    label=label,
                )
            )
        steps = tuple(self.step(fe, flat.avals) for fe in flat.equations)
        return Program(steps=steps, buffers=tuple(buffers))

    def step(self, fe: FlatEquation, avals: Sequence[Any]) -> Step:
        eqn = fe.eqn
        reads = tuple(dict.fromkeys(r for r in fe.inputs if isinstance(r, int)))
        rule = _rule_for(eqn)
        scratch, flops = 0, rule.flops(eqn)
        if rule.body_params:
            costs = [self.body(body) for body in _bodies(eqn, rule)]
            scratch = max(c.scratch_bytes for c in costs)
            flops = rule.trip_count(fe) * rule.combine_flops(c.flops for c in costs)
        touched = sum(jc.nbytes(avals[b]) for b in (*reads, *fe.outputs))
        return Step(
            reads=reads,
            writes=fe.outputs,
            transient_bytes=scratch,
            flops=flops,
            bytes_accessed=touched,
            name=eqn.primitive.name,
            label=self.source_line(eqn),
        )

    def body(self, jaxpr: Any) -> _BodyCost:
        """A body's own peak beyond its arguments and results, and its flops."""
        key = id(jaxpr)
        if key not in self.bodies:
            closed = jaxpr if isinstance(jaxpr, jc.ClosedJaxpr) else jc.ClosedJaxpr(jaxpr, ())
            flat = flatten(closed, unroll=False)
            labels = [f"body argument {i}" for i in range(flat.num_inputs)]
            program = self.program(flat, input_labels=labels, donated=[False] * flat.num_inputs)
            boundary = {*range(flat.num_inputs), *(r for r in flat.outputs if isinstance(r, int))}
            boundary_bytes = sum(program.buffers[b].nbytes for b in boundary)
            peak = simulate(program, keep_all(program)).peak_bytes
            self.bodies[key] = _BodyCost(max(0, peak - boundary_bytes), sum(s.flops for s in program.steps))
        return self.bodies[key]


def _common_root(paths: Iterable[str]) -> str:
    """The first scope of every scoped equation, when they share one and it is named as a class is
    (a capital first letter): a Flax model's root module, which Flax names by its class (its
    submodules by attribute names or ``Dense_0``). It tells no two values apart, and Flax's own
    parameter paths start below it, so labels leave it out: ``Block_2/Dense_0`` rather than
    ``Transformer/Block_2/Dense_0``. A user's own scope (``jax.named_scope("encoder")``) stays."""
    roots = {path.split("/", 1)[0] for path in paths if path}
    root = roots.pop() if len(roots) == 1 else ""
    return root if root[:1].isupper() else ""


def _donation_aliases(flat: FlatProgram, outputs: Sequence[int], donated: Sequence[bool]) -> dict[int, int]:
    """Which output takes over which donated input: as XLA pairs them, the first output of the same
    shape and dtype not yet taken, for each donated input in order."""
    free = [o for o in dict.fromkeys(outputs) if o >= flat.num_inputs]
    aliases: dict[int, int] = {}
    for b in range(flat.num_inputs):
        if not donated[b]:
            continue
        aval = flat.avals[b]
        for o in free:
            if flat.avals[o].shape == aval.shape and flat.avals[o].dtype == aval.dtype:
                aliases[o] = b
                free.remove(o)
                break
    return aliases


def to_program(
    flat: FlatProgram, *, input_labels: Sequence[str], donated: Sequence[bool], output_labels: Sequence[str] = ()
) -> Program:
    """The planner's program for a flattened step. Arguments are labelled ``argument <input label>``,
    results by their ``output_labels`` (``result[0]['w']``), other values by ``_Analysis.value_label``."""
    with gc_paused():
        return _Analysis().program(flat, input_labels=input_labels, donated=donated, output_labels=output_labels)


def _counted_loop_trips(fe: FlatEquation) -> int | None:
    """The trip count of a ``while`` written as a counted loop, or ``None`` if it is not one.

    The pattern is ``fori_loop``'s when its bounds are traced values (with Python int bounds it writes
    a ``scan``), and the hand-written ``while c[0] < n``: an integer counter carried from a literal,
    stepped by a positive literal in the body, compared ``lt`` against a literal bound. The bound may
    also be a condition operand or a carry the body passes on unchanged, whose value is a literal:
    ``flatten`` puts a caller's literal there when the loop sits inside an inlined ``jit``.
    """
    params = fe.eqn.params
    cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
    cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
    initial = fe.inputs[cond_nconsts + body_nconsts :]  # the carries' values before the first trip
    compare = _defining_equation(cond, cond.outvars[0])
    if compare is None or compare.primitive.name != "lt":
        return None
    counter_var, bound_var = compare.invars
    counter = _position(counter_var, cond.invars[cond_nconsts:])
    if counter is None:
        return None
    lower = _literal_int(initial[counter])
    step = _counter_step(body, body_nconsts, counter)
    upper = _literal_int(bound_var)  # a literal in the condition itself
    if (k := _position(bound_var, cond.invars[:cond_nconsts])) is not None:
        upper = _literal_int(fe.inputs[k])
    elif (k := _position(bound_var, cond.invars[cond_nconsts:])) is not None and _passed_on(body, body_nconsts, k):
        upper = _literal_int(initial[k])
    if lower is None or upper is None or step is None or step <= 0:
        return None
    return max(0, -((lower - upper) // step))  # ceil((upper - lower) / step), none if upper <= lower


def _counter_step(body: jc.Jaxpr, nconsts: int, counter: int) -> int | None:
    """The literal the body adds to carry ``counter`` each trip, if that is all it does to it."""
    before, after = body.invars[nconsts + counter], body.outvars[counter]
    add = _defining_equation(body, after)
    if add is None or add.primitive.name != "add":
        return None
    operands = add.invars
    if operands[0] is before:
        return _literal_int(operands[1])
    if operands[1] is before:
        return _literal_int(operands[0])
    return None


def _passed_on(body: jc.Jaxpr, nconsts: int, carry: int) -> bool:
    """Whether the body returns carry ``carry`` unchanged, so that it keeps its initial value."""
    return body.outvars[carry] is body.invars[nconsts + carry]


def _defining_equation(jaxpr: jc.Jaxpr, atom: Any) -> jc.JaxprEqn | None:
    return next((e for e in reversed(jaxpr.eqns) if any(o is atom for o in e.outvars)), None)


def _position(atom: Any, atoms: Sequence[Any]) -> int | None:
    return next((i for i, a in enumerate(atoms) if a is atom), None)


def _literal_int(atom: Any) -> int | None:
    """An integer literal's value; ``None`` for anything else (a traced value, a float)."""
    if not isinstance(atom, jc.Literal) or getattr(atom.aval.dtype, "kind", None) not in ("i", "u"):
        return None
    return int(atom.val)
