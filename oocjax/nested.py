"""An ``ooc_jit`` step called inside a jax transformation (``jax.jit``, ``jax.grad``, ``jax.vmap``):
it is traced inline, as a nested ``jax.jit`` is, and its budget does not apply; a warning says so,
pointing at the user's line."""

from __future__ import annotations

import os
import sys
import warnings

import jax

from oocjax.schedule import format_bytes

# Warned once per ``ooc_jit`` step called with traced arguments (inside jax.jit, jax.grad, jax.vmap).
NESTED_WARNING = (
    "oocjax: {name} was called inside a jax transformation (jax.jit, jax.grad, jax.vmap, ...): it is traced "
    "inline there, as a nested jax.jit is, and its budget of {budget} does not apply. The budget holds only "
    "where an ooc_jit function is called at the top level, on arrays; an outer jit, grad or vmap decides the "
    "memory of the whole itself. To keep the budget, wrap the whole (differentiated) step in ooc_jit, e.g. "
    "ooc_jit(jax.value_and_grad(loss), budget=...) rather than jax.grad(ooc_jit(loss, budget=...))."
)

_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(jax.__file__)))


def warn_nested(name: str, budget_bytes: int) -> None:
    """Warns that step ``name`` runs inline in a transformation, where its budget does not hold."""
    message = NESTED_WARNING.format(name=name, budget=format_bytes(budget_bytes))
    warnings.warn(message, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller at the first frame outside
    oocjax and jax: the user's line that called the transformation, not jax's internals."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
