"""The first call of a step: trace, plan, cut, compile and run, ``ooc_jit`` against ``jax.jit``, on the CPU.

The test zoo's transformer (``tests/support/zoo.py``) at 4, 12 and 24 layers, at 30% of its in-core
estimate (``--fractions``: others too), donated state, ``min_offload_bytes=4096`` as the tests use;
and (``--ways``) one GPT-style
decoder written four ways (``examples/decoders.py``: Flax auto names, explicit numeric names under a
parent, NNX with a list of blocks, a plain function over a list of weight dicts), the same way.
Per model and depth:

* **First process.** Caches cleared (the device rates ``ooc_jit`` measures once per process
  too), fresh wrappers: the wall time of
  ``jax.jit(step)(state, batch)`` and of ``ooc_jit(step, budget=...)(state, batch)``, each blocked
  on, everything included. Best of ``--repeats``, the two taken in turns. Besides the ratio: the
  distinct compiled programs, segments per layer, the plans made during the first call (more
  than one where compiled segments measured over the budget), the chain's executed peak against
  the budget, and whether the first call's results are ``jax.jit``'s (``RTOL``, ``ATOL``: the
  tests' tolerances for the decoders).
* **Second process** (``--second-process``). With JAX's persistent cache directory set
  (``jax_compilation_cache_dir``, ``jax_persistent_cache_min_compile_time_secs=0``), a process
  makes the first call and a new one makes it again: the new one's first call, ``ooc_jit``
  against ``jax.jit`` (each with a cache of its own). Target: at most 1.2x.

Beside the wall time, each first call records the CPU time the process spent in it and JAX's
backend compiles (``/jax/core/compile/backend_compile_duration`` events: how many, and their
durations summed, which overlap where programs compile in parallel threads): XLA:CPU compiles on
every core, so on this 2-core machine the CPU time says how much compiling work a wrapper does.

    python benchmarks/first_call.py [--out benchmarks/results/first_call-cpu-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from oocjax import ooc_jit

if __package__ in (None, ""):  # run as ``python benchmarks/first_call.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from examples.decoders import WAYS, decoder_case
from tests.support.zoo import transformer_dropout_adamw

ROOT = Path(__file__).resolve().parent.parent

DEPTHS = (4, 12, 24)
FRACTION = 0.3
RTOL, ATOL = 1e-5, 3e-4


def make_case(model: str, layers: int) -> tuple:
    """``(step, state, batch)``: ``"zoo"`` for the test zoo's transformer, else a way of ``WAYS``."""
    if model == "zoo":
        case = transformer_dropout_adamw(layers)
        return case.step, case.state, case.batches[0]
    return decoder_case(model, layers)


def in_core_bytes(layers: int, model: str = "zoo") -> int:
    step, state, batch = make_case(model, layers)
    return ooc_jit(step, budget=2**62).plan(state, batch).baseline_peak_bytes


@dataclass(frozen=True, slots=True)
class FirstCall:
    seconds: float  # wall time
    cpu_seconds: float  # this process's CPU time, every thread's
    compiles: int  # XLA backend compiles
    compile_seconds: float  # their durations, summed (they overlap where compiled in threads)
    step: object  # the wrapped step
    results: object  # what the first call returned


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def first_call(layers: int, wrapper: str, budget: int, model: str = "zoo") -> FirstCall:
    """One first call in this process, caches cleared."""
    step_fn, state, batch = make_case(model, layers)
    state = jax.tree.map(lambda x: x.copy(), state)
    jax.block_until_ready(state)
    jax.clear_caches()
    compiles: list[float] = []

    def count(event: str, seconds: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        started, cpu = time.perf_counter(), time.process_time()
        if wrapper == "jit":
            step = jax.jit(step_fn, donate_argnums=0)
        else:
            step = ooc_jit(step_fn, budget=budget, donate_argnums=0, min_offload_bytes=4096)
        results = jax.block_until_ready(step(state, batch))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return FirstCall(seconds, cpu, len(compiles), sum(compiles), step, results)


def same_results(got, expected) -> bool:
    """Whether ``got`` is ``expected`` within ``RTOL`` and ``ATOL`` (random keys bit for bit)."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True)
    unkeyed = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    return all(np.allclose(unkeyed(a), unkeyed(b), rtol=RTOL, atol=ATOL) for a, b in pairs)


def first_process(model: str, layers: int, repeats: int, fraction: float = FRACTION) -> dict:
    budget = int(in_core_bytes(layers, model) * fraction)
    # Taken in turns, so that a slower stretch of a shared machine falls on both wrappers.
    turns = [tuple(first_call(layers, wrapper, budget, model) for wrapper in ("jit", "ooc")) for _ in range(repeats)]
    jit, ooc = (min(runs, key=lambda run: run.seconds) for runs in zip(*turns, strict=True))
    jit_s, ooc_s = jit.seconds, ooc.seconds
    _, state, batch = make_case(model, layers)
    plan = ooc.step.plan(state, batch)
    (planner,) = ooc.step._planners.values()
    distinct = len({id(p) for p in planner.built.programs})
    row = dict(
        model=model,
        layers=layers,
        fraction=fraction,
        jit_s=jit_s,
        ooc_s=ooc_s,
        ratio=ooc_s / jit_s,
        segments=len(plan.segments),
        segments_per_layer=len(plan.segments) / layers,
        distinct_programs=distinct,
        moved_bytes=sum(plan.program.buffers[m.buffer].nbytes for m in plan.schedule.moves),
        recomputed=len(plan.recomputed),
        plans=len(plan.attempts),
        executed_peak_bytes=plan.executed_peak_bytes,
        budget_bytes=budget,
        results_as_jax_jit=same_results(ooc.results, jit.results),
        layer_policy=list(plan.layer_policy),
        jit_cpu_s=jit.cpu_seconds,
        ooc_cpu_s=ooc.cpu_seconds,
        jit_compiles=jit.compiles,
        ooc_compiles=ooc.compiles,
        jit_compile_s=jit.compile_seconds,
        ooc_compile_s=ooc.compile_seconds,
    )
    print(
        f"{model} {layers:2d} layers at {fraction:.0%}: jax.jit {jit_s:.2f} s, ooc_jit {ooc_s:.2f} s "
        f"({row['ratio']:.2f}x); "
        f"{row['segments']} segments ({row['segments_per_layer']:.1f} per layer), {distinct} distinct programs, "
        f"{row['plans']} plans, peak {row['executed_peak_bytes'] or 0:,} of {budget:,} bytes, results as jax.jit's: "
        f"{row['results_as_jax_jit']}; "
        f"CPU time {jit.cpu_seconds:.2f} s against {ooc.cpu_seconds:.2f} s, backend compiles "
        f"{jit.compiles} ({jit.compile_seconds:.2f} s) against {ooc.compiles} ({ooc.compile_seconds:.2f} s summed)"
    )
    return row


# Run in a fresh interpreter: the first call of a step, with JAX's persistent cache in ``argv[3]``.
CHILD = """
import sys, time, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from benchmarks.first_call import first_call
print(first_call(int(sys.argv[1]), sys.argv[2], int(sys.argv[4])).seconds)
"""


def second_process(layers: int, repeats: int) -> dict:
    budget = int(in_core_bytes(layers) * FRACTION)
    seconds = {}
    for wrapper in ("jit", "ooc"):
        with tempfile.TemporaryDirectory() as cache:
            argv = [sys.executable, "-c", CHILD, str(layers), wrapper, cache, str(budget)]
            runs = [
                float(subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, check=True).stdout)
                for _ in range(1 + repeats)
            ]
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
    parser.add_argument("--ways", default="", help=f"decoders to measure too, of {','.join(WAYS)} (or 'all')")
    parser.add_argument("--fractions", default=str(FRACTION), help="budgets, as fractions of the in-core estimate")
    parser.add_argument("--out")
    args = parser.parse_args()
    depths = [int(d) for d in args.layers.split(",") if d]
    ways = WAYS if args.ways == "all" else [w for w in args.ways.split(",") if w]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = [
        first_process(model, layers, args.repeats, fraction)
        for model in ["zoo", *ways]
        for layers in depths
        for fraction in fractions
    ]
    second, failures = [], []
    for depth in [int(d) for d in args.second_process.split(",") if d]:
        try:
            second.append(second_process(depth, args.repeats))
        except subprocess.CalledProcessError as error:  # kept, not lost with the first processes' figures
            named = [line for line in (error.stderr or "").splitlines() if "Error" in line]  # not the notes after
            failures.append(dict(layers=depth, error="\n".join(named[-3:])[-2000:] or str(error)))
            print(f"{depth:2d} layers, second process failed: {failures[-1]['error']}")
    if args.out:
        record = dict(
            benchmark="first_call", repeats=args.repeats, rows=rows, second_process=second, jax=jax.__version__
        )
        record |= dict(second_process_failures=failures) if failures else {}
        Path(args.out).write_text(json.dumps(record | machine(), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
