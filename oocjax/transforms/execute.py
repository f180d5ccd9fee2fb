"""Running the chain of segments (``schedule.chain``, made executable by
``executable_chain``) with real transfers and real waits, within the budget.

The loop is ``eval_jaxpr``'s, over the chain's operations in order (waits, prefetches, launches,
offloads), each dropping the slots whose last use it is. What it adds is memory accounting: before
each launch or prefetch it waits until the device memory account (``transforms.account``) says
what the launch allocates fits the budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from oocjax.schedule.chain import OPERATION_NAMES, Chain, CopyIn, CopyOut, Launch, Operation, Wait
from oocjax.schedule.segments import SegmentCost
from oocjax.transforms import compat as jc
from oocjax.transforms.account import DeviceAccess, DeviceMemory, ready_probe
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.functions import segment_literals
from oocjax.transforms.memories import memory_kind, on_device, sharding
from oocjax.transforms.shardings import Layout, array_shard_bytes, shard_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutableChain:
    """A chain (``schedule.chain.Chain``) with what running it takes on JAX's side, all made once
    per plan so that the executor (``transforms.execute``) decodes nothing per call."""

    chain: Chain
    programs: tuple[Any, ...]  # per segment, its compiled program
    costs: tuple[SegmentCost, ...]  # per segment
    literals: tuple[tuple[Any, ...], ...]  # per segment, device arrays passed after its inputs
    names: tuple[str, ...]  # per operation, for profiles: ``oocjax.offload(<value>, ...)``, ``segment_3``
    constants: tuple[tuple[int, Any], ...]  # (slot, value)
    result_literals: tuple[Any, ...]  # per result of the step: its value where it is a literal
    slot_bytes: tuple[int, ...]  # per slot, the device bytes of its value, per device (0 for host slots)
    shardings: tuple[Any, ...] | None = None  # on a mesh: per buffer, its device sharding


def executable_chain(
    flat: FlatProgram,
    chain: Chain,
    programs: Sequence[Any],
    costs: Sequence[SegmentCost],
    labels: Sequence[str] = (),
    layout: Layout | None = None,
) -> ExecutableChain:
    """The chain with its compiled ``programs`` (per segment). With a ``layout`` (a mesh), sizes
    are per device, and constants and literals are placed on every device."""

    def name(op: Operation) -> str:
        if isinstance(op, Launch):
            return f"segment_{op.segment}"
        values = ", ".join(labels[b] if b < len(labels) else f"buffer {b}" for b in op.buffers)
        return f"oocjax.{OPERATION_NAMES[type(op)]}({values})"

    if layout is None:
        nbytes = [jc.nbytes(aval) for aval in flat.avals]
        constants, place = tuple(flat.constants), on_device
    else:
        nbytes = [shard_bytes(aval, s) for aval, s in zip(flat.avals, layout.shardings, strict=True)]
        constants = tuple((b, jax.device_put(x, layout.shardings[b])) for b, x in flat.constants)

        def place(values: Sequence[Any]) -> tuple[Any, ...]:
            return tuple(jax.device_put(x, layout.replicated) for x in values)

    return ExecutableChain(
        chain=chain,
        programs=tuple(programs),
        costs=tuple(costs),
        literals=tuple(place(segment_literals(flat, s)) for s in chain.segments),
        names=tuple(map(name, chain.operations)),
        constants=constants,
        result_literals=tuple(r.val if isinstance(r, jc.Literal) else None for r in flat.outputs),
        slot_bytes=(*nbytes, *(0 for _ in nbytes)),
        shardings=None if layout is None else layout.shardings,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchAccount:
    """A segment about to be launched, as the executor accounts for it.

    Attributes:
      segment: its index.
      cost: its compiled program's own memory.
      held_bytes: device bytes of the arrays the executor references now.
      in_flight_bytes: device bytes it has let go of that work still enqueued may be using.
      allocator_bytes: the allocator's bytes in use as the gate last read them before this launch
        (None where the device reports none, or ``DeviceAccess.allocator_gate`` is off).
      foreign_bytes: bytes in use at the start of the call that were not the executor's.
    """

    segment: int
    cost: SegmentCost
    held_bytes: int
    in_flight_bytes: int
    allocator_bytes: int | None = None
    foreign_bytes: int = 0


_observers: list[Callable[[LaunchAccount], None]] = []  # those of the ``observe_segments`` blocks open now


@contextlib.contextmanager
def observe_segments(callback: Callable[[LaunchAccount], None]) -> Iterator[None]:
    """Calls ``callback(launch)`` just before each segment is launched (for tests and tools that
    sample memory, e.g. ``jax.live_arrays()`` or ``memory_stats()``, at every boundary)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _device_bytes(x: Any) -> int:
    """What ``x`` costs each device it is on (a sharded array: its shard), if in device memory."""
    return array_shard_bytes(x) if memory_kind(x) == "device" else 0


def _in_host(x: Any) -> Any:
    return x.sharding.with_memory_kind("pinned_host")


Noting = Callable[[list[int]], str | None] | None  # what to note on a failed call's error, of its consumed arguments


@dataclass(frozen=True, slots=True)
class ChainRun:
    """What one call of the chain returns: the step's flat results, and the device peak it measured
    (None where the device reports no allocator statistics, or the gate is off)."""

    results: list[Any]
    measured_peak_bytes: int | None


class ChainExecutor:
    """Runs an ``ExecutableChain`` (``executable_chain``) on the step's flat
    arguments: one loop over the chain's operations, each slot dropped where the chain says.

    Where the device reports its allocator's statistics, each call also measures its own peak
    (``ChainRun.measured_peak_bytes``): the allocator's count at each launch plus what the launch allocates,
    and the process's peak if the call raised it, less the memory that was not the executor's when
    the call started. That includes what no account sees (the allocator's fragmentation), so the
    caller can plan again when it is over the budget."""

    def __init__(self, executable: ExecutableChain, budget_bytes: int, functions: Sequence[Callable] = (), access=None):
        self.executable, self.chain, self.budget_bytes = executable, executable.chain, budget_bytes
        self.functions = list(functions)  # the jitted segments, run instead under jax_debug_nans / _infs
        self._checked_functions: dict[int, Callable] = {}  # those segments without donation, made when first run
        self.argument_of_slot = {slot: i for i, slot in enumerate(self.chain.argument_slots)}
        self._consumed_arguments: list[int] = []  # of the call running: caller's arrays a launch consumed
        self.host, self.device = sharding("pinned_host"), sharding("device")
        device = next(iter(self.device.device_set))
        self.access = access = access or DeviceAccess()
        stream_ordered = device.platform in access.compute_synchronized
        self.memory = DeviceMemory(
            budget_bytes, access.allocator_reader(device), stream_ordered=stream_ordered, access=access
        )
        self.peak_in_use = access.peak_reader(device)
        self._follow = {Wait: self._wait, CopyIn: self._prefetch, Launch: self._launch, CopyOut: self._offload}

    def __call__(self, arguments: list[Any], owned: Sequence[bool] = (), on_failure: Noting = None) -> ChainRun:
        """Runs the chain on the flat arguments, taking the list over: it is emptied, so that no
        argument outlives its last use here. ``owned`` marks arguments that are copies made for
        this call (moved to the memory the plan wants them in): deleted at their last use.

        Not reentrant: one call at a time (``ooc_jit`` holds a lock around it). If the call fails,
        or is interrupted between segments, it waits for the work in flight, deletes what it made
        and lets go of everything else before the error propagates, with the note ``on_failure``
        makes of the arguments whose device buffers a launch had consumed (donated), if any."""
        memory, executable, chain = self.memory, self.executable, self.chain
        memory.start_call()
        self._consumed_arguments = []
        self._deleted_at_launch: list[tuple[int, Any]] = []
        peak_before = self.peak_in_use() if self.peak_in_use is not None else None
        self._launch_peak: int | None = None
        slots: list[Any] = [None] * chain.num_slots
        owned = list(owned) or [False] * len(arguments)
        # The caller's arrays (and the constants): let go of, never deleted, if the call fails.
        self._callers = {id(x) for _, x in executable.constants}
        self._callers |= {id(x) for x, mine in zip(arguments, owned) if not mine}
        try:
            for slot, x in executable.constants:
                slots[slot] = x
                memory.hold(x, _device_bytes(x), owned=False)
            # The arguments are where the plan wants them (a host slot holds no device bytes).
            for slot, x, mine in zip(chain.argument_slots, arguments, owned, strict=True):
                slots[slot] = x
                memory.hold(x, executable.slot_bytes[slot], owned=mine)
            arguments.clear()
            memory.count_foreign()
            for op, name in zip(chain.operations, executable.names, strict=True):
                self._follow[type(op)](op, name, slots)
            # A result the step computes as a constant (optax's step count at init) is a new array
            # each call, as jax.jit returns it: the caller may donate it.
            results = [
                jax.device_put(value, self.device) if slot is None else slots[slot]
                for slot, value in zip(chain.result_slots, executable.result_literals, strict=True)
            ]
        except BaseException as error:
            self._abandon(slots)
            if on_failure is not None and (note := on_failure(self._consumed_arguments)):
                error.add_note(note)
            raise
        return ChainRun(results=results, measured_peak_bytes=self._measured(peak_before))

    # One method per operation of the chain. Transfers are named as in the chain's jaxpr
    # (``oocjax.offload(<value>)``): a profiler trace says what moves.

    def _wait(self, op: Wait, name: str, slots: list[Any]) -> None:
        host = self.chain.host_offset
        with jax.profiler.TraceAnnotation(name):
            for b in op.buffers:
                self.memory.block(slots[b + host])
        for slot in op.dropped:
            slots[slot] = None

    def _prefetch(self, op: CopyIn, name: str, slots: list[Any]) -> None:
        memory, chain, host = self.memory, self.executable, self.chain.host_offset
        memory.make_room(sum(chain.slot_bytes[b] for b in op.buffers))
        # On a mesh, each value comes back in its own layout, as the segment was compiled for it.
        target = self.device if chain.shardings is None else [chain.shardings[b] for b in op.buffers]
        with jax.profiler.TraceAnnotation(name):
            copies = self.access.put([slots[b + host] for b in op.buffers], target)
        for b, x in zip(op.buffers, copies, strict=True):
            slots[b] = x
            memory.hold(x, chain.slot_bytes[b], owned=True)
        # The caller donated these: gone now, as jax.jit's would be after the call; before the
        # first launch, once it is launched, so that a call stopped before it leaves the state whole.
        deleted = [(slot, slots[slot]) for slot in op.deleted]
        if op.segment == 0:
            self._deleted_at_launch += deleted
        else:
            self._delete(deleted)
        for slot in op.dropped:
            slots[slot] = None

    def _delete(self, deleted: list[tuple[int, Any]]) -> None:
        for slot, x in deleted:
            x.delete()
            self._consumed_arguments.append(self.argument_of_slot[slot])

    def _launch(self, op: Launch, name: str, slots: list[Any]) -> None:
        """Launches a segment once there is room for it."""
        memory, executable = self.memory, self.executable
        cost = executable.costs[op.segment]
        inputs = [slots[b] for b in op.inputs]
        inputs += executable.literals[op.segment]
        memory.make_room(cost.launch_bytes)
        for observer in _observers:  # every thread's launches, as the block is open
            observer(
                LaunchAccount(
                    segment=op.segment,
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
            outputs = self._checked(op.segment)(*inputs)
        else:
            outputs = executable.programs[op.segment](*inputs)
        self._delete(self._deleted_at_launch)
        self._deleted_at_launch = []
        probe = ready_probe(outputs)
        if any(op.donated):
            self._consumed(op, inputs, probe)
        memory.launched(probe)
        del inputs
        for b, x in zip(op.outputs, outputs, strict=True):
            slots[b] = x
            memory.hold(x, executable.slot_bytes[b], owned=True)
        dying = [slots[b] for b in op.dropped]
        for b in op.dropped:
            slots[b] = None
        memory.release(dying, probe=probe, extra_bytes=cost.temp_bytes - cost.alias_bytes)

    def _consumed(self, op: Launch, inputs: list[Any], probe: Any) -> None:
        donated = [x for x, d in zip(inputs, op.donated) if d]
        self.memory.consumed(donated, probe)
        # XLA may leave a donation unused (no result of that shape and type to write over: jax
        # warns "Some donated buffers were not usable"), and jax then keeps the array: a caller's
        # donated argument would stay on the device, out of the account, until the call ends. This
        # launch is its last device use, as the plan counts it: delete it, as a used donation does.
        for x in donated:
            if not x.is_deleted():
                x.delete()
        self._consumed_arguments += [
            self.argument_of_slot[b]
            for b, d, x in zip(op.inputs, op.donated, inputs)
            if d and b in self.argument_of_slot and id(x) not in self.memory.owned and x.is_deleted()
        ]

    def _offload(self, op: CopyOut, name: str, slots: list[Any]) -> None:
        host = self.chain.host_offset
        leaving = [slots[b] for b in op.buffers]
        # On a mesh, each shard is copied to its own device's host memory: the layout stays.
        target = self.host if self.executable.shardings is None else [_in_host(x) for x in leaving]
        with jax.profiler.TraceAnnotation(name):
            copies = self.access.put(leaving, target)
        del leaving
        dropped = set(op.dropped)
        for b, copy in zip(op.buffers, copies, strict=True):
            slots[b + host] = copy
            if b in dropped:
                self.memory.release([slots[b]], probe=copy, copied=True)
                slots[b] = None

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
        ``FloatingPointError`` naming the operation (``transforms.functions`` adds the source line).
        On a mesh it keeps the segment's layout: each input and output in its buffer's sharding,
        the literals as they were placed (replicated)."""
        if segment not in self._checked_functions:
            function, shardings = self.functions[segment].__wrapped__, self.executable.shardings
            if shardings is None:
                inputs: Any = self.device
                outputs: Any = self.device
            else:
                cut, literals = self.chain.segments[segment], self.executable.literals[segment]
                inputs = (*(shardings[b] for b in cut.inputs), *(x.sharding for x in literals))
                outputs = tuple(shardings[b] for b in cut.outputs)
            self._checked_functions[segment] = jax.jit(function, in_shardings=inputs, out_shardings=outputs)
        return self._checked_functions[segment]

    def _measured(self, peak_before: int | None) -> int | None:
        """The call's peak (``ChainRun.measured_peak_bytes``). Allocations happen when work is
        enqueued, so the process's peak is final once the last launch is enqueued."""
        peak_after = self.peak_in_use() if self.peak_in_use is not None else None
        raised = (
            peak_after - self.memory.foreign_bytes if peak_before is not None and peak_after > peak_before else None
        )
        samples = [x for x in (self._launch_peak, raised) if x is not None]
        return max(samples) if samples else None
