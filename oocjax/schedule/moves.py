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

from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A complete plan for one program.

    Attributes:
      strategy: which planner made it ("window", "keep_all", ...).
      budget_bytes: the device budget it was made for, or None for a baseline made without one.
      host_inputs: inputs that live in host memory between steps (pinned host).
      host_outputs: outputs returned in host memory.
      moves: offloads and prefetches, ordered by the step at which they start.
    """

    strategy: str
    budget_bytes: int | None
    host_inputs: frozenset[int] = frozenset()
    host_outputs: frozenset[int] = frozenset()
    moves: tuple[Move, ...] = ()

    @property
    def offloads(self) -> tuple[Offload, ...]:
        return tuple(m for m in self.moves if isinstance(m, Offload))

    @property
    def prefetches(self) -> tuple[Prefetch, ...]:
        return tuple(m for m in self.moves if isinstance(m, Prefetch))

    @property
    def moves_nothing(self) -> bool:
        return not (self.moves or self.host_inputs or self.host_outputs)


def move_order(move: Move) -> tuple[int, int]:
    """Sorts moves by when they start: prefetches at a step's start, offloads after it."""
    if isinstance(move, Prefetch):
        return (move.issue_step, 0)
    return (move.after_step, 1)
