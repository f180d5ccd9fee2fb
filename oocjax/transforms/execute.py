"""Running the chain of segments (``transforms.segment.Chain``) with real transfers, real waits and
a byte gate on how far dispatch runs ahead.

The loop is ``eval_jaxpr``'s, over records decoded once per plan: per segment, wait, prefetch,
launch, offload, and drop every slot whose last use that was. What it adds is memory accounting,
because on a GPU a launch allocates its outputs and scratch when the host *enqueues* it, and
memory given back (a dropped argument, an offloaded source) is free only once the work using it
has finished. So the executor counts

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
``ALLOCATOR_GATE = False`` turns this off (the account alone), to measure what it changes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.schedule.segments import SegmentCost
from oocjax.transforms import _compat as jc
from oocjax.transforms.memories import memory_kind, put, sharding, spec
from oocjax.transforms.segment import Chain, SegmentRun
from oocjax.transforms.shardings import array_shard_bytes

ALLOCATOR_GATE = True  # also wait on the allocator's bytes in use, where the device reports them


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """A segment about to be launched, as the executor accounts for it.

    Attributes:
      segment: its index.
      cost: its compiled program's own memory.
      held_bytes: device bytes of the arrays the executor references now.
      in_flight_bytes: device bytes it has let go of that work still enqueued may be using.
      allocator_bytes: the allocator's bytes in use as the gate last read them before this launch
        (None where the device reports none, or ``ALLOCATOR_GATE`` is off).
      foreign_bytes: bytes in use at the start of the call that were not the executor's.
    """

    segment: int
    cost: SegmentCost
    held_bytes: int
    in_flight_bytes: int
    allocator_bytes: int | None = None
    foreign_bytes: int = 0


_observer: Callable[[Launch], None] | None = None


@contextlib.contextmanager
def observe_segments(callback: Callable[[Launch], None]) -> Iterator[None]:
    """Calls ``callback(launch)`` just before each segment is launched (for tests and tools that
    sample memory, e.g. ``jax.live_arrays()`` or ``memory_stats()``, at every boundary)."""
    global _observer
    previous, _observer = _observer, callback
    try:
        yield
    finally:
        _observer = previous


def segment_specs(chain: jc.ClosedJaxpr) -> list[list[jax.ShapeDtypeStruct]]:
    """Per segment call of a chain's jaxpr (``Plan.jaxpr``), its arguments' types, on the device."""
    return [[spec(v.aval, "device") for v in eqn.invars] for eqn in chain.jaxpr.eqns if eqn.primitive is jc.jit_p]


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


class _DeviceMemory:
    """What the executor holds on the device and what it has let go of but may still be in use.

    What is in flight outlives a call: the next step's first launches are enqueued while the last
    one's tail may still run, so ``pending`` carries over from call to call. ``bytes_in_use`` reads
    the allocator's own count (None: the device has none)."""

    def __init__(self, budget_bytes: int, bytes_in_use: Callable[[], int | None] | None = None):
        self.budget_bytes = budget_bytes
        self.bytes_in_use = bytes_in_use
        self.pending_bytes = 0
        self.pending: deque[list] = deque()  # [ready probe or None, bytes], oldest first
        self.latest_launch: Any = None  # ready once the last launch is done, so are its deferred frees
        self.foreign_bytes = 0
        self.allocator_bytes: int | None = None  # the gate's last reading
        self.start_call()

    def start_call(self) -> None:
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

    def release(self, arrays: Sequence[Any], probe: Any, extra_bytes: int = 0) -> None:
        """Lets go of ``arrays`` (and ``extra_bytes`` of scratch), in use until ``probe`` is ready."""
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
        if freed > 0 and probe is not None:
            self.pending.append([probe, freed])
            self.pending_bytes += freed

    def consumed(self, donated: Sequence[Any], probe: Any) -> None:
        """Arrays donated to a launch can no longer be polled: what waits on them waits on ``probe``
        (a result of that later launch, which ends after them)."""
        gone = {id(x) for x in donated}
        for entry in self.pending:
            if id(entry[0]) in gone:
                entry[0] = probe
        if id(self.latest_launch) in gone:
            self.latest_launch = probe

    def launched(self, probe: Any) -> None:
        """A segment was launched; ``probe`` is ready once it is done."""
        self.latest_launch = probe

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
            elif self.latest_launch is not None:
                _wait(self.latest_launch)  # its outputs' and the released arrays' frees happen after it
                self.latest_launch = None
            else:
                return  # nothing left to wait on

    def drain(self) -> None:
        """Waits for everything in flight (after a failed call: the next one starts with nothing pending)."""
        try:
            while self.pending:
                self._wait_oldest()
            _wait(self.latest_launch)
        finally:
            self.pending.clear()
            self.pending_bytes, self.latest_launch = 0, None

    def _read_allocator(self) -> int | None:
        return self.bytes_in_use() if ALLOCATOR_GATE and self.bytes_in_use is not None else None

    def _forget_finished(self) -> None:
        while self.pending and _finished(self.pending[0][0]):
            self._forget_oldest()

    def _wait_oldest(self) -> None:
        _wait(self.pending[0][0])
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, nbytes = self.pending.popleft()
        self.pending_bytes -= nbytes


def _probe(values: Sequence[Any]) -> Any:
    """A value that is ready once the work that made ``values`` is done (None if none can tell: a
    typed random key cannot be polled)."""
    return next((x for x in values if hasattr(x, "is_ready")), None)


def _device_bytes(x: Any) -> int:
    """What ``x`` costs each device it is on (a sharded array: its shard), if in device memory."""
    return array_shard_bytes(x) if memory_kind(x) == "device" else 0


def _in_host(x: Any) -> Any:
    return x.sharding.with_memory_kind("pinned_host")


def _finished(probe: Any) -> bool:
    # A probe the caller has deleted since (a returned array it donated) cannot be polled: polling a
    # deleted array crashes the process. Its work was enqueued before anything that deleted it.
    return probe is None or probe.is_deleted() or probe.is_ready()


def _wait(probe: Any) -> None:
    if probe is not None and not probe.is_deleted():
        probe.block_until_ready()


class ChainExecutor:
    """Runs a ``Chain`` (``transforms.segment.build_chain``) on the step's flat arguments.

    Where the device reports its allocator's statistics, each call also measures its own peak,
    ``measured_peak_bytes``: the allocator's count at each launch plus what the launch allocates,
    and the process's peak if the call raised it, less the memory that was not the executor's when
    the call started. That includes what no account sees (the allocator's fragmentation), so the
    caller can plan again when it is over the budget."""

    measured_peak_bytes: int | None = None  # of the last call; None where the device reports nothing

    def __init__(self, chain: Chain, budget_bytes: int, functions: Sequence[Callable] = ()):
        self.chain, self.budget_bytes = chain, budget_bytes
        self.functions = list(functions)  # the jitted segments, run instead under jax_debug_nans / _infs
        self._checked_functions: dict[int, Callable] = {}  # those segments without donation, made when first run
        self.argument_of_slot = {slot: i for i, slot in enumerate(chain.argument_slots)}
        self.consumed_arguments: list[int] = []  # of the last call: caller's arrays a launch consumed
        self.host, self.device = sharding("pinned_host"), sharding("device")
        device = next(iter(self.device.device_set))
        self.memory = _DeviceMemory(budget_bytes, allocator_reader(device))
        self.peak_in_use = peak_reader(device)

    def __call__(self, arguments: list[Any], owned: Sequence[bool] = ()) -> list[Any]:
        """Runs the chain on the flat arguments, taking the list over: it is emptied, so that no
        argument outlives its last use here. ``owned`` marks arguments that are copies made for
        this call (moved to the memory the plan wants them in): deleted at their last use.

        Not reentrant: one call at a time (``ooc_jit`` holds a lock around it). If the call fails,
        or is interrupted between segments, it waits for the work in flight, deletes what it made
        and lets go of everything else before the error propagates; ``consumed_arguments`` then
        lists the arguments whose device buffers a launch had consumed (donated)."""
        memory, chain = self.memory, self.chain
        memory.start_call()
        self.consumed_arguments = []
        peak_before = self.peak_in_use() if self.peak_in_use is not None else None
        self._launch_peak: int | None = None
        slots: list[Any] = [None] * chain.num_slots
        owned = list(owned) or [False] * len(arguments)
        # The caller's arrays (and the constants): let go of, never deleted, if the call fails.
        self._callers = {id(x) for _, x in chain.constants} | {id(x) for x, mine in zip(arguments, owned) if not mine}
        try:
            for slot, x in chain.constants:
                slots[slot] = x
                memory.hold(x, _device_bytes(x), owned=False)
            for slot, x, mine in zip(chain.argument_slots, arguments, owned, strict=True):
                slots[slot] = x
                memory.hold(x, _device_bytes(x), owned=mine)
            arguments.clear()
            memory.count_foreign()
            for run in chain.runs:
                self._run(run, slots)
            results = [r.val if isinstance(r, jc.Literal) else slots[r] for r in chain.results]
        except BaseException:
            self._abandon(slots)
            raise
        self._measure(peak_before)
        return results

    def _run(self, run: SegmentRun, slots: list[Any]) -> None:
        """One segment: its waits, prefetches, launch and offloads, each slot dropped at its last use.
        Transfers are named as in the chain (``oocjax.offload(<value>)``): a profiler trace says what moves."""
        memory, host_offset, slot_bytes = self.memory, self.chain.host_offset, self.chain.slot_bytes
        if run.waits:
            with jax.profiler.TraceAnnotation(run.names[0]):
                for slot in run.waits:
                    slots[slot].block_until_ready()
        if run.prefetches:
            memory.make_room(run.prefetch_bytes)
            # On a mesh, each value comes back in its own layout, as the segment was compiled for it.
            target = self.device if self.chain.shardings is None else [self.chain.shardings[b] for b in run.prefetches]
            with jax.profiler.TraceAnnotation(run.names[1]):
                copies = put([slots[b + host_offset] for b in run.prefetches], target)
            for b, x in zip(run.prefetches, copies):
                slots[b] = x
                memory.hold(x, slot_bytes[b], owned=True)
            del copies
        for slot in run.dropped_after_prefetches:
            slots[slot] = None
        inputs = [slots[b] for b in run.inputs]
        inputs += run.literals
        outputs = self._launch(run, inputs)
        del inputs
        for b, x in zip(run.outputs, outputs):
            slots[b] = x
            memory.hold(x, slot_bytes[b], owned=True)
        dying = [slots[b] for b in run.dropped_after_launch]
        for b in run.dropped_after_launch:
            slots[b] = None
        memory.release(dying, probe=_probe(outputs), extra_bytes=run.cost.temp_bytes - run.cost.alias_bytes)
        del dying, outputs
        if run.offloads:
            leaving = [slots[b] for b in run.offloads]
            # On a mesh, each shard is copied to its own device's host memory: the layout stays.
            target = self.host if self.chain.shardings is None else [_in_host(x) for x in leaving]
            with jax.profiler.TraceAnnotation(run.names[2]):
                copies = put(leaving, target)
            del leaving
            for b, copy, last in zip(run.offloads, copies, run.dropped_after_offload):
                slots[b + host_offset] = copy
                if last:
                    memory.release([slots[b]], probe=copy)
                    slots[b] = None

    def _launch(self, run: SegmentRun, inputs: list[Any]) -> list[Any]:
        """Launches a segment once there is room for it; its results."""
        memory, cost = self.memory, run.cost
        memory.make_room(cost.launch_bytes)
        if _observer is not None:
            _observer(
                Launch(
                    segment=run.index,
                    cost=cost,
                    held_bytes=memory.held,
                    in_flight_bytes=memory.pending_bytes,
                    allocator_bytes=memory.allocator_bytes,
                    foreign_bytes=memory.foreign_bytes,
                )
            )
        if memory.allocator_bytes is not None:
            at_launch = memory.allocator_bytes - memory.foreign_bytes + cost.launch_bytes
            self._launch_peak = max(self._launch_peak or 0, at_launch)
        if self.functions and (jax.config.jax_debug_nans or jax.config.jax_debug_infs):
            outputs = self._checked(run.index)(*inputs)
        else:
            outputs = run.program(*inputs)
        probe = _probe(outputs)
        if any(run.donated):
            donated = [x for x, d in zip(inputs, run.donated) if d]
            memory.consumed(donated, probe)
            # XLA may leave a donation unused (no result of that shape and type to write over: jax
            # warns "Some donated buffers were not usable"), and jax then keeps the array: a caller's
            # donated argument would stay on the device, out of the account, until the call ends. This
            # launch is its last device use, as the plan counts it: delete it, as a used donation does.
            for x in donated:
                if not x.is_deleted():
                    x.delete()
            self.consumed_arguments += [
                self.argument_of_slot[b]
                for b, d, x in zip(run.inputs, run.donated, inputs)
                if d and b in self.argument_of_slot and id(x) not in memory.owned and x.is_deleted()
            ]
        memory.launched(probe)
        return outputs

    def _abandon(self, slots: list[Any]) -> None:
        """After a failure: nothing of the call may stay alive through the exception. Work in flight
        is waited for (its memory is then free and the next call's account starts clean), arrays
        the executor made are deleted, and the caller's are let go of."""
        memory = self.memory
        with contextlib.suppress(Exception):  # the failed work itself may raise again when waited on
            memory.drain()
        for x in slots:  # results, copies, prefetches, offloads, and copies made for the call (``owned``)
            if isinstance(x, jax.Array) and id(x) not in self._callers and not x.is_deleted():
                x.delete()
        slots.clear()
        memory.start_call()

    def _checked(self, segment: int) -> Callable:
        """The segment as ``jax.jit`` runs it under ``jax_debug_nans`` / ``_infs``: donating nothing,
        so that on a NaN or inf jax can run its equations again one by one and raise a
        ``FloatingPointError`` naming the operation (``transforms.segment`` adds the source line).
        On a mesh it keeps the segment's layout: each input and output in its buffer's sharding,
        the literals as they were placed (replicated)."""
        if segment not in self._checked_functions:
            function, shardings = self.functions[segment].__wrapped__, self.chain.shardings
            if shardings is None:
                inputs: Any = self.device
                outputs: Any = self.device
            else:
                run = self.chain.runs[segment]
                inputs = (*(shardings[b] for b in run.inputs), *(x.sharding for x in run.literals))
                outputs = tuple(shardings[b] for b in run.outputs)
            self._checked_functions[segment] = jax.jit(function, in_shardings=inputs, out_shardings=outputs)
        return self._checked_functions[segment]

    def _measure(self, peak_before: int | None) -> None:
        """Sets ``measured_peak_bytes`` for the call just made. Allocations happen when work is
        enqueued, so the process's peak is final once the last launch is enqueued."""
        peak_after = self.peak_in_use() if self.peak_in_use is not None else None
        raised = (
            peak_after - self.memory.foreign_bytes if peak_before is not None and peak_after > peak_before else None
        )
        samples = [x for x in (self._launch_peak, raised) if x is not None]
        self.measured_peak_bytes = max(samples) if samples else None
