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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

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
      label: where it comes from, for people ("argument params['w']", "output of dot_general ...").
    """

    nbytes: int
    kind: BufferKind = "computed"
    is_output: bool = False
    donated: bool = False
    aliased_input: int | None = None
    label: str = ""


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
        for index, step in enumerate(self.steps):
            for b in step.reads:
                self._check_id(b, index)
                if not defined[b]:
                    raise ValueError(f"step {index} ({step.describe()}) reads buffer {b} before it is defined")
            if len(set(step.reads)) != len(step.reads):
                raise ValueError(f"step {index} ({step.describe()}) lists a read twice: {step.reads}")
            for b in step.writes:
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
            if buffer.donated and buffer.kind != "input":
                raise ValueError(f"buffer {b} is donated but is not an input")
            alias = buffer.aliased_input
            if alias is not None and not (
                buffer.is_output and 0 <= alias < len(self.buffers) and self.buffers[alias].donated
            ):
                raise ValueError(f"buffer {b} aliases {alias}, which is not a donated input of an output")

    @cached_property
    def uses(self) -> Uses:
        """Where each buffer is defined and read (computed once)."""
        return Uses.of(self)

    def _check_id(self, b: int, index: int) -> None:
        if not 0 <= b < len(self.buffers):
            raise ValueError(f"step {index} names buffer {b}, but there are {len(self.buffers)} buffers")

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
