"""Memory kinds, ``"device"`` and ``"pinned_host"``: of this process's first device, or, for a value
placed on several devices (a mesh), of those devices in the same layout."""

from __future__ import annotations

import functools
from collections.abc import Sequence
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


def put(values: Sequence[Any], targets: jax.sharding.Sharding | Sequence[jax.sharding.Sharding]) -> list[Any]:
    """``jax.device_put(values, targets)`` in one batch, except that in a run of several processes
    an array spanning them, moved to another memory in its own layout, is copied shard by shard:
    ``device_put`` would run a resharding program across the processes for it (117 of them per
    step in a two-process run, when measured), where each process can copy its own shards with no
    program. In one process, ``jax.device_put`` itself: no array is inspected on the hot path."""
    if jax.process_count() == 1:
        return jax.device_put(list(values), targets)
    targets = list(targets) if isinstance(targets, Sequence) else [targets] * len(values)
    by_shard = [_spans_processes(x) and _same_layout(x, t) for x, t in zip(values, targets, strict=True)]
    whole = [i for i, shard_wise in enumerate(by_shard) if not shard_wise]
    moved = dict(zip(whole, jax.device_put([values[i] for i in whole], [targets[i] for i in whole]), strict=True))
    for i in (i for i, shard_wise in enumerate(by_shard) if shard_wise):
        shards = [s.data for s in values[i].addressable_shards]
        copies = jax.device_put(shards, [s.sharding.with_memory_kind(targets[i].memory_kind) for s in shards])
        moved[i] = jax.make_array_from_single_device_arrays(values[i].shape, targets[i], copies)
    return [moved[i] for i in range(len(values))]


def _spans_processes(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _same_layout(x: jax.Array, target: jax.sharding.Sharding) -> bool:
    return x.sharding.with_memory_kind(target.memory_kind).is_equivalent_to(target, x.ndim)


def on_device(values: Sequence[Any]) -> tuple[Any, ...]:
    """``values`` placed in device memory."""
    return tuple(jax.device_put(x, sharding("device")) for x in values)
