"""How many trips a ``while`` loop makes, read from its equation before it runs.

``counted_loop_trips`` recognises a counted loop (``fori_loop`` with traced bounds, a hand-written
``while c[0] < n``) and works out its trip count from the literals it starts, steps and stops at.
The ``while`` rule (``transforms.rules``) multiplies one trip's flops by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation


def counted_loop_trips(fe: FlatEquation) -> int | None:
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
