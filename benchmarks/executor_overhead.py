"""What running a step as a chain of segments costs when nothing needs to move, on the CPU.

A CPU-sized MLP training step (SGD) runs under ``jax.jit`` and under ``ooc_jit`` with a budget above
its in-core estimate but forced into N segments (``min_segments=N``): the difference per step,
divided by N, is the executor's cost per segment launch (the Python loop, the memory account, the
dispatch of one more program). Per-step times are medians over ``--steps`` steps, each blocked on.

    python benchmarks/executor_overhead.py [--out benchmarks/results/executor_overhead-cpu-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from oocjax import ooc_jit

if __package__ in (None, ""):  # run as ``python benchmarks/executor_overhead.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine


def mlp_step(params, x):
    def loss_fn(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.01 * g for w, g in zip(params, grads)], loss


def seconds_per_step(step, params, x, steps: int) -> float:
    params, loss = step(params, x)  # compile and warm up
    jax.block_until_ready((params, loss))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        params, loss = step(params, x)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--segments", default="2,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), args.layers + 1)
    params = [jax.random.normal(k, (args.width, args.width)) / args.width**0.5 for k in keys[1:]]
    x = jax.random.normal(keys[0], (args.batch, args.width))
    in_core = ooc_jit(mlp_step, budget=2**62).plan(params, x).baseline_peak_bytes
    jit_s = seconds_per_step(jax.jit(mlp_step), params, x, args.steps)
    print(f"jax.jit: {jit_s * 1e3:.2f} ms/step ({args.layers} layers, {args.width} wide, batch {args.batch})")
    rows = []
    for n in map(int, args.segments.split(",")):
        step = ooc_jit(mlp_step, budget=2 * in_core, min_segments=n)
        segments = len(step.plan(params, x).segments)
        ooc_s = seconds_per_step(step, params, x, args.steps)
        per_segment_us = (ooc_s - jit_s) / segments * 1e6
        rows.append(dict(segments=segments, s_per_step=ooc_s, vs_jit=ooc_s / jit_s, us_per_segment=per_segment_us))
        speed = f"{ooc_s * 1e3:.2f} ms/step, {ooc_s / jit_s:.2f}x jax.jit"
        print(f"{segments:3d} segments: {speed}, {per_segment_us:.0f} us/segment")
    if args.out:
        record = dict(
            benchmark="executor_overhead",
            model=dict(layers=args.layers, width=args.width, batch=args.batch),
            jit_s_per_step=jit_s,
            steps=args.steps,
            rows=rows,
            jax=jax.__version__,
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
