"""Models written the ways ``examples/decoders.py`` does not: each with its training step, for the layer tests.

- ``"equinox"``: an Equinox-style model, written in plain JAX: the blocks a Python list of weight
  records (pytrees), the model written for one example and mapped over the batch with ``jax.vmap``.
- ``"llama"``: Llama-style blocks in Flax Linen, named ``layers_<i>``: RMSNorm, a gated (SwiGLU)
  MLP, grouped-query attention (two key/value heads for four query heads), no biases.
- ``"encoder"``: a BERT-style encoder (no causal mask) with a pooler (a tanh dense layer over the
  first token) and a classifier head, in Flax Linen.
- ``"local_global"``: a decoder whose layers repeat a pattern, as Gemma's do: three layers of
  sliding-window attention, then one of global attention (plain JAX over weight dicts).

``case(way, layers)`` returns ``(step, state, batch)`` with ``step(state, batch) -> (state, loss)``
and the state ``(params, opt_state)``, AdamW throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

WAYS = ("equinox", "llama", "encoder", "local_global")
VOCAB, WIDTH, HEADS, SEQ, BATCH, CLASSES = 48, 64, 4, 32, 8, 5
WINDOW = 8  # the sliding window of a local attention layer


def _attention(q, k, v, mask):
    """``[..., seq, heads, head]`` queries against keys and values of as many or fewer heads
    (grouped-query attention repeats each key/value head over its group of query heads)."""
    group = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.where(mask, logits, jnp.finfo(q.dtype).min)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), v)


def _causal(window: int | None = None):
    rows, columns = jnp.arange(SEQ)[:, None], jnp.arange(SEQ)[None, :]
    mask = columns <= rows
    return mask if window is None else mask & (rows - columns < window)


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[..., 1:]).mean()


def _step(loss: Callable, optimizer) -> Callable:
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step


def _tokens(key, shape):
    return jax.random.randint(key, shape, 0, VOCAB)


# -- Equinox-style: a list of blocks, one example at a time under vmap --------------------------------


class EqxBlock(NamedTuple):
    """One block's weights, as an Equinox module holds them: a record of arrays."""

    norm1: jax.Array
    qkv: jax.Array
    out: jax.Array
    norm2: jax.Array
    up: jax.Array
    down: jax.Array

    def __call__(self, x):  # x: [seq, width], one example
        h = _layer_norm(x, self.norm1)
        q, k, v = (t.reshape(SEQ, HEADS, WIDTH // HEADS) for t in jnp.split(h @ self.qkv, 3, axis=-1))
        x = x + _attention(q, k, v, _causal()).reshape(SEQ, WIDTH) @ self.out
        return x + jax.nn.gelu(_layer_norm(x, self.norm2) @ self.up) @ self.down


def _layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * scale


def _equinox(layers: int, key):
    keys = iter(jax.random.split(key, 6 * layers + 2))

    def dense(n, m):
        return jax.random.normal(next(keys), (n, m)) / n**0.5

    blocks = [
        EqxBlock(
            jnp.ones(WIDTH),
            dense(WIDTH, 3 * WIDTH),
            dense(WIDTH, WIDTH),
            jnp.ones(WIDTH),
            dense(WIDTH, 4 * WIDTH),
            dense(4 * WIDTH, WIDTH),
        )
        for _ in range(layers)
    ]
    params = {"embed": jax.random.normal(next(keys), (VOCAB, WIDTH)) * 0.02, "blocks": blocks}

    def model(params, tokens):  # one example: [seq] -> [seq, vocab]
        x = params["embed"][tokens]
        for block in params["blocks"]:
            x = block(x)
        return x @ params["embed"].T

    def loss(params, tokens):
        logits = jax.vmap(model, in_axes=(None, 0))(params, tokens[:, :-1])
        return _next_token_loss(logits, tokens)

    return loss, params


# -- Llama-style blocks ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale


class LlamaBlock(nn.Module):
    kv_heads: int = 2

    @nn.compact
    def __call__(self, x):
        head = WIDTH // HEADS
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
        h = RMSNorm()(x)
        q = dense(WIDTH, "q")(h).reshape(*x.shape[:-1], HEADS, head)
        k = dense(self.kv_heads * head, "k")(h).reshape(*x.shape[:-1], self.kv_heads, head)
        v = dense(self.kv_heads * head, "v")(h).reshape(*x.shape[:-1], self.kv_heads, head)
        x = x + dense(WIDTH, "o")(_attention(q, k, v, _causal()).reshape(x.shape))
        h = RMSNorm()(x)
        return x + dense(WIDTH, "down")(nn.silu(dense(2 * WIDTH, "gate")(h)) * dense(2 * WIDTH, "up")(h))


class Llama(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        for i in range(self.layers):
            x = LlamaBlock(name=f"layers_{i}")(x)
        return nn.Dense(VOCAB, use_bias=False)(RMSNorm()(x))


# -- An encoder with a pooler ---------------------------------------------------------------------


class EncoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (t.reshape(*x.shape[:-1], HEADS, WIDTH // HEADS) for t in jnp.split(nn.Dense(3 * WIDTH)(x), 3, -1))
        x = nn.LayerNorm()(x + nn.Dense(WIDTH)(_attention(q, k, v, True).reshape(x.shape)))
        return nn.LayerNorm()(x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(x))))


class Encoder(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("position", nn.initializers.normal(0.02), (SEQ, WIDTH))
        for _ in range(self.layers):
            x = EncoderBlock()(x)
        pooled = jnp.tanh(nn.Dense(WIDTH, name="pooler")(x[:, 0]))
        return nn.Dense(CLASSES, name="classifier")(pooled)


# -- A pattern of local and global attention layers -------------------------------------------------


def _local_global(layers: int, key):
    keys = iter(jax.random.split(key, 4 * layers + 1))

    def dense(n, m):
        return jax.random.normal(next(keys), (n, m)) / n**0.5

    params = {
        "embed": jax.random.normal(next(keys), (VOCAB, WIDTH)) * 0.02,
        "layers": [
            {
                "qkv": dense(WIDTH, 3 * WIDTH),
                "out": dense(WIDTH, WIDTH),
                "up": dense(WIDTH, 4 * WIDTH),
                "down": dense(4 * WIDTH, WIDTH),
                "norm": jnp.ones((2, WIDTH)),
            }
            for _ in range(layers)
        ],
    }

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        for i, w in enumerate(params["layers"]):
            mask = _causal() if i % 4 == 3 else _causal(WINDOW)  # every fourth layer attends globally
            h = _layer_norm(x, w["norm"][0])
            q, k, v = (t.reshape(*x.shape[:-1], HEADS, WIDTH // HEADS) for t in jnp.split(h @ w["qkv"], 3, -1))
            x = x + _attention(q, k, v, mask).reshape(x.shape) @ w["out"]
            x = x + jax.nn.gelu(_layer_norm(x, w["norm"][1]) @ w["up"]) @ w["down"]
        return _next_token_loss(x @ params["embed"].T, tokens)

    return loss, params


def case(way: str, layers: int, *, seed: int = 0, batch: int = BATCH) -> tuple[Callable, Any, Any]:
    """``(step, state, batch)`` for one of ``WAYS`` with ``layers`` layers and ``batch`` examples."""
    key, data = jax.random.split(jax.random.key(seed))
    optimizer = optax.adamw(1e-3)
    if way == "equinox":
        loss, params = _equinox(layers, key)
        data = _tokens(data, (batch, SEQ + 1))
    elif way == "local_global":
        loss, params = _local_global(layers, key)
        data = _tokens(data, (batch, SEQ + 1))
    elif way == "llama":
        model = Llama(layers)
        params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))
        loss = lambda p, tokens: _next_token_loss(model.apply(p, tokens[:, :-1]), tokens)  # noqa: E731
        data = _tokens(data, (batch, SEQ + 1))
    elif way == "encoder":
        model = Encoder(layers)
        params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))
        data = (_tokens(data, (batch, SEQ)), jax.random.randint(key, (batch,), 0, CLASSES))
        loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b[0]), b[1]).mean()  # noqa: E731
    else:
        raise ValueError(f"unknown way {way!r}; known: {WAYS}")
    return _step(loss, optimizer), (params, optimizer.init(params)), data
