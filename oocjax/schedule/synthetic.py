"""Synthetic training-step programs, shaped like the jaxpr of a layered model trained with Adam.

Used by the planner benchmarks and tests, where a real model would be slow to trace.
"""

from __future__ import annotations

from oocjax.schedule.program import Buffer, Program, Step

MiB = 2**20


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
    buffers: list[Buffer] = []
    steps: list[Step] = []

    def new(nbytes: int, label: str, **kw) -> int:
        buffers.append(Buffer(nbytes=nbytes, label=label, **kw))
        return len(buffers) - 1

    def step(name: str, reads: list[int], writes: list[int]) -> None:
        touched = sum(buffers[b].nbytes for b in (*reads, *writes))
        steps.append(
            Step(
                reads=tuple(dict.fromkeys(reads)),
                writes=tuple(writes),
                name=name,
                flops=touched * flops_per_byte,
                bytes_accessed=touched,
            )
        )

    scales = (1, 4, 1, 1 / 64)
    batch = new(activation_bytes, "batch", kind="input")
    params = [new(param_bytes, f"params[{i}]", kind="input", donated=True) for i in range(layers)]
    moments = [
        (
            new(param_bytes, f"mu[{i}]", kind="input", donated=True),
            new(param_bytes, f"nu[{i}]", kind="input", donated=True),
        )
        for i in range(layers)
    ]

    saved: list[list[int]] = []
    x = batch
    for i in range(layers):
        inputs = []
        for j in range(ops_per_layer):
            inputs.append(x)
            y = new(max(1, int(activation_bytes * scales[j % len(scales)])), f"h[{i}][{j}]")
            step("dot_general" if j == 0 else "tanh", [x, params[i]] if j == 0 else [x], [y])
            x = y
        saved.append(inputs)
    loss = new(4, "loss", is_output=True)
    step("reduce_sum", [x], [loss])
    grad = new(buffers[x].nbytes, "d_out")
    step("broadcast_in_dim", [loss], [grad])

    param_grads = [0] * layers
    for i in reversed(range(layers)):
        for j in reversed(range(ops_per_layer)):
            activation = saved[i][j]
            g = new(buffers[activation].nbytes, f"d_h[{i}][{j}]")
            if j == 0:
                param_grads[i] = new(param_bytes, f"d_params[{i}]")
                step("dot_general", [grad, activation, params[i]], [g, param_grads[i]])
            else:
                step("mul", [grad, activation], [g])
            grad = g

    for i in range(layers):
        mu, nu = moments[i]
        outs = [
            new(param_bytes, f"new_params[{i}]", is_output=True, aliased_input=params[i]),
            new(param_bytes, f"new_mu[{i}]", is_output=True, aliased_input=mu),
            new(param_bytes, f"new_nu[{i}]", is_output=True, aliased_input=nu),
        ]
        step("adam", [params[i], param_grads[i], mu, nu], outs)
    return Program(steps=tuple(steps), buffers=tuple(buffers))
