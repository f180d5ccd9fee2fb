"""Homes: where a window plan's inputs and outputs live between steps (device or host).

The window planner starts every movable input on host; ``settle_homes`` keeps on the device the
inputs that fit there within the budget, and sends each output that replaces a donated input to
where that input lives. ``resident_candidates`` proposes inputs to keep on the device before
planning, for the planner to plan the rest around them.
"""

from __future__ import annotations

from oocjax.schedule.feasibility import required_bytes
from oocjax.schedule.moves import Offload, Schedule, move_order
from oocjax.schedule.program import Program
from oocjax.schedule.range_max import RangeMax
from oocjax.schedule.simulate import simulate


def settle_homes(program: Program, schedule: Schedule) -> Schedule:
    """Decides where inputs and outputs live between steps, given the window plan.

    * An input the device can hold from the start is kept there instead of on host, where the
      budget still holds (``_inputs_kept_on_device``): the window starts every movable input on
      host, which is right only for what does not fit. Without this, a budget a little below what
      a plan needs with nothing moved sends the whole training state to host and back every step.
    * An output that replaces a donated input lives where that input lives, so the next call finds
      its state where the plan expects it. If the input stays on host while the output would be
      returned on the device, the output is returned on host: as the host copy its offload made,
      if the plan offloads it (a value never changes, so that copy is still valid, and a second
      offload is invalid), else as a copy made after its last use (the device copy was held to the
      end anyway).
    """
    kept_on_device = _inputs_kept_on_device(program, schedule)
    host_inputs = set(schedule.host_inputs) - kept_on_device
    host_outputs = set(schedule.host_outputs)
    extra_offloads = []
    for b, buffer in enumerate(program.buffers):
        source = buffer.aliased_input
        if source in host_inputs and b not in host_outputs and buffer.kind == "computed":
            host_outputs.add(b)
            if b not in schedule.offload_by_buffer:
                last = max((program.uses.defined_at[b], *program.uses.read_at[b]))
                extra_offloads.append(Offload(buffer=b, after_step=last, done_before_step=None))

    moves = [m for m in schedule.moves if m.buffer not in kept_on_device] if kept_on_device else schedule.moves
    if extra_offloads:
        moves = sorted([*moves, *extra_offloads], key=move_order)  # two sorted runs: a linear merge
    return Schedule(
        strategy=schedule.strategy,
        budget_bytes=schedule.budget_bytes,
        host_inputs=frozenset(host_inputs),
        host_outputs=frozenset(host_outputs),
        moves=tuple(moves),
    )


def _inputs_kept_on_device(program: Program, schedule: Schedule) -> set[int]:
    """The host inputs kept on the device instead, each where the planned timeline plus its bytes
    stays within the budget, cheapest first.

    A kept input occupies the device over its unmoved span (from step 0 to its last read if it is
    donated, to the last step if not) where the plan held it only between each prefetch and its
    reads; it saves its prefetches, and the offload that would return its output to a host home.
    Cheapest: fewest added byte-steps per byte saved, so an input prefetched at step 0 and never
    dropped (no added bytes) is always kept. An input whose output the plan returns on host stays
    on host with it."""
    last_step = len(program.steps) - 1
    aliased_output = program.replaced_by
    candidates = []  # (added byte-steps per byte saved, buffer, the steps it would add its bytes to)
    for b in schedule.host_inputs:
        output = aliased_output.get(b)
        if b in schedule.host_outputs or output in schedule.host_outputs:
            continue  # its output stays on host: keep the input there too
        nbytes, fetches = program.buffers[b].nbytes, len(schedule.prefetches_by_buffer.get(b, ()))
        saved = nbytes * (fetches + (output is not None))
        if not saved:
            continue
        gaps, covered = [], program.unmoved_spans[b][0]  # steps of the unmoved span the plan's stays leave out
        for stay in schedule.device_stays(program, b):
            if stay.start > covered:
                gaps.append((covered, stay.start - 1))
            covered = max(covered, min(stay.end, last_step) + 1)
        if covered <= program.unmoved_spans[b][1]:
            gaps.append((covered, program.unmoved_spans[b][1]))
        added = nbytes * sum(end - start + 1 for start, end in gaps)
        candidates.append((added / saved, b, gaps))
    if not candidates:
        return set()
    budget = schedule.budget_bytes
    device = RangeMax(simulate(program, schedule).device_bytes)  # a list would make this quadratic
    kept: set[int] = set()
    for _, b, gaps in sorted(candidates):
        nbytes = program.buffers[b].nbytes
        if budget is not None and any(device.max(s, e + 1) + nbytes > budget for s, e in gaps):
            continue
        for s, e in gaps:
            device.add(s, e + 1, nbytes)
        kept.add(b)
    return kept


# Candidate sets of resident inputs fill these fractions of the room the plan leaves.
RESIDENT_FRACTIONS = (0.25, 0.5, 0.75)


def resident_candidates(
    program: Program, schedule: Schedule, budget_bytes: int, min_offload_bytes: int
) -> list[frozenset[int]]:
    """Sets of host inputs to keep on the device for the whole step (with the outputs that replace
    them), each for the window planner to plan the rest around; none where ``schedule`` fetches no
    input twice.

    ``settle_homes`` keeps an input only where the finished plan leaves room for it over the whole
    step, and a plan tight at one step (a layer's backward pass) leaves room almost nowhere. Yet
    where the training state is larger than the device, a parameter is fetched for the forward
    pass, again for its layer's recomputation and again for its gradient, while a moment is fetched
    once: keeping parameters on the device and moving more of the rest saves bytes. Each candidate
    takes the inputs ``schedule`` fetches most often, first, into a fraction of the room: the
    budget less the largest need of any step (``required_bytes``); one that makes some step need
    more than the budget is left out.

    Only where the donated state is larger than the budget: elsewhere it fits beside the step's
    values and ``settle_homes`` keeps what the plan fetches more than once, and a plan tighter than
    it needs to be risks compiled segments measuring over the budget (and planning again).
    """
    fetches = {b: len(schedule.prefetches_by_buffer.get(b, ())) for b in schedule.host_inputs}
    if program.donated_bytes <= budget_bytes or max(fetches.values(), default=0) < 2:
        return []
    replaced_by = program.replaced_by
    ranked = sorted((b for b, n in fetches.items() if n), key=lambda b: (-fetches[b], b))
    room = budget_bytes - max(required_bytes(program, min_offload_bytes), default=0)
    candidates: list[frozenset[int]] = []
    for fraction in RESIDENT_FRACTIONS:
        free, chosen = fraction * room, []
        for b in ranked:
            if program.buffers[b].nbytes <= free:
                chosen.append(b)
                free -= program.buffers[b].nbytes
        resident = frozenset(chosen) | {replaced_by[b] for b in chosen if b in replaced_by}
        if not chosen or (candidates and resident == candidates[-1]):
            continue
        if max(required_bytes(program, min_offload_bytes, resident), default=0) <= budget_bytes:
            candidates.append(resident)
    return candidates
