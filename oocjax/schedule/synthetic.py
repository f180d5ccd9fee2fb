"""Synthetic training-step programs, shaped like the jaxpr of a layered model trained with Adam.

Used by the planner benchmarks and tests, where a real model would be slow to trace.
"""

from __future__ import annotations

from oocjax.schedule.program import Buffer, Program, Step
from oocjax.schedule.units import MiB


def layered_training_step(
    layers: int,
    ops_per_layer: int = 4,
    *,
    activation_bytes: int = 8 * MiB,
    param_bytes: int = 4 * MiB,
    flops_per_byte: int = 64,
) -> Program:
    """Forward through ``layers`` blocks of ``ops_per_layer`` operations, a loss, the backward pass
    reading saved activations in reverse, then an Adam update per layer. Parameters and the two
    optimizer moments are donated inputs; the updated ones are outputs aliased to them.

    Activation sizes cycle through 1x, 4x, 1x, 1/64x of ``activation_bytes`` (an MLP's widening,
    and a small statistic that stays below the offload threshold), so the window has to adapt.
    Steps: ``layers * (2 * ops_per_layer + 1) + 2``.
    """
    build = _Builder(flops_per_byte)
    batch = build.new(activation_bytes, "batch", kind="input")
    params = [build.new(param_bytes, f"params[{i}]", kind="input", donated=True) for i in range(layers)]
    moments = [
        (
            build.new(param_bytes, f"mu[{i}]", kind="input", donated=True),
            build.new(param_bytes, f"nu[{i}]", kind="input", donated=True),
        )
        for i in range(layers)
    ]
    saved, x = _forward(build, batch, params, ops_per_layer, activation_bytes)
    loss = build.new(4, "loss", is_output=True)
    build.step("reduce_sum", [x], [loss])
    grad = build.new(build.buffers[x].nbytes, "d_out")
    build.step("broadcast_in_dim", [loss], [grad])
    param_grads = _gradients(build, grad, saved, params, param_bytes)
    for i, (mu, nu) in enumerate(moments):
        outs = [
            build.new(param_bytes, f"new_params[{i}]", is_output=True, aliased_input=params[i]),
            build.new(param_bytes, f"new_mu[{i}]", is_output=True, aliased_input=mu),
            build.new(param_bytes, f"new_nu[{i}]", is_output=True, aliased_input=nu),
        ]
        build.step("adam", [params[i], param_grads[i], mu, nu], outs)
    return Program(steps=tuple(build.steps), buffers=tuple(build.buffers))


class _Builder:
    """Buffers and steps in the order they are made; a step's cost follows the bytes it touches."""

    def __init__(self, flops_per_byte: int):
        self.flops_per_byte = flops_per_byte
        self.buffers: list[Buffer] = []
        self.steps: list[Step] = []

    def new(self, nbytes: int, label: str, **kw) -> int:
        self.buffers.append(Buffer(nbytes=nbytes, label=label, **kw))
        return len(self.buffers) - 1

    def step(self, name: str, reads: list[int], writes: list[int]) -> None:
        touched = sum(self.buffers[b].nbytes for b in (*reads, *writes))
        self.steps.append(
            Step(
                reads=tuple(dict.fromkeys(reads)),
                writes=tuple(writes),
                name=name,
                flops=touched * self.flops_per_byte,
                bytes_accessed=touched,
            )
        )


_SCALES = (1, 4, 1, 1 / 64)  # activation sizes along a block, as multiples of activation_bytes


def _forward(
    build: _Builder, batch: int, params: list[int], ops_per_layer: int, activation_bytes: int
) -> tuple[list[list[int]], int]:
    """The forward blocks: per layer, the activations its operations read (saved for the backward
    pass), and the last activation."""
    saved: list[list[int]] = []
    x = batch
    for i in range(len(params)):
        inputs = []
        for j in range(ops_per_layer):
            inputs.append(x)
            y = build.new(max(1, int(activation_bytes * _SCALES[j % len(_SCALES)])), f"h[{i}][{j}]")
            build.step("dot_general" if j == 0 else "tanh", [x, params[i]] if j == 0 else [x], [y])
            x = y
        saved.append(inputs)
    return saved, x


def _gradients(build: _Builder, grad: int, saved: list[list[int]], params: list[int], param_bytes: int) -> list[int]:
    """The backward pass, reading the saved activations in reverse; the parameter gradients."""
    param_grads = [0] * len(params)
    for i in reversed(range(len(params))):
        for j in reversed(range(len(saved[i]))):
            activation = saved[i][j]
            g = build.new(build.buffers[activation].nbytes, f"d_h[{i}][{j}]")
            if j == 0:
                param_grads[i] = build.new(param_bytes, f"d_params[{i}]")
                build.step("dot_general", [grad, activation, params[i]], [g, param_grads[i]])
            else:
                build.step("mul", [grad, activation], [g])
            grad = g
    return param_grads
