"""Plans and their compiled segments kept across processes, beside JAX's persistent compilation cache.

Where ``jax_compilation_cache_dir`` is set, a step's first call in a new process does not plan or
compile again what an earlier process planned for the same step, budget and options: it reads the
plan (the chosen program, schedule, segments and their measured sizes) and the segments' compiled
programs (``jax.experimental.serialize_executable``) from ``<cache dir>/oocjax``. What remains is
tracing the step, which the key needs, as ``jax.jit``'s own cache does.

The key covers everything a plan depends on: the step's jaxpr (every shape, primitive and
parameter), donation, which arguments the caller holds and where they are, the budget and options,
the device, the versions of jax and jaxlib and oocjax's own source. A plan with a recompute policy
function is never cached (a function has no stable key). An entry that cannot be read is ignored
and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jaxlib

from oocjax.schedule.settled import SettledPlan

FORMAT = 2  # bumped when what an entry holds changes


@dataclass(frozen=True, slots=True)
class Entry:
    """What one entry holds: the settled plan, its distinct compiled programs (serialized) and,
    per segment, which of them it runs."""

    settled: SettledPlan
    executables: tuple[tuple, ...]
    program_index: tuple[int, ...]

    @classmethod
    def of(cls, settled: SettledPlan, programs: Sequence[Any]) -> Entry:
        """The entry of ``settled`` and its segments' compiled ``programs``, each distinct one
        serialized once (none: the plan alone, as on a platform whose programs do not survive
        that, ``KEEPS_PROGRAMS``)."""
        distinct = list({id(p): p for p in programs}.values())
        where = {id(p): i for i, p in enumerate(distinct)}
        return cls(settled, tuple(serialize(p) for p in distinct), tuple(where[id(p)] for p in programs))

    def programs(self) -> list[Any] | None:
        """Every segment's compiled program, loaded (a program shared by segments, once); None where
        the entry keeps the plan alone (compile them again: JAX's persistent cache has them)."""
        if not self.program_index:
            return None
        loaded = [deserialize(p) for p in self.executables]
        return [loaded[i] for i in self.program_index]


# XLA:CPU programs serialized here and loaded by a later process could fail at their first run
# ("Error dispatching computation: Function broadcast_select_fusion not found"): on this project's
# 2-core CPU, the test zoo's 4-layer transformer at 30%, in 15 of 18 second processes that loaded
# them, where the same programs compiled again through JAX's persistent cache ran (2 of 2). On a
# CPU an entry keeps the plan alone, and a later process compiles its segments again (from JAX's
# cache: fast); since then 7 of 7 such second processes ran.
KEEPS_PROGRAMS = {"cpu": False}


def directory() -> Path | None:
    """Where entries live: ``oocjax`` under JAX's persistent cache directory (None: not enabled)."""
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "oocjax" if root else None


def key(*parts: Any) -> str | None:
    """A digest of ``parts`` (a repr that is complete for them) with the versions and device, or
    None when caching is off or a part cannot be keyed (a function)."""
    if directory() is None or any(callable(p) for p in parts):
        return None
    device = jax.local_devices()[0]
    seen = (FORMAT, _source_digest(), jax.__version__, jaxlib.__version__, device.platform, device.device_kind, parts)
    return hashlib.sha256(repr(seen).encode()).hexdigest()


def placement(layout: Any) -> tuple | None:
    """What a stored plan of a step on a mesh was compiled for: every buffer's sharding, the mesh's
    devices in order, and this process (compiled programs name their devices)."""
    if layout is None:
        return None
    devices = tuple(d.id for d in layout.replicated.mesh.devices.flat)
    return repr(layout.shardings), devices, jax.process_index(), jax.process_count()


def load(name: str | None) -> Entry | None:
    """The entry stored under ``name``, or None (absent, unreadable, or from another version)."""
    if name is None:
        return None
    path = directory() / f"{name}.pkl"
    try:
        entry = pickle.loads(path.read_bytes())
        if not isinstance(entry, Entry):
            raise TypeError(f"it holds a {type(entry).__name__}, not an Entry")
        return entry
    except FileNotFoundError:
        return None
    except Exception as error:  # a truncated or stale entry: plan again, and replace it
        warnings.warn(f"oocjax: ignoring an unreadable plan cache entry {path}: {error}", stacklevel=3)
        return None


def store(name: str | None, entry: Entry) -> None:
    """Writes ``entry`` under ``name``, atomically (a reader never sees half an entry)."""
    if name is None:
        return
    path = directory() / f"{name}.pkl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{id(entry)}.tmp")
        partial.write_bytes(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
        partial.replace(path)
    except OSError as error:
        warnings.warn(f"oocjax: could not write the plan cache entry {path}: {error}", stacklevel=3)


def serialize(compiled: Any) -> tuple:
    from jax.experimental.serialize_executable import serialize

    return serialize(compiled)


def deserialize(payload: tuple) -> Any:
    from jax.experimental.serialize_executable import deserialize_and_load

    return deserialize_and_load(*payload)


@functools.cache
def _source_digest() -> str:
    """oocjax's own code: a plan made by other code is not this code's plan."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
