"""Train a small ResNet with batch norm the way Flax's ImageNet example does, under a device-memory budget.

The step is the ``train_step`` of Flax's ``examples/imagenet/train.py``, kept as it is written there:
a ``TrainState`` that carries ``batch_stats`` next to the parameters, the model applied with
``mutable=["batch_stats"]`` so that it returns the updated running statistics, an L2 weight penalty
added to the cross-entropy, SGD with Nesterov momentum on a warmup-then-cosine learning-rate schedule,
and the new statistics stored with ``state.apply_gradients(grads=..., batch_stats=...)``. What differs:
one device (no ``pmap``, so no ``lax.pmean`` of the gradients), no mixed precision (no
``dynamic_scale``), a CPU-sized ResNet (``ResNet`` of ``models.py``: bottleneck stages, by default two
stages of one block on 32x32 images) and synthetic data: each class is a fixed random image, and a
sample is its class's image plus noise.

``ooc_jit`` runs the step at a fraction of its in-core memory estimate (the step planned once without
a limit), donating the training state as ``jax.jit`` would.

    python examples/train_resnet.py [--steps 20] [--budget-fraction 0.85]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from oocjax import ooc_jit
from oocjax.schedule import format_bytes

if __package__:  # imported as examples.train_resnet, from the repository root (the tests)
    from .models import ResNet
else:  # run as a script: examples/ is on sys.path
    from models import ResNet

CLASSES, IMAGE_SIZE = 10, 32
# The default (1 MiB) is sized for GPU models: in this CPU-sized step no activation is that large.
MIN_OFFLOAD_BYTES = 64 * 1024


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` with the model's batch statistics next to its parameters."""

    batch_stats: Any


def create_model(*, stages: Sequence[int] = (1, 1), width: int = 8) -> ResNet:
    return ResNet(stages=tuple(stages), width=width, classes=CLASSES)


def create_learning_rate_fn(base_learning_rate: float, warmup_steps: int, total_steps: int) -> Callable:
    """Linear warmup, then cosine decay, as the ImageNet example's schedule (counted in steps, not epochs)."""
    warmup = optax.linear_schedule(0.0, base_learning_rate, warmup_steps)
    cosine = optax.cosine_decay_schedule(base_learning_rate, max(total_steps - warmup_steps, 1))
    return optax.join_schedules([warmup, cosine], boundaries=[warmup_steps])


def create_train_state(key, model: ResNet, learning_rate_fn: Callable, *, momentum: float = 0.9) -> TrainState:
    tx = optax.sgd(learning_rate_fn, momentum=momentum, nesterov=True)

    @jax.jit  # one compiled program rather than an operation at a time
    def init(key):
        variables = model.init(key, jnp.ones((1, IMAGE_SIZE, IMAGE_SIZE, 3)))
        return TrainState.create(
            apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=tx
        )

    return init(key)


def synthetic_batches(seed: int, batch_size: int) -> Iterator[dict]:
    """Batches of images of ``CLASSES`` classes, as an input pipeline yields them (NumPy arrays): each
    class is a fixed random image, and each sample its class's image plus noise."""
    rng = np.random.default_rng(seed)
    templates = np.random.default_rng(1234).normal(size=(CLASSES, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    while True:
        label = rng.integers(0, CLASSES, batch_size, dtype=np.int32)
        noise = rng.normal(size=(batch_size, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
        yield {"image": templates[label] + noise, "label": label}


def cross_entropy_loss(logits, labels):
    one_hot_labels = jax.nn.one_hot(labels, num_classes=CLASSES)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels))


def compute_metrics(logits, labels):
    return {"loss": cross_entropy_loss(logits, labels), "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def train_step(state: TrainState, batch: dict, learning_rate_fn: Callable) -> tuple[TrainState, dict]:
    """Perform a single training step (Flax's ImageNet ``train_step``, on one device)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"], mutable=["batch_stats"]
        )
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    aux, grads = grad_fn(state.params)
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = learning_rate_fn(state.step)
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def make_train_step(learning_rate_fn: Callable) -> Callable:
    """``step(state, batch) -> (state, metrics)``: what ``ooc_jit`` (or ``jax.jit``) compiles."""
    return functools.partial(train_step, learning_rate_fn=learning_rate_fn)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    # The convolutions' compiled scratch is a large share of so small a step: much below this fraction the
    # segments, as compiled, measure over the budget.
    parser.add_argument("--budget-fraction", type=float, default=0.85, help="of the in-core estimate")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args(argv)

    learning_rate_fn = create_learning_rate_fn(args.learning_rate, warmup_steps=2, total_steps=args.steps)
    state = create_train_state(jax.random.key(0), create_model(), learning_rate_fn)
    step_fn = make_train_step(learning_rate_fn)
    batches = map(jax.device_put, synthetic_batches(0, args.batch))
    batch = next(batches)

    # Size the budget from the step itself: plan once without a limit, then ask for a fraction.
    in_core = ooc_jit(step_fn, budget=2**62).plan(state, batch).baseline_peak_bytes
    budget = int(in_core * args.budget_fraction)
    step = ooc_jit(step_fn, budget=budget, donate_argnums=(0,), min_offload_bytes=MIN_OFFLOAD_BYTES)
    print(f"in-core estimate {format_bytes(in_core)}; budget {format_bytes(budget)}")
    print(step.plan(state, batch))
    for i in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {i}: loss {float(metrics['loss']):.4f}, accuracy {float(metrics['accuracy']):.2f}")
        batch = next(batches)


if __name__ == "__main__":
    main()
