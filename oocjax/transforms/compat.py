"""Every use of jax internals (``jax.extend`` and ``jax._src``) in oocjax, in one place.

Checked against jax 0.10.2. When jax moves, this is the only file that should need to follow.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from jax._src import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Primitive, Var, jaxpr_as_fun
from jax.extend.core import primitives as _p
from jax.interpreters import mlir

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Var",
    "bind_equation",
    "called_function_name",
    "equation_context",
    "jaxpr_as_fun",
    "nbytes",
    "nested_in",
    "scope_path",
    "source_line",
    "sub_jaxprs",
    "unrolled_threefry",
    "wait_p",
]

# Higher-order primitives oocjax knows. ``jit`` (pjit) calls are inlined; the others stay opaque.
jit_p = _p.jit_p
scan_p = _p.scan_p
while_p = _p.while_p
cond_p = _p.cond_p
remat_p = _p.remat_p
custom_jvp_call_p = _p.custom_jvp_call_p
custom_vjp_call_p = _p.custom_vjp_call_p
closed_call_p = _p.closed_call_p
device_put_p = _p.device_put_p
# Primitives whose jaxpr params are scalar combiners (how to add two elements), not calls: they
# need no scratch beyond their operands and results.
combiner_primitives = frozenset(
    getattr(_p, name)
    for name in (
        "scatter_p",
        "scatter_add_p",
        "scatter_mul_p",
        "scatter_min_p",
        "scatter_max_p",
        "reduce_p",
        "reduce_window_p",
        "select_and_scatter_p",
        "select_and_scatter_add_p",
        "select_and_gather_add_p",
    )
)


# ``ooc_wait``: in the chain of segments, block until a host copy is complete, so that the device
# memory of its source is free. Identity on values; inside a compiled program it is a no-op.
wait_p = Primitive("ooc_wait")
wait_p.def_impl(lambda x: x.block_until_ready())
wait_p.def_abstract_eval(lambda aval: aval)
mlir.register_lowering(wait_p, lambda ctx, x: [x])


_threefry_lock = threading.Lock()
_threefry_blocks = 0  # blocks running now, in any thread: the rolled rule comes back after the last


@contextlib.contextmanager
def unrolled_threefry() -> Iterator[None]:
    """Lowers Threefry's rounds unrolled on the CPU too, while the block runs.

    jax lowers them as a loop on the CPU, which XLA:CPU compiles slowly: measured on this project's
    2-core machine, a program with one dropout mask of 16x32x64 compiled in 0.55 s of CPU time
    with the loop and 0.057 s unrolled, and ran in 357 against 149 us; the bits are the same (the
    rounds are integer arithmetic). Every program that makes random bits pays that compile, and a
    chain of segments has several such programs where ``jax.jit`` has one. jax's lowering rules
    are one table for the process: while a block runs, whatever another thread lowers for the CPU
    gets the unrolled rounds too (the same bits). Where jax's internals have moved, nothing changes."""
    global _threefry_blocks
    try:
        from jax._src.random import threefry2x32 as threefry

        rolled, unrolled = threefry._threefry2x32_cpu_lowering_rule, threefry._threefry2x32_lowering_rule
    except (ImportError, AttributeError):
        yield
        return
    with _threefry_lock:
        if not _threefry_blocks:
            mlir.register_lowering(threefry.threefry2x32_p, unrolled, platform="cpu")
        _threefry_blocks += 1
    try:
        yield
    finally:
        with _threefry_lock:
            _threefry_blocks -= 1
            if not _threefry_blocks:
                mlir.register_lowering(threefry.threefry2x32_p, rolled, platform="cpu")


def nbytes(aval: Any) -> int:
    """Device bytes of an abstract value; 0 for tokens and other shapeless values.

    Extended dtypes (PRNG keys) report the itemsize of their underlying data.
    """
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    size = 1
    for dim in shape:
        size *= int(dim)
    return size * int(dtype.itemsize)


def sub_jaxprs(params: dict[str, Any]) -> Iterator[tuple[str, ClosedJaxpr | Jaxpr]]:
    """The jaxprs an equation's params hold, found generically (as equinox's passes do)."""
    for name, value in params.items():
        values = value if isinstance(value, tuple) else (value,)
        for item in values:
            if isinstance(item, (ClosedJaxpr, Jaxpr)):
                yield name, item


def bind_equation(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Applies an equation's primitive to values, as ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    # Older jax returned (subfuns, params); 0.10.2 returns the params alone.
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


@contextlib.contextmanager
def equation_context(eqn: JaxprEqn) -> Iterator[None]:
    """Re-binds under the equation's user source info, so the rewritten program points at user code."""
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
        yield


def with_source_of(eqn: JaxprEqn, source: JaxprEqn) -> JaxprEqn:
    """``eqn`` as if written where ``source`` was (oocjax's own slicing and stacking of a scan)."""
    return eqn.replace(source_info=source.source_info)


def nested_in(eqn: JaxprEqn, caller: JaxprEqn) -> JaxprEqn:
    """``eqn``, from the body of ``caller`` (a ``jit``, remat or ``scan`` equation), as jax's own
    inlining gives it: the caller's name stack before its own (a body's name stack is relative to
    its call, so a Flax module that calls a jitted function, ``jax.random`` or ``jnp.where``, would
    otherwise lose its path), and the caller's traceback where its own has no frame of the user's
    (the body of a jitted library function: its equations then point at the line that called it)."""
    info = eqn.source_info
    outer = caller.source_info.name_stack
    name_stack = outer + info.name_stack if outer.stack else None
    traceback = caller.source_info.traceback if _user_frame(info.traceback) is None else None
    if name_stack is None and traceback is None:
        return eqn
    return eqn.replace(source_info=info.replace(traceback=traceback, name_stack=name_stack))


# Scopes jax itself opens, which name no part of the user's model.
_JAX_SCOPES = frozenset({"rematted_computation"})


def scope_path(eqn: JaxprEqn) -> str:
    """``"Transformer/Block_0/Dense_1"``: the named scopes an equation ran in (Flax modules, whose
    methods run under ``jax.named_scope``, and the user's own), without the transformations around
    them (``jvp``, ``transpose``); ``""`` outside any."""
    return _scope_path(eqn.source_info.name_stack)


@functools.lru_cache(maxsize=4096)  # equations of one module share name stacks
def _scope_path(name_stack: Any) -> str:
    path: list[str] = []
    part: list[str] = []
    for item in name_stack.stack:
        if isinstance(item, source_info_util.Transform):
            path, part = _rerooted(path, part), []
        elif item.name not in _JAX_SCOPES:
            part.append(item.name)
    return "/".join(_rerooted(path, part))


def _rerooted(path: list[str], part: list[str]) -> list[str]:
    """The path after ``part``, the scopes that follow a transformation. A transformed equation may
    carry its whole stack again there (jax's transpose of a remat block gives
    ``transpose(jvp(Model))/jvp(Model)``): a part that repeats the path so far replaces it."""
    return part if path and part[: len(path)] == path else path + part


def called_function_name(eqn: JaxprEqn) -> str | None:
    """The name of the function a call equation runs, as its user wrote it: ``relu`` for the
    ``custom_jvp_call`` of ``jax.nn.relu``, ``silu`` for the ``jit`` of ``jax.nn.silu``, ``where``
    for ``jnp.where``'s ``_where``; None where there is none (a lambda, or not a call)."""
    name = eqn.params.get("name")
    if not isinstance(name, str):
        callee = eqn.params.get("call_jaxpr")
        debug = getattr(getattr(callee, "jaxpr", callee), "debug_info", None)
        name = getattr(debug, "func_name", None)
    name = name.lstrip("_") if isinstance(name, str) else ""
    return name if name.isidentifier() else None


def source_line(eqn: JaxprEqn) -> str:
    """``"model.py:42 (loss)"``: the user's line an equation came from, or ``""`` if none.

    Frames in installed libraries (Flax's ``nn.scan``, Optax) are skipped, so that an equation
    names the line of the user's model that called them; a notebook cell reads ``In[3]:5``."""
    frame = _user_frame(eqn.source_info.traceback)
    if frame is None:
        return ""
    function = frame.function_name.rsplit(".", 1)[-1]
    return f"{_file_label(frame.file_name)}:{frame.start_line} ({function})"


_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=4096)  # equations of one layer share tracebacks
def _user_frame(traceback: Any) -> Any:
    frames = list(source_info_util.user_frames(traceback))
    return next((f for f in frames if not any(d in f.file_name for d in _LIBRARY_DIRS)), frames[0] if frames else None)


def _file_label(path: str) -> str:
    """The file's name, or ``In[3]`` for the code of a notebook cell (IPython compiles each cell to
    a file with a hashed name)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(path)
    return named[1] if named else os.path.basename(path)
