"""A scan over layers runs one iteration at a time: its body's equations are planned once per
iteration, the residuals the forward scan stacks for the backward stay per-iteration arrays (each can
move to host and back), and the step trains as jax.jit trains it."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.models import Transformer, next_token_step
from oocjax import BudgetInfeasibleError, ooc_jit, to_device, to_host
from tests.support.reference import trains_like_jax_jit_within
from tests.support.seams import REAL, with_seams


def decoder_step():
    """``nn.scan(nn.remat(block))`` over 6 layers, parameters stacked on a leading axis, AdamW."""
    model = Transformer(vocab=64, width=64, heads=4, layers=6, causal=True, attention_bias=False, scan=True, remat=True)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 64)
    params = model.init(jax.random.key(0), tokens[:, :-1])
    return next_token_step(model, optimizer), (params, optimizer.init(params)), tokens


def scanned_mlp_loss(w, x, reverse=False):
    def layer(h, w_i):
        return jnp.tanh(h @ w_i), (h * w_i[0]).sum()

    h, per_layer = jax.lax.scan(layer, x, w, reverse=reverse)
    return (h**2).mean() + 1e-3 * per_layer.sum()


def scanned_mlp_step(w, x):
    loss, grad = jax.value_and_grad(scanned_mlp_loss)(w, x)
    return w - 0.1 * grad, loss


W = jnp.stack([jnp.eye(128) * 0.9 + 0.01 * i for i in range(8)])
X = jnp.linspace(-1, 1, 512 * 128).reshape(512, 128)


def test_a_scan_over_layers_is_planned_one_iteration_at_a_time_and_says_so():
    plan = ooc_jit(scanned_mlp_step, budget=2**62).plan(W, X)
    assert "scan" not in {s.name for s in plan.program.steps}
    assert [(loop.length, loop.unrolled) for loop in plan.loops] == [(8, True), (8, True)]  # forward, backward
    assert all(loop.label.startswith("test_loops.py:") for loop in plan.loops)
    assert "2 scans run one iteration at a time" in plan.summary()


def test_the_forward_residuals_are_never_stacked_only_the_results_read_whole_are():
    plan = ooc_jit(scanned_mlp_step, budget=2**62).plan(W, X)
    stacks = [s for s in plan.program.steps if s.name == "stack"]
    # The backward scan reads the forward's residuals per iteration; what is stacked is the
    # gradient of the stacked weights (read whole by the update), and the per-layer sums.
    assert len(stacks) == 2


def test_a_small_scan_stays_one_step_and_the_plan_says_it_was_not_unrolled():
    def cumulative(x):
        return jax.lax.scan(lambda c, v: (c + v, c), 0.0, x)[1].sum()

    plan = ooc_jit(cumulative, budget=2**62).plan(jnp.ones(16))
    assert [(loop.length, loop.unrolled) for loop in plan.loops] == [(16, False)]
    assert "scan" in {s.name for s in plan.program.steps}


def test_a_scanned_mlp_trains_like_jax_jit_at_35_percent_within_the_budget():
    trains_like_jax_jit_within(scanned_mlp_step, W, X, 0.35)


@pytest.mark.slow
def test_a_flax_scan_of_remat_blocks_with_adamw_trains_like_jax_jit_at_35_percent_within_the_budget():
    step, state, tokens = decoder_step()
    plan = trains_like_jax_jit_within(step, state, tokens, 0.35)
    assert plan.loops and all(loop.unrolled for loop in plan.loops)


def test_gradients_through_a_reverse_scan_run_per_iteration_equal_the_reference():
    grad = jax.grad(lambda w, x: scanned_mlp_loss(w, x, reverse=True))
    in_core = ooc_jit(grad, budget=2**62).plan(W, X).baseline_peak_bytes
    # Swap only: recomputed copies round differently inside other fusions, and whether the plan
    # recomputes depends on this machine's measured speed; this test is about offloads across a scan.
    ooc = ooc_jit(grad, budget=int(in_core * 0.3), min_offload_bytes=4096, recompute="off")
    w, x = to_host((W, X))  # not donated: passed in host memory, so that the step may stream them in
    assert ooc.plan(w, x).offloads
    # Within float32 rounding of a sum reassociated: on a CPU without AVX-512, per-iteration programs
    # summed the last two of 128 columns in another order than jax.jit's one program (2.5e-6 apart).
    np.testing.assert_allclose(np.asarray(to_device(ooc(w, x))), np.asarray(jax.jit(grad)(W, X)), rtol=1e-5, atol=1e-9)


def test_iterations_of_a_scan_share_compiled_segments():
    in_core = ooc_jit(scanned_mlp_step, budget=2**62).plan(W, X).baseline_peak_bytes
    plan = ooc_jit(scanned_mlp_step, budget=int(in_core * 0.35), min_offload_bytes=4096).plan(W, X)
    calls = [e.params["jaxpr"] for e in plan.jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    distinct = {str(c.jaxpr) for c in calls}
    assert len(distinct) < len(calls) / 2, (len(distinct), len(calls))


def smallest_feasible_budget(step, *args, **seams) -> int:
    with pytest.raises(BudgetInfeasibleError) as caught:
        with_seams(ooc_jit(step, budget=1024, min_offload_bytes=4096), **seams).plan(*args)
    return caught.value.required_bytes


def test_the_smallest_feasible_budget_of_a_scan_run_per_iteration_is_below_the_whole_loops():
    per_iteration = smallest_feasible_budget(scanned_mlp_step, W, X)
    every_scan_whole = functools.partial(REAL.trace, max_unrolled=0)
    whole = smallest_feasible_budget(scanned_mlp_step, W, X, trace=every_scan_whole)
    assert per_iteration < whole / 2, (per_iteration, whole)


def test_the_pretty_view_shows_iterations_alike_once_with_how_many_more_times_they_run():
    in_core = ooc_jit(scanned_mlp_step, budget=2**62).plan(W, X).baseline_peak_bytes
    # Swap only: a plan that does not depend on the measured speed of this machine.
    plan = ooc_jit(scanned_mlp_step, budget=int(in_core * 0.35), min_offload_bytes=4096, recompute="off").plan(W, X)
    lines = plan.pretty_jaxpr().splitlines()
    repeats = [
        line for line in lines if re.match(r"\.\.\. segments \d+\.\.\d+: the same \d+ segments? \d+ more times", line)
    ]
    assert repeats
    shown = [line for line in lines if line.startswith("segment ")]
    hidden = sum(int(b) - int(a) + 1 for a, b in (re.search(r"segments (\d+)\.\.(\d+)", r).groups() for r in repeats))
    assert len(shown) + hidden == len(plan.segments) and hidden > len(plan.segments) // 4
