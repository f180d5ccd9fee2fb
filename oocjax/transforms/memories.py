"""Memory kinds, ``"device"`` and ``"pinned_host"``: of this process's first device, or, for a value
placed on several devices (a mesh), of those devices in the same layout."""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.cache
def sharding(kind: str) -> jax.sharding.Sharding:
    """The first local device's memory of this kind (in a multi-process run, ``jax.devices()[0]``
    may belong to another process)."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=kind)


def layout(x: Any) -> jax.sharding.Sharding | None:
    """The sharding of an array or ``ShapeDtypeStruct`` placed on several devices, in device memory
    (its layout, whatever memory it is in); None for anything on one device or not placed."""
    placed = getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
    if placed is None or len(placed.device_set) <= 1:
        return None
    return placed.with_memory_kind("device")


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
    """The type of ``x`` (as for ``abstract``), placed in ``kind``: on the first device, or, if
    ``x`` is placed on several devices, in its own layout."""
    shape, dtype, weak_type = abstract(x)
    placed = layout(x)
    target = sharding(kind) if placed is None else placed.with_memory_kind(kind)
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=target)
