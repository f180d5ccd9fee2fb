"""Train a small causal transformer language model the way Flax's lm1b example does, under a memory budget.

The step is the ``train_step`` of Flax's ``examples/lm1b/train.py``, kept as it is written there: a
``TrainState`` (parameters and an AdamW optimizer on a warmup-then-rsqrt schedule), a dropout key
folded with the step number and passed as ``rngs={"dropout": ...}``, the inputs shifted right by one
so that each position predicts its own token from the ones before it (causal self-attention), and a
cross-entropy weighted to skip padding (token 0), with optional label smoothing. What differs: one
device (no ``pmap``, so no ``lax.pmean``/``psum``), no packed sequences, the GPT-style
``Transformer`` of ``models.py`` (``causal=True``, with dropout, no attention biases as in lm1b) in
place of lm1b's ``TransformerLM`` (so the step, not the model, shifts the inputs), and synthetic
data: each sequence counts up from a random token by a random stride (modulo the vocabulary), and
ends in padding after a random length, so that the next token is predictable from the two before it.

``ooc_jit`` runs the step at a fraction of its in-core memory estimate (the step planned once without
a limit), donating the training state as ``jax.jit`` would.

    python examples/train_lm.py [--steps 20] [--budget-fraction 0.35]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import common_utils, train_state

from oocjax import ooc_jit
from oocjax.schedule import format_bytes

if __package__:  # imported as examples.train_lm, from the repository root (the tests)
    from .models import Transformer
else:  # run as a script: examples/ is on sys.path
    from models import Transformer

VOCAB, LENGTH = 64, 32


def create_model(*, width: int = 64, heads: int = 4, layers: int = 2, dropout_rate: float = 0.1) -> Transformer:
    # No biases in the attention projections, as in lm1b (a key bias gets no gradient but rounding noise).
    return Transformer(
        vocab=VOCAB,
        width=width,
        heads=heads,
        layers=layers,
        causal=True,
        dropout_rate=dropout_rate,
        attention_bias=False,
    )


def rsqrt_schedule(init_value: float, shift: int = 0) -> Callable:
    """``lr = init_value / sqrt(step)``, shifted by ``shift`` steps (lm1b's schedule)."""

    def schedule(count):
        return init_value * (count + shift) ** -0.5 * shift**0.5

    return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int) -> Callable:
    """Linear warmup, then the reverse square root."""
    return optax.join_schedules(
        [
            optax.linear_schedule(init_value=0, end_value=learning_rate, transition_steps=warmup_steps),
            rsqrt_schedule(init_value=learning_rate, shift=warmup_steps),
        ],
        boundaries=[warmup_steps],
    )


def create_train_state(key, model: Transformer, learning_rate_fn: Callable) -> train_state.TrainState:
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)

    @jax.jit  # one compiled program rather than an operation at a time
    def init(key):
        variables = model.init(key, jnp.ones((1, LENGTH), jnp.int32), train=False)
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)

    return init(key)


def synthetic_batches(seed: int, batch_size: int) -> Iterator[dict]:
    """Batches as an input pipeline yields them (NumPy arrays): sequences that count up from a random
    token by a random stride, then padding (0) after a random length."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(1, VOCAB, (batch_size, 1))
        stride = rng.integers(1, 4, (batch_size, 1))
        tokens = 1 + (start + stride * np.arange(LENGTH)) % (VOCAB - 1)  # 1..VOCAB-1: 0 is padding
        length = rng.integers(LENGTH // 2, LENGTH + 1, (batch_size, 1))
        yield {"inputs": np.where(np.arange(LENGTH) < length, tokens, 0).astype(np.int32)}


def shift_right(x):
    """The decoder's inputs: the targets shifted one position right, a 0 in front (lm1b's ``shift_inputs``)."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Summed cross entropy of ``logits`` [batch, length, vocab] against ``targets`` [batch, length], and
    the normalizing factor (the number of weighted positions)."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence) + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
    loss = -jnp.sum(soft_targets * jax.nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
    accurate = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        accurate = accurate * weights
        normalizing_factor = weights.sum()
    return accurate.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    accuracy, _ = compute_weighted_accuracy(logits, labels, weights)
    return {"loss": loss, "accuracy": accuracy, "denominator": weight_sum}


def train_step(state, batch, dropout_rng, learning_rate_fn, label_smoothing=0.0):
    """Perform a single training step (Flax's lm1b ``train_step``, on one device)."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, shift_right(inputs), rngs={"dropout": dropout_rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    step = state.step
    lr = learning_rate_fn(step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics["learning_rate"] = lr
    return new_state, metrics


def make_train_step(learning_rate_fn: Callable, label_smoothing: float = 0.0) -> Callable:
    """``step(state, batch, dropout_rng) -> (state, metrics)``: what ``ooc_jit`` (or ``jax.jit``) compiles."""
    return functools.partial(train_step, learning_rate_fn=learning_rate_fn, label_smoothing=label_smoothing)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget-fraction", type=float, default=0.35, help="of the in-core estimate")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    args = parser.parse_args(argv)

    learning_rate_fn = create_learning_rate_schedule(args.learning_rate, warmup_steps=5)
    init_rng, dropout_rng = jax.random.split(jax.random.key(0))
    state = create_train_state(init_rng, create_model(), learning_rate_fn)
    step_fn = make_train_step(learning_rate_fn)
    batches = map(jax.device_put, synthetic_batches(0, args.batch))
    batch = next(batches)

    # Size the budget from the step itself: plan once without a limit, then ask for a fraction.
    in_core = ooc_jit(step_fn, budget=2**62).plan(state, batch, dropout_rng).baseline_peak_bytes
    budget = int(in_core * args.budget_fraction)
    step = ooc_jit(step_fn, budget=budget, donate_argnums=(0,))
    print(f"in-core estimate {format_bytes(in_core)}; budget {format_bytes(budget)}")
    print(step.plan(state, batch, dropout_rng))
    for i in range(args.steps):
        state, metrics = step(state, batch, dropout_rng)
        loss, accuracy = (float(metrics[name]) / float(metrics["denominator"]) for name in ("loss", "accuracy"))
        print(f"step {i}: loss {loss:.4f}, accuracy {accuracy:.2f}")
        batch = next(batches)


if __name__ == "__main__":
    main()
