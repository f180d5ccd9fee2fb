"""The benchmark model suite: Flax + Optax training steps, sized by arguments so that the same code
serves CPU-sized checks and GPU-sized runs.

Each builder returns a ``Workload``: the step ``(state, batch) -> (state, loss)``, and abstract
(``jax.ShapeDtypeStruct``) state and batch, so that planning a 20 GiB model allocates nothing. Use
``Workload.materialise`` for real arrays when the step is to run. The models are the shared ones of
``examples/models.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

if __package__ in (None, ""):  # imported as ``models`` by a script in benchmarks/: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.models import MLP, ResNet, Transformer


@dataclass(frozen=True)
class Workload:
    name: str
    make_step: Callable  # remat policy or None -> step
    batch: Any  # abstract
    init: Callable  # key -> real state

    @property
    def step(self) -> Callable:
        return self.make_step(None)

    @cached_property
    def state(self) -> Any:
        """The abstract state (shapes and dtypes), worked out on first use."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def materialise(self, seed: int = 0) -> tuple[Any, Any]:
        """Real arrays: initialised state and a batch of valid values."""
        state = self.init(jax.random.key(seed))
        batch = jax.tree.map(_fill, self.batch)
        return state, batch


def _fill(spec: jax.ShapeDtypeStruct) -> jax.Array:
    if jnp.issubdtype(spec.dtype, jnp.integer):
        return jnp.zeros(spec.shape, spec.dtype)  # token 0 and class 0 are valid everywhere
    return jax.random.normal(jax.random.key(1), spec.shape, spec.dtype)


def _workload(name, model, optimizer, example_inputs, loss_fn, batch, *, mutable=()) -> Workload:
    """A step for ``model`` with ``optimizer``; ``loss_fn(model, variables, batch)`` returns
    (loss, updated mutable collections)."""

    def init(key):
        variables = model.init(key, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), example_inputs))
        params = variables["params"]
        extra = {k: v for k, v in variables.items() if k != "params"}
        return params, extra, optimizer.init(params)

    def make_step(remat_policy=None):
        """The training step; with a policy, the loss is wrapped in ``jax.checkpoint`` (JAX's own
        rematerialisation and offload baselines)."""

        def step(state, batch):
            params, extra, opt_state = state

            def objective(p):
                return loss_fn(model, {"params": p, **extra}, batch)

            if remat_policy is not None:
                objective = jax.checkpoint(objective, policy=remat_policy)
            (loss, updated), grads = jax.value_and_grad(objective, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), {**extra, **updated}, opt_state), loss

        return step

    return Workload(name, make_step, batch, init)


# -- MLP --------------------------------------------------------------------------------------------


def mlp(width: int = 4096, depth: int = 16, batch: int = 4096) -> Workload:
    model = MLP(width, depth, classes=1000, activation=jax.nn.gelu, dtype=jnp.bfloat16)
    data = (jax.ShapeDtypeStruct((batch, width), jnp.bfloat16), jax.ShapeDtypeStruct((batch,), jnp.int32))

    def loss_fn(model, variables, batch):
        x, y = batch
        logits = model.apply(variables, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), {}

    return _workload(f"mlp-{depth}x{width}-b{batch}", model, optax.adamw(1e-3), (data[0],), loss_fn, data)


# -- ResNet-50-style CNN ----------------------------------------------------------------------------


def resnet50(batch: int = 128, image: int = 224, width: int = 64) -> Workload:
    model = ResNet(width=width, dtype=jnp.bfloat16)
    data = (jax.ShapeDtypeStruct((batch, image, image, 3), jnp.bfloat16), jax.ShapeDtypeStruct((batch,), jnp.int32))

    def loss_fn(model, variables, batch):
        x, y = batch
        logits, updated = model.apply(variables, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean(), updated

    example = (jax.ShapeDtypeStruct((1, image, image, 3), jnp.bfloat16),)
    return _workload(
        f"resnet50-w{width}-b{batch}-{image}px", model, optax.sgd(0.1, momentum=0.9), example, loss_fn, data
    )


# -- GPT-2-style decoder and BERT-style encoder --------------------------------------------------------


def _language_model(name, model, batch, seq) -> Workload:
    data = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def loss_fn(model, variables, tokens):
        logits = model.apply(variables, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), {}

    example = (jax.ShapeDtypeStruct((1, seq), jnp.int32),)
    return _workload(name, model, optax.adamw(3e-4), example, loss_fn, data)


def gpt2(
    layers: int = 12,
    width: int = 768,
    heads: int = 12,
    batch: int = 8,
    seq: int = 1024,
    vocab: int = 50257,
    dtype: Any = jnp.bfloat16,
    remat_policy: Callable | None = None,
) -> Workload:
    """A GPT-2-style decoder; ``dtype`` is the compute dtype (parameters are float32 either way).
    With ``remat_policy`` every block runs in ``nn.remat`` under it, as a user writes per-block remat
    (the same parameters as without)."""
    model = Transformer(
        vocab=vocab,
        width=width,
        heads=heads,
        layers=layers,
        causal=True,
        dtype=dtype,
        remat=remat_policy is not None,
        remat_policy=remat_policy,
    )
    suffix = "" if jnp.dtype(dtype) == jnp.bfloat16 else f"-{jnp.dtype(dtype).name}"
    suffix += "" if remat_policy is None else "-remat"
    return _language_model(f"gpt2-{layers}x{width}-b{batch}-s{seq}{suffix}", model, batch, seq)


def bert(
    layers: int = 12, width: int = 768, heads: int = 12, batch: int = 32, seq: int = 512, vocab: int = 30522
) -> Workload:
    model = Transformer(vocab=vocab, width=width, heads=heads, layers=layers, causal=False, dtype=jnp.bfloat16)
    return _language_model(f"bert-{layers}x{width}-b{batch}-s{seq}", model, batch, seq)


def gpu_suite() -> list[Workload]:
    """Sizes that overflow a 24-80 GiB GPU in-core, the reason oocjax exists."""
    return [
        mlp(width=8192, depth=16, batch=8192),
        resnet50(batch=256),
        gpt2(layers=12, width=768, batch=16),
        gpt2(layers=48, width=1024, heads=16, batch=8),
        bert(layers=24, width=1024, heads=16, batch=32),
    ]


def cpu_suite() -> list[Workload]:
    """The same architectures, small enough to run on a CPU in seconds."""
    return [
        mlp(width=256, depth=4, batch=128),
        resnet50(batch=2, image=64, width=16),
        gpt2(layers=2, width=64, heads=4, batch=4, seq=64, vocab=512),
        bert(layers=2, width=64, heads=4, batch=4, seq=64, vocab=512),
    ]
