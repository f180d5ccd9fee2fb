"""Where an ``ooc_jit`` step's time goes, segment by segment, against ``jax.jit``: the GPU GPT of ``gpu_check.py``.

One process, no memory cap (a plan depends on its budget, not on the allocator's limit), the GPT of
``gpu_check.py`` under ``ooc_jit`` at ``--budget-bytes`` (default: the budget of the H200 check).
Medians over ``--steps`` steps, each blocked on:

* ``jax.jit``'s step;
* ``ooc_jit``'s step: the executor with its transfers, waits, account and allocator gate; again
  with the gate off (``account.ALLOCATOR_GATE``); and with no waits for work in flight either (the
  budget is then not held: this measures what draining the queue before a launch costs);
* its segment programs back to back (``executor_overhead.back_to_back``: no executor);
* each segment program alone, on the inputs the step gave it: its time, work, recomputed steps,
  and the rate it reached.

Where the step is slower than back to back, the executor costs the difference; where back to back
is slower than ``jax.jit``, the programs do (the cuts between them and what they recompute).

    python benchmarks/segment_profile.py --out benchmarks/results/   # on a GPU: segment_profile-<device>-<date>.json
    python benchmarks/segment_profile.py --dry-run                   # anywhere, a CPU-tiny GPT: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

if __package__ in (None, ""):  # run as ``python benchmarks/segment_profile.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.executor_overhead import back_to_back, median_seconds
from benchmarks.gpu_check import DRY_MODEL, GPU_MODEL, _slug, _versions, workload
from oocjax import ooc_jit
from oocjax.transforms import account

H200_BUDGET_BYTES = 8286266982  # gpu_check's budget on the H200: 0.8 of the allocator limit under a 0.069 fraction


def profile(model: dict, budget_bytes: int | None, steps: int, dry_run: bool) -> dict:
    work = workload(model)
    state = jax.jit(work.init)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), work.batch.shape, 0, model["vocab"], work.batch.dtype)
    jitted = jax.jit(work.step)
    jit_s = median_seconds(lambda: jitted(state, batch), steps)
    print(f"jax.jit        {jit_s * 1e3:8.2f} ms/step", flush=True)
    options = {}
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
    account.ALLOCATOR_GATE = False
    try:
        ungated_s = median_seconds(one_step, steps)
        # Also without the account's waits for work in flight: what draining the queue before a
        # launch costs. Memory is then not held to the budget: a measurement, not a way to run.
        wait, account._wait = account._wait, lambda probe: None
        try:
            unwaited_s = median_seconds(one_step, steps)
        finally:
            account._wait = wait
    finally:
        account.ALLOCATOR_GATE = True
    plain = back_to_back(step, (state, batch))
    plain_s = median_seconds(plain, steps)
    print(f"ooc_jit        {ooc_s * 1e3:8.2f} ms/step ({ooc_s / jit_s:.2f}x jax.jit), gate off {ungated_s * 1e3:.2f}")
    print(f"  no waits     {unwaited_s * 1e3:8.2f} ms (the budget not held)")
    print(f"back to back   {plain_s * 1e3:8.2f} ms ({plain_s / jit_s:.2f}x jax.jit), {len(plan.segments)} segments")
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
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a CPU-tiny GPT, half its in-core estimate")
    parser.add_argument("--budget-bytes", type=int, default=H200_BUDGET_BYTES)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--out", help="a JSON file, or a folder for segment_profile-<device>-<date>.json")
    args = parser.parse_args()
    model = DRY_MODEL if args.dry_run else GPU_MODEL
    steps = args.steps or (3 if args.dry_run else 20)
    record = profile(model, None if args.dry_run else args.budget_bytes, steps, args.dry_run)
    record = dict(benchmark="segment_profile", steps=steps, versions=_versions(), **record, **machine())
    record["device"] = jax.devices()[0].device_kind
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            out = out / f"segment_profile-{_slug(record['device'])}-{record['date']}.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
