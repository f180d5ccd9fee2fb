"""Baseline schedules and the timed simulation."""

import pytest
from hypothesis import assume, given

from benchmarks.baselines import fixed_lookahead, swap_all_just_in_time
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
)
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.profiles import DEFAULT_PROFILE, PROFILES, DeviceProfile, resolve_profile
from tests.support.programs import mlp_chain, programs


@given(programs())
def test_the_swapping_baselines_always_give_valid_schedules(program):
    for schedule in (swap_all_just_in_time(program), fixed_lookahead(program, 3)):
        assert validate(program, schedule) == ()


def test_swap_all_just_in_time_moves_every_long_gap_of_the_mlp_chain():
    program = mlp_chain()
    schedule = swap_all_just_in_time(program)
    label = {b: buffer.label for b, buffer in enumerate(program.buffers)}
    # With one step of look-ahead a gap is long when it spans more than two steps. a1 is read by f2
    # (step 1) and next by b2 (step 4): out after f2, back at step 3. Inputs live on host and are
    # fetched one step before each use (at step 0 for f1 and f2); x, w1 and w2 again for the backward.
    moves = [
        (type(m).__name__, label[m.buffer], m.issue_step if isinstance(m, Prefetch) else m.after_step)
        for m in schedule.moves
    ]
    assert moves == [
        ("Prefetch", "x", 0),
        ("Prefetch", "w1", 0),
        ("Prefetch", "w2", 0),
        ("Prefetch", "w3", 1),
        ("Offload", "a1", 1),
        ("Prefetch", "w2", 3),
        ("Prefetch", "a1", 3),
        ("Prefetch", "x", 4),
        ("Prefetch", "w1", 4),
    ]
    assert simulate(program, schedule).peak_bytes < simulate(program, keep_all(program)).peak_bytes


@given(programs())
def test_the_timed_step_is_never_faster_than_its_lower_bound(program):
    budget = max(1, simulate(program, keep_all(program)).peak_bytes * 3 // 4)
    assume(budget >= max(required_bytes(program)))  # infeasible budgets are the planner's own properties
    schedule = plan_window(program, budget)
    for profile in PROFILES.values():
        result = simulate_time(program, schedule, profile)
        assert result.step_time_s >= result.lower_bound_s - 1e-12
        assert result.step_time_s >= result.compute_time_s - 1e-12
        assert result.exposed_transfer_s == pytest.approx(result.step_time_s - result.compute_time_s)


def test_the_timed_simulation_overlaps_copies_with_compute_as_worked_out_by_hand():
    # 1 FLOP/s and 1 byte/s each way make times easy: each step takes its flops in seconds.
    profile = DeviceProfile(
        name="unit",
        flops_per_s=1.0,
        hbm_bytes_per_s=1e30,
        h2d_bytes_per_s=1.0,
        d2h_bytes_per_s=1.0,
        op_overhead_s=0.0,
        copy_latency_s=0.0,
    )
    program = Program.from_ops(
        [("f", [], ["a"]), ("g", [], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c"], ["d"])],
        {"a": 3, "b": 1, "c": 1, "d": 1},
        flops={0: 2, 1: 2, 2: 2, 3: 2},
    )
    schedule = Schedule(
        strategy="hand",
        budget_bytes=None,
        moves=(
            Offload(buffer=0, after_step=0, done_before_step=2),
            Prefetch(buffer=0, issue_step=3, use_step=3),
        ),
    )
    result = simulate_time(program, schedule, profile)
    # f: 0-2; a's offload 2-5; g: 2-4; h waits for the offload: 5-7; the prefetch starts when h ends
    # (7-10); k waits for it: 10-12.
    assert result.compute_spans == ((0, 2), (2, 4), (5, 7), (10, 12))
    assert result.d2h_spans == ((2, 5),) and result.h2d_spans == ((7, 10),)
    assert (result.step_time_s, result.compute_time_s, result.exposed_transfer_s) == (12, 8, 4)
    assert result.lower_bound_s == 8


def test_an_unknown_profile_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown device profile 'tpu'; known: h100-pcie"):
        simulate_time(mlp_chain(), keep_all(mlp_chain()), "tpu")


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("h100-sxm", "h100-sxm"),  # the exact name
        ("H100 SXM", "h100-sxm"),  # case, spaces and underscores do not matter
        ("gh", "gh200"),  # the one profile whose name starts so
        ("h100", "h100-pcie"),  # a family: its first profile, the slower H100
    ],
)
def test_a_profile_name_means_the_profile_it_clearly_names(name, meant):
    assert resolve_profile(name) is PROFILES[meant]
    assert simulate_time(mlp_chain(), keep_all(mlp_chain()), name) == simulate_time(
        mlp_chain(), keep_all(mlp_chain()), PROFILES[meant]
    )


def test_a_profile_value_is_used_as_it_is_and_the_default_is_one_of_the_known_profiles():
    custom = DeviceProfile(
        name="h100-pcie", flops_per_s=1.0, hbm_bytes_per_s=1.0, h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0
    )
    assert resolve_profile(custom) is custom
    assert PROFILES[DEFAULT_PROFILE.name] is DEFAULT_PROFILE


def test_a_profile_name_that_could_mean_several_profiles_lists_them():
    with pytest.raises(ValueError, match="ambiguous device profile 'h1': it could be h100-pcie or h100-sxm; known: "):
        resolve_profile("h1")


def test_an_unknown_profile_name_suggests_the_closest_known_one():
    with pytest.raises(ValueError, match=r"unknown device profile 'h300'; known: .*gh200, cpu; did you mean 'h200'\?"):
        resolve_profile("h300")
