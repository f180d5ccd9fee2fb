"""The same idea with Flax NNX: split the model and optimizer into a pure state, and ooc_jit the step.

A small residual MLP learns a fixed random teacher network on synthetic data, under half of the
step's in-core memory estimate.

    python examples/train_nnx.py [--steps 200] [--json result.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tqdm import tqdm

from oocjax import ooc_jit
from oocjax.schedule import format_bytes


class ResidualMLP(nnx.Module):
    def __init__(self, width: int, depth: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.norms = nnx.List([nnx.LayerNorm(width, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        for layer, norm in zip(self.layers, self.norms):
            x = x + jax.nn.gelu(layer(norm(x)))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--json", type=Path, help="also write the plan's figures and the losses to this file")
    args = parser.parse_args()

    width = 128
    model = ResidualMLP(width, depth=6, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    teacher = jax.random.normal(jax.random.key(1), (width, 1)) / jnp.sqrt(width)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def batch(i):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(2), i), (args.batch, width))
        return x, jnp.sin(x @ teacher)

    x, y = batch(0)
    in_core = ooc_jit(train_step, budget=2**62).plan(state, x, y).baseline_peak_bytes
    budget = in_core // 2
    step = ooc_jit(train_step, budget=budget, donate_argnums=(0,), min_offload_bytes=64 * 1024)
    plan = step.plan(state, x, y)
    print(f"in-core estimate {format_bytes(in_core)}")
    print(plan)

    losses = []
    for i in tqdm(range(args.steps), desc="training", unit="step", mininterval=2.0):
        state, loss = step(state, *batch(i))
        losses.append(float(loss))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if args.json:
        figures = dict(in_core_estimate_bytes=in_core, budget_bytes=budget, planned_peak_bytes=plan.peak_bytes)
        figures |= dict(executed_peak_bytes=plan.executed_peak_bytes, offloads=len(plan.offloads), losses=losses)
        figures |= dict(recomputed=len(plan.recomputed), layer_policy=list(plan.layer_policy))
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
