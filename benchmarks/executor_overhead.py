"""What the executor itself costs per segment, on the CPU, against the same programs run back to back.

Two measurements, per-step medians over ``--steps`` steps, each blocked on:

* **Per segment.** A CPU-sized MLP training step (SGD) under ``ooc_jit`` with a budget above its
  in-core estimate, forced into N segments (``min_segments=N``): nothing moves. Its step time less
  the time of the same segment programs called back to back (a plain loop over the chain's records:
  no transfers, no waits, no memory account; programs compiled without donation so that inputs
  stay valid), divided by N, is the executor's own time per segment (launch, accounting). Lost
  fusion is in both and cancels. Target: at most 50 us.
* **A step with moves.** The test zoo's transformer at 30% of its in-core estimate, with everything
  the plan moves and recomputes, against its segments back to back (as above, host-kept values
  already on the device). Target: at most 1.2x.

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
from oocjax.testing import CopyIn, CopyOut, Launch, sharding

if __package__ in (None, ""):  # run as ``python benchmarks/executor_overhead.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from tests.support.zoo import transformer_dropout_adamw


def mlp_step(params, x):
    def loss_fn(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.01 * g for w, g in zip(params, grads)], loss


def median_seconds(run, steps: int) -> float:
    jax.block_until_ready(run())  # compile and warm up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def back_to_back(step, args):
    """A function running ``step``'s segment programs for ``args`` in a plain loop: the chain's
    operations and slots, no transfers (host slots hold device arrays), no waits, no account.
    Called with ``keep=True`` it returns every slot instead of the results (each program's inputs).
    ``.calls`` lists, per segment, (its program without donation, its input slots, its literals)."""
    (planner,) = step._planners.values()
    executor = planner.built.executor
    executable, chain, device = executor.executable, executor.chain, sharding("device")
    plain = {}
    calls = []
    for op in (op for op in chain.operations if isinstance(op, Launch)):
        program, literals = executable.programs[op.segment], executable.literals[op.segment]
        if id(program) not in plain:  # the same program without donation: its inputs stay valid
            function = jax.jit(executor.functions[op.segment].__wrapped__, in_shardings=device, out_shardings=device)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device) for a in program.in_avals[0]]
            plain[id(program)] = function.trace(*specs[: len(op.inputs) + len(literals)]).lower().compile()
        calls.append((plain[id(program)], op.inputs, literals))
    leaves = [jax.device_put(x, device) for x in jax.tree.leaves(args)]
    host = chain.host_offset

    def run_all(keep: bool = False):
        slots = [None] * chain.num_slots
        for slot, x in executable.constants:
            slots[slot] = x
        for slot, x in zip(chain.argument_slots, leaves):
            slots[slot] = x
        for op in chain.operations:
            if isinstance(op, CopyIn):
                for b in op.buffers:
                    slots[b] = slots[b + host]
            elif isinstance(op, Launch):
                program, inputs, literals = calls[op.segment]
                outputs = program(*[slots[b] for b in inputs], *literals)
                for b, x in zip(op.outputs, outputs):
                    slots[b] = x
            elif isinstance(op, CopyOut):
                for b in op.buffers:
                    slots[b + host] = slots[b]
        return slots if keep else [slots[r] for r in chain.result_slots if r is not None]

    run_all.calls = calls
    return run_all


def per_segment(args) -> tuple[float, list[dict]]:
    keys = jax.random.split(jax.random.key(0), args.layers + 1)
    params = [jax.random.normal(k, (args.width, args.width)) / args.width**0.5 for k in keys[1:]]
    x = jax.random.normal(keys[0], (args.batch, args.width))
    in_core = ooc_jit(mlp_step, budget=2**62).plan(params, x).baseline_peak_bytes
    jitted = jax.jit(mlp_step)
    jit_s = median_seconds(lambda: jitted(params, x), args.steps)
    print(f"jax.jit: {jit_s * 1e3:.2f} ms/step ({args.layers} layers, {args.width} wide, batch {args.batch})")
    rows = []
    for n in map(int, args.segments.split(",")):
        step = ooc_jit(mlp_step, budget=2 * in_core, min_segments=n)
        segments = len(step.plan(params, x).segments)
        ooc_s = median_seconds(lambda step=step: step(params, x), args.steps)
        plain_s = median_seconds(back_to_back(step, (params, x)), args.steps)
        us = (ooc_s - plain_s) / segments * 1e6
        rows.append(dict(segments=segments, s_per_step=ooc_s, back_to_back_s=plain_s, vs_jit=ooc_s / jit_s))
        rows[-1]["executor_us_per_segment"] = us
        print(
            f"{segments:3d} segments: {ooc_s * 1e3:.2f} ms/step ({ooc_s / jit_s:.2f}x jax.jit), back to back "
            f"{plain_s * 1e3:.2f} ms: the executor {us:.0f} us/segment"
        )
    return jit_s, rows


def with_moves(args) -> dict:
    case = transformer_dropout_adamw(args.transformer_layers)
    batch = case.batches[0]
    in_core = ooc_jit(case.step, budget=2**62).plan(case.state, batch).baseline_peak_bytes
    step = ooc_jit(case.step, budget=int(in_core * 0.3), donate_argnums=0, min_offload_bytes=4096)
    state = [jax.tree.map(lambda x: x.copy(), case.state)]
    plan = step.plan(state[0], batch)

    def one_step():
        state[0], metrics = step(state[0], batch)
        return metrics["loss"]

    ooc_s = median_seconds(one_step, args.steps)
    plain_s = median_seconds(back_to_back(step, (case.state, batch)), args.steps)
    jitted = jax.jit(case.step)
    jit_s = median_seconds(lambda: jitted(case.state, batch), args.steps)
    row = dict(
        model=f"transformer_dropout_adamw, {args.transformer_layers} layers",
        fraction=0.3,
        segments=len(plan.segments),
        moved_bytes=sum(plan.program.buffers[m.buffer].nbytes for m in plan.schedule.moves),
        recomputed=len(plan.recomputed),
        s_per_step=ooc_s,
        back_to_back_s=plain_s,
        jit_s=jit_s,
        vs_back_to_back=ooc_s / plain_s,
    )
    print(
        f"{row['model']} at 30%: {ooc_s * 1e3:.2f} ms/step, its {row['segments']} segments back to back "
        f"{plain_s * 1e3:.2f} ms ({row['vs_back_to_back']:.2f}x), jax.jit {jit_s * 1e3:.2f} ms"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--segments", default="8,16,32,64")
    parser.add_argument("--transformer-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    jit_s, rows = per_segment(args)
    moves = with_moves(args)
    if args.out:
        record = dict(
            benchmark="executor_overhead",
            model=dict(layers=args.layers, width=args.width, batch=args.batch),
            jit_s_per_step=jit_s,
            steps=args.steps,
            rows=rows,
            with_moves=moves,
            jax=jax.__version__,
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
