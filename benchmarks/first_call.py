"""The first call of a step: trace, plan, cut, compile and run, ``ooc_jit`` against ``jax.jit``, on the CPU.

The test zoo's transformer (``tests/zoo.py``) at 4, 12 and 24 layers, at 30% of its in-core
estimate, donated state, ``min_offload_bytes=4096`` as the tests use. Per depth:

* **First process.** Caches cleared, fresh wrappers: the wall time of
  ``jax.jit(step)(state, batch)`` and of ``ooc_jit(step, budget=...)(state, batch)``, each blocked
  on, everything included. Best of ``--repeats``. Target: at most 1.5x, and the distinct compiled
  programs growing by at most a small constant from 12 to 24 layers; segments per layer (forward
  and backward) at most 6.
* **Second process** (``--second-process``). With JAX's persistent cache directory set
  (``jax_compilation_cache_dir``, ``jax_persistent_cache_min_compile_time_secs=0``), a process
  makes the first call and a new one makes it again: the new one's first call, ``ooc_jit``
  against ``jax.jit`` (each with a cache of its own). Target: at most 1.2x.

    python benchmarks/first_call.py [--out benchmarks/results/first_call-cpu-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from oocjax import ooc_jit

if __package__ in (None, ""):  # run as ``python benchmarks/first_call.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from tests.zoo import transformer_dropout_adamw

ROOT = Path(__file__).resolve().parent.parent

DEPTHS = (4, 12, 24)
FRACTION = 0.3


def in_core_bytes(layers: int) -> int:
    case = transformer_dropout_adamw(layers)
    return ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes


def first_call_s(layers: int, wrapper: str, budget: int) -> tuple[float, object]:
    """One first call in this process, caches cleared; the wrapped step."""
    case = transformer_dropout_adamw(layers)
    state, batch = jax.tree.map(lambda x: x.copy(), case.state), case.batches[0]
    jax.block_until_ready(state)
    jax.clear_caches()
    started = time.perf_counter()
    if wrapper == "jit":
        step = jax.jit(case.step, donate_argnums=0)
    else:
        step = ooc_jit(case.step, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    jax.block_until_ready(step(state, batch))
    return time.perf_counter() - started, step


def first_process(layers: int, repeats: int) -> dict:
    budget = int(in_core_bytes(layers) * FRACTION)
    jit_s = min(first_call_s(layers, "jit", budget)[0] for _ in range(repeats))
    runs = [first_call_s(layers, "ooc", budget) for _ in range(repeats)]
    ooc_s, step = min(runs, key=lambda run: run[0])
    case = transformer_dropout_adamw(layers)
    plan = step.plan(case.state, case.batches[0])
    (planner,) = step._planners.values()
    distinct = len({id(p) for p in planner.built.programs})
    row = dict(
        layers=layers,
        fraction=FRACTION,
        jit_s=jit_s,
        ooc_s=ooc_s,
        ratio=ooc_s / jit_s,
        segments=len(plan.segments),
        segments_per_layer=len(plan.segments) / layers,
        distinct_programs=distinct,
        moved_bytes=sum(plan.program.buffers[m.buffer].nbytes for m in plan.schedule.moves),
        recomputed=len(plan.recomputed),
    )
    print(
        f"{layers:2d} layers: jax.jit {jit_s:.2f} s, ooc_jit {ooc_s:.2f} s ({row['ratio']:.2f}x); "
        f"{row['segments']} segments ({row['segments_per_layer']:.1f} per layer), {distinct} distinct programs"
    )
    return row


# Run in a fresh interpreter: the first call of a step, with JAX's persistent cache in ``argv[3]``.
CHILD = """
import sys, time, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from benchmarks.first_call import first_call_s
print(first_call_s(int(sys.argv[1]), sys.argv[2], int(sys.argv[4]))[0])
"""


def second_process(layers: int, repeats: int) -> dict:
    budget = int(in_core_bytes(layers) * FRACTION)
    seconds = {}
    for wrapper in ("jit", "ooc"):
        with tempfile.TemporaryDirectory() as cache:
            argv = [sys.executable, "-c", CHILD, str(layers), wrapper, cache, str(budget)]
            runs = [float(subprocess.check_output(argv, cwd=ROOT, text=True)) for _ in range(1 + repeats)]
        seconds[wrapper] = (runs[0], min(runs[1:]))
    row = dict(
        layers=layers,
        jit_first_process_s=seconds["jit"][0],
        jit_second_process_s=seconds["jit"][1],
        ooc_first_process_s=seconds["ooc"][0],
        ooc_second_process_s=seconds["ooc"][1],
        ratio=seconds["ooc"][1] / seconds["jit"][1],
    )
    print(
        f"{layers:2d} layers, second process with the persistent cache: jax.jit {seconds['jit'][1]:.2f} s, "
        f"ooc_jit {seconds['ooc'][1]:.2f} s ({row['ratio']:.2f}x; first processes {seconds['jit'][0]:.2f} s, "
        f"{seconds['ooc'][0]:.2f} s)"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--second-process", default="4,24", help="depths to measure in second processes")
    parser.add_argument("--out")
    args = parser.parse_args()
    depths = [int(d) for d in args.layers.split(",") if d]
    rows = [first_process(layers, args.repeats) for layers in depths]
    second = [second_process(int(d), args.repeats) for d in args.second_process.split(",") if d]
    if args.out:
        record = dict(
            benchmark="first_call", repeats=args.repeats, rows=rows, second_process=second, jax=jax.__version__
        )
        Path(args.out).write_text(json.dumps(record | machine(), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
