"""Does planning cost more than tracing? A 48-layer GPT-2-style Flax training step, on the CPU.

Times, best of ``--repeats``, each on a freshly built step function so that no JAX cache helps:
  trace:   ``jax.jit(step).trace(state, batch)`` (what ``ooc_jit`` does first, and ``jax.jit`` too);
  plan:    analyse (flatten, size, label) + the window planner + cutting segments, at half the in-core estimate;
  rewrite: tracing the chain of segments (segment calls and transfers), reported apart: it replaces the
           trace ``jax.jit`` would do on the first call.
Prints the equation count and the ratio plan / trace (the target is at most 1).

    python benchmarks/plan_vs_trace.py [--layers 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from oocjax.schedule import keep_all, plan_window, simulate
from oocjax.schedule.segments import cut_segments
from oocjax.transforms.analyse import flatten, to_program
from oocjax.transforms.segment import chain_function, chain_jaxpr, segment_functions

if __package__ in (None, ""):  # run as ``python benchmarks/plan_vs_trace.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from examples.models import Transformer, next_token_step


def gpt(layers: int) -> Transformer:
    """The GPT-2-style decoder this benchmark plans: small in width, long in layers."""
    return Transformer(vocab=256, width=64, heads=4, layers=layers, causal=True)


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()

    model, optimizer = gpt(args.layers), optax.adamw(1e-3)
    tokens = jnp.zeros((8, 65), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
    state = (params, jax.eval_shape(optimizer.init, params))

    trace_s, traced = best_of(args.repeats, lambda: jax.jit(next_token_step(model, optimizer)).trace(state, tokens))
    labels = [f"leaf {i}" for i in range(len(jax.tree.leaves(state)) + 1)]
    donated = [False] * len(labels)

    def analyse():
        flat = flatten(traced.jaxpr)
        return flat, to_program(flat, input_labels=labels, donated=donated)

    analyse_s, (flat, program) = best_of(args.repeats, analyse)
    budget = simulate(program, keep_all(program)).peak_bytes // 2
    planner_s, schedule = best_of(args.repeats, lambda: plan_window(program, budget, min_offload_bytes=64 * 1024))
    segment_s, segments = best_of(
        args.repeats, lambda: cut_segments(program, schedule, budget_bytes=budget, min_segment_flops=4 * 10**11)
    )

    def rewrite():
        functions = segment_functions(flat, segments)
        kinds = ["pinned_host" if b in schedule.host_inputs else "device" for b in range(flat.num_inputs)]
        return chain_jaxpr(chain_function(flat, schedule, segments, functions), flat, kinds)

    rewrite_s, _ = best_of(1, rewrite)
    plan_s = analyse_s + planner_s + segment_s
    print(
        f"GPT-2-style step, {args.layers} layers: {len(flat.equations)} equations after inlining, "
        f"{len(schedule.moves)} moves at half the in-core estimate"
    )
    print(f"trace   {trace_s:7.3f} s")
    print(
        f"plan    {plan_s:7.3f} s  (analyse {analyse_s:.3f} s + planner {planner_s:.3f} s + "
        f"segments {segment_s:.3f} s: {len(segments)})"
    )
    print(f"rewrite {rewrite_s:7.3f} s  (tracing the chain of segments; replaces jax.jit's own trace)")
    print(f"plan / trace = {plan_s / trace_s:.2f}  (target: at most 1)")
    if args.out:
        record = dict(
            benchmark="plan_vs_trace",
            layers=args.layers,
            equations=len(flat.equations),
            moves=len(schedule.moves),
            trace_s=trace_s,
            analyse_s=analyse_s,
            planner_s=planner_s,
            segment_s=segment_s,
            segments=len(segments),
            rewrite_s=rewrite_s,
            ratio=plan_s / trace_s,
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
