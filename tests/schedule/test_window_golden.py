"""The window planner on programs small enough to plan by hand.

The expected schedules below were worked out by stepping through the algorithm on paper
(Hayakawa & Narihira 2020); the comments give the reasoning that fixes each move.
"""

import dataclasses

import pytest

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule import Prefetch, Program, plan_window, required_bytes, simulate, validate
from oocjax.schedule.homes import resident_candidates
from oocjax.schedule.synthetic import layered_training_step
from oocjax.schedule.window import _WindowPlanner
from tests.support.programs import MiB, mlp_chain


def ids(program: Program) -> dict[str, int]:
    return {buffer.label: b for b, buffer in enumerate(program.buffers)}


def named_moves(program: Program, schedule) -> list[tuple]:
    label = {b: buffer.label for b, buffer in enumerate(program.buffers)}
    return [
        ("prefetch", label[m.buffer], m.issue_step, m.use_step)
        if isinstance(m, Prefetch)
        else ("offload", label[m.buffer], m.after_step, m.done_before_step)
        for m in schedule.moves
    ]


def test_a_budget_at_the_in_core_peak_moves_nothing():
    program = mlp_chain()
    in_core = simulate(program, plan_window(program, 10**12)).peak_bytes
    assert in_core == 21 * MiB  # step b3: x, w1, w2, w3, a1, a2, a3, g3, dw3 all held
    schedule = plan_window(program, in_core)
    assert schedule.moves_nothing and schedule.budget_bytes == in_core


def test_the_window_pass_over_the_mlp_chain_at_16_MiB_follows_the_hand_worked_schedule():
    # Attempt 1 prefetches the four inputs at step 0 and lets the window run into b2; reserving b3's
    # outputs then finds nothing to wait for, so it backtracks: a1 and w2 may not enter before step 4.
    # Attempt 2 offloads a1 after f2 (its next use, b2, is outside the window), waits for it when b3
    # needs room, and offloads dw3 (its return lies outside the window). At step 4 the window reaches
    # the returns and cancels dw3's offload; b2's outputs then do not fit: backtrack again.
    # Attempt 3 keeps dw3's offload, waits for it before b2, and returns dw3 on host.
    program = mlp_chain()
    schedule = _WindowPlanner(program, 16 * MiB, 24 * MiB, MiB).plan()  # the window's own pass, every input on host
    assert named_moves(program, schedule) == [
        ("prefetch", "x", 0, 0),
        ("prefetch", "w1", 0, 0),
        ("prefetch", "w2", 0, 1),
        ("prefetch", "w3", 0, 2),
        ("offload", "a1", 1, 3),
        ("offload", "dw3", 3, 4),
        ("prefetch", "a1", 4, 4),
        ("prefetch", "w2", 4, 4),
        ("prefetch", "x", 4, 5),
        ("prefetch", "w1", 4, 5),
    ]
    assert {program.buffers[b].label for b in schedule.host_outputs} == {"dw3"}
    assert validate(program, schedule) == ()


def test_then_the_inputs_that_still_fit_stay_on_the_device_cheapest_first():
    # No input is donated, so one kept on the device holds its megabyte from step 0 to the end.
    # x and w1 were fetched at steps 0 and 4: kept, they add 1 MiB each to steps 1-3 (10, 13, 14 MiB)
    # and save two fetches each. w2 (fetched at 0 and 4) would add a megabyte to steps 2, 3 and 5 for
    # two fetches, as cheap, but after x and w1 step 3 is at the budget. w3 (fetched once) would add
    # one to steps 4 and 5, where step 4 is at the budget. So w2 and w3 stay on host.
    program = mlp_chain()
    schedule = plan_window(program, 16 * MiB)
    assert named_moves(program, schedule) == [
        ("prefetch", "w2", 0, 1),
        ("prefetch", "w3", 0, 2),
        ("offload", "a1", 1, 3),
        ("offload", "dw3", 3, 4),
        ("prefetch", "a1", 4, 4),
        ("prefetch", "w2", 4, 4),
    ]
    assert {program.buffers[b].label for b in schedule.host_inputs} == {"w2", "w3"}
    assert {program.buffers[b].label for b in schedule.host_outputs} == {"dw3"}
    timeline = simulate(program, schedule)
    assert [b // MiB for b in timeline.device_bytes] == [8, 12, 15, 16, 16, 12]
    assert validate(program, schedule) == ()


def test_the_16_MiB_plan_takes_two_backtracks():
    planner = _WindowPlanner(mlp_chain(), 16 * MiB, 24 * MiB, MiB)
    planner.plan()
    assert planner.backtracks == 2


def test_host_parameters_are_dropped_and_fetched_again_without_a_copy_out():
    program = mlp_chain()
    schedule = plan_window(program, 16 * MiB)
    name = ids(program)
    assert [m.issue_step for m in schedule.prefetches if m.buffer == name["w2"]] == [0, 4]
    offloaded = {program.buffers[m.buffer].label for m in schedule.offloads}
    assert offloaded == {"a1", "dw3"}  # no parameter is ever copied out


def test_dead_values_are_freed_without_a_copy():
    program = mlp_chain()
    schedule = plan_window(program, 14 * MiB)
    moved = {program.buffers[m.buffer].label for m in schedule.moves}
    # a2, a3 and g3 die at b3 and b2: freed there, never copied, although memory is at its tightest.
    assert not moved & {"a2", "a3", "g3", "g2", "g1"}
    assert simulate(program, schedule).peak_bytes == 14 * MiB


def gap_program() -> Program:
    """``a`` is made at s0 and read again only at s4; everything else is a short-lived chain."""
    sizes = {"x": MiB, "a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB, "e": 4 * MiB, "d": MiB}
    ops = [
        ("s0", ["x"], ["a"]),
        ("s1", ["a"], ["b"]),
        ("s2", ["b"], ["c"]),
        ("s3", ["c"], ["e"]),
        ("s4", ["a", "e"], ["d"]),
    ]
    return Program.from_ops(ops, sizes, inputs=["x"], outputs=["d"])


def test_a_swap_out_still_in_flight_when_the_value_is_needed_again_is_cancelled():
    # With a 12 MiB window, a's next use (s4) is outside the window after s1, so its swap-out is
    # issued there. At 12.5 MiB nothing has to wait for it before the window reaches s4 at step 3:
    # the swap-out is cancelled and a stays on the device, with no copy either way.
    program = gap_program()
    schedule = plan_window(program, int(12.5 * MiB), window_bytes=12 * MiB)
    assert named_moves(program, schedule) == [("prefetch", "x", 0, 0)]
    assert validate(program, schedule) == ()


def test_the_same_swap_out_is_kept_when_memory_is_needed_before_the_value_returns():
    # At 11.5 MiB, c (s2) does not fit next to a and b: the swap-out is waited for before s2, and a
    # is fetched back for s4. Fetching it at step 3 would leave no room for e, so a backtrack moves
    # the prefetch to step 4.
    program = gap_program()
    schedule = plan_window(program, int(11.5 * MiB), window_bytes=12 * MiB)
    assert named_moves(program, schedule) == [("offload", "a", 1, 2), ("prefetch", "a", 4, 4)]
    # x is fetched once at step 0; kept on the device (holding 1 MiB to the end) it still fits.
    assert schedule.host_inputs == frozenset()
    assert validate(program, schedule) == ()


def test_an_infeasible_budget_names_the_step_and_the_smallest_feasible_budget():
    program = mlp_chain()
    assert max(required_bytes(program)) == 14 * MiB
    with pytest.raises(BudgetInfeasibleError, match=r"step 3 \(b3\) alone needs 14 MiB") as caught:
        plan_window(program, 13 * MiB)
    assert caught.value.required_bytes == 14 * MiB
    assert caught.value.step == 3
    assert "The smallest feasible budget is 14 MiB" in str(caught.value)
    plan_window(program, 14 * MiB)  # and that budget does work


def test_values_below_the_offload_threshold_never_move():
    program = mlp_chain()
    schedule = plan_window(program, 18 * MiB, min_offload_bytes=2 * MiB)
    assert all(program.buffers[m.buffer].nbytes >= 2 * MiB for m in schedule.moves)
    assert schedule.host_inputs == frozenset()
    # Held on the device, the 1 MiB inputs and gradients raise what b3 needs.
    with pytest.raises(BudgetInfeasibleError, match="lower min_offload_bytes"):
        plan_window(program, 16 * MiB, min_offload_bytes=2 * MiB)


def test_a_window_too_small_for_a_step_is_refused():
    with pytest.raises(ValueError, match=r"window_bytes=1048576 cannot hold step 3 \(b3\), which touches 14 MiB"):
        plan_window(mlp_chain(), 16 * MiB, window_bytes=MiB)


def test_a_non_positive_budget_is_refused():
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        plan_window(mlp_chain(), 0)


def test_an_output_replacing_a_streamed_input_is_returned_on_host():
    # w is read by f and again by sgd, with a large activation between: it is dropped and fetched
    # again. Its replacement w_new must then go back to host too, so the next step finds it there;
    # the copy out completes at the end (its device copy is held to the end either way).
    sizes = {"w": 4 * MiB, "h": 4 * MiB, "big": 8 * MiB, "g": 4 * MiB, "w_new": 4 * MiB}
    ops = [("f", ["w"], ["h"]), ("mid", ["h"], ["big"]), ("grad", ["big", "h"], ["g"]), ("sgd", ["w", "g"], ["w_new"])]
    program = Program.from_ops(ops, sizes, inputs=["w"], donated=["w"], outputs=["w_new"], aliases={"w_new": "w"})
    schedule = plan_window(program, 16 * MiB)
    assert named_moves(program, schedule) == [
        ("prefetch", "w", 0, 0),
        ("prefetch", "w", 3, 3),
        ("offload", "w_new", 3, None),
    ]
    name = ids(program)
    assert schedule.host_inputs == {name["w"]} and schedule.host_outputs == {name["w_new"]}
    assert validate(program, schedule) == ()


def test_donated_state_fetched_once_stays_on_the_device_with_its_replacement():
    program = layered_training_step(12, activation_bytes=8 * MiB, param_bytes=MiB)
    in_core = simulate(program, plan_window(program, 10**12)).peak_bytes
    schedule = plan_window(program, in_core * 8 // 10)  # the first layers' state fits the opening window
    pairs = [(buffer.aliased_input, b) for b, buffer in enumerate(program.buffers) if buffer.aliased_input is not None]
    kept = [(i, o) for i, o in pairs if i not in schedule.host_inputs]
    streamed = [(i, o) for i, o in pairs if i in schedule.host_inputs]
    assert kept and streamed  # both cases occur at this budget
    assert all(o not in schedule.host_outputs for _, o in kept)
    assert all(o in schedule.host_outputs for _, o in streamed)
    assert not any(m.buffer in {i for i, _ in kept} for m in schedule.moves)  # a kept input is never copied
    assert validate(program, schedule) == ()


def test_inputs_fetched_again_and_again_stay_on_the_device_where_that_moves_fewer_bytes(monkeypatch):
    # Four layers of 4 MiB parameters with AdamW-like moments: 48 MiB of donated state at a 45 MiB
    # budget. Every input starts on host; that plan fetches params[2] and params[3] for the forward
    # pass and again for their gradients, returns every update to host, and finds no room to keep
    # any input (124 MiB moved). Planned again with those two parameters (and their updates) kept
    # from the start, the rest moves around them: each saves two fetches and its return (100 MiB).
    program = layered_training_step(4, 1, activation_bytes=4 * MiB, param_bytes=4 * MiB)
    name = ids(program)
    schedule = plan_window(program, 45 * MiB)
    assert validate(program, schedule) == () and simulate(program, schedule).peak_bytes <= 45 * MiB
    assert name["params[2]"] not in schedule.host_inputs and name["params[3]"] not in schedule.host_inputs
    assert {program.buffers[b].label for b in schedule.host_inputs} >= {"params[0]", "params[1]", "mu[3]", "nu[3]"}
    assert schedule.moved_bytes(program) == 100 * MiB

    first = plan_window(program, 45 * MiB, residents=False)
    assert [len(first.prefetches_by_buffer[name[f"params[{i}]"]]) for i in range(4)] == [1, 1, 2, 2]
    assert first.moved_bytes(program) == 124 * MiB


def test_no_input_is_kept_by_choice_where_the_state_fits_the_budget_or_none_is_fetched_twice(monkeypatch):
    program = layered_training_step(4, 1, activation_bytes=4 * MiB, param_bytes=4 * MiB)  # 48 MiB of state
    schedule = plan_window(program, 45 * MiB, residents=False)  # fetches params[2] and params[3] twice (above)
    assert resident_candidates(program, schedule, 45 * MiB, MiB)
    assert resident_candidates(program, schedule, 48 * MiB, MiB) == []  # the state fits
    first_fetches = {m.buffer: m for m in reversed(schedule.prefetches)}.values()
    once = dataclasses.replace(schedule, moves=(*schedule.offloads, *first_fetches))
    assert resident_candidates(program, once, 45 * MiB, MiB) == []
