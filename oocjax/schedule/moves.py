"""What a schedule says: where inputs and outputs live, and which copies run when.

Timing is in step indices. A step's device memory is counted while the step runs.

* ``Offload(buffer, after_step, done_before_step)``: a device-to-host copy starts once step
  ``after_step`` has run; the device copy is released (it waits for the copy) before step
  ``done_before_step`` runs, or at the end of the program when that is ``None``.
* ``Prefetch(buffer, issue_step, use_step)``: a host-to-device copy starts when step ``issue_step``
  starts; memory is taken from then on; step ``use_step`` is the first read it serves.

Dropping a device copy is never a move: a device copy is released after its last read, as XLA does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from oocjax.schedule.program import Program, Stay


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    buffer: int
    after_step: int
    done_before_step: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Prefetch:
    buffer: int
    issue_step: int
    use_step: int


Move = Offload | Prefetch
_M = TypeVar("_M", Offload, Prefetch, Move)


# Not slotted: the move index below is cached on the instance (in its __dict__).
@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A complete plan for one program.

    The index properties (``offload_by_buffer``, ``prefetches_by_buffer``, ``prefetches_by_issue_step``,
    ``offloads_by_after_step``, ``waits_by_step``) group the moves once, on first use, and are shared
    by every caller: read them, do not change them. Within a group, moves keep the order of
    ``moves`` (prefetches of one buffer: issue order).

    Attributes:
      strategy: which planner made it ("window", "keep_all", ...).
      budget_bytes: the device budget it was made for, or None for a baseline made without one.
      host_inputs: inputs that live in host memory between steps (pinned host).
      host_outputs: outputs returned in host memory.
      moves: offloads and prefetches, ordered by the step at which they start.
      segment_starts: steps the plan was made to start segments at: where a plan in ranges
        planned each range as one step (``schedule.ranges``), its segments are those ranges.
    """

    strategy: str
    budget_bytes: int | None
    host_inputs: frozenset[int] = frozenset()
    host_outputs: frozenset[int] = frozenset()
    moves: tuple[Move, ...] = ()
    segment_starts: frozenset[int] = frozenset()

    @cached_property
    def offloads(self) -> tuple[Offload, ...]:
        return tuple(m for m in self.moves if isinstance(m, Offload))

    @cached_property
    def prefetches(self) -> tuple[Prefetch, ...]:
        return tuple(m for m in self.moves if isinstance(m, Prefetch))

    @cached_property
    def offload_by_buffer(self) -> dict[int, Offload]:
        """The offload of each offloaded buffer (a value is copied out once; where an invalid
        schedule has more, the first)."""
        return {b: offloads[0] for b, offloads in _grouped(self.offloads, _BUFFER).items()}

    @cached_property
    def prefetches_by_buffer(self) -> dict[int, tuple[Prefetch, ...]]:
        """The prefetches of each prefetched buffer, in issue order (buffers in the order of their
        first prefetch in ``moves``)."""
        return {b: tuple(sorted(fetches, key=_ISSUE_STEP)) for b, fetches in _grouped(self.prefetches, _BUFFER).items()}

    @cached_property
    def prefetches_by_issue_step(self) -> dict[int, tuple[Prefetch, ...]]:
        return _grouped(self.prefetches, _ISSUE_STEP)

    @cached_property
    def offloads_by_after_step(self) -> dict[int, tuple[Offload, ...]]:
        return _grouped(self.offloads, attrgetter("after_step"))

    @cached_property
    def waits_by_step(self) -> dict[int, tuple[Move, ...]]:
        """Per step, the copies that must complete before it runs: the prefetches whose first use
        it is and the offloads done before it (an offload done at the end waits for no step)."""
        awaited = [m for m in self.moves if not (isinstance(m, Offload) and m.done_before_step is None)]
        return _grouped(awaited, lambda m: m.use_step if isinstance(m, Prefetch) else m.done_before_step)

    def device_stays(self, program: Program, b: int) -> list[Stay]:
        """Every stay of buffer ``b`` on the device under this schedule (``Program.device_stays``)."""
        fetches = self.prefetches_by_buffer.get(b, ())
        return program.device_stays(
            b,
            on_host=b in self.host_inputs,
            prefetch_steps=[p.issue_step for p in fetches],
            offload=self.offload_by_buffer.get(b),
            returned_on_device=program.buffers[b].is_output and b not in self.host_outputs,
        )

    @cached_property
    def copy_steps(self) -> frozenset[int]:
        """The steps before which the executor stops to copy: each prefetch's issue step and each
        step an offload must be done before. Each is a cut between compiled programs."""
        waits = (m.done_before_step for m in self.offloads if m.done_before_step is not None)
        return frozenset((*(m.issue_step for m in self.prefetches), *waits))

    def moved_bytes(self, program: Program) -> int:
        """Bytes its copies move, both ways together."""
        return sum(program.buffers[m.buffer].nbytes for m in self.moves)

    @property
    def moves_nothing(self) -> bool:
        return not (self.moves or self.host_inputs or self.host_outputs)


_BUFFER, _ISSUE_STEP = attrgetter("buffer"), attrgetter("issue_step")


def _grouped(moves: Iterable[_M], key: Callable[[_M], int]) -> dict[int, tuple[_M, ...]]:
    groups: dict[int, list[_M]] = {}
    for move in moves:
        groups.setdefault(key(move), []).append(move)
    return {k: tuple(group) for k, group in groups.items()}


def move_order(move: Move) -> tuple[int, int, int]:
    """Sorts moves by when they start: prefetches at a step's start, first needed first; offloads after it."""
    if isinstance(move, Prefetch):
        return (move.issue_step, 0, move.use_step)
    return (move.after_step, 1, 0)


def keep_all(program: Program, *, budget_bytes: int | None = None, strategy: str = "keep_all") -> Schedule:
    """Everything stays on the device: the in-core schedule."""
    del program  # the same schedule fits every program
    return Schedule(strategy=strategy, budget_bytes=budget_bytes)
