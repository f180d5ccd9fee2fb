"""Recompute by block, and plans that move less: below the budget where the per-value selector fits
the step, the plan recomputes each block's insides (per-block remat) rather than move state, where
the model says that costs at most ``MOVE_MARGIN`` more time; it moves fewer bytes than the plan
chosen before (the faster by the model of swap only and the selector), and computes what
``jax.jit`` computes.

The plans are made with the published CPU profile, as every plan is (measured under load, rates
changed which plan is the faster, and with it the premise of a test)."""

import functools

import jax
import numpy as np
import pytest

from oocjax import ooc_jit
from oocjax.schedule import Program, plan_window, simulate_time
from oocjax.schedule.blocks import block_targets
from oocjax.schedule.hybrid import MOVE_MARGIN, plan_hybrid
from oocjax.schedule.profiles import resolve_profile
from oocjax.schedule.recompute import choose_recompute
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.recompute import recomputable_steps
from tests.support.zoo import transformer_dropout_adamw

LAYERS = 8
PROFILE = resolve_profile("cpu")


@functools.cache
def case():
    return transformer_dropout_adamw(LAYERS)


@functools.cache
def in_core() -> int:
    return ooc_jit(case().step, budget=2**62).plan(case().state, case().batches[0]).baseline_peak_bytes


def fresh(state):
    return jax.tree.map(lambda x: x.copy(), state)


def moved_bytes(program: Program, schedule) -> int:
    return sum(program.buffers[m.buffer].nbytes for m in schedule.moves)


def todays_choice(planner, budget_bytes: int) -> int:
    """The bytes the plan chosen before this change moves: the faster (by the model) of swap only
    and the per-value selector with the window planner (no block candidate, no margin)."""
    program, profile = planner.program, PROFILE
    recomputable = recomputable_steps(planner.traced.flat).__getitem__
    swap = plan_window(program, budget_bytes, min_offload_bytes=4096)
    rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=4096)
    rewrite = choose_recompute(program, budget_bytes, **rules)
    hybrid = plan_window(rewrite.program, budget_bytes, min_offload_bytes=4096)
    swap_s = simulate_time(program, swap, profile).step_time_s
    hybrid_s = simulate_time(rewrite.program, hybrid, profile).step_time_s
    return moved_bytes(rewrite.program, hybrid) if hybrid_s < swap_s else moved_bytes(program, swap)


@pytest.mark.slow
def test_at_a_fifth_of_in_core_the_transformer_recomputes_by_block_and_moves_less_than_the_todays_choice():
    step = ooc_jit(case().step, budget=int(0.2 * in_core()), donate_argnums=0, min_offload_bytes=4096)
    plan = step.plan(case().state, case().batches[0])
    (planner,) = step._planners.values()

    assert plan.recomputed_by_block and "recomputed by block" in repr(plan)
    assert moved_bytes(plan.program, plan.schedule) < todays_choice(planner, plan.schedule.budget_bytes)
    assert plan.executed_peak_bytes <= plan.budget_bytes
    state, batch = case().state, case().batches[0]
    expected = jax.jit(case().step)(fresh(state), batch)[1]["loss"]
    np.testing.assert_allclose(float(step(fresh(state), batch)[1]["loss"]), float(expected), rtol=1e-6)


@pytest.mark.slow
def test_at_30_percent_of_in_core_the_plan_moves_nothing_where_the_faster_by_the_model_moved_state():
    step = ooc_jit(case().step, budget=int(0.3 * in_core()), donate_argnums=0, min_offload_bytes=4096)
    plan = step.plan(case().state, case().batches[0])
    (planner,) = step._planners.values()
    # Swap only is faster by the model here, by less than MOVE_MARGIN: the recomputing plan that
    # moves nothing is kept.
    assert todays_choice(planner, plan.schedule.budget_bytes) > 0
    assert plan.recomputed and plan.schedule.moves_nothing
    assert plan.step_time_s <= plan.swap_only_time_s * (1 + MOVE_MARGIN)


def test_a_blocks_members_are_its_insides_not_its_output():
    case4 = transformer_dropout_adamw(2)
    step = ooc_jit(case4.step, budget=2**62)
    step.plan(case4.state, case4.batches[0])
    (planner,) = step._planners.values()
    runs = layer_runs(planner.traced.flat)
    backward = min(a for a, _, kind in runs if kind.startswith("transpose"))
    blocks = [(a, y) for a, y, kind in runs if not kind.startswith("transpose")]
    program = planner.program
    members = set(block_targets(program, blocks, backward))
    first_block_output = {b for step in program.steps[blocks[0][0] : blocks[0][1]] for b in step.writes} & {
        b for step in program.steps[blocks[1][0] : blocks[1][1]] for b in step.reads
    }
    assert first_block_output and not first_block_output & members
    made = {b for a, y in blocks for step in program.steps[a:y] for b in step.writes}
    assert len(members) > len(made) // 2  # most of what a block makes is recomputed, as remat does


def test_layers_alike_recompute_alike_values():
    # At 30% the per-value picks alone recompute 36 values of the bottom layer only (the last bytes
    # over the budget stand where only its values are live), and the bottom layer then compiles a
    # program of its own; made alike, nothing moves.
    four = transformer_dropout_adamw(4)
    in_core_step = ooc_jit(four.step, budget=2**62, donate_argnums=0)
    budget = int(0.3 * in_core_step.plan(four.state, four.batches[0]).baseline_peak_bytes)
    (planner,) = in_core_step._planners.values()
    program, runs = planner.program, layer_runs(planner.traced.flat)
    backward = min(a for a, _, kind in runs if kind.startswith("transpose"))
    blocks = [(a, y) for a, y, _ in runs if y <= backward]
    recomputable = recomputable_steps(planner.traced.flat).__getitem__
    choice = plan_hybrid(
        program,
        budget,
        recomputable=recomputable,
        profile=PROFILE,
        blocks=blocks,
        backward_start=backward,
        min_offload_bytes=4096,
    )
    recomputed = set(choice.rewrite.recomputed)
    below_the_top = [[b for step in program.steps[a:y] for b in step.writes] for a, y in blocks[:-1]]
    assert len(blocks) == 4 and recomputed
    for alike in zip(*below_the_top, strict=True):  # the top layer's last values are read at once: kept
        assert len({b in recomputed for b in alike}) == 1
    assert choice.schedule.moves_nothing


def test_a_plan_alike_in_alike_layers_replaces_a_faster_unlike_one_that_moves_no_less():
    # At 30% of its in-core estimate the 4-layer transformer's per-value picks move nothing and
    # simulate 5% faster than the half-block plan, but unlike in its layers: 20 programs, and
    # compiled segments over the budget (planned twice). The half-block plan runs its layers alike.
    four = transformer_dropout_adamw(4)
    budget = int(0.3 * ooc_jit(four.step, budget=2**62).plan(four.state, four.batches[0]).baseline_peak_bytes)
    step = ooc_jit(four.step, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    plan = step.plan(four.state, four.batches[0])
    (planner,) = step._planners.values()
    assert plan.recomputed_by_block and len(plan.attempts) == 1
    assert len(plan.segments) <= 3 * 4 and len({id(p) for p in planner.built.programs}) <= 6
    assert plan.executed_peak_bytes <= budget
