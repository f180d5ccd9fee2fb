"""Baseline schedules in the planner's framework, to compare the window planner against:

* ``fixed_lookahead``: TFLMS-like. Every value that can move is sent to host after the access that
  precedes a long gap (more than ``lookahead_steps + 1`` steps without a use) and prefetched
  ``lookahead_steps`` steps before it is needed again; inputs live on host and are fetched the same way.
* ``swap_all_just_in_time``: vDNN-like, ``fixed_lookahead`` with one step of look-ahead.

They take no budget: they follow a fixed rule, so their peak is what it is. (``keep_all``, in
core, is ``oocjax.schedule``'s own.)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # imported from a script in benchmarks/: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oocjax.schedule import MiB, Move, Offload, Prefetch, Program, Schedule
from oocjax.testing import move_order


def fixed_lookahead(program: Program, lookahead_steps: int = 4, *, min_offload_bytes: int = MiB) -> Schedule:
    """Offload across long gaps, prefetch a fixed number of steps ahead (TFLMS-like)."""
    if lookahead_steps < 1:
        raise ValueError(f"lookahead_steps must be at least 1, got {lookahead_steps}")
    uses = program.uses
    moves: list[Move] = []
    host_inputs = set()
    long_gap = lookahead_steps + 1
    for b, buffer in enumerate(program.buffers):
        if buffer.never_moves(min_offload_bytes):
            continue
        if buffer.kind == "input":
            host_inputs.add(b)
        has_host_copy = buffer.kind == "input"
        previous = uses.defined_at[b]  # the last step that touched the device copy; None: no copy yet
        for read in uses.read_at[b]:
            if previous is not None and read - previous <= long_gap:
                previous = read
                continue
            if not has_host_copy:
                # The gap is longer than lookahead + 1, so the prefetch below starts after this completes.
                moves.append(Offload(buffer=b, after_step=previous, done_before_step=previous + 2))
                has_host_copy = True
            moves.append(Prefetch(buffer=b, issue_step=max(read - lookahead_steps, 0), use_step=read))
            previous = read
    return Schedule(
        strategy=f"fixed_lookahead_{lookahead_steps}",
        budget_bytes=None,
        host_inputs=frozenset(host_inputs),
        moves=tuple(sorted(moves, key=move_order)),
    )


def swap_all_just_in_time(program: Program, *, min_offload_bytes: int = MiB) -> Schedule:
    """Offload every movable value across each long gap and fetch it one step before use (vDNN-like)."""
    schedule = fixed_lookahead(program, 1, min_offload_bytes=min_offload_bytes)
    return Schedule(
        strategy="swap_all_just_in_time",
        budget_bytes=None,
        host_inputs=schedule.host_inputs,
        moves=schedule.moves,
    )
