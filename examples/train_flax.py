"""Train a small Flax (Linen) transformer with Optax under a device-memory budget that forces offloading.

The task is copying: the second half of each sequence repeats the first half, so the loss on the
second half falls towards zero once attention learns to look back. The model is the GPT-style
``Transformer`` of ``models.py``, next to this file. The step is wrapped in ``ooc_jit`` with a budget
of a fifth of what it needs in-core, so some values are recomputed before their backward use and
others (activations, parameters, optimizer state) are moved to host memory and back between the
separately compiled segments the step runs as. The trained state is then evaluated on a held-out batch
with an ``ooc_jit`` eval step under the same budget, which reads state the plan keeps in host memory
where it is (plain ``jax.jit`` refuses to compute on host memory).

    python examples/train_flax.py [--steps 300] [--budget-fraction 0.2] [--json result.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from models import Transformer  # models.py, next to this file
from tqdm import tqdm

from oocjax import ooc_jit, to_device
from oocjax.schedule import format_bytes

VOCAB, LENGTH = 32, 64


def copy_batch(key, batch):
    half = jax.random.randint(key, (batch, LENGTH // 2), 1, VOCAB)
    return jnp.concatenate([half, half], axis=1)


def make_loss(model):
    def loss_fn(params, tokens):
        logits = model.apply(params, tokens[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return losses[:, LENGTH // 2 :].mean()  # the copied half is predictable

    return loss_fn


def make_train_step(model, optimizer):
    loss_fn = make_loss(model)

    def train_step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def make_eval_step(model):
    loss_fn = make_loss(model)

    def eval_step(state, tokens):
        params, _ = state
        return loss_fn(params, tokens)

    return eval_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    # At a quarter of the in-core estimate this step fits by recomputing alone (its layers alike); a fifth moves values.
    parser.add_argument("--budget-fraction", type=float, default=0.2, help="of the in-core estimate")
    parser.add_argument("--json", type=Path, help="also write the plan's figures and the losses to this file")
    args = parser.parse_args()

    model = Transformer(vocab=VOCAB, width=64, heads=4, layers=3, causal=True)
    optimizer = optax.adamw(3e-3)
    key = jax.random.key(0)
    params = model.init(key, jnp.zeros((1, LENGTH - 1), jnp.int32))
    state = (params, optimizer.init(params))
    train_step = make_train_step(model, optimizer)
    tokens = copy_batch(key, args.batch)

    # Size the budget from the step itself: plan once without a limit, then ask for a fraction.
    in_core = ooc_jit(train_step, budget=2**62).plan(state, tokens).baseline_peak_bytes
    budget = int(in_core * args.budget_fraction)
    step = ooc_jit(train_step, budget=budget, donate_argnums=(0,), min_offload_bytes=256 * 1024)
    plan = step.plan(state, tokens)
    print(f"in-core estimate {format_bytes(in_core)}; budget {format_bytes(budget)}")
    print(plan.summary(largest=5))  # plan.summary(profile="h100") adds a simulated GPU's step time
    assert plan.peak_bytes <= budget and plan.offloads, "the budget should force offloading"
    assert plan.executed_peak_bytes <= budget, "the compiled segments, as measured, fit the budget"

    batches = (copy_batch(jax.random.fold_in(key, i), args.batch) for i in range(args.steps))
    first = next(batches)
    reference = float(jax.jit(train_step)(state, first)[1])
    started = time.perf_counter()
    losses = []
    with tqdm(range(args.steps), desc="training", unit="step", mininterval=2.0) as progress:
        for i in progress:
            state, loss = step(state, first if i == 0 else next(batches))
            losses.append(float(loss))
            if i == 0:
                print(f"first step: loss {losses[0]:.6f}, jax.jit gives {reference:.6f}")
            if i % 25 == 0:
                progress.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - started
    device = jax.devices()[0].device_kind
    print(
        f"{args.steps} steps in {elapsed:.1f}s, measured on this {device}: "
        f"{elapsed / args.steps * 1e3:.0f} ms per step (the first compiles); loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )

    # Evaluate the trained state where the plan keeps it. A plan may keep state in host memory between
    # steps (here none at the default sizes: every parameter is below min_offload_bytes), and plain jax.jit
    # refuses to compute on it; an ooc_jit eval step under the same budget streams it in. Not donated,
    # the state stays as it is. (to_device(state) moves it back instead, where the device has room.)
    evaluate = ooc_jit(make_eval_step(model), budget=budget, min_offload_bytes=256 * 1024)
    held_out = copy_batch(jax.random.fold_in(key, args.steps), args.batch)
    eval_loss = float(evaluate(state, held_out))
    on_host = sum(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state))
    expected = float(jax.jit(make_eval_step(model))(to_device(state), held_out))
    print(
        f"eval loss {eval_loss:.6f} on a held-out batch ({on_host} of {len(jax.tree.leaves(state))} state leaves "
        f"kept on host); jax.jit on device copies gives {expected:.6f}"
    )
    if args.json:
        figures = dict(in_core_estimate_bytes=in_core, budget_bytes=budget, planned_peak_bytes=plan.peak_bytes)
        figures |= dict(executed_peak_bytes=plan.executed_peak_bytes, offloads=len(plan.offloads), losses=losses)
        figures |= dict(eval_loss=eval_loss)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit("the loss did not fall: training under the budget did not work")
    if abs(eval_loss - expected) > 1e-4 * max(1.0, abs(expected)):
        raise SystemExit("the ooc_jit evaluation of the host-kept state differs from jax.jit's")


if __name__ == "__main__":
    main()
