"""What oocjax knows of each primitive: one ``PrimitiveRule`` per primitive name, in one table.

A rule says, for one primitive:

* what ``flatten`` inlines: the call whose equations the planner sees instead (``jit``,
  ``closed_call``, remat blocks);
* what ``to_program`` costs it at: the bodies an opaque call runs and how their costs combine (a
  ``cond`` runs one branch, a ``while`` its condition and body once per trip, a ``scan`` its body
  ``length`` times), or a first-order primitive's flops and scratch;
* the name users call it by, for value labels (``select_n`` is ``where``);
* whether an equation of it may run twice (``transforms.recompute``).

A primitive without a rule gets the default, ``DEFAULT_RULE``: one flop per output element, its
primitive name, and it may run twice unless it has effects (or holds a body with an equation that
may not). A higher-order primitive without a rule is refused (``rule_for``): guessing its memory
could break the budget.

Teaching oocjax a primitive is one call, before the step is traced::

    from oocjax.transforms.rules import PrimitiveRule, register_primitive

    # an opaque call that runs each of the jaxprs in its ``jaxprs`` param once:
    register_primitive("my_call", PrimitiveRule(body_params=("jaxprs",)))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod

import jax
import jax.numpy as jnp
import numpy as np

from oocjax.errors import UnsupportedPrimitiveError
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation
from oocjax.transforms.loop_trips import counted_loop_trips

RecomputeRule = Callable[[jc.JaxprEqn], str | None]  # why an equation may not run twice; None: it may
UserNameRule = str | Callable[[jc.JaxprEqn], str | None]  # a name, or a function of the equation (None: no better name)


def _dot_general_flops(eqn: jc.JaxprEqn) -> int:
    (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(lhs.shape[d] for d in lhs_contracting)


def _conv_flops(eqn: jc.JaxprEqn) -> int:
    rhs = eqn.invars[1].aval
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(rhs.shape) // max(out_features, 1)


# Backends that multiply floats narrower than 32 bits in float32 copies (``_upcast_product_scratch``).
_UPCASTS_NARROW_PRODUCTS = frozenset({"cpu"})


@functools.cache
def _platform() -> str:
    return jax.local_devices()[0].platform


def _is_narrow_float(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _upcast_product_scratch(eqn: jc.JaxprEqn) -> int:
    """The float32 copies XLA:CPU makes of a matmul or convolution with a narrower float result.

    XLA:CPU has no bfloat16 (or float16) product with a bfloat16 result: it converts each operand to
    float32, multiplies into a float32 result and rounds that back (read in its optimised HLO; a
    bfloat16 product with a float32 result runs as it is). No jaxpr value shows those copies: a
    [256,128] x [128,128] bfloat16 matmul holds 256 KiB of scratch beside its 64 KiB result. Left
    out, the compiled segments of mixed-precision steps measured over the budget plan after plan:
    the MLPs of tests/test_mixed_precision.py took 3 to 5 plans to fit (after 5 the planner gives
    up, OocError), 1 with them. Counted as the copies' sum, an upper bound (that matmul's: 320
    KiB). GPUs and TPUs multiply bfloat16 as it is: 0 there. The local device decides, so a program
    traced on a CPU to plan for a GPU counts them too."""
    result = eqn.outvars[0].aval
    if _platform() not in _UPCASTS_NARROW_PRODUCTS or not _is_narrow_float(result.dtype):
        return 0
    avals = [v.aval for v in eqn.invars[:2] if _is_narrow_float(v.aval.dtype)] + [result]
    return sum(4 * prod(aval.shape) for aval in avals)


def _no_scratch(eqn: jc.JaxprEqn) -> int:
    return 0


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
    trips = counted_loop_trips(fe)
    return 1 if trips is None else trips


def _default_user_name_rule(eqn: jc.JaxprEqn) -> str:
    return eqn.primitive.name


def _refuse(reason: str) -> RecomputeRule:
    return lambda eqn: reason


def _default_recompute_rule(eqn: jc.JaxprEqn) -> str | None:
    if eqn.effects:
        names = ", ".join(sorted(type(effect).__name__ for effect in eqn.effects))
        return f"it has effects ({names}): running it twice would perform them twice"
    for _, body in jc.sub_jaxprs(eqn.params):
        reason = _why_not_body(getattr(body, "jaxpr", body))
        if reason is not None:
            return f"its {eqn.primitive.name} body holds an equation that may not run twice: {reason}"
    return None


@functools.lru_cache(maxsize=1024)  # unrolled layers hold the same bodies: check each once
def _why_not_body(jaxpr: jc.Jaxpr) -> str | None:
    return next((r for eqn in jaxpr.eqns if (r := why_not_recomputable(eqn)) is not None), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrimitiveRule:
    """How oocjax treats one primitive. Every field has a default: a rule names only what differs.

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
      scratch: a first-order primitive's own scratch, in bytes beyond its operands and results
        (memory the compiled program holds while it runs that no jaxpr value shows).
      user_name: the name users call the operation by, where the primitive's name is not it: a name,
        or a function of the equation returning one (``None``: no better name than the primitive's).
      why_not_recomputable: why an equation of the primitive may not run twice, or ``None`` if it
        may. The default refuses an equation with effects, and one holding a body with an equation
        that may not run twice.
    """

    inline_param: str | None = None
    body_params: tuple[str, ...] = ()
    combine_flops: Callable[[Iterable[int]], int] = sum
    trip_count: Callable[[FlatEquation], int] = _once
    flops: Callable[[jc.JaxprEqn], int] = _elementwise_flops
    scratch: Callable[[jc.JaxprEqn], int] = _no_scratch
    user_name: UserNameRule = _default_user_name_rule
    why_not_recomputable: RecomputeRule = _default_recompute_rule


DEFAULT_RULE = PrimitiveRule()

_rules: dict[str, PrimitiveRule] = {
    # Calls and loops.
    jc.jit_p.name: PrimitiveRule(inline_param="jaxpr"),
    jc.closed_call_p.name: PrimitiveRule(inline_param="call_jaxpr"),
    jc.scan_p.name: PrimitiveRule(body_params=("jaxpr",), trip_count=_scan_length),
    jc.while_p.name: PrimitiveRule(body_params=("cond_jaxpr", "body_jaxpr"), trip_count=_while_trip_count),
    jc.cond_p.name: PrimitiveRule(body_params=("branches",), combine_flops=max),
    # A remat (checkpoint) block is planned through: its equations become steps, so its internal
    # peak is planned rather than reserved whole. The recomputation stays (its own equations), and
    # the forward and the recomputation land in separate segments, so XLA cannot merge them.
    jc.remat_p.name: PrimitiveRule(inline_param="jaxpr"),
    jc.custom_jvp_call_p.name: PrimitiveRule(
        body_params=("call_jaxpr",),
        user_name=jc.called_function_name,  # jax.nn.relu's custom_jvp_call: relu
    ),
    jc.custom_vjp_call_p.name: PrimitiveRule(body_params=("call_jaxpr",), user_name=jc.called_function_name),
    # A shard_map call runs whole, its body's per-device peak as its scratch: the body's avals are
    # already one device's (``transforms.shardings`` sizes its outputs from ``out_specs``).
    "shard_map": PrimitiveRule(body_params=("jaxpr",)),
    # Flops, and the scratch of narrow-float products on the CPU.
    "dot_general": PrimitiveRule(flops=_dot_general_flops, scratch=_upcast_product_scratch),
    "conv_general_dilated": PrimitiveRule(flops=_conv_flops, scratch=_upcast_product_scratch),
    # Their jaxpr params are scalar combiners (how to add two elements), not calls: they need no
    # scratch beyond their operands and results.
    **{primitive.name: DEFAULT_RULE for primitive in jc.combiner_primitives},
    # The name users call an operation by, where jax's primitive name is not it.
    "add_any": PrimitiveRule(user_name="add"),  # jax's sum of two cotangents
    "gt": PrimitiveRule(user_name=">"),
    "ge": PrimitiveRule(user_name=">="),
    "lt": PrimitiveRule(user_name="<"),
    "le": PrimitiveRule(user_name="<="),
    "eq": PrimitiveRule(user_name="=="),
    "ne": PrimitiveRule(user_name="!="),
    "max": PrimitiveRule(user_name="maximum"),  # element-wise, as jnp.maximum; the reductions are jnp.max and friends
    "min": PrimitiveRule(user_name="minimum"),
    "reduce_max": PrimitiveRule(user_name="max"),
    "reduce_min": PrimitiveRule(user_name="min"),
    "reduce_sum": PrimitiveRule(user_name="sum"),
    "reduce_prod": PrimitiveRule(user_name="prod"),
    "select_n": PrimitiveRule(user_name="where"),
    "logistic": PrimitiveRule(user_name="sigmoid"),
    "convert_element_type": PrimitiveRule(user_name="astype"),
    # Which equations may not run twice.
    # A transfer between memories (or devices) inside the step: a copy would move the bytes again,
    # over the link the plan's own transfers use, at a cost the planner does not count.
    jc.device_put_p.name: PrimitiveRule(
        why_not_recomputable=_refuse("it is a transfer (device_put): a copy would move its bytes again")
    ),
    # XLA's stateful generator: its bits depend on how many draws came before, not on operands.
    "rng_uniform": PrimitiveRule(
        why_not_recomputable=_refuse("it draws from XLA's stateful generator: a second run gives other bits")
    ),
    # Declared pure, so JAX may call it twice too; but it runs Python on the host, whose time the
    # planner cannot estimate, so recomputing it could cost more than moving its result.
    "pure_callback": PrimitiveRule(
        why_not_recomputable=_refuse("it calls back into Python on the host, at a cost the planner cannot estimate")
    ),
    # Opaque higher-order equations (scan, while, cond, custom_jvp_call, custom_vjp_call) take the
    # default rule: without effects a jaxpr is a function of its operands, so running it again gives
    # the same results; the default rule also checks their bodies equation by equation, because a
    # body may hold a primitive refused above (a device_put, a stateful draw) that has no effect.
}


def register_primitive(name: str, rule: PrimitiveRule) -> PrimitiveRule | None:
    """Teaches oocjax the primitive called ``name`` (``primitive.name``): from now on ``rule`` is how
    it is flattened, costed, named and recomputed. Call it before tracing the step that uses it.

    A rule replaces the one registered before (a built-in one too); fields left out keep the
    default's behaviour (``DEFAULT_RULE``). To change one field of a registered rule, register
    ``dataclasses.replace(registered_rule(name), field=...)``. A higher-order primitive (one holding jaxprs in its
    params) needs a rule: without one, ``ooc_jit`` refuses it and names the rule to register.

    Returns:
      The rule it replaces, or ``None`` if there was none (to put it back).

    >>> register_primitive("my_call", PrimitiveRule(body_params=("jaxprs",))) is None
    True
    >>> registered_rule("my_call").body_params
    ('jaxprs',)
    >>> unregister_primitive("my_call").body_params  # this example's rule, taken back
    ('jaxprs',)
    """
    if not isinstance(rule, PrimitiveRule):
        raise TypeError(f"register_primitive takes a PrimitiveRule, got {type(rule).__name__}")
    replaced = _rules.get(name)
    _rules[name] = rule
    return replaced


def unregister_primitive(name: str) -> PrimitiveRule | None:
    """Forgets the rule registered for ``name`` (a built-in one falls back to the default); returns it."""
    return _rules.pop(name, None)


def registered_rule(name: str) -> PrimitiveRule | None:
    """The rule registered for the primitive called ``name``; ``None`` if it has none."""
    return _rules.get(name)


def _default_rule(eqn: jc.JaxprEqn) -> PrimitiveRule:
    """A primitive without a rule is first-order, or refused: a call's memory cannot be guessed."""
    held = dict.fromkeys(name for name, _ in jc.sub_jaxprs(eqn.params))
    if not held:
        return DEFAULT_RULE
    name, where = eqn.primitive.name, jc.source_line(eqn) or "an unknown source line"
    raise UnsupportedPrimitiveError(
        f"oocjax has no rule for the higher-order primitive {name!r} (at {where}).\n"
        "It cannot size the memory such a call uses inside, and guessing could break the budget.\n"
        "Fixes:\n  1. move the call out of the function given to ooc_jit, or\n"
        "  2. register a rule; if the call runs each of its jaxprs once:\n"
        f"     oocjax.transforms.rules.register_primitive({name!r}, "
        f"oocjax.transforms.rules.PrimitiveRule(body_params={tuple(held)!r}))"
    )


def rule_for(eqn: jc.JaxprEqn) -> PrimitiveRule:
    """The rule of ``eqn``'s primitive: the registered one, else the default (``DEFAULT_RULE``).

    Raises:
      UnsupportedPrimitiveError: for a higher-order primitive without a rule; the message names the
        rule to register.
    """
    rule = _rules.get(eqn.primitive.name)
    return rule if rule is not None else _default_rule(eqn)


def user_name(eqn: jc.JaxprEqn) -> str:
    """The name users call ``eqn``'s operation by (``PrimitiveRule.user_name``): ``where`` for ``select_n``."""
    rule = _rules.get(eqn.primitive.name, DEFAULT_RULE).user_name
    name = rule if isinstance(rule, str) else rule(eqn)
    return name or _default_user_name_rule(eqn)


def why_not_recomputable(eqn: jc.JaxprEqn) -> str | None:
    """Why ``eqn`` may not run twice, or ``None`` if it may.

    >>> import jax, jax.numpy as jnp
    >>> eqns = jax.make_jaxpr(lambda k: jax.random.normal(k, (2,)))(jax.random.key(0)).eqns
    >>> [why_not_recomputable(e) for e in eqns]
    [None]
    """
    rule = _rules.get(eqn.primitive.name, DEFAULT_RULE).why_not_recomputable
    return rule(eqn)
