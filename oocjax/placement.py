"""Which memory an array is in, and moving arrays there: ``to_host`` and ``to_device`` for users, and
the moves a call makes so that every argument is where the plan expects it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from oocjax.errors import OocError
from oocjax.schedule import format_bytes
from oocjax.transforms.memories import layout, memory_kind, put, sharding
from oocjax.transforms.shardings import Layout, array_shard_bytes


def to_host(tree: Any) -> Any:
    """``tree`` with every array leaf moved to host memory (``pinned_host``): state an ``ooc_jit``
    step may stream in, and that the device does not hold between steps.

    >>> import jax.numpy as jnp
    >>> to_host({"w": jnp.ones(2)})["w"].sharding.memory_kind
    'pinned_host'
    """
    return jax.tree.map(lambda x: to_memory(x, "pinned_host") if isinstance(x, jax.Array) else x, tree)


def to_device(tree: Any, *, free_bytes: int | None = None) -> Any:
    """``tree`` with every leaf kept in host memory (state an ``ooc_jit`` plan keeps there) moved to
    device memory, e.g. to evaluate the trained parameters with ``jax.jit``, which refuses to compute
    on host memory.

    Raises ``OocError`` when the device has less free memory than those leaves need (``free_bytes``,
    by default what its allocator reports; a CPU reports none): evaluate them where they are then,
    with an ``ooc_jit`` step under the training budget.

    >>> import jax.numpy as jnp
    >>> to_device({"w": jnp.ones(2)})["w"].sharding.memory_kind
    'device'
    """
    on_host = [x for x in jax.tree.leaves(tree) if memory_kind(x) == "pinned_host"]
    needed = sum(array_shard_bytes(x) for x in on_host)  # on each device: its shards
    free = _free_device_bytes() if free_bytes is None else free_bytes
    if free is not None and needed > free:
        raise OocError(
            f"to_device: the {len(on_host)} leaves kept in host memory need {format_bytes(needed)} on the device, "
            f"which has {format_bytes(free)} free.\n"
            "Fixes:\n"
            "  1. evaluate them where they are, with an ooc_jit step under the training budget (it streams them "
            "in): ooc_jit(eval_step, budget=...)(state, batch), without donating the state;\n"
            "  2. move only what you need, e.g. to_device(state['params']) without the optimizer state;\n"
            "  3. free device memory first (delete arrays you no longer need)."
        )
    return jax.tree.map(device_if_on_host, tree)


def _free_device_bytes() -> int | None:
    """What the device's allocator has left; None where the device does not say (a CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def on_host(x: Any) -> bool:
    return memory_kind(x) == "pinned_host"


def process_bytes(x: Any) -> int:
    """The bytes this process holds of ``x``: on a mesh, a shard on each of its own devices."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        return array_shard_bytes(x) * len(x.sharding.addressable_devices)
    return int(getattr(x, "nbytes", 0))


def device_if_on_host(x: Any) -> Any:
    """``x`` in device memory, in its own layout (never gathered onto one device)."""
    return put([x], x.sharding.with_memory_kind("device"))[0] if memory_kind(x) == "pinned_host" else x


def place_arguments(leaves: Sequence[Any], kinds: Sequence[str], placed: Layout | None) -> list[Any]:
    """The arguments in the memory kinds the plan expects; on a mesh (``placed``: the step's
    layout), also exactly in the shardings the compiled segments expect (they do not reshard)."""
    if placed is None:
        return [to_memory(x, kind) for x, kind in zip(leaves, kinds)]
    return [to_memory(x, kind, target) for x, kind, target in zip(leaves, kinds, placed.shardings)]


def to_memory(x: Any, kind: str, target: Any = None) -> Any:
    """Moves an argument to the memory the plan expects it in, if it is elsewhere; with a
    ``target`` sharding (a step on a mesh), also to that layout, if it is in another."""
    if target is None:
        if memory_kind(x) == kind:
            return x
        placed = layout(x)
        return put([x], sharding(kind) if placed is None else placed.with_memory_kind(kind))[0]
    target, current = target.with_memory_kind(kind), getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and current.is_equivalent_to(target, x.ndim):
        return x
    if isinstance(x, jax.Array) and len(current.device_set) == 1 < len(target.device_set):
        # A replicated copy of a one-device array keeps the original's buffer as one of its shards,
        # even with may_alias=False (jax 0.10.2): deleting a donated original would delete that shard.
        x = x.copy()
    return put([x], target)[0]
