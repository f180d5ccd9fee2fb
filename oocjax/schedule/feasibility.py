"""Feasibility: the device bytes no schedule can go below at each step, and whether a budget allows them.

A step needs its own operands, results and scratch on the device, plus every value too small to
move (or that never moves) alive across it. No plan can fit a budget below the largest such need;
``check_feasible`` says so before any planning, with the smallest feasible budget and the fixes.
"""

from __future__ import annotations

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.program import Program
from oocjax.schedule.units import MiB, format_bytes


def required_bytes(program: Program, min_offload_bytes: int = MiB, resident: frozenset[int] = frozenset()) -> list[int]:
    """Per step, the device bytes no schedule can go below: the step's own operands, results and
    scratch, plus every value too small to move (or ``resident``: kept on the device by choice)
    that is alive across it."""
    n = len(program.steps)
    movable_bytes = [
        0 if b in resident or buffer.never_moves(min_offload_bytes) else buffer.nbytes
        for b, buffer in enumerate(program.buffers)
    ]
    pinned_diff = [0] * (n + 1)
    for b, buffer in enumerate(program.buffers):
        if n and not movable_bytes[b]:
            start, end = program.unmoved_spans[b]
            pinned_diff[start] += buffer.nbytes
            pinned_diff[end + 1] -= buffer.nbytes
    need, pinned = [], 0
    for k, step in enumerate(program.steps):
        pinned += pinned_diff[k]
        movable = step.transient_bytes
        for b in step.reads:
            movable += movable_bytes[b]
        for b in step.writes:
            movable += movable_bytes[b]
        need.append(pinned + movable)
    return need


def check_feasible(program: Program, budget_bytes: int, min_offload_bytes: int = MiB) -> None:
    """Raises ``BudgetInfeasibleError`` if some step alone needs more than ``budget_bytes``."""
    need = required_bytes(program, min_offload_bytes)
    if not need or max(need) <= budget_bytes:
        return
    worst = max(range(len(need)), key=need.__getitem__)
    step = program.steps[worst]
    own = sum(program.buffers[b].nbytes for b in (*step.reads, *step.writes)) + step.transient_bytes
    # Rounded up: the figure, passed back as the budget, must be accepted.
    smallest = format_bytes(need[worst], round_up=True)
    fixes = [
        f"raise the budget to at least {smallest} ({need[worst]} bytes);",
        "make that operation smaller: a smaller batch, or split it (chunk the sequence, the vocabulary "
        "or the layer's width) so that no single operation needs so much at once;",
    ]
    if need[worst] > own:
        fixes.append(
            f"lower min_offload_bytes (now {format_bytes(min_offload_bytes)}): "
            f"{format_bytes(need[worst] - own)} of that is values too small to move, held on the device"
        )
    numbered = "\n".join(f"  {i}. {fix}" for i, fix in enumerate(fixes, 1))
    # Two figures make up what the step needs; each gets its own line, saying what it counts.
    pinned = need[worst] - own
    parts = (
        f"That is:\n  - {format_bytes(own)} for its own operands, results and scratch;\n"
        f"  - {format_bytes(pinned)} for other values alive across it that no plan moves (constants, "
        f"arguments kept on the device, values under min_offload_bytes, now {format_bytes(min_offload_bytes)})."
        if pinned
        else "All of it is the operation's own operands, results and scratch."
    )
    raise BudgetInfeasibleError(
        f"a budget of {format_bytes(budget_bytes)} is too small: step {worst} ({step.describe()}) alone "
        f"needs {smallest} on the device.\n{parts}\n"
        f"The smallest feasible budget is {smallest}, set by that operation.\nFixes:\n{numbered}",
        budget_bytes=budget_bytes,
        required_bytes=need[worst],
        step=worst,
        where=step.describe(),
    )


def check_window(program: Program, window_bytes: int) -> None:
    """Raises ``ValueError`` if some step alone touches more than the window planner's look-ahead."""
    nbytes = [b.nbytes for b in program.buffers]
    touched = [sum(nbytes[b] for b in step.reads) + sum(nbytes[b] for b in step.writes) for step in program.steps]
    widest = max(range(len(touched)), key=touched.__getitem__, default=None)
    if widest is not None and touched[widest] > window_bytes:
        raise ValueError(
            f"window_bytes={window_bytes} cannot hold step {widest} ({program.steps[widest].describe()}), which "
            f"touches {format_bytes(touched[widest])}: use a window of at least {touched[widest]} bytes, or leave "
            "it unset (1.5x the budget)"
        )
