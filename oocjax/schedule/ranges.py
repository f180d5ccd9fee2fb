"""Planning in ranges: copies only between ranges of steps, each range planned as one step.

The window planner places every copy at the step where memory asks for it. Where the training
state is larger than the device, that is almost every step of the backward pass: each prefetch
issued and each offload waited for is a cut between compiled programs, and a cut program holds its
arguments and results for its whole run, so a plan tight step by step is cut again where a range of
its steps does not fit (the 1.34B GPT at 14 GiB: 441 segments, 18 a layer). Each boundary costs
the executor time on a GPU.

Planning in ranges turns that round. The steps are grouped into ranges, each as long as fits a
share of the budget on its own (``ranges_within``: what it reads from before it, what it leaves
for after it, and the peak of what it makes and frees inside); the program of ranges
(``coarse_program``, one step per range) is planned by the window planner; and its moves are put
back on the steps (``refined``): a prefetch issued at its range's start, an offload after its
range's last step, a wait before a range. A range's memory as one step is what a segment of it
holds, so the plan cuts where it moves and needs no other cuts. The share trades boundaries for
bytes: small ranges move little more than the step-by-step plan, large ones prefetch a whole range
ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.moves import Offload, Prefetch, Schedule, move_order
from oocjax.schedule.program import Program, Step


@dataclass(frozen=True, slots=True)
class Range:
    """Steps ``start .. stop - 1``, and the peak of the values made and freed inside them (with
    the steps' scratch): what they need beyond what they read and leave."""

    start: int
    stop: int
    inner_peak: int


def ranges_within(program: Program, limit: int, bounds: frozenset[int] = frozenset()) -> list[Range]:
    """Consecutive ranges covering the program, each extended while what it needs as one step
    (its reads from before it, its results needed after it, and its inner peak) stays within
    ``limit``, and never across a step of ``bounds`` (where layers begin and end); a step alone
    where even that does not."""
    steps, nbytes = program.steps, [b.nbytes for b in program.buffers]
    defined_at, read_at = program.uses.defined_at, program.uses.read_at
    dying_at: list[list[int]] = [[] for _ in steps]  # computed values, not returned, by last read
    for b, buffer in enumerate(program.buffers):
        if buffer.kind == "computed" and not buffer.is_output:
            dying_at[read_at[b][-1] if read_at[b] else defined_at[b]].append(b)
    ranges: list[Range] = []
    start, outside, read_bytes, result_bytes = 0, set(), 0, 0
    # The range's steps' scratch plus the values made and freed inside it, per step of it, and
    # their peak: a value freed at step k adds to steps ``defined .. k``, so the peak only rises.
    inner, inner_peak = [], 0
    k = 0
    while k < len(steps):
        step = steps[k]
        reads = [b for b in step.reads if b not in outside and (defined_at[b] is None or defined_at[b] < start)]
        made = sum(nbytes[b] for b in step.writes)
        dying = [b for b in dying_at[k] if defined_at[b] >= start]  # made in the range: inside it now
        freed = sum(nbytes[b] for b in dying)
        inner.append(step.transient_bytes)
        first = min((defined_at[b] - start for b in dying), default=len(inner) - 1)
        for b in dying:
            d = defined_at[b] - start
            inner[d:] = [x + nbytes[b] for x in inner[d:]]
        peak = max(inner_peak, max(inner[first:]))
        need = read_bytes + sum(nbytes[b] for b in reads) + result_bytes + made - freed + peak
        if (need > limit or k in bounds) and k > start:  # step k starts the next range instead
            ranges.append(Range(start, k, inner_peak))
            start, outside, read_bytes, result_bytes, inner, inner_peak = k, set(), 0, 0, [], 0
            continue
        outside.update(reads)
        read_bytes += sum(nbytes[b] for b in reads)
        result_bytes += made - freed
        inner_peak = peak
        k += 1
    if steps:
        ranges.append(Range(start, len(steps), inner_peak))
    return ranges


def coarse_program(program: Program, ranges: list[Range]) -> tuple[Program, tuple[int, ...]]:
    """The program with one step per range, and per buffer of it the program's buffer: the values
    made and freed inside a range are its scratch."""
    uses, buffers = program.uses, program.buffers
    last_read = [reads[-1] if reads else -1 for reads in uses.read_at]
    coarse_steps = []
    for r in ranges:
        inside = program.steps[r.start : r.stop]
        reads = dict.fromkeys(
            b for step in inside for b in step.reads if uses.defined_at[b] is None or uses.defined_at[b] < r.start
        )
        writes = [b for step in inside for b in step.writes if last_read[b] >= r.stop or buffers[b].is_output]
        coarse_steps.append((tuple(reads), tuple(writes), r, inside))
    kept = sorted(
        {b for reads, writes, _, _ in coarse_steps for b in (*reads, *writes)}
        | {b for b, buffer in enumerate(buffers) if buffer.kind != "computed"}
    )
    new = {b: i for i, b in enumerate(kept)}
    olds = (buffers[b] for b in kept)  # one no output replaces: the same record
    renumbered = lambda x: replace(x, aliased_input=new[x.aliased_input])  # noqa: E731
    coarse_buffers = tuple(x if x.aliased_input is None else renumbered(x) for x in olds)
    return Program(
        steps=tuple(
            Step(
                reads=tuple(new[b] for b in reads),
                writes=tuple(new[b] for b in writes),
                transient_bytes=r.inner_peak,
                flops=sum(step.flops for step in inside),
                bytes_accessed=sum(step.bytes_accessed for step in inside),
                name=f"steps {r.start}..{r.stop - 1}",
            )
            for reads, writes, r, inside in coarse_steps
        ),
        buffers=coarse_buffers,
    ), tuple(kept)


def refined(program: Program, coarse: Schedule, ranges: list[Range], ids: tuple[int, ...]) -> Schedule:
    """The coarse program's plan on the program's steps: a prefetch issued at its range's start
    (serving the first read from there), an offload issued after its range's last step, a wait
    before a range."""
    read_at = program.uses.read_at
    moves: list[Prefetch | Offload] = []
    for m in coarse.moves:
        b = ids[m.buffer]
        if isinstance(m, Prefetch):
            used_from = ranges[m.use_step].start
            use = next(k for k in read_at[b] if k >= used_from)
            moves.append(Prefetch(buffer=b, issue_step=ranges[m.issue_step].start, use_step=use))
        else:
            done = None if m.done_before_step is None else ranges[m.done_before_step].start
            moves.append(Offload(buffer=b, after_step=ranges[m.after_step].stop - 1, done_before_step=done))
    return Schedule(
        strategy=f"{coarse.strategy} in ranges",
        budget_bytes=coarse.budget_bytes,
        host_inputs=frozenset(ids[b] for b in coarse.host_inputs),
        host_outputs=frozenset(ids[b] for b in coarse.host_outputs),
        moves=tuple(sorted(moves, key=move_order)),
        segment_starts=frozenset(r.start for r in ranges),
    )


def plan_in_ranges(program: Program, budget_bytes: int, share: float, plan: Callable[..., Schedule]) -> Schedule:
    """``plan`` (the window planner) run on ranges that each fit ``share`` of the budget alone, its
    moves put back on the steps."""
    ranges = ranges_within(program, int(share * budget_bytes))
    coarse, ids = coarse_program(program, ranges)
    return refined(program, plan(coarse, budget_bytes), ranges, ids)


# Where the state is larger than the budget, the step is also planned in ranges that each fit these
# shares of the budget, and the plan taken is the one that moves fewest bytes with each boundary
# charged as BOUNDARY_BYTES: measured on an H200, the executor cost about 1.3 ms per segment
# (segment_profile-nvidia-h200-2026-11-26.json), the time its link moves 70 MB in (54 GB/s each
# way, gpu-nvidia-h200-2026-11-26b.json).
RANGE_SHARES = (0.2, 0.3, 0.4, 0.5, 0.7, 0.9)
BOUNDARY_BYTES = 70 * 10**6


def cheapest_in_ranges(
    program: Program, budget_bytes: int, plan: Callable[..., Schedule], step_by_step: Schedule
) -> Schedule:
    """The plan whose copies (each way: half of both) and boundaries (the segments it starts) cost
    the least link time, of ``plan`` in ranges of each of ``RANGE_SHARES`` of the budget and of
    ``step_by_step``."""
    plans = [step_by_step]
    for share in RANGE_SHARES:
        try:
            plans.append(plan_in_ranges(program, budget_bytes, share, plan))
        except (BudgetInfeasibleError, ValueError):  # a range alone over the budget or the window
            continue
    boundaries = lambda s: len(s.copy_steps | s.segment_starts)  # noqa: E731
    return min(plans, key=lambda s: s.moved_bytes(program) // 2 + boundaries(s) * BOUNDARY_BYTES)
