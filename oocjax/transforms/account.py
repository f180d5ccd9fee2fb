"""The executor's account of device memory, and its byte gate on how far dispatch runs ahead.

The executor (``transforms.execute``) needs it because on a GPU a launch allocates its outputs
and scratch when the host *enqueues* it, and memory given back (a dropped argument, an offloaded
source) is free only once the work using it has finished. So the executor counts

* ``held``: device arrays it references (arguments, segment results, prefetched copies);
* ``pending``: memory it has let go of that may still be in use, each entry with an array that is
  ready once that memory is free (a later result of the same program, or the host copy of an
  offload);

and before each launch or prefetch it waits, oldest first, until ``held + pending + what the
launch allocates`` fits the budget: the seed algorithm's "wait for a swap-out only when its memory
is needed", extended to everything in flight.

Where the device reports its allocator's ``bytes_in_use`` (GPUs; a CPU reports nothing), the
executor also asks the allocator, because the account can fall short of it: on an H200 the
allocator had up to 0.53 GiB more in use at a launch than ``held + pending`` (whether memory given
back later than the account assumes, or memory outside it, was not yet known). At the start of a
call the executor takes what is in use beyond its account as not its own (the caller's other
arrays); before each launch or prefetch, after the account's wait, it goes on waiting, oldest
first and then on the latest launch, while the allocator's count less that foreign memory plus
what the launch allocates is over the budget, until nothing is left to wait on.
``DeviceAccess(allocator_gate=False)`` turns this off (the account alone), to measure what it changes.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.transforms.memories import put

# Platforms whose client runs launches in order on one compute stream, with an allocator that
# hands memory freed by a launch to the next launch on that stream at once (PJRT's GPU client).
COMPUTE_SYNCHRONIZED = frozenset({"gpu", "cuda", "rocm"})


def _stat_reader(device: jax.Device, stat: str) -> Callable[[], int | None] | None:
    """A function reading one of ``device``'s allocator statistics; None where it reports none (a CPU)."""
    if stat not in (device.memory_stats() or {}):
        return None
    return lambda: (device.memory_stats() or {}).get(stat)


def allocator_reader(device: jax.Device) -> Callable[[], int | None] | None:
    """The bytes ``device``'s allocator has in use now."""
    return _stat_reader(device, "bytes_in_use")


def peak_reader(device: jax.Device) -> Callable[[], int | None] | None:
    """The most bytes ``device``'s allocator has had in use in this process (fragmentation included)."""
    return _stat_reader(device, "peak_bytes_in_use")


class DeviceMemory:
    """What the executor holds on the device and what it has let go of but may still be in use.

    What is in flight outlives a call: the next step's first launches are enqueued while the last
    one's tail may still run, so ``pending`` carries over from call to call. ``bytes_in_use`` reads
    the allocator's own count (None: the device has none).

    ``stream_ordered``: the device runs launches in order on one compute stream and its allocator
    is synchronized with that stream (``COMPUTE_SYNCHRONIZED``), so memory whose last use is a
    launch is reusable by the next launch at once: nothing waits for it. Only a copy to host runs
    beside the compute stream, and its source stays in use until the copy ends."""

    def __init__(
        self,
        budget_bytes: int,
        bytes_in_use: Callable[[], int | None] | None = None,
        *,
        stream_ordered: bool = False,
        access: DeviceAccess | None = None,
    ):
        self.budget_bytes, self.stream_ordered = budget_bytes, stream_ordered
        self.access = access = access or DeviceAccess()
        self.bytes_in_use = bytes_in_use if access.allocator_gate else None
        self.pending_bytes = 0
        # Probes are held weakly: a result the caller dropped after the call must not stay on the
        # device (an H200 step found a 250 MiB result of another wrapper's last call still there).
        self.pending: deque[list] = deque()  # [weak ready probe or None, bytes], oldest first
        self.latest_launch: Any = None  # weakly, ready once the last launch is done, so are its deferred frees
        self.foreign_bytes = 0
        self.allocator_bytes: int | None = None  # the gate's last reading
        self.start_call()

    def start_call(self) -> None:
        self.waits, self.blocked_s = 0, 0.0  # of this call: host waits on the device, and their time
        self.held = 0
        self.references: dict[int, list[int]] = {}  # id(array) -> [slots naming it, its device bytes]
        self.owned: set[int] = set()  # ids of arrays the executor made (not arguments or constants)

    def hold(self, x: Any, nbytes: int, *, owned: bool) -> None:
        """References ``x``, of ``nbytes`` on the device (0: it is in host memory, not counted)."""
        if not nbytes:
            return
        key = id(x)
        entry = self.references.get(key)
        if entry is None:
            self.references[key] = [1, nbytes]
            self.held += nbytes
            if owned:
                self.owned.add(key)
        else:
            entry[0] += 1

    def release(self, arrays: Sequence[Any], probe: Any, extra_bytes: int = 0, *, copied: bool = False) -> None:
        """Lets go of ``arrays`` (and ``extra_bytes`` of scratch), in use until ``probe`` is ready:
        a later launch's result, or (``copied``) the host copy of what the arrays held. Where the
        device is ``stream_ordered``, only a copy keeps the memory in use."""
        freed = extra_bytes
        deleted = []
        for x in arrays:
            key = id(x)
            entry = self.references.get(key)
            if entry is None:
                continue
            entry[0] -= 1
            if not entry[0]:
                del self.references[key]
                self.held -= entry[1]
                freed += entry[1]
                if key in self.owned:
                    # Delete now rather than when Python lets go of the object: a stray reference
                    # (a cycle the collector has not reached) must not hold device memory.
                    # PJRT keeps the buffer until work already enqueued on it is done.
                    self.owned.discard(key)
                    if not x.is_deleted():
                        deleted.append(x)
        if deleted:
            self.consumed(deleted, probe)  # what waited on them waits on what used them last
            for x in deleted:
                x.delete()
        if freed > 0 and probe is not None and (copied or not self.stream_ordered):
            self.pending.append([_weak(probe), freed])
            self.pending_bytes += freed

    def consumed(self, donated: Sequence[Any], probe: Any) -> None:
        """Arrays donated to a launch can no longer be polled: what waits on them waits on ``probe``
        (a result of that later launch, which ends after them)."""
        gone = {id(x) for x in donated}
        for entry in self.pending:
            if id(_target(entry[0])) in gone:
                entry[0] = _weak(probe)
        if id(_target(self.latest_launch)) in gone:
            self.latest_launch = _weak(probe)

    def launched(self, probe: Any) -> None:
        """A segment was launched; ``probe`` is ready once it is done."""
        self.latest_launch = _weak(probe)

    def count_foreign(self) -> None:
        """Takes what the allocator has in use beyond the executor's account, at the start of a call
        (its arguments and constants held), as not the executor's: the caller's other arrays."""
        self._forget_finished()
        in_use = self._read_allocator()
        self.foreign_bytes = 0 if in_use is None else max(0, in_use - self.held - self.pending_bytes)

    def make_room(self, nbytes: int) -> None:
        """Waits, oldest first, until ``nbytes`` more fit the budget or nothing is left in flight:
        by the account, then by the allocator's count."""
        self._forget_finished()
        while self.pending and self.held + self.pending_bytes + nbytes > self.budget_bytes:
            self._wait_oldest()
        while True:
            self.allocator_bytes = in_use = self._read_allocator()
            if in_use is None or in_use - self.foreign_bytes + nbytes <= self.budget_bytes:
                return
            if self.pending:
                self._wait_oldest()
            elif self.latest_launch is not None and not self.stream_ordered:
                self.block(_target(self.latest_launch))  # its outputs' and the released arrays' frees happen after it
                self.latest_launch = None
            else:
                return  # nothing left to wait on

    def drain(self) -> None:
        """Waits for everything in flight (after a failed call: the next one starts with nothing pending)."""
        try:
            while self.pending:
                self._wait_oldest()
            self.access.wait(_target(self.latest_launch))
        finally:
            self.pending.clear()
            self.pending_bytes, self.latest_launch = 0, None

    def _read_allocator(self) -> int | None:
        return None if self.bytes_in_use is None else self.bytes_in_use()

    def _forget_finished(self) -> None:
        while self.pending and self.access.finished(_target(self.pending[0][0])):
            self._forget_oldest()

    def block(self, probe: Any) -> None:
        """Waits for ``probe`` (counted in ``waits`` and ``blocked_s`` where it was not ready)."""
        if self.access.finished(probe):
            return
        started = time.perf_counter()
        self.access.wait(probe)
        self.waits += 1
        self.blocked_s += time.perf_counter() - started

    def _wait_oldest(self) -> None:
        self.block(_target(self.pending[0][0]))
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, nbytes = self.pending.popleft()
        self.pending_bytes -= nbytes


def ready_probe(values: Sequence[Any]) -> Any:
    """A value that is ready once the work that made ``values`` is done (None if none can tell: a
    typed random key cannot be polled)."""
    return next((x for x in values if hasattr(x, "is_ready")), None)


def _weak(probe: Any) -> weakref.ref | None:
    return None if probe is None else weakref.ref(probe)


def _target(reference: weakref.ref | None) -> Any:
    """The probe ``reference`` names; None once the caller dropped it (its memory is freed when the
    work enqueued on it is done, as for a probe the caller deleted)."""
    return None if reference is None else reference()


def finished(probe: Any) -> bool:
    # A probe the caller has deleted since (a returned array it donated) cannot be polled: polling a
    # deleted array crashes the process. Its work was enqueued before anything that deleted it.
    return probe is None or probe.is_deleted() or probe.is_ready()


def wait(probe: Any) -> None:
    if probe is not None and not probe.is_deleted():
        probe.block_until_ready()


@dataclass(frozen=True, slots=True)
class DeviceAccess:
    """How the executor reads, waits on and copies to the device: what tests and benchmarks replace
    (an allocator that never has room, waits that are recorded, the gate switched off).

    ``allocator_gate``: also wait on the allocator's bytes in use, where the device reports them.
    ``compute_synchronized``: the platforms whose launches run in order on one compute stream, with
    an allocator that hands memory freed by a launch to the next launch on it at once (PJRT's GPU
    client): there only a copy to host keeps memory in use."""

    allocator_gate: bool = True
    allocator_reader: Callable[[jax.Device], Callable[[], int | None] | None] = allocator_reader
    peak_reader: Callable[[jax.Device], Callable[[], int | None] | None] = peak_reader
    compute_synchronized: frozenset[str] = COMPUTE_SYNCHRONIZED
    finished: Callable[[Any], bool] = finished
    wait: Callable[[Any], None] = wait
    put: Callable[..., list[Any]] = put
    memory: type[DeviceMemory] = DeviceMemory  # the account itself (a subclass checks what it holds)
