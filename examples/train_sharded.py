"""Train a Flax transformer data-parallel over every local device, under a per-device memory budget.

The batch is split over a one-axis mesh (``data``); parameters and optimizer state are replicated,
as ``jax.jit`` would run them. The step is wrapped in ``ooc_jit`` with a budget of half of what
one device needs in-core: the budget is per device, the same number as a device's memory limit,
and the plan's byte figures are per device too. While training, every segment launch is sampled:
per device, the bytes of live arrays in device memory (counted from each array's sharding and
shard shape) plus what the launch allocates, against the budget.

On the CPU the script asks XLA for 8 virtual devices (``--cpu-devices``); on N GPUs it uses them as
they are. On several hosts, call ``jax.distributed.initialize()`` first in every process and give
the step global arrays (``docs/guide.md``, "Several devices and hosts").

    python examples/train_sharded.py [--steps 50] [--budget-fraction 0.5] [--cpu-devices 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from math import prod


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split over the devices")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="of one device's in-core estimate")
    parser.add_argument("--cpu-devices", type=int, default=8, help="virtual CPU devices (the CPU only)")
    parser.add_argument("--json", help="also write the figures and the losses to this file")
    return parser.parse_args()


args = parse()
# XLA reads its flags when jax starts: the virtual devices must be asked for before the import.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from models import Transformer  # noqa: E402  (models.py, next to this file)
from train_flax import LENGTH, VOCAB, copy_batch, make_train_step  # noqa: E402  (the copying task)

from oocjax import ooc_jit  # noqa: E402
from oocjax.schedule import format_bytes  # noqa: E402
from oocjax.transforms.execute import observe_segments  # noqa: E402


class PerDevicePeak:
    """At each segment launch, per device: live device bytes plus what the launch allocates."""

    def __init__(self):
        self.peak_bytes = 0
        self.launches = 0

    def __call__(self, launch) -> None:
        held: dict[int, int] = defaultdict(int)
        for x in jax.live_arrays():  # never ``addressable_shards``: reading them makes new arrays
            if x.sharding.memory_kind == "device":
                for device in x.sharding.device_set:
                    held[device.id] += prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        self.peak_bytes = max(self.peak_bytes, max(held.values(), default=0) + launch.cost.launch_bytes)
        self.launches += 1


def main() -> None:
    devices = jax.local_devices()
    # Auto axes: XLA decides the layout of what the step computes inside, as under plain jax.jit.
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = Transformer(vocab=VOCAB, width=128, heads=4, layers=4, causal=True)
    optimizer = optax.adamw(3e-3)
    key = jax.random.key(0)
    params = jax.device_put(model.init(key, jnp.zeros((1, LENGTH - 1), jnp.int32)), replicated)
    state = (params, jax.device_put(optimizer.init(params), replicated))
    train_step = make_train_step(model, optimizer)

    def batch(i):
        return jax.device_put(copy_batch(jax.random.fold_in(key, i), args.batch), split)

    first = batch(0)
    in_core = ooc_jit(train_step, budget=2**62).plan(state, first).baseline_peak_bytes
    budget = int(in_core * args.budget_fraction)
    step = ooc_jit(train_step, budget=budget, donate_argnums=(0,))
    plan = step.plan(state, first)
    print(
        f"{len(devices)} {devices[0].device_kind} devices; per device: in-core estimate {format_bytes(in_core)}, "
        f"budget {format_bytes(budget)}"
    )
    print(plan.summary(largest=3))
    if not (plan.moved_bytes or plan.recomputed):
        sys.exit("the budget should force the plan to move or recompute values; try a smaller --budget-fraction")

    reference = float(jax.jit(train_step)(state, first)[1])
    sampled = PerDevicePeak()
    losses = []
    with observe_segments(sampled):
        for i in range(args.steps):
            state, loss = step(state, first if i == 0 else batch(i))
            losses.append(float(loss))
    print(f"first step: loss {losses[0]:.6f}, jax.jit gives {reference:.6f}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"parameters: {jax.tree.leaves(state[0])[0].sharding}")
    print(
        f"per-device peak at {sampled.launches} launches: {format_bytes(sampled.peak_bytes)} "
        f"against a budget of {format_bytes(budget)} (planned {format_bytes(plan.peak_bytes)})"
    )
    if args.json:
        figures = dict(
            devices=len(devices),
            in_core_estimate_bytes=in_core,
            budget_bytes=budget,
            planned_peak_bytes=plan.peak_bytes,
            measured_peak_bytes=sampled.peak_bytes,
            launches=sampled.launches,
            moved_bytes=plan.moved_bytes,
            recomputed=len(plan.recomputed),
            jax_jit_first_loss=reference,
            losses=losses,
            parameter_devices=sorted({len(x.sharding.device_set) for x in jax.tree.leaves(state[0])}),
        )
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    if sampled.peak_bytes > budget:
        sys.exit("over the budget")


if __name__ == "__main__":
    main()
