"""Memory kinds on the one device oocjax plans for: ``"device"`` and ``"pinned_host"``."""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.cache
def sharding(kind: str) -> jax.sharding.Sharding:
    """The first device's memory of this kind."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def memory_kind(x: Any) -> str | None:
    """Where an array lives (None for values that are not placed, such as Python scalars)."""
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def abstract(x: Any) -> tuple:
    """Shape, dtype and weak type of an array, a Python scalar, an aval or a ``ShapeDtypeStruct``:
    its type, whatever memory it is in."""
    if not hasattr(x, "weak_type"):
        x = jax.typeof(x)
    return tuple(x.shape), x.dtype, bool(x.weak_type)


def spec(x: Any, kind: str) -> jax.ShapeDtypeStruct:
    """The type of ``x`` (as for ``abstract``), placed in ``kind``."""
    shape, dtype, weak_type = abstract(x)
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=sharding(kind))
