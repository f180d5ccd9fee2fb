"""The step as it runs, for people: each segment of the chain with the transfers and waits around
it, what moves and where it comes from, and what it recomputes (``Plan.pretty_jaxpr``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oocjax.schedule import format_bytes
from oocjax.schedule.chain import CopyIn, Launch, Wait, chain_of
from oocjax.schedule.layer_cuts import segment_signature
from oocjax.schedule.units import counted

if TYPE_CHECKING:
    from oocjax.plan import Plan


def pretty_jaxpr(plan: Plan, *, full: bool = False) -> str:
    """The step as it runs, in order: each segment with the transfers and waits around it, what
    moves and where it comes from, and what it recomputes. ``full=True`` appends the chain's jaxpr
    as jax prints it (each segment call holds its part of the step)."""
    if plan.jaxpr is None:
        raise ValueError("this plan has no jaxpr (it was loaded from JSON); plan the step again to see it")
    if not plan.segments:
        lines = ["one program: jax.jit's own (nothing moves)"]
    else:
        lines = _chain_lines(plan)
    if full:
        lines += ["", str(plan.jaxpr.pretty_print(use_color=False))]
    return "\n".join(lines)


def _chain_lines(plan: Plan) -> list[str]:
    """One block per segment; a run of blocks that repeats (a loop's iterations, or layers alike)
    is shown once, with how many more times it runs."""
    blocks = _segment_blocks(plan)
    kinds = _segment_kinds(plan)
    lines, i = [], 0
    while i < len(blocks):
        period, copies = _repetition(kinds, i)
        for block in blocks[i : i + period]:
            lines += block
        if copies > 1:
            first, last = i + period, i + period * copies - 1
            moved = sum(
                plan.program.buffers[b].nbytes
                for segment in plan.segments[first : last + 1]
                for b in (*segment.prefetches, *segment.offloads)
            )
            again = sum(len(_recomputed_in(plan, segment)) for segment in plan.segments[first : last + 1])
            lines.append(
                f"... segments {first}..{last}: the same {counted(period, 'segment')} {copies - 1} more times "
                f"(same programs and transfers), moving {format_bytes(moved)}"
                + (f", recomputing {counted(again, 'value')}" if again else "")
            )
        i += period * copies
    return lines


MIN_COPIES, MAX_PERIOD = 3, 64  # a run of blocks shown once when it repeats at least this often


def _repetition(kinds: list, i: int) -> tuple[int, int]:
    """(period, copies) of the shortest run of blocks starting at ``i`` that repeats at least
    ``MIN_COPIES`` times back to back; (1, 1) where none does."""
    for period in range(1, min(MAX_PERIOD, (len(kinds) - i) // MIN_COPIES) + 1):
        run = kinds[i : i + period]
        copies = 1
        while kinds[i + copies * period : i + (copies + 1) * period] == run:
            copies += 1
        if copies >= MIN_COPIES:
            return period, copies
    return 1, 1


def _segment_kinds(plan: Plan) -> list[tuple]:
    """Per segment, what makes two alike: what it computes (``segment_signature``), what it moves
    and what it recomputes (labels, sizes)."""
    buffers = plan.program.buffers

    def moved(bs: tuple[int, ...]) -> tuple:
        return tuple((buffers[b].label, buffers[b].nbytes) for b in bs)

    def recomputed(segment) -> tuple:  # what, not where: layers alike recompute at other equations
        return tuple((r.label, r.nbytes) for r in _recomputed_in(plan, segment))

    return [
        (
            segment_signature(plan.program, s.start, s.stop),
            *map(moved, (s.waits, s.prefetches, s.offloads)),
            recomputed(s),
        )
        for s in plan.segments
    ]


def _recomputed_in(plan: Plan, segment) -> list:
    """The recomputed values whose copies run in ``segment``."""
    return [r for r in plan.recomputed if segment.start <= r.recomputed_at < segment.stop]


def _segment_blocks(plan: Plan) -> list[list[str]]:
    """Per segment, its lines: the chain's operations around its launch, in the order they run."""
    buffers = plan.program.buffers
    uses = {b: [p.use_step for p in fetches] for b, fetches in plan.schedule.prefetches_by_buffer.items()}

    def value(b: int) -> str:
        return f"{buffers[b].label} ({format_bytes(buffers[b].nbytes)})"

    def offload(b: int, after: int) -> str:
        later = [u for u in uses.get(b, ()) if u > after]
        return f"not needed again until equation {min(later)}" if later else "stays on host"

    def prefetch(b: int, start: int) -> str:
        served = [u for u in uses.get(b, ()) if u >= start]
        return f"read at equation {min(served)}" if served else "read in this segment"

    blocks = []
    costs = plan.segment_costs or (None,) * len(plan.segments)
    chain = plan.chain or chain_of(plan.program, plan.schedule, plan.segments)  # a plan built by hand has none
    for i, operations in chain.by_segment():
        segment, lines = plan.segments[i], []
        for op in operations:
            if isinstance(op, Wait):
                lines += [
                    f"  wait  {value(b)}: its offload must end before its device memory is reused" for b in op.buffers
                ]
            elif isinstance(op, CopyIn):
                lines += [f"  >>>   prefetch {value(b)}: {prefetch(b, segment.start)}" for b in op.buffers]
            elif isinstance(op, Launch):
                recomputed = _recomputed_in(plan, segment)
                lines.append(_segment_line(plan, i, costs[i], len(recomputed)))
                lines += [
                    f"  +++   recomputes {r.label} ({format_bytes(r.nbytes)}): dropped after equation "
                    f"{r.dropped_after}, computed again at equation {r.recomputed_at}"
                    for r in recomputed
                ]
            else:
                lines += [f"  <<<   offload {value(b)}: {offload(b, segment.stop - 1)}" for b in op.buffers]
        blocks.append(lines)
    return blocks


def _segment_line(plan: Plan, i: int, cost, recomputed: int) -> str:
    """``segment 3: equations 598..599, holds 12.8 MiB at launch, scratch 0 B  [model.py:126]``, and
    how many values it recomputes (listed below it)."""
    segment = plan.segments[i]
    where = list(dict.fromkeys(s.label for s in plan.program.steps[segment.start : segment.stop] if s.label))
    measured = "" if cost is None else f", scratch {format_bytes(cost.temp_bytes)}"
    again = f", recomputes {counted(recomputed, 'value')}" if recomputed else ""
    shown = f"  [{', '.join(where[:3])}{', ...' if len(where) > 3 else ''}]" if where else ""
    return (
        f"segment {i}: equations {segment.start}..{segment.stop - 1}, holds {format_bytes(segment.held_bytes)} "
        f"at launch{measured}{again}{shown}"
    )
