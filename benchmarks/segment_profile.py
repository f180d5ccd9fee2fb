"""Where an ``ooc_jit`` step's time goes, segment by segment, against ``jax.jit``: the GPU GPT of ``gpu_check.py``.

One process, no memory cap (a plan depends on its budget, not on the allocator's limit), the GPT of
``gpu_check.py`` under ``ooc_jit`` at ``--budget-bytes`` (default: the budget of the H200 check).
Medians over ``--steps`` steps, each blocked on:

* ``jax.jit``'s step;
* ``ooc_jit``'s step: the executor with its transfers, waits, account and allocator gate; again
  with the gate off (``DeviceAccess(allocator_gate=False)``); and with no waits for work in flight either (the
  budget is then not held: this measures what draining the queue before a launch costs);
* its segment programs back to back (``executor_overhead.back_to_back``: no executor);
* each segment program alone, on the inputs the step gave it: its time, work, recomputed steps,
  and the rate it reached;
* the executor's host waits per step and the seconds they blocked, and the time from the call to
  its first launch;
* every block in ``nn.remat(nothing_saveable)``: its step and its peak (its compiled program's
  arguments, outputs and scratch), and ``ooc_jit`` at that peak and at 90% and 80% of it.

``--trace-dir`` writes a profiler trace of one step each of ``jax.jit``, remat and ``ooc_jit`` at
remat's peak; ``--ab`` reruns the main figures in a fresh process per ``AB_VARIANTS`` entry (XLA's
command buffers off; the ``cuda_async`` allocator). ``jax.jit`` under a memory cap (XLA's own
remat, or its host offloading) is ``gpu_check.py``'s ``jax_jit_capped`` configuration.

Where the step is slower than back to back, the executor costs the difference; where back to back
is slower than ``jax.jit``, the programs do (the cuts between them and what they recompute).

    python benchmarks/segment_profile.py --ab --trace-dir /tmp/traces --out benchmarks/results/   # on a GPU
    python benchmarks/segment_profile.py --dry-run                   # anywhere, a CPU-tiny GPT: checks the script
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

if __package__ in (None, ""):  # run as ``python benchmarks/segment_profile.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.executor_overhead import back_to_back, median_seconds
from benchmarks.gpu_check import DRY_MODEL, GPU_MODEL, _slug, _versions, workload
from oocjax import BudgetInfeasibleError, ooc_jit
from oocjax.testing import DeviceAccess, observe_segments, with_seams

H200_BUDGET_BYTES = 8286266982  # gpu_check's budget on the H200: 0.8 of the allocator limit under a 0.069 fraction
# ooc_jit's budgets as shares of per-block remat's peak. A dry run keeps one at the peak (where the
# CPU-tiny GPT moves nothing) and one below it (segments): the code paths the three take.
REMAT_FRACTIONS = (1.0, 0.9, 0.8)
DRY_REMAT_FRACTIONS = (1.0, 0.8)


def profile(model: dict, budget_bytes: int | None, steps: int, dry_run: bool, trace_dir: str | None = None) -> dict:
    work = workload(model)
    state = jax.jit(work.init)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), work.batch.shape, 0, model["vocab"], work.batch.dtype)
    jitted = jax.jit(work.step)
    jit_s = median_seconds(lambda: jitted(state, batch), steps)
    print(f"jax.jit        {jit_s * 1e3:8.2f} ms/step", flush=True)
    # A dry run plans with the rates of the H200 the script is for (the CPU's choose other plans).
    options = {"rates": "h200"} if dry_run else {}
    if budget_bytes is None:  # a CPU has no memory to cap: half the in-core estimate, so that the tiny model moves
        budget_bytes = ooc_jit(work.step, budget=2**62).plan(state, batch).baseline_peak_bytes // 2
        options = dict(min_offload_bytes=16 * 1024)
    step = ooc_jit(work.step, budget=budget_bytes, donate_argnums=(0,), **options)
    plan = step.plan(state, batch)
    carried = [jax.tree.map(lambda x: x.copy(), state)]

    def one_step():
        carried[0], metrics = step(carried[0], batch)
        return metrics

    ooc_s = median_seconds(one_step, steps)

    def timed_with(access: DeviceAccess) -> float:
        other = with_seams(step, device_access=access)

        def other_step():
            carried[0], metrics = other(carried[0], batch)
            return metrics

        other_step()  # its first call plans and compiles: not timed
        return median_seconds(other_step, steps)

    ungated_s = timed_with(DeviceAccess(allocator_gate=False))
    # Also without the account's waits for work in flight: what draining the queue before a
    # launch costs. Memory is then not held to the budget: a measurement, not a way to run.
    unwaited_s = timed_with(DeviceAccess(allocator_gate=False, wait=lambda probe: None))
    plain = back_to_back(step, (state, batch))
    plain_s = median_seconds(plain, steps)
    print(f"ooc_jit        {ooc_s * 1e3:8.2f} ms/step ({ooc_s / jit_s:.2f}x jax.jit), gate off {ungated_s * 1e3:.2f}")
    print(f"  no waits     {unwaited_s * 1e3:8.2f} ms (the budget not held)")
    print(f"back to back   {plain_s * 1e3:8.2f} ms ({plain_s / jit_s:.2f}x jax.jit), {len(plan.segments)} segments")
    rows = segment_rows(plan, plain, steps)
    distinct = {r["program"] for r in rows}
    solo_sum = sum(r["solo_s"] for r in rows)
    print(f"segments alone {solo_sum * 1e3:8.2f} ms in all", flush=True)
    return dict(
        model=dict(model, name=work.name, dtype="float32", optimizer="adamw"),
        budget_bytes=budget_bytes,
        plan=repr(plan),
        step_flops=sum(step.flops for step in plan.program.steps) - plan.extra_flops,
        recompute_flops=plan.extra_flops,
        plan_segments=len(plan.segments),
        jit_s=jit_s,
        ooc_s=ooc_s,
        ooc_gate_off_s=ungated_s,
        ooc_no_waits_s=unwaited_s,
        back_to_back_s=plain_s,
        segments_alone_s=solo_sum,
        distinct_programs=len(distinct),
        segments=rows,
        dry_run=dry_run,
        **executor_costs(step, carried, batch, steps),
        **against_remat(model, work, state, batch, jit_s, steps, options, trace_dir, dry_run),
    )


def segment_rows(plan, plain, steps: int) -> list[dict]:
    """Each segment program of ``plan`` alone, on the inputs its back-to-back run (``plain``:
    ``executor_overhead.back_to_back``) gave it, median of ``steps``: its steps, which distinct
    program it is, its FLOPs, the values it recomputes, its seconds and the rate it reached."""
    slots = jax.block_until_ready(plain(keep=True))
    recomputed_at = [r.recomputed_at for r in plan.recomputed]
    distinct: dict[int, int] = {}
    rows = []
    for i, (segment, (program, inputs, literals)) in enumerate(zip(plan.segments, plain.calls, strict=True)):
        inputs = [*(slots[b] for b in inputs), *literals]
        seconds = median_seconds(lambda program=program, inputs=inputs: program(*inputs), steps)
        rows.append(
            dict(
                segment=i,
                steps=[segment.start, segment.stop],
                program=distinct.setdefault(id(program), len(distinct)),
                flops=segment.flops,
                bytes_accessed=sum(step.bytes_accessed for step in plan.program.steps[segment.start : segment.stop]),
                recomputed=sum(segment.start <= k < segment.stop for k in recomputed_at),
                solo_s=seconds,
                flops_per_s=segment.flops / seconds,
                first=f"{plan.program.steps[segment.start].name} at {plan.program.steps[segment.start].label}",
            )
        )
        row = rows[-1]
        print(
            f"segment {i:3d} steps {segment.start:5d}-{segment.stop:5d} {seconds * 1e3:8.3f} ms "
            f"{row['flops_per_s'] / 1e12:7.2f} TFLOP/s, {row['recomputed']:4d} recomputed, {row['first'][:60]}"
        )
    return rows


def compiled_peak_bytes(compiled) -> int:
    """A compiled program's device bytes: its arguments, outputs and scratch, less what outputs alias."""
    stats = compiled.memory_analysis()
    return (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )


def executor_costs(step, carried: list, batch, steps: int) -> dict:
    """Per step, medians: the executor's host waits on the device and the seconds they blocked,
    and the time from the call to its first launch (what the executor does before any work)."""
    (planner,) = step._planners.values()
    memory, waits, blocked, to_first = planner.built.executor.memory, [], [], []
    first: list[float] = []

    def seen(launch) -> None:
        if launch.segment == 0:
            first.append(time.perf_counter())

    with observe_segments(seen):
        for _ in range(steps):
            started = time.perf_counter()
            carried[0], metrics = step(carried[0], batch)
            to_first.append(first[-1] - started)
            waits.append(memory.waits)
            blocked.append(memory.blocked_s)
            jax.block_until_ready(metrics)
    row = dict(
        host_waits_per_step=statistics.median(waits),
        blocked_s_per_step=statistics.median(blocked),
        first_launch_s=statistics.median(to_first),
        argument_leaves=len(jax.tree.leaves(carried[0])) + len(jax.tree.leaves(batch)),
    )
    print(
        f"  host waits   {row['host_waits_per_step']:.0f} a step, blocked {row['blocked_s_per_step'] * 1e3:.2f} ms; "
        f"call to first launch {row['first_launch_s'] * 1e3:.3f} ms ({row['argument_leaves']} argument leaves)"
    )
    return row


def against_remat(
    model: dict, work, state, batch, jit_s: float, steps: int, options: dict, trace_dir, dry_run: bool = False
) -> dict:
    """Every block in ``nn.remat(nothing_saveable)``: its step time and peak (its compiled program's
    arguments, outputs and scratch); ``ooc_jit`` at that peak and at 90% and 80% of it
    (``REMAT_FRACTIONS``; a dry run's: ``DRY_REMAT_FRACTIONS``), fresh wrappers, state donated: step
    time, bytes moved, values recomputed. With ``trace_dir``, a profiler trace of one step of
    ``jax.jit``, remat and ``ooc_jit`` at remat's peak."""
    remat = workload(model, "remat_block_nothing_saveable")
    remat_jitted = jax.jit(remat.step)
    peak = compiled_peak_bytes(remat_jitted.lower(state, batch).compile())
    remat_s = median_seconds(lambda: remat_jitted(state, batch), steps)
    print(f"per-block remat {remat_s * 1e3:7.2f} ms/step ({remat_s / jit_s:.2f}x jax.jit), peak {peak / 2**30:.3f} GiB")
    rows = []
    for fraction in DRY_REMAT_FRACTIONS if dry_run else REMAT_FRACTIONS:
        step = ooc_jit(work.step, budget=int(fraction * peak), donate_argnums=(0,), **options)
        try:
            plan = step.plan(state, batch)
        except BudgetInfeasibleError as error:
            rows.append(dict(fraction=fraction, budget_bytes=int(fraction * peak), infeasible=str(error)))
            print(f"ooc_jit at {fraction:.0%} of remat's peak: infeasible")
            continue
        carried = [jax.tree.map(lambda x: x.copy(), state)]

        def one_step(step=step, carried=carried):
            carried[0], metrics = step(carried[0], batch)
            return metrics

        seconds = median_seconds(one_step, steps)
        rows.append(
            dict(
                fraction=fraction,
                budget_bytes=int(fraction * peak),
                s_per_step=seconds,
                vs_jit=seconds / jit_s,
                vs_remat=seconds / remat_s,
                moved_bytes=plan.moved_bytes,
                recomputed=len(plan.recomputed),
                segments=len(plan.segments),
            )
        )
        print(
            f"ooc_jit at {fraction:.0%} of remat's peak: {seconds * 1e3:.2f} ms ({seconds / remat_s:.2f}x remat, "
            f"{seconds / jit_s:.2f}x jax.jit), moves {plan.moved_bytes / 2**20:.1f} MiB, "
            f"recomputes {len(plan.recomputed)}"
        )
        if trace_dir and fraction == 1.0:
            runs = dict(jax_jit=functools.partial(jax.jit(work.step), state, batch), ooc_jit=one_step)
            runs["remat"] = functools.partial(remat_jitted, state, batch)
            for name, run in runs.items():
                with jax.profiler.trace(str(Path(trace_dir) / name)):
                    jax.block_until_ready(run())
    return dict(remat_s=remat_s, remat_peak_bytes=peak, at_remat_peak=rows)


# Each variant runs in a process of its own: XLA reads these when the backend starts.
AB_VARIANTS = {
    "command_buffers_off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "cuda_async_allocator": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
}
AB_KEYS = ("jit_s", "ooc_s", "back_to_back_s", "remat_s", "first_launch_s", "host_waits_per_step", "blocked_s_per_step")


def variant(name: str, argv: list[str]) -> dict:
    """The profile's main figures run again in a fresh process under variant ``name``'s environment."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "variant.json"
        env = os.environ | AB_VARIANTS[name]
        if "XLA_FLAGS" in os.environ and "XLA_FLAGS" in AB_VARIANTS[name]:
            env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {AB_VARIANTS[name]['XLA_FLAGS']}"
        done = subprocess.run([sys.executable, __file__, *argv, "--out", str(out)], env=env, timeout=1200)
        if done.returncode:
            return dict(env=AB_VARIANTS[name], failed=done.returncode)
        record = json.loads(out.read_text())
    return dict(env=AB_VARIANTS[name], **{k: record[k] for k in AB_KEYS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a CPU-tiny GPT, half its in-core estimate")
    parser.add_argument("--budget-bytes", type=int, default=H200_BUDGET_BYTES)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--trace-dir", help="write a profiler trace of one step each of jax.jit, remat and ooc_jit")
    parser.add_argument(
        "--ab", action="store_true", help="also rerun in a process per variant: " + ", ".join(AB_VARIANTS)
    )
    parser.add_argument("--out", help="a JSON file, or a folder for segment_profile-<device>-<date>.json")
    args = parser.parse_args()
    model = DRY_MODEL if args.dry_run else GPU_MODEL
    steps = args.steps or (3 if args.dry_run else 20)
    record = profile(model, None if args.dry_run else args.budget_bytes, steps, args.dry_run, args.trace_dir)
    record = dict(benchmark="segment_profile", steps=steps, versions=_versions(), **record, **machine())
    record["device"] = jax.devices()[0].device_kind
    record["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    if args.ab:
        argv = [
            *(["--dry-run"] if args.dry_run else []),
            "--budget-bytes",
            str(args.budget_bytes),
            "--steps",
            str(steps),
        ]
        record["ab"] = {name: variant(name, argv) for name in AB_VARIANTS}
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            out = out / f"segment_profile-{_slug(record['device'])}-{record['date']}.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
