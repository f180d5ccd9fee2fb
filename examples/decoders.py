"""One GPT-style decoder written the four ways users write models, each with its training step.

The same computation every time: a token embedding plus a learned position embedding, ``layers``
pre-norm blocks (causal self-attention, then a 4x GELU MLP, each added to the residual stream), a
final norm and a dense head; AdamW on the mean next-token cross-entropy. Only how the model is
written changes, and with it what a tracer sees of its layers:

- ``"linen_auto"``: Flax Linen blocks in a loop, named by Flax (``Block_0``, ``Block_1``, ...).
- ``"linen_named"``: Flax Linen blocks named ``"0"``, ``"1"``, ... under a parent module ``h``
  inside ``transformer`` (``transformer/h/0``), as in the widely used Flax GPT-2.
- ``"nnx"``: Flax NNX, the blocks held in an ``nnx.List``; NNX puts no module names in traces.
- ``"plain"``: a plain function over a list of per-layer weight dicts: no modules, no names.

``decoder_case(way, layers)`` returns ``(step, state, batch)`` with
``step(state, batch) -> (state, loss)``; the state is ``(params, opt_state)``.

Tests and benchmarks, run from the repository root, import this file as ``examples.decoders``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

WAYS = ("linen_auto", "linen_named", "nnx", "plain")

VOCAB, WIDTH, HEADS, SEQ, BATCH = 50, 64, 4, 32, 16


def attention(q, k, v, heads: int):
    """Causal multi-head attention over ``[batch, seq, width]`` queries, keys and values."""
    b, s, w = q.shape
    split = lambda x: x.reshape(b, s, heads, w // heads)  # noqa: E731
    logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / jnp.sqrt(w // heads).astype(q.dtype)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, jnp.finfo(q.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), split(v)).reshape(b, s, w)


# -- Flax Linen -----------------------------------------------------------------------------------


class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        q, k, v = jnp.split(nn.Dense(3 * self.width)(h), 3, axis=-1)
        x = x + nn.Dense(self.width)(attention(q, k, v, self.heads))
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class AutoNamedDecoder(nn.Module):
    """Blocks named by Flax: ``Block_0`` .. ``Block_<layers-1>``."""

    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("position", nn.initializers.normal(0.02), (SEQ, WIDTH))
        for _ in range(self.layers):
            x = Block(WIDTH, HEADS)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class BlockCollection(nn.Module):
    layers: int

    def setup(self):
        self.blocks = [Block(WIDTH, HEADS, name=str(i)) for i in range(self.layers)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Body(nn.Module):
    layers: int

    def setup(self):
        self.wte = nn.Embed(VOCAB, WIDTH)
        self.wpe = nn.Embed(SEQ, WIDTH)
        self.h = BlockCollection(self.layers)
        self.ln_f = nn.LayerNorm()

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        return self.ln_f(self.h(x))


class ExplicitlyNamedDecoder(nn.Module):
    """Blocks at ``transformer/h/0`` .. ``transformer/h/<layers-1>``, as the Flax GPT-2 names them."""

    layers: int

    def setup(self):
        self.transformer = Body(self.layers)
        self.lm_head = nn.Dense(VOCAB)

    def __call__(self, tokens):
        return self.lm_head(self.transformer(tokens))


# -- Flax NNX -------------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln_1, self.ln_2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
        self.qkv, self.proj = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.up, self.down = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(self.ln_1(x)), 3, axis=-1)
        x = x + self.proj(attention(q, k, v, HEADS))
        return x + self.down(nnx.gelu(self.up(self.ln_2(x))))


class NnxDecoder(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, WIDTH)))
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- A plain function over weight lists -----------------------------------------------------------


def layer_norm(x, w):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * w["scale"] + w["bias"]


def plain_decoder(weights: dict, tokens):
    """``weights``: ``embed``, ``position``, ``blocks`` (a list of dicts), ``ln_f``, ``head``."""
    x = weights["embed"][tokens] + weights["position"]
    for w in weights["blocks"]:
        q, k, v = jnp.split(layer_norm(x, w["ln_1"]) @ w["qkv"] + w["qkv_bias"], 3, axis=-1)
        x = x + attention(q, k, v, HEADS) @ w["proj"] + w["proj_bias"]
        h = jax.nn.gelu(layer_norm(x, w["ln_2"]) @ w["up"] + w["up_bias"])
        x = x + h @ w["down"] + w["down_bias"]
    return layer_norm(x, weights["ln_f"]) @ weights["head"] + weights["head_bias"]


def plain_weights(layers: int, key) -> dict:
    keys = iter(jax.random.split(key, 4 * layers + 3))
    dense = lambda m, n: 0.02 * jax.random.normal(next(keys), (m, n))  # noqa: E731
    norm = lambda: {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)}  # noqa: E731
    block = lambda: {  # noqa: E731
        "ln_1": norm(),
        "qkv": dense(WIDTH, 3 * WIDTH),
        "qkv_bias": jnp.zeros(3 * WIDTH),
        "proj": dense(WIDTH, WIDTH),
        "proj_bias": jnp.zeros(WIDTH),
        "ln_2": norm(),
        "up": dense(WIDTH, 4 * WIDTH),
        "up_bias": jnp.zeros(4 * WIDTH),
        "down": dense(4 * WIDTH, WIDTH),
        "down_bias": jnp.zeros(WIDTH),
    }
    return {
        "embed": dense(VOCAB, WIDTH),
        "position": dense(SEQ, WIDTH),
        "blocks": [block() for _ in range(layers)],
        "ln_f": norm(),
        "head": dense(WIDTH, VOCAB),
        "head_bias": jnp.zeros(VOCAB),
    }


# -- The training step ----------------------------------------------------------------------------


def decoder_case(way: str, layers: int, *, seed: int = 0) -> tuple[Callable, Any, jax.Array]:
    """``(step, state, batch)`` for the decoder written ``way`` (one of ``WAYS``) with ``layers`` blocks."""
    key = jax.random.key(seed)
    tokens = jax.random.randint(jax.random.key(seed + 1), (BATCH, SEQ + 1), 0, VOCAB)
    if way in ("linen_auto", "linen_named"):
        model = AutoNamedDecoder(layers) if way == "linen_auto" else ExplicitlyNamedDecoder(layers)
        params, apply = model.init(key, tokens[:, :-1]), model.apply
    elif way == "nnx":
        graphdef, params = nnx.split(NnxDecoder(layers, nnx.Rngs(seed)), nnx.Param)
        apply = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
    elif way == "plain":
        params, apply = plain_weights(layers, key), plain_decoder
    else:
        raise ValueError(f"unknown way {way!r}: one of {WAYS}")
    optimizer = optax.adamw(1e-3, weight_decay=0.01)

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            logits = apply(p, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, optimizer.init(params)), tokens
