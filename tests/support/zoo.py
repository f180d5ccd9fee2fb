"""Training steps written as users write them (Flax Linen + Optax), small enough for a CPU.

Each case gives a step ``(state, batch) -> (state, metrics)``, an initial state, a few batches and
whether the state is donated. The models are the shared ones of ``examples/models.py``; the steps are
plain functions: the tests jit them with ``jax.jit`` and with ``ooc_jit`` and compare.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from examples.models import CNN, MLP, Transformer


@dataclass(frozen=True)
class Case:
    name: str
    step: Callable
    state: Any
    batches: list
    donate: bool


def _classifier_batches(key, n, shape, dtype=jnp.float32):
    keys = jax.random.split(key, n)
    return [
        (jax.random.normal(k, shape, dtype), jax.random.randint(jax.random.fold_in(k, 1), (shape[0],), 0, 10))
        for k in keys
    ]


def mlp_adam(dtype=jnp.float32, name="mlp_adam") -> Case:
    model, optimizer = MLP(width=96, depth=6, dtype=dtype, param_dtype=dtype), optax.adam(1e-3)
    params = model.init(jax.random.key(0), jnp.zeros((1, 64), dtype))

    def step(state, batch):
        params, opt_state = state
        x, y = batch

        def loss_fn(p):
            logits = model.apply(p, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    batches = _classifier_batches(jax.random.key(1), 3, (128, 64), dtype)
    return Case(name, step, (params, optimizer.init(params)), batches, donate=True)


def cnn_batchnorm_momentum() -> Case:
    model, optimizer = CNN(), optax.sgd(0.05, momentum=0.9)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)

    def step(state, batch):
        params, batch_stats, opt_state = state
        x, y = batch

        def loss_fn(p):
            logits, updated = model.apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), batch_stats, opt_state), {"loss": loss}

    params = variables["params"]
    batches = _classifier_batches(jax.random.key(2), 3, (16, 16, 16, 3))
    return Case(
        "cnn_batchnorm_momentum",
        step,
        (params, variables["batch_stats"], optimizer.init(params)),
        batches,
        donate=False,
    )


def transformer_dropout_adamw(layers: int = 4) -> Case:
    # No attention biases: the key bias has an exactly zero gradient (softmax ignores a shift along the
    # keys), so Adam would amplify rounding noise in it to the size of the learning rate.
    model = Transformer(
        vocab=50,
        width=64,
        heads=4,
        layers=layers,
        causal=False,
        dropout_rate=0.1,
        attention_bias=False,
        position_embedding=False,
        final_norm=False,
    )
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32), train=False)

    def step(state, batch):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)

        def loss_fn(p):
            logits = model.apply(p, batch[:, :-1], train=True, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        # None leaves in the metrics: pytrees with holes must come back as they went in.
        return (optax.apply_updates(params, updates), opt_state, key), {"loss": loss, "aux": None}

    batches = [jax.random.randint(jax.random.key(3 + i), (16, 33), 0, 50) for i in range(3)]
    return Case(
        "transformer_dropout_adamw", step, (params, optimizer.init(params), jax.random.key(7)), batches, donate=True
    )


# Each case by name, and whether it donates its state: known without building it (building initialises
# a model, seconds each), so that tests parametrize over names and build a case on first use, not when
# pytest collects them.
BUILDERS: dict[str, Callable[[], Case]] = {
    "mlp_adam": mlp_adam,
    "mlp_bfloat16_adam": functools.partial(mlp_adam, jnp.bfloat16, name="mlp_bfloat16_adam"),
    "cnn_batchnorm_momentum": cnn_batchnorm_momentum,
    "transformer_dropout_adamw": transformer_dropout_adamw,
}
DONATED = ("mlp_adam", "mlp_bfloat16_adam", "transformer_dropout_adamw")


@functools.cache
def case(name: str) -> Case:
    """The case ``name``, built once per process. Shared: tests copy its state before donating it."""
    built = BUILDERS[name]()
    assert built.name == name and built.donate == (name in DONATED), (name, built.donate)
    return built
