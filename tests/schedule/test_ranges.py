"""Planning in ranges: the steps grouped into ranges that each fit a share of the budget, the ranges
planned as steps, the moves put back between them."""

from hypothesis import given
from hypothesis import strategies as st

from oocjax.schedule import plan_window, required_bytes, simulate, validate
from oocjax.schedule import ranges as ranges_module
from oocjax.schedule import window as window_module
from oocjax.schedule.ranges import coarse_program, plan_in_ranges, ranges_within
from oocjax.schedule.segments import _Segmenter
from oocjax.schedule.synthetic import layered_training_step
from tests.support.programs import MiB


def state_bytes(program) -> int:
    return program.donated_bytes


def plan_steps(program, budget):
    return window_module._plan_checked(program, budget, window=int(1.5 * budget), min_offload_bytes=MiB)


@st.composite
def steps_with_state_over_the_budget(draw):
    """A layered training step whose donated state is larger than a feasible budget, and the budget."""
    program = layered_training_step(
        draw(st.integers(2, 6)),
        draw(st.integers(1, 4)),
        activation_bytes=draw(st.sampled_from([MiB, 4 * MiB])),
        param_bytes=draw(st.sampled_from([2 * MiB, 4 * MiB, 8 * MiB])),
    )
    low, high = max(required_bytes(program)), state_bytes(program)
    budget = draw(st.integers(low, max(low, high - 1)))
    return program, budget


@given(steps_with_state_over_the_budget(), st.sampled_from(ranges_module.RANGE_SHARES))
def test_ranges_cover_the_steps_in_order_and_each_needs_what_a_segment_of_it_would_hold(case, share):
    program, budget = case
    limit = int(share * budget)
    ranges = ranges_within(program, limit)
    assert [r.start for r in ranges] == [0, *(r.stop for r in ranges[:-1])] and ranges[-1].stop == len(program.steps)
    coarse, ids = coarse_program(program, ranges)
    assert len(coarse.steps) == len(ranges) and [program.buffers[b].nbytes for b in ids] == [
        b.nbytes for b in coarse.buffers
    ]
    nothing_held = _Segmenter(program, window_module.keep_all(program))
    for r, step in zip(ranges, coarse.steps, strict=True):
        need = sum(coarse.buffers[b].nbytes for b in (*step.reads, *step.writes)) + step.transient_bytes
        assert need <= limit or r.stop - r.start == 1
        # The segment estimate of the range, with every value it reads held (as a plan on the
        # device holds them) and none of its results written in place: the range as one step.
        held, estimate = nothing_held.estimate(r.start, r.stop)
        reads_held = sum(coarse.buffers[b].nbytes for b in step.reads)
        assert estimate - held + reads_held <= need


@given(steps_with_state_over_the_budget(), st.sampled_from(ranges_module.RANGE_SHARES))
def test_a_plan_in_ranges_is_valid_within_the_budget_and_moves_only_between_ranges(case, share):
    program, budget = case
    schedule = plan_in_ranges(program, budget, share, plan_steps)
    assert validate(program, schedule) == ()
    assert simulate(program, schedule).peak_bytes <= budget
    starts = {r.start for r in ranges_within(program, int(share * budget))}
    assert {m.issue_step for m in schedule.prefetches} <= starts
    assert {m.done_before_step for m in schedule.offloads} - {None} <= starts


def test_where_the_state_is_larger_than_the_budget_the_plan_stops_the_executor_far_less_often():
    # Six layers of 16 operations and 8 MiB parameters with their moments: 144 MiB of state at a
    # 100 MiB budget. Step by step, the plan stops before 70 steps to copy and moves 508 MiB; in
    # ranges of half the budget it starts 16 segments and moves 526 MiB, of 0.9 of it 11 and 574 MiB:
    # at 70 MB a boundary, the cheapest.
    program = layered_training_step(6, 16, activation_bytes=MiB, param_bytes=8 * MiB)
    budget = 100 * MiB
    assert state_bytes(program) == 144 * MiB
    step_by_step = plan_steps(program, budget)
    chosen = plan_window(program, budget)
    assert validate(program, chosen) == () and simulate(program, chosen).peak_bytes <= budget
    assert (len(step_by_step.copy_steps), step_by_step.moved_bytes(program)) == (70, 508 * MiB)
    assert (len(chosen.copy_steps | chosen.segment_starts), chosen.moved_bytes(program)) == (11, 574 * MiB)


def test_where_the_state_fits_the_budget_the_step_by_step_plan_is_the_plan():
    program = layered_training_step(4, 4, activation_bytes=8 * MiB, param_bytes=MiB)
    budget = max(required_bytes(program)) + 8 * MiB
    assert state_bytes(program) < budget
    schedule = plan_window(program, budget)
    assert schedule == plan_window(program, budget, in_ranges=False) and schedule.strategy == "window"
    assert validate(program, schedule) == () and schedule.moves
