"""Properties of the window planner over random programs (a few hundred each, derandomized)."""

import re
from unittest.mock import patch

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from oocjax.budget import resolve_budget
from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule import (
    Offload,
    Prefetch,
    Program,
    Schedule,
    keep_all,
    plan_window,
    required_bytes,
    simulate,
    validate,
    window,
)
from oocjax.schedule.range_max import RangeMax
from oocjax.schedule.synthetic import layered_training_step
from tests.support.programs import MiB, an_offloaded_output_of_a_host_input, programs


def in_core_peak(program) -> int:
    return simulate(program, keep_all(program)).peak_bytes


def smallest_feasible(program) -> int:
    return max(required_bytes(program), default=0)


@given(programs(), st.floats(0.0, 1.0))
@example(an_offloaded_output_of_a_host_input(), 0.0)  # y was offloaded twice: to free it, then to return it
def test_every_feasible_budget_gives_a_valid_plan_within_the_budget(program, position):
    low, high = smallest_feasible(program), in_core_peak(program)
    budget = max(1, int(low + position * (high - low)))
    schedule = plan_window(program, budget)
    assert validate(program, schedule) == ()
    assert simulate(program, schedule).peak_bytes <= budget


@given(programs(), st.floats(1.0, 2.0))
def test_a_budget_at_or_above_the_in_core_peak_moves_nothing(program, factor):
    budget = max(1, int(in_core_peak(program) * factor))
    assert plan_window(program, budget).moves_nothing


@given(programs(), st.floats(0.0, 1.0))
def test_the_same_program_and_budget_give_the_same_plan(program, position):
    low, high = smallest_feasible(program), in_core_peak(program)
    budget = max(1, int(low + position * (high - low)))
    assert plan_window(program, budget) == plan_window(program, budget)


@given(programs(), st.floats(0.0, 0.999))
def test_an_infeasible_budget_raises_and_never_returns_a_plan(program, fraction):
    need = smallest_feasible(program)
    budget = int(need * fraction)
    assume(0 < budget < need)  # else this program has no infeasible budget to ask for
    with pytest.raises(BudgetInfeasibleError) as caught:
        plan_window(program, budget)
    assert caught.value.required_bytes == need
    assert caught.value.budget_bytes == budget


def one_operation_of(nbytes: int) -> Program:
    return Program.from_ops([("make_y", [], ["y"])], {"y": nbytes}, inputs=[], outputs=["y"])


@given(programs(), st.floats(0.0, 0.999))
@example(one_operation_of(24_894_632), 0.5)  # 23.74 MiB, once printed as "at least 23.7 MiB"
def test_the_smallest_budget_an_infeasible_budget_names_is_accepted_as_printed(program, fraction):
    need = smallest_feasible(program)
    budget = int(need * fraction)
    assume(0 < budget < need)
    with pytest.raises(BudgetInfeasibleError) as caught:
        plan_window(program, budget)
    printed = re.search(r"raise the budget to at least (\S+ \w+) \(", str(caught.value)).group(1)
    assert resolve_budget(printed, device=None) >= need, printed
    plan_window(program, resolve_budget(printed, device=None))  # passed back as the budget, it is accepted


@given(programs(), st.floats(0.0, 1.0), st.sampled_from([1.0, 1.5, 3.0]))
def test_any_window_that_holds_every_step_gives_a_valid_plan(program, position, window_factor):
    low, high = smallest_feasible(program), in_core_peak(program)
    budget = max(1, int(low + position * (high - low)))
    touched = max((sum(program.buffers[b].nbytes for b in (*s.reads, *s.writes)) for s in program.steps), default=0)
    window = max(touched, int(budget * window_factor))
    schedule = plan_window(program, budget, window_bytes=window)
    assert validate(program, schedule) == ()


def test_an_output_of_a_host_input_that_is_offloaded_already_is_returned_as_that_host_copy():
    # Its offload made a host copy that stays valid (a value never changes): the output is returned
    # as that copy. A second offload after use_y is invalid, and at run time the segment that reads
    # y last would consume its device copy before that offload reads it.
    program = an_offloaded_output_of_a_host_input()
    x, y = 0, 1
    schedule = plan_window(program, MiB)
    assert validate(program, schedule) == ()
    assert schedule.host_inputs == {x} and schedule.host_outputs == {y}
    assert schedule.moves == (
        Offload(buffer=y, after_step=0, done_before_step=10),
        Prefetch(buffer=y, issue_step=11, use_step=11),
    )
    # y is on host from its offload to the end, beside x; on the device only until the offload is
    # done (before "small") and again for use_y, which is the last to read that copy.
    timeline = simulate(program, schedule)
    assert timeline.device_bytes == (MiB,) * 10 + (4096, MiB)
    assert timeline.host_bytes == (2 * MiB,) * 12


@given(
    st.lists(st.integers(0, 100), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 39), st.integers(0, 39), st.integers(0, 50)), max_size=30),
)
def test_the_range_max_timeline_agrees_with_a_plain_list(values, operations):
    timeline, plain = RangeMax(values), list(values)
    for a, b, value in operations:
        start, stop = sorted((a % len(plain), b % len(plain)))
        stop += 1
        timeline.add(start, stop, value)
        plain[start:stop] = [x + value for x in plain[start:stop]]
        assert timeline.max(start, stop) == max(plain[start:stop])
        assert timeline.max(0, len(plain)) == max(plain)


def _started_over(self) -> int:
    """``window._Pass.rewind`` as the planner first was: every pass after a backtrack from step 0."""
    self.__init__(self.planner)
    return 0


def planned_both_ways(program, budget: int, snapshot_steps: int) -> tuple[Schedule, Schedule, int]:
    """The plan of passes resumed from snapshots every ``snapshot_steps``, the plan of passes
    started over, and the backtracks either made."""
    planners = []
    made = window._WindowPlanner.__init__

    def counted(self, *args, **kwargs):
        made(self, *args, **kwargs)
        planners.append(self)

    snapshots = patch.object(window, "SNAPSHOT_STEPS", snapshot_steps)
    with snapshots, patch.object(window._WindowPlanner, "__init__", counted):
        resumed = plan_window(program, budget)
    with patch.object(window._Pass, "rewind", _started_over):
        over = plan_window(program, budget)
    return resumed, over, sum(p.backtracks for p in planners)


@given(programs(), st.floats(0.0, 1.0), st.sampled_from([1, 2, 5, 32]))
def test_a_pass_resumed_from_a_snapshot_after_a_backtrack_plans_as_a_pass_started_over(program, position, every):
    low, high = smallest_feasible(program), in_core_peak(program)
    budget = max(1, int(low + position * (high - low)))
    resumed, over, _ = planned_both_ways(program, budget, every)
    assert resumed == over


@pytest.mark.parametrize("every", [1, 3, 32])
def test_a_layered_step_that_backtracks_twenty_times_plans_alike_resumed_or_started_over(every):
    program = layered_training_step(12)
    budget = max(required_bytes(program))
    resumed, over, backtracks = planned_both_ways(program, budget, every)
    assert backtracks >= 20
    assert resumed == over
    assert validate(program, resumed) == ()


def test_a_pass_takes_no_snapshot_before_the_first_backtrack_and_a_bounded_number_after():
    program, passes = layered_training_step(12), []  # 110 steps
    run = window._Pass.run

    def spied(self, start=0):
        schedule = run(self, start)
        passes.append((self.planner.backtracks, len(self.snapshots)))
        return schedule

    bounds = patch.object(window, "SNAPSHOT_STEPS", 1), patch.object(window, "MOST_SNAPSHOTS", 4)
    with bounds[0], bounds[1], patch.object(window._Pass, "run", spied):
        plan_window(program, max(required_bytes(program)))
    assert passes[0] == (0, 0)  # a program that never backtracks pays for no copies
    assert len(passes) > 2 and any(taken for _, taken in passes[1:])
    assert all(taken <= 4 + 1 for _, taken in passes)  # steps 0, 27, 54, 81 and 108 at most
