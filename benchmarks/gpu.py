"""The GPU truth harness: what XLA really compiles and runs, per model, budget and strategy.

Each configuration runs in a fresh process with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so that
the runtime peak is its own. Strategies: ``jax_jit`` (in-core), ``ooc_jit`` at fractions of the
in-core estimate, and JAX's own baselines: ``jax.checkpoint`` with ``nothing_saveable`` (recompute
everything) and with ``offload_dot_with_no_batch_dims`` (offload matmul outputs). Per
configuration: the compiled ``memory_analysis()`` (peak, host temp), the runtime
``peak_bytes_in_use``, steps per second, whether ``copy-start``/``copy-done`` on memory space
``S(5)`` appear in the scheduled HLO and where, the plan's figures, and the XLA flags. A link probe
measures host<->device bandwidth with pinned host memory, both directions.

    python benchmarks/gpu.py                      # on a GPU: GPU-sized models, results JSON
    python benchmarks/gpu.py --dry-run            # anywhere: CPU-sized models; plans, lowers for
                                                  # cuda, checks the program structure, runs the harness

The dry run (used in CI) checks the harness itself; its timings and memory figures are the CPU's
and mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("jax_jit", "ooc_jit", "remat_nothing_saveable", "remat_offload_dots")


def run_configuration(config: dict) -> dict:
    """One configuration, in this (fresh) process."""
    import jax

    from oocjax import ooc_jit

    try:
        from benchmarks import models
    except ImportError:
        import models

    suite = {w.name: w for w in (models.cpu_suite() if config["dry_run"] else models.gpu_suite())}
    workload = suite[config["model"]]
    state, batch = workload.materialise()
    strategy, record = config["strategy"], dict(config)
    if strategy == "ooc_jit":
        in_core = ooc_jit(workload.step, budget=2**62).plan(state, batch).baseline_peak_bytes
        # CPU-sized models have no tensor of a megabyte: let small ones move in the dry run.
        small = {"min_offload_bytes": 16 * 1024} if config["dry_run"] else {}
        step = ooc_jit(
            workload.step,
            budget=int(in_core * config["fraction"]),
            donate_argnums=(0,),
            check_compiled_peak=not config["dry_run"],
            **small,
        )
        plan = step.plan(state, batch)
        record |= dict(
            budget_bytes=plan.budget_bytes,
            planned_peak_bytes=plan.peak_bytes,
            in_core_estimate_bytes=plan.baseline_peak_bytes,
            offloads=len(plan.offloads),
            host_inputs=len(plan.host_inputs),
            planned_for_bytes=plan.schedule.budget_bytes,
            compiled_peak_checked_bytes=plan.compiled_peak_bytes,
        )
        cuda = step.lower(state, batch, lowering_platforms=("cuda",)).as_text()
        compiled = step.lower(state, batch).compile()
        expected_host = len(plan.offloads) + len(plan.host_outputs)
        record["cuda_structure_ok"] = cuda.count('_xla_buffer_placement = "pinned_host"') == expected_host
    else:
        policy = {
            "jax_jit": None,
            "remat_nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "remat_offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
        }[strategy]
        step = jax.jit(workload.make_step(policy), donate_argnums=(0,))
        cuda = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
        compiled = step.lower(state, batch).compile()
    record["cuda_pinned_host_annotations"] = cuda.count('_xla_buffer_placement = "pinned_host"')

    stats = compiled.memory_analysis()
    record["compiled"] = {
        field: getattr(stats, field, None)
        for field in (
            "peak_memory_in_bytes",
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "host_temp_size_in_bytes",
        )
    }
    record["scheduled_copies"] = copy_placement(compiled.as_text())

    device = jax.devices()[0]
    record["device"] = device.device_kind
    state, loss = step(state, batch)  # compile and warm up
    jax.block_until_ready(loss)
    started, steps = time.perf_counter(), config["steps"]
    for _ in range(steps):
        state, loss = step(state, batch)
    jax.block_until_ready(loss)
    record["steps_per_s"] = steps / (time.perf_counter() - started)
    record["loss"] = float(loss)
    memory = device.memory_stats()
    record["runtime_peak_bytes"] = memory.get("peak_bytes_in_use") if memory else None
    return record


def copy_placement(hlo: str) -> dict:
    """Where XLA's scheduler put the host copies: positions in the entry computation's schedule
    (0 = first instruction, 1 = last) and how far each copy-start is from its copy-done."""
    entry = hlo[hlo.find("ENTRY") :] if "ENTRY" in hlo else hlo
    lines = [line for line in entry.splitlines() if "=" in line]
    starts = {m.group(1): i for i, line in enumerate(lines) if (m := re.search(r"%?([\w.-]+) = .*copy-start", line))}
    spans = []
    for i, line in enumerate(lines):
        if "copy-done" in line:
            source = re.search(r"copy-done\(.*?%?([\w.-]+)\)", line)
            if source and source.group(1) in starts:
                spans.append((starts[source.group(1)], i))
    total = max(len(lines) - 1, 1)
    return dict(
        copy_start=sum("copy-start" in line for line in lines),
        copy_done=sum("copy-done" in line for line in lines),
        host_memory_space=hlo.count("S(5)"),
        start_positions=[round(s / total, 4) for s, _ in spans],
        start_to_done=[d - s for s, d in spans],
    )


def link_probe(megabytes: int = 256, repeats: int = 5) -> dict:
    """Host<->device bandwidth of device_put inside jit, pinned host memory, per direction."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    to_host = jax.jit(lambda a: a, out_shardings=host)
    to_device = jax.jit(lambda a: a, in_shardings=host, out_shardings=on_device)
    h = jax.block_until_ready(to_host(x))
    jax.block_until_ready(to_device(h))
    result = {}
    for name, fn, arg in (("d2h_GB_per_s", to_host, x), ("h2d_GB_per_s", to_device, h)):
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(fn(arg))
            best = min(best, time.perf_counter() - started)
        result[name] = x.nbytes / best / 1e9
    return dict(bytes=x.nbytes, device=device.device_kind, **result)


def in_fresh_process(payload: dict, dump_dir: str | None, timeout_s: int) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if dump_dir:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text".strip()
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(payload)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        return dict(payload, error=done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["xla_flags"] = env.get("XLA_FLAGS", "")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU-sized models; checks the harness, not a GPU")
    parser.add_argument("--models", help="comma-separated name prefixes (default: the whole suite)")
    parser.add_argument("--fractions", default="0.75,0.5,0.35", help="ooc_jit budgets, of the in-core estimate")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per configuration")
    parser.add_argument("--out", help="default on a GPU: benchmarks/results/gpu-<device>-<date>.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        payload = json.loads(args.child)
        print(
            json.dumps(
                link_probe(64 if payload.get("dry_run") else 1024)
                if payload.get("probe")
                else run_configuration(payload)
            )
        )
        return

    try:
        from benchmarks import models
        from benchmarks._machine import machine
    except ImportError:
        import models
        from _machine import machine
    suite = models.cpu_suite() if args.dry_run else models.gpu_suite()
    if args.models:
        prefixes = args.models.split(",")
        suite = [w for w in suite if any(w.name.startswith(p) for p in prefixes)]
    configs = []
    for workload in suite:
        for strategy in args.strategies.split(","):
            fractions = [float(f) for f in args.fractions.split(",")] if strategy == "ooc_jit" else [None]
            configs += [
                dict(model=workload.name, strategy=strategy, fraction=f, steps=args.steps, dry_run=args.dry_run)
                for f in fractions
            ]

    results = [in_fresh_process(dict(probe=True, dry_run=args.dry_run), None, args.timeout)]
    print(f"link: {results[0]}")
    with tempfile.TemporaryDirectory() as dumps:
        for i, config in enumerate(configs):
            dump = None if args.dry_run else os.path.join(dumps, str(i))
            result = in_fresh_process(config, dump, args.timeout)
            results.append(result)
            status = result.get("error", "").splitlines()[-1:] or [f"{result.get('steps_per_s', 0):.2f} steps/s"]
            print(f"{config['model']:<28} {config['strategy']:<24} {config['fraction'] or '':<5} {status[0]}")
    failed = [r for r in results if "error" in r]
    record = dict(benchmark="gpu", dry_run=args.dry_run, **machine(), results=results)
    out = args.out
    if out is None and not args.dry_run:
        device = re.sub(r"[^a-z0-9]+", "-", results[0].get("device", "unknown").lower()).strip("-")
        out = f"benchmarks/results/gpu-{device}-{datetime.date.today().isoformat()}.json"
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
    if failed:
        raise SystemExit(f"{len(failed)} configurations failed")
    if args.dry_run:
        bad = [r for r in results if r.get("strategy") == "ooc_jit" and not r.get("cuda_structure_ok")]
        if bad:
            raise SystemExit(f"the cuda lowering of {len(bad)} ooc_jit configurations lacks its planned transfers")
        print("dry run passed: every configuration planned, lowered for cuda, compiled and ran")


if __name__ == "__main__":
    main()
