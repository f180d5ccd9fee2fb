"""The first call of a step: trace, plan, compile and run, ``ooc_jit`` against ``jax.jit``, on the CPU.

For each training step of the test zoo (``tests/zoo.py``: an MLP in float32 and bfloat16, a CNN
with batch norm, a small transformer), the wall time of the first call, caches cleared before
each: ``jax.jit(step)(state, batch)`` and ``ooc_jit(step, budget=...)(state, batch)`` at 60% and
35% of the in-core estimate (``min_offload_bytes=4096``, as the tests use), each blocked on. The
target is at most 1.5x ``jax.jit``. Best of ``--repeats``.

    python benchmarks/first_call.py [--out benchmarks/results/first_call-cpu-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from oocjax import ooc_jit

if __package__ in (None, ""):  # run as ``python benchmarks/first_call.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from tests.zoo import all_cases

FRACTIONS = (0.6, 0.35)


def first_call_s(make_step, state, batch, repeats: int) -> tuple[float, object]:
    best, step = float("inf"), None
    for _ in range(repeats):
        jax.clear_caches()
        state_copy = jax.tree.map(lambda x: x.copy(), state)
        started = time.perf_counter()
        step = make_step()
        jax.block_until_ready(step(state_copy, batch))
        best = min(best, time.perf_counter() - started)
    return best, step


def measure(case, repeats: int) -> list[dict]:
    donate = (0,) if case.donate else ()
    batch = case.batches[0]
    in_core = ooc_jit(case.step, budget=2**62).plan(case.state, batch).baseline_peak_bytes
    jit_s, _ = first_call_s(lambda: jax.jit(case.step, donate_argnums=donate), case.state, batch, repeats)
    rows = []
    for fraction in FRACTIONS:
        budget = int(in_core * fraction)

        def make(budget=budget):
            return ooc_jit(case.step, budget=budget, donate_argnums=donate, min_offload_bytes=4096)

        ooc_s, step = first_call_s(make, case.state, batch, repeats)
        segments = len(step.plan(case.state, batch).segments)
        rows.append(dict(model=case.name, fraction=fraction, jit_s=jit_s, ooc_s=ooc_s, segments=segments))
        rows[-1]["ratio"] = ooc_s / jit_s
        print(f"{case.name:<28} {fraction:>4}: jax.jit {jit_s:.2f} s, ooc_jit {ooc_s:.2f} s ", end="")
        print(f"({ooc_s / jit_s:.2f}x, {segments} segments)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = [row for case in all_cases() for row in measure(case, args.repeats)]
    if args.out:
        record = dict(benchmark="first_call", repeats=args.repeats, rows=rows, jax=jax.__version__, **machine())
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
