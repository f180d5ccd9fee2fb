"""The planner's model of one training step: an ordered list of steps over immutable buffers.

A *step* is one operation the device runs (a jaxpr equation, or an opaque call such as a ``scan``).
A *buffer* is one value the step program creates or receives. Values are written once (the program
is in SSA form, as a jaxpr is), so a buffer never changes after it is defined: a host copy, once
made, stays valid, and dropping the device copy of a value that has one costs no transfer.

Buffer kinds:
  ``input``     an argument of the step (parameters, optimizer state, batch). The planner may keep
                it in host memory between steps and stream it in.
  ``constant``  a value baked into the program. Always on the device.
  ``computed``  defined by exactly one step.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from oocjax.schedule.moves import Offload

BufferKind = Literal["input", "constant", "computed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Buffer:
    """One value of the step program.

    Attributes:
      nbytes: size on the device.
      kind: ``input``, ``constant`` or ``computed``.
      is_output: whether the step returns it.
      donated: for inputs: the caller gives the buffer up, so XLA may reuse its memory after its
        last read (a kept input occupies the device for the whole step).
      aliased_input: for outputs: the donated input this output replaces in the next call, so the
        planner keeps the two in the same memory.
      held_by_caller: for inputs: the caller passes it in device memory and keeps it (not donated),
        so it occupies the device for the whole step whatever a plan does: copying it to host
        would cost a transfer and free nothing.
      label: where it comes from, for people ("argument params['w']", "output of dot_general ...").
    """

    nbytes: int
    kind: BufferKind = "computed"
    is_output: bool = False
    donated: bool = False
    aliased_input: int | None = None
    held_by_caller: bool = False
    label: str = ""

    def never_moves(self, min_offload_bytes: int) -> bool:
        """Whether no plan moves it: constants are baked into the program, an argument the caller
        holds on the device stays there anyway, and a value under ``min_offload_bytes`` costs more
        to copy than the memory it would free."""
        return self.kind == "constant" or self.held_by_caller or self.nbytes < min_offload_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One operation: the buffers it reads and defines, and what it costs.

    Attributes:
      reads: ids of the buffers it reads (each once).
      writes: ids of the buffers it defines.
      transient_bytes: scratch it needs while it runs beyond its reads and writes (an opaque loop's
        own peak, say).
      flops: arithmetic work, for the timed simulation.
      bytes_accessed: memory traffic, for the timed simulation.
      name: the operation (a primitive name).
      label: where it comes from in user code ("model.py:42").
    """

    reads: tuple[int, ...]
    writes: tuple[int, ...]
    transient_bytes: int = 0
    flops: int = 0
    bytes_accessed: int = 0
    name: str = ""
    label: str = ""

    def describe(self) -> str:
        return f"{self.name} at {self.label}" if self.label else self.name or "step"


@dataclass(frozen=True, kw_only=True)
class Program:
    """A whole step program. Checked on construction: it must be in SSA form."""

    steps: tuple[Step, ...]
    buffers: tuple[Buffer, ...]

    def __post_init__(self) -> None:
        defined = [b.kind != "computed" for b in self.buffers]
        n = len(defined)
        for index, step in enumerate(self.steps):  # inlined checks: the selector builds a program per pick
            for b in step.reads:
                if not 0 <= b < n:
                    self._check_id(b, index)
                if not defined[b]:
                    raise ValueError(f"step {index} ({step.describe()}) reads buffer {b} before it is defined")
            if len(set(step.reads)) != len(step.reads):
                raise ValueError(f"step {index} ({step.describe()}) lists a read twice: {step.reads}")
            for b in step.writes:
                if not 0 <= b < n:
                    self._check_id(b, index)
                if defined[b]:
                    kind = self.buffers[b].kind
                    raise ValueError(f"step {index} ({step.describe()}) redefines {kind} buffer {b}")
                defined[b] = True
        for b, buffer in enumerate(self.buffers):
            if not defined[b]:
                raise ValueError(f"computed buffer {b} ({buffer.label or 'unlabelled'}) is never defined")
            if buffer.nbytes < 0:
                raise ValueError(f"buffer {b} has a negative size {buffer.nbytes}")
            if (buffer.donated or buffer.held_by_caller) and buffer.kind != "input":
                raise ValueError(f"buffer {b} is donated or held by the caller but is not an input")
            if buffer.donated and buffer.held_by_caller:
                raise ValueError(f"buffer {b} is both donated and held by the caller")
            alias = buffer.aliased_input
            if alias is not None and not (
                buffer.is_output and 0 <= alias < len(self.buffers) and self.buffers[alias].donated
            ):
                raise ValueError(f"buffer {b} aliases {alias}, which is not a donated input of an output")

    @cached_property
    def donated_bytes(self) -> int:
        """Bytes of the inputs the caller donates: the training state, in a training step."""
        return sum(b.nbytes for b in self.buffers if b.kind == "input" and b.donated)

    @cached_property
    def state_bytes(self) -> int:
        """What the step keeps between calls: its donated inputs (the training state), or its results
        where those are more (an init, which makes the state)."""
        return max(self.donated_bytes, sum(b.nbytes for b in self.buffers if b.is_output))

    @cached_property
    def replaced_by(self) -> dict[int, int]:
        """Per donated input that an output replaces (``Buffer.aliased_input``), that output."""
        return {buf.aliased_input: b for b, buf in enumerate(self.buffers) if buf.aliased_input is not None}

    @cached_property
    def in_core_bytes(self) -> tuple[int, ...]:
        """Device bytes per step with nothing moved: each buffer over its ``unmoved_spans``, plus
        each step's scratch (the simulator's figure for ``keep_all``), computed once: the recompute
        rewrite, the selector's every pick and the pressure bound ask it."""
        diff = [0] * (len(self.steps) + 1)
        for buffer, (start, end) in zip(self.buffers, self.unmoved_spans):
            diff[start] += buffer.nbytes
            diff[end + 1] -= buffer.nbytes
        return tuple(live + step.transient_bytes for live, step in zip(accumulate(diff), self.steps))

    @cached_property
    def uses(self) -> Uses:
        """Where each buffer is defined and read (computed once)."""
        return Uses.of(self)

    @cached_property
    def unmoved_spans(self) -> tuple[tuple[int, int], ...]:
        """Per buffer, the first and last step its device copy occupies when no move touches it:
        from its definition (step 0 for an argument or constant) to its last read, or to the last
        step for an output or a buffer ``held_for_whole_step``. This is the one stay
        ``device_stays`` gives such a buffer, clamped to the steps; it is written out (and computed
        once) because the simulation and ``required_bytes`` ask it of every buffer."""
        last_step = len(self.steps) - 1
        spans = []
        for buffer, defined_at, reads in zip(self.buffers, self.uses.defined_at, self.uses.read_at):
            start = defined_at or 0
            if buffer.is_output or held_for_whole_step(buffer, reads):
                spans.append((start, last_step))
            else:
                spans.append((start, max(start, reads[-1]) if reads else start))
        return tuple(spans)

    def device_stays(
        self,
        b: int,
        *,
        on_host: bool,
        prefetch_steps: Sequence[int],
        offload: Offload | None,
        returned_on_device: bool,
    ) -> list[Stay]:
        """Every stay of buffer ``b`` on the device, in start order: the liveness rule.

        A stay starts where the buffer is defined, before the first step for an argument or a
        constant not placed on host (``on_host``), or at each prefetch's issue step. It lasts to
        the last read it serves (reads before the next stay starts), to its offload's completion if
        it carries the offload (its ``done_before_step``; None: the end), and to the end of the
        step if it is an argument ``held_for_whole_step`` or the last stay of an output returned on
        the device.
        """
        n, uses = len(self.steps), self.uses
        buffer, reads = self.buffers[b], uses.read_at[b]
        if buffer.kind == "computed":
            starts = [uses.defined_at[b]]
        else:
            starts = [] if on_host else [BEFORE_FIRST_STEP]
        first_prefetched = len(starts)
        starts += prefetch_steps
        stays = []
        for j, start in enumerate(starts):
            following = starts[j + 1] if j + 1 < len(starts) else n
            served = reads[bisect_left(reads, start) : bisect_left(reads, following)]  # reads ascend
            end = served[-1] if served else start
            offloaded = offload is not None and start <= offload.after_step < following
            if offloaded:
                done = offload.done_before_step
                end = max(end, n if done is None else done - 1)
            held = start == BEFORE_FIRST_STEP and held_for_whole_step(buffer, reads)
            if held or (j == len(starts) - 1 and returned_on_device):
                end = n
            stays.append(Stay(b, start, end, served, j >= first_prefetched, offloaded))
        return stays

    def _check_id(self, b: int, index: int) -> None:
        if not 0 <= b < len(self.buffers):
            raise ValueError(f"step {index} names buffer {b}, but there are {len(self.buffers)} buffers")

    def with_held_by_caller(self, held: Sequence[bool]) -> Program:
        """The program with the arguments ``held`` marks as held by the caller (``Buffer.held_by_caller``)."""
        if not any(held):
            return self
        buffers = tuple(
            replace(x, held_by_caller=True) if b < len(held) and held[b] else x for b, x in enumerate(self.buffers)
        )
        return Program(steps=self.steps, buffers=buffers)

    @classmethod
    def from_ops(
        cls,
        ops: Sequence[tuple[str, Sequence[str], Sequence[str]]],
        sizes: Mapping[str, int],
        *,
        inputs: Iterable[str] = (),
        constants: Iterable[str] = (),
        outputs: Iterable[str] = (),
        donated: Iterable[str] = (),
        aliases: Mapping[str, str] | None = None,
        transient: Mapping[int, int] | None = None,
        flops: Mapping[int, int] | None = None,
    ) -> Program:
        """Builds a program from named buffers; the names become labels. For tests and docs.

        >>> p = Program.from_ops([("mul", ["x"], ["y"])], {"x": 4, "y": 4}, inputs=["x"], outputs=["y"])
        >>> p.buffers[1].label, p.steps[0].reads
        ('y', (0,))
        """
        inputs, constants, outputs, donated = set(inputs), set(constants), set(outputs), set(donated)
        aliases, transient, flops = aliases or {}, transient or {}, flops or {}
        ids = {name: i for i, name in enumerate(sizes)}
        buffers = tuple(
            Buffer(
                nbytes=nbytes,
                kind="input" if name in inputs else "constant" if name in constants else "computed",
                is_output=name in outputs,
                donated=name in donated,
                aliased_input=ids[aliases[name]] if name in aliases else None,
                label=name,
            )
            for name, nbytes in sizes.items()
        )
        steps = tuple(
            Step(
                reads=tuple(ids[r] for r in reads),
                writes=tuple(ids[w] for w in writes),
                transient_bytes=transient.get(i, 0),
                flops=flops.get(i, 0),
                name=name,
            )
            for i, (name, reads, writes) in enumerate(ops)
        )
        return cls(steps=steps, buffers=buffers)


BEFORE_FIRST_STEP = -1  # the start of a stay already on the device when the step begins


# A NamedTuple, not a frozen dataclass: a simulation of a large step makes hundreds of thousands,
# and a frozen dataclass takes three times as long to create.
class Stay(NamedTuple):
    """One stay of a buffer's device copy (``Program.device_stays``): it occupies the device from
    step ``start`` (``BEFORE_FIRST_STEP`` for an argument there from the beginning) to step ``end``
    (the number of steps for a copy held past the last step: returned, or copied out at the end).

    Attributes:
      buffer: the buffer.
      start, end: the steps it occupies.
      served: the reads it serves, ascending.
      prefetched: whether a prefetch brought it in.
      offloaded: whether it carries the buffer's offload (ends no earlier than the copy completes).
    """

    buffer: int
    start: int
    end: int
    served: tuple[int, ...]
    prefetched: bool
    offloaded: bool = False

    @property
    def first_use(self) -> int:
        """The first step that reads this copy (-1: none)."""
        return self.served[0] if self.served else -1

    def needed_after(self, stop: int) -> bool:
        """Whether a program that runs the steps before ``stop`` must hand this copy on: it lasts to
        ``stop`` or later, or its offload is issued after that program."""
        return self.end >= stop or self.offloaded


def held_for_whole_step(buffer: Buffer, reads: tuple[int, ...]) -> bool:
    """Whether a buffer that starts on the device holds its memory to the end of the step.

    Constants and kept inputs do: XLA cannot free an argument it does not own. A donated input is
    modelled as free after its last read, because the output that aliases it takes its memory over;
    one that nothing reads is held, like any argument.
    """
    return buffer.kind == "constant" or (buffer.kind == "input" and (not buffer.donated or not reads))


@dataclass(frozen=True, slots=True)
class Uses:
    """Where each buffer is defined and read, derived once from a program."""

    defined_at: tuple[int | None, ...]  # None for inputs and constants
    read_at: tuple[tuple[int, ...], ...]  # ascending step indices

    @classmethod
    def of(cls, program: Program) -> Uses:
        defined_at: list[int | None] = [None] * len(program.buffers)
        read_at: list[list[int]] = [[] for _ in program.buffers]
        for index, step in enumerate(program.steps):
            for b in step.reads:
                read_at[b].append(index)
            for b in step.writes:
                defined_at[b] = index
        return cls(tuple(defined_at), tuple(map(tuple, read_at)))
