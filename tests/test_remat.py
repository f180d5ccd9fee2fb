"""Remat (checkpoint) blocks are planned through: their equations are steps of the program, so a
model of remat blocks fits the budgets a model without remat fits, and trains as jax.jit trains it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.models import Transformer, next_token_step
from oocjax import ooc_jit, to_device, to_host
from tests.support.reference import trains_like_jax_jit_within


def adamw_step(remat=True):
    """A 4-layer decoder whose blocks run in a Python loop, each in ``nn.remat`` (or not)."""
    model = Transformer(
        vocab=64, width=64, heads=4, layers=4, causal=True, attention_bias=False, position_embedding=False, remat=remat
    )
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 64)
    params = model.init(jax.random.key(0), tokens[:, :-1])
    return next_token_step(model, optimizer), (params, optimizer.init(params)), tokens


def test_a_remat_block_is_planned_through_not_held_as_one_operation():
    step, state, tokens = adamw_step()
    plan = ooc_jit(step, budget=2**62).plan(state, tokens)
    assert "remat2" not in {s.name for s in plan.program.steps}
    # The recomputation stays: the remat'd step has more equations than the same model without remat.
    plain_step, plain_state, _ = adamw_step(remat=False)
    plain = ooc_jit(plain_step, budget=2**62).plan(plain_state, tokens)
    assert len(plan.program.steps) > len(plain.program.steps)


@pytest.mark.slow  # 11 s here
def test_a_decoder_of_remat_blocks_trains_like_jax_jit_at_35_percent_within_the_budget():
    step, state, tokens = adamw_step()
    trains_like_jax_jit_within(step, state, tokens, 0.35)


def test_gradients_through_remat_blocks_equal_the_reference_at_a_budget_that_moves_values():
    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w)

        for w in ws:
            x = jax.checkpoint(layer)(x, w)
        return (x**2).mean()

    ws = [jnp.eye(128) * 0.9 + 0.01 * i for i in range(6)]
    x = jnp.linspace(-1, 1, 512 * 128).reshape(512, 128)
    grad = jax.grad(loss)
    in_core = ooc_jit(grad, budget=2**62).plan(ws, x).baseline_peak_bytes
    ooc = ooc_jit(grad, budget=int(in_core * 0.3), min_offload_bytes=4096)
    host_ws, host_x = to_host((ws, x))  # not donated: passed in host memory, so that the step may stream them in
    assert ooc.plan(host_ws, host_x).offloads
    for actual, expected in zip(to_device(ooc(host_ws, host_x)), jax.jit(grad)(ws, x)):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-6, atol=1e-9)
