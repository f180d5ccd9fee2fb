"""The Flax (Linen) models that the examples, the tests and the benchmarks train: one definition of each.

- ``MLP``: dense layers with an activation, then a dense classifier.
- ``CNN``: a plain stack of 3x3 convolutions with batch norm; ``ResNet``: ResNet-50-style bottleneck stages.
- ``Transformer``: pre-norm ``Block``s over a token embedding: a GPT-2-style decoder with ``causal=True``,
  a BERT-style encoder without; blocks in a loop or an ``nn.scan``, optionally remat'd. ``next_token_step``
  is its training step.

Sizes, the compute ``dtype`` and the optional parts (dropout, attention biases, the learned position
embedding, the final norm) are fields, so that one definition serves a CPU-sized example, a test step
and a GPU-sized benchmark. Parameters are float32 unless ``param_dtype`` says otherwise. Models with
batch norm or dropout take ``train`` (default True: they are here to be trained).

The examples import this file as ``models`` (``python examples/train_flax.py`` puts ``examples/`` on
``sys.path``); tests and benchmarks, run from the repository root, as ``examples.models``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
    """``depth`` dense layers of ``width`` units, each followed by ``activation``, then ``classes`` logits."""

    width: int
    depth: int
    classes: int = 10
    activation: Callable = nn.relu
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        for _ in range(self.depth):
            x = self.activation(dense(self.width)(x))
        return dense(self.classes)(x)


class CNN(nn.Module):
    """3x3 convolutions, each followed by batch norm and ReLU; global average pooling; a dense classifier."""

    features: Sequence[int] = (8, 8, 16, 16, 16, 16)
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in self.features:
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided), 1x1 convolutions with batch norm; a projected shortcut where the shape changes."""

    features: int
    strides: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = partial(nn.BatchNorm, use_running_average=not train, dtype=self.dtype)
        conv = partial(nn.Conv, dtype=self.dtype)
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(y)))
        y = norm()(conv(4 * self.features, (1, 1))(y))
        if x.shape != y.shape:
            x = norm()(conv(4 * self.features, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet-50 with the default ``stages`` and ``width``: a 7x7 stem, bottleneck stages, a dense classifier."""

    stages: Sequence[int] = (3, 4, 6, 3)
    width: int = 64
    classes: int = 1000
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (7, 7), 2, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = Bottleneck(self.width * 2**i, 2 if i > 0 and j == 0 else 1, self.dtype)(x, train)
        return nn.Dense(self.classes, dtype=self.dtype)(x.mean(axis=(1, 2)))


class Block(nn.Module):
    """A pre-norm transformer block: self-attention, then a 4x-wide GELU MLP, each added to the residual
    stream (through dropout when ``dropout_rate`` > 0 and training)."""

    width: int
    heads: int
    causal: bool = False
    dropout_rate: float = 0.0
    attention_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        dropout = partial(nn.Dropout, self.dropout_rate, deterministic=not train)
        mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads,
            dtype=self.dtype,
            dropout_rate=self.dropout_rate,
            deterministic=not train,
            use_bias=self.attention_bias,
        )(h, h, mask=mask)
        x = x + dropout()(h)
        h = nn.Dense(4 * self.width, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + dropout()(nn.Dense(self.width, dtype=self.dtype)(nn.gelu(h)))


class _ScannedBlock(nn.Module):
    """A ``Block`` as a scan body: the residual stream is the carry."""

    block: dict[str, Any]
    train: bool

    @nn.compact
    def __call__(self, x, _):
        return Block(**self.block)(x, self.train), None


class Transformer(nn.Module):
    """Token embedding (plus a learned position embedding), ``layers`` blocks, a final norm, ``vocab`` logits.

    The blocks run as a Python loop, or with ``scan=True`` as ``nn.scan`` over one block with the
    parameters stacked on a leading ``[layers, ...]`` axis (as large models are written, to keep
    compile time flat in depth); ``remat=True`` wraps each block in ``nn.remat``, under
    ``remat_policy`` where one is given (a ``jax.checkpoint_policies`` policy; by default nothing is
    saved). Blocks are named ``Block_<i>`` either way, so a remat'd model has the plain one's parameters."""

    vocab: int
    width: int
    heads: int
    layers: int
    causal: bool
    dropout_rate: float = 0.0
    attention_bias: bool = True
    position_embedding: bool = True
    final_norm: bool = True
    dtype: Any = None
    scan: bool = False
    remat: bool = False
    remat_policy: Callable | None = None

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        if self.position_embedding:
            x = x + self.param("position", nn.initializers.normal(0.02), (tokens.shape[1], self.width))
        block = dict(
            width=self.width,
            heads=self.heads,
            causal=self.causal,
            dropout_rate=self.dropout_rate,
            attention_bias=self.attention_bias,
            dtype=self.dtype,
        )
        if self.scan:
            body = nn.remat(_ScannedBlock) if self.remat else _ScannedBlock
            split = {"params": True, "dropout": True}
            blocks = nn.scan(body, variable_axes={"params": 0}, split_rngs=split, length=self.layers)
            x, _ = blocks(block, train)(x, None)
        else:
            layer = nn.remat(Block, policy=self.remat_policy, static_argnums=(2,)) if self.remat else Block
            for i in range(self.layers):  # train (argument 2) is static
                x = layer(**block, name=f"Block_{i}")(x, train)
        if self.final_norm:
            x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype)(x)


def next_token_step(model: nn.Module, optimizer: Any) -> Callable:
    """The training step of a language model: cross-entropy of each next token, one optimizer update.
    ``step((params, opt_state), tokens) -> ((params, opt_state), loss)``, tokens ``[batch, seq + 1]``."""

    def step(state, tokens):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step
