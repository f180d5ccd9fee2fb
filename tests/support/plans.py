"""Plans the view tests read: a wide MLP's (40 parameter arrays) and the zoo transformer's, each
made once per process."""

import functools

import jax
import jax.numpy as jnp

from oocjax import ooc_jit
from oocjax.plan import Plan
from tests.support.zoo import transformer_dropout_adamw


def wide_mlp_step(params, x):
    """40 parameter arrays (20 layers of weight and bias), and its gradient step."""

    def loss(params):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return (h**2).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


WIDE_PARAMS = [(jnp.eye(64) * 0.5, jnp.zeros(64)) for _ in range(20)]
WIDE_X = jnp.ones((512, 64))


@functools.cache
def wide_plan(fraction: float = 0.4) -> Plan:
    """The wide MLP's swap-only plan (these views are about transfers; tests/test_recompute_views.py
    shows recomputation)."""
    in_core = ooc_jit(wide_mlp_step, budget=2**62).plan(WIDE_PARAMS, WIDE_X).baseline_peak_bytes
    step = ooc_jit(wide_mlp_step, budget=int(in_core * fraction), min_offload_bytes=1024, recompute="off")
    return step.plan(WIDE_PARAMS, WIDE_X)


@functools.cache
def transformer_plan(recompute: str = "off") -> Plan:
    """The zoo's Flax transformer (4 blocks, AdamW, donated state) at 35% of its in-core estimate:
    "off" moves values, "always" recomputes them."""
    case = transformer_dropout_adamw()
    in_core = ooc_jit(case.step, budget=2**62, donate_argnums=(0,)).plan(case.state, case.batches[0])
    budget = int(in_core.baseline_peak_bytes * 0.35)
    step = ooc_jit(case.step, budget=budget, donate_argnums=(0,), min_offload_bytes=4096, recompute=recompute)
    return step.plan(case.state, case.batches[0])
