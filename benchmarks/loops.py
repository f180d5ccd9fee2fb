"""Loops and remat on the CPU: how low a budget each way of writing the same decoder can go, how the
floor of a scanned model moves with depth, and what a scanned step costs to compile.

One small Flax decoder (width 64, 4 heads, batch 16, sequence 64, AdamW), its layers written four
ways: a Python loop of blocks, a loop of ``nn.remat`` blocks, ``nn.scan`` over a block and
``nn.scan(nn.remat(block))``. For each, at 8 layers:

- ``floor``: the smallest feasible budget (the planner's ``required_bytes``) as a share of the
  in-core estimate;
- ``at 35%``: planned, compiled and run for one step at 35% of the in-core estimate, its executed
  peak (from the compiled segments) against the budget.

Then the ``nn.scan(nn.remat)`` decoder at 6, 12 and 24 layers: its smallest feasible budget; and at
24 layers, the time to the first compiled step: ``ooc_jit(...).plan`` at 35% (trace, plan, compile
every distinct segment) against ``jax.jit(step).lower(...).compile()``. Best of ``--repeats``.

    python benchmarks/loops.py [--out benchmarks/results/loops-cpu-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import optax

if __package__ in (None, ""):  # run as ``python benchmarks/loops.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from examples.models import Transformer, next_token_step
from oocjax import ooc_jit
from oocjax.schedule import required_bytes
from oocjax.testing import trace_step

STYLES = ("loop", "remat loop", "scan", "scan(remat)")


def workload(layers: int, style: str):
    model = Transformer(
        vocab=64,
        width=64,
        heads=4,
        layers=layers,
        causal=True,
        attention_bias=False,
        position_embedding=False,
        final_norm=False,
        scan=style.startswith("scan"),
        remat="remat" in style,
    )
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 64)
    params = model.init(jax.random.key(0), tokens[:, :-1])
    return next_token_step(model, optimizer), (params, optimizer.init(params)), tokens


def floor(step, state, tokens) -> tuple[int, int]:
    """(smallest feasible budget, in-core estimate), moving values of 4 KiB and up."""
    program = trace_step(step, state, tokens, donate_argnums=(0,)).program
    in_core = ooc_jit(step, budget=2**62).plan(state, tokens).baseline_peak_bytes
    return max(required_bytes(program, 4096)), in_core


def styles_at(layers: int) -> list[dict]:
    rows = []
    for style in STYLES:
        step, state, tokens = workload(layers, style)
        smallest, in_core = floor(step, state, tokens)
        budget = int(in_core * 0.35)
        row = dict(style=style, layers=layers, in_core_bytes=in_core, floor_bytes=smallest, floor=smallest / in_core)
        try:
            ooc = ooc_jit(step, budget=budget, donate_argnums=(0,), min_offload_bytes=4096)
            plan = ooc.plan(state, tokens)
            jax.block_until_ready(ooc(jax.tree.map(lambda x: x.copy(), state), tokens))
            row |= dict(budget_35_bytes=budget, executed_peak_bytes=plan.executed_peak_bytes, runs_at_35=True)
        except Exception as error:  # recorded: a style that cannot go that low is a result
            row |= dict(budget_35_bytes=budget, runs_at_35=False, error=f"{type(error).__name__}: {error}"[:300])
        rows.append(row)
        print(
            f"{style:<12} {layers} layers: floor {row['floor']:.0%} of in-core ({smallest / 2**20:.2f} of "
            f"{in_core / 2**20:.2f} MiB); at 35%: "
            + (f"runs, executed peak {row['executed_peak_bytes'] / 2**20:.2f} MiB" if row["runs_at_35"] else "refused")
        )
    return rows


def compile_times(layers: int, repeats: int) -> dict:
    step, state, tokens = workload(layers, "scan(remat)")
    in_core = ooc_jit(step, budget=2**62).plan(state, tokens).baseline_peak_bytes
    jit_s = ooc_s = float("inf")
    for _ in range(repeats):
        jax.clear_caches()
        started = time.perf_counter()
        jax.jit(step, donate_argnums=(0,)).lower(state, tokens).compile()
        jit_s = min(jit_s, time.perf_counter() - started)
        jax.clear_caches()
        started = time.perf_counter()
        plan = ooc_jit(step, budget=int(in_core * 0.35), donate_argnums=(0,), min_offload_bytes=4096).plan(
            state, tokens
        )
        ooc_s = min(ooc_s, time.perf_counter() - started)
    calls = [e.params["jaxpr"] for e in plan.jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    distinct = len({str(c.jaxpr) for c in calls})
    print(
        f"compile, scan(remat) {layers} layers: jax.jit {jit_s:.2f} s, ooc_jit at 35% {ooc_s:.2f} s "
        f"({ooc_s / jit_s:.2f}x; {len(calls)} segments, {distinct} distinct programs)"
    )
    return dict(
        layers=layers, jax_jit_s=jit_s, ooc_jit_s=ooc_s, ratio=ooc_s / jit_s, segments=len(calls), distinct=distinct
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    record = dict(benchmark="loops", styles=styles_at(8), depth=[], **machine())
    for layers in (6, 12, 24):
        step, state, tokens = workload(layers, "scan(remat)")
        smallest, in_core = floor(step, state, tokens)
        record["depth"].append(dict(layers=layers, floor_bytes=smallest, in_core_bytes=in_core))
        print(f"scan(remat) {layers:>2} layers: floor {smallest / 2**20:.2f} MiB, {smallest / in_core:.0%} of in-core")
    record["compile"] = compile_times(24, args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
