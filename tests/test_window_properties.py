"""Properties of the window planner over random programs (a few hundred each, derandomized)."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule import keep_all, plan_window, required_bytes, simulate, validate
from tests.programs import programs


def in_core_peak(program) -> int:
    return simulate(program, keep_all(program)).peak_bytes


def smallest_feasible(program) -> int:
    return max(required_bytes(program), default=0)


@given(programs(), st.floats(0.0, 1.0))
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


@given(programs(), st.floats(0.0, 1.0), st.sampled_from([1.0, 1.5, 3.0]))
def test_any_window_that_holds_every_step_gives_a_valid_plan(program, position, window_factor):
    low, high = smallest_feasible(program), in_core_peak(program)
    budget = max(1, int(low + position * (high - low)))
    touched = max((sum(program.buffers[b].nbytes for b in (*s.reads, *s.writes)) for s in program.steps), default=0)
    window = max(touched, int(budget * window_factor))
    schedule = plan_window(program, budget, window_bytes=window)
    assert validate(program, schedule) == ()
