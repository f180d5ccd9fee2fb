"""Keep, move or recompute: the hybrid plan moves less than swap-only, is slower by the model only by
less than MOVE_MARGIN (and then moves less), moves nothing where recomputation makes the step fit, and
computes what jax.jit computes."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.rates import measure_profile
from oocjax import BudgetInfeasibleError, ooc_jit
from oocjax.schedule import plan_window, required_bytes, simulate, simulate_time
from oocjax.schedule.hybrid import plan_hybrid
from oocjax.schedule.layer_plan import MOVE_MARGIN
from oocjax.schedule.synthetic import layered_training_step
from oocjax.transforms.recompute import recomputable_steps
from oocjax.transforms.trace import trace_step
from tests.support import zoo
from tests.support.programs import programs

MiB = 2**20


def case():
    """The zoo's transformer, built on first use (not at collection)."""
    return zoo.case("transformer_dropout_adamw")


@functools.cache
def in_core() -> int:
    return ooc_jit(case().step, budget=2**62).plan(case().state, case().batches[0]).baseline_peak_bytes


@functools.cache
def planned(fraction: float, recompute: str):
    step = ooc_jit(
        case().step, budget=int(in_core() * fraction), donate_argnums=(0,), min_offload_bytes=4096, recompute=recompute
    )
    return step, step.plan(case().state, case().batches[0])


def fresh(state):
    return jax.tree.map(lambda x: x.copy(), state)


@functools.cache
def chosen(fraction: float, recompute: str):
    """The plan ``ooc_jit`` chooses at ``fraction`` of in-core, without compiling its segments."""
    traced = trace_step(case().step, case().state, case().batches[0], donate_argnums=(0,))
    recomputable = recomputable_steps(traced.flat).__getitem__
    budget = int(in_core() * fraction)
    window = dict(min_offload_bytes=4096)
    return plan_hybrid(
        traced.program, budget, recomputable=recomputable, profile=measure_profile(), recompute=recompute, **window
    )


@pytest.mark.parametrize("fraction", [0.6, 0.35])
def test_recomputing_moves_strictly_fewer_bytes_than_swap_only_and_is_slower_by_the_model_only_within_the_margin(
    fraction,
):
    swap_only, hybrid = chosen(fraction, "off"), chosen(fraction, "auto")
    assert hybrid.rewrite.recomputed and not swap_only.rewrite.recomputed
    moved = [simulate(p.program, p.schedule) for p in (swap_only, hybrid)]
    assert moved[1].h2d_bytes + moved[1].d2h_bytes < moved[0].h2d_bytes + moved[0].d2h_bytes
    assert hybrid.swap_only_time_s == swap_only.step_time_s
    assert hybrid.step_time_s <= swap_only.step_time_s * (1 + MOVE_MARGIN)
    assert hybrid.rewrite.extra_flops > 0 and moved[1].peak_bytes <= int(in_core() * fraction)


def dropout_masks(name: str, label: str) -> bool | None:
    """An expert's policy: recompute every dropout mask (the `lt` of uniform bits against the keep
    rate, kept for the backward), decide the rest by cost."""
    return True if name == "lt" else None


@pytest.mark.slow
def test_a_dropout_model_whose_mask_is_recomputed_trains_like_its_swap_only_plan():
    step, plan = planned(0.6, dropout_masks)
    masks = [r for r in plan.recomputed if plan.program.steps[r.recomputed_at].name == "lt" and r.nbytes >= 4096]
    assert len(masks) >= 4, plan.recomputed  # one per dropout after attention and in the MLP, per layer
    swap_only, _ = planned(0.6, "off")
    losses = {}
    for name, run in (("hybrid", step), ("swap only", swap_only), ("jax.jit", jax.jit(case().step))):
        state, losses[name] = fresh(case().state), []
        for batch in case().batches[:2]:
            state, metrics = run(state, batch)
            losses[name].append(float(metrics["loss"]))
    # The same key gives the same bits: the recomputed masks drop exactly what the originals dropped.
    np.testing.assert_allclose(losses["hybrid"], losses["swap only"], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(losses["hybrid"], losses["jax.jit"], rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_where_recomputation_makes_the_step_fit_nothing_moves():
    fraction = 0.9
    _, swap_only = planned(fraction, "off")
    _, hybrid = planned(fraction, "auto")
    assert swap_only.moved_bytes > 0
    assert hybrid.recomputed and hybrid.moved_bytes == 0 and not hybrid.offloads and not hybrid.host_inputs
    assert hybrid.executed_peak_bytes <= hybrid.budget_bytes
    step, _ = planned(fraction, "auto")
    metrics = step(fresh(case().state), case().batches[0])[1]
    expected = jax.jit(case().step)(case().state, case().batches[0])[1]
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-6)


def test_an_unknown_recompute_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match=r"recompute must be one of \('auto', 'off', 'always'\) or a function"):
        ooc_jit(case().step, budget=2**30, recompute="sometimes")


def test_at_the_in_core_estimate_nothing_is_recomputed_and_jax_jits_program_runs():
    plan = ooc_jit(case().step, budget=in_core(), recompute="always").plan(case().state, case().batches[0])
    assert not plan.recomputed and not plan.segments and plan.jaxpr is plan.source_jaxpr


# The pure-Python choice, on random programs: never slower than swap-only by the model by more than
# MOVE_MARGIN, and slower only where it moves fewer bytes.


def everything_recomputable(program):
    return lambda step: True


@settings(max_examples=60, deadline=None)
@given(program=programs(), position=st.floats(0.3, 1.0), profile=st.sampled_from(["h100-pcie", "cpu"]))
def test_the_hybrid_plan_is_valid_within_the_budget_and_slower_than_swap_only_only_to_move_less(
    program, position, profile
):
    peak = simulate(program, plan_window(program, 2**62)).peak_bytes
    budget = max(1, int(peak * position))
    try:
        swap = plan_window(program, budget)
    except BudgetInfeasibleError as error:  # infeasible budgets are the planner's tests' business
        assert budget < error.required_bytes == max(required_bytes(program))  # and truly infeasible
        return
    chosen = plan_hybrid(program, budget, recomputable=everything_recomputable(program), profile=profile)
    assert simulate(chosen.program, chosen.schedule).peak_bytes <= budget
    swap_time = simulate_time(program, swap, profile).step_time_s
    assert chosen.step_time_s <= swap_time * (1 + MOVE_MARGIN) + 1e-12
    if chosen.step_time_s > swap_time + 1e-12:
        moved = sum(chosen.program.buffers[m.buffer].nbytes for m in chosen.schedule.moves)
        assert moved < sum(program.buffers[m.buffer].nbytes for m in swap.moves)


def test_on_a_layered_step_recomputation_fits_where_swap_only_moves():
    program = layered_training_step(3)
    chosen = plan_hybrid(
        program, 160 * MiB, recomputable=lambda s: program.steps[s].name != "adam", profile="h100-pcie"
    )
    assert chosen.rewrite.recomputed and chosen.schedule.moves_nothing
    assert not chosen.swap_only.moves_nothing
    off = plan_hybrid(program, 160 * MiB, recomputable=lambda s: True, profile="h100-pcie", recompute="off")
    assert not off.rewrite.recomputed and off.schedule == chosen.swap_only


def test_a_plan_moving_more_bytes_is_taken_only_where_it_is_faster_by_more_than_the_margin():
    from types import SimpleNamespace

    from oocjax.schedule.hybrid import _chosen

    def candidate(moved_bytes, time_s):
        moves = SimpleNamespace(moves=(), moved_bytes=lambda program: moved_bytes)
        return SimpleNamespace(rewrite=SimpleNamespace(program=None), time_s=time_s, schedule=moves)

    fewer, many_more = candidate(8 * MiB, 0.0279), candidate(4 * 8 * MiB, 0.0269)  # 4% faster: not enough
    assert _chosen([fewer, many_more], "auto") is fewer
    much_faster = candidate(4 * 8 * MiB, 0.0279 / (1 + MOVE_MARGIN) - 1e-6)
    assert _chosen([fewer, much_faster], "auto") is much_faster
    assert _chosen([fewer, many_more], "always") is many_more  # the recomputing plan, last
