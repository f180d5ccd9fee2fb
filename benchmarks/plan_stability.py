"""One plan for one step: the same step, budget and device planned in fresh processes, and with the
device's rates scaled, compared by what the plan does (segments, moves, recomputed values).

The model is ``tests/support/more_ways.py``'s ``local_global`` decoder (three layers of sliding-window
attention to one of global attention, as Gemma's pattern) at 4 and 8 layers, budgets 30% and 60%
of its in-core estimate. Each of ``--processes`` fresh processes plans every case on this machine
(compiling its segments, as a first call does) and prints a digest of each plan; then, in this
process, each case is planned for the CPU's published profile with its compute rates and its link
rates scaled by 0.75 and 1.25 (plan-only, ``profile=``), and compared with the unscaled profile's
plan. Prints and writes one JSON record.

    python benchmarks/plan_stability.py --out benchmarks/results/plan_stability-cpu-<date>.json   # ~4 min
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as ``python benchmarks/plan_stability.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine

CASES = [(layers, share) for layers in (4, 8) for share in (0.3, 0.6)]
SCALES = (0.75, 1.25)
RATES = {"compute": ("flops_per_s", "hbm_bytes_per_s"), "link": ("h2d_bytes_per_s", "d2h_bytes_per_s")}


def digest(plan) -> dict:
    """What a plan does, as a comparable record and its hash."""
    what = dict(
        segments=[(s.start, s.stop) for s in plan.segments],
        moves=[
            (type(m).__name__, m.buffer, getattr(m, "issue_step", getattr(m, "after_step", None)))
            for m in plan.schedule.moves
        ],
        host_inputs=sorted(plan.schedule.host_inputs),
        recomputed=[r.label for r in plan.recomputed],
    )
    return dict(
        sha=hashlib.sha256(repr(what).encode()).hexdigest()[:16],
        segments=len(plan.segments),
        moves=len(plan.schedule.moves),
        recomputed=len(plan.recomputed),
    )


def case(layers: int, share: float, **plan_options):
    from oocjax import ooc_jit
    from tests.support import more_ways

    step, state, batch = more_ways.case("local_global", layers)
    in_core = ooc_jit(step, budget=2**62).plan(state, batch).baseline_peak_bytes
    wrapped = ooc_jit(step, budget=int(in_core * share), donate_argnums=(0,), min_offload_bytes=4096)
    return wrapped.plan(state, batch, **plan_options)


def child() -> None:
    print(json.dumps({f"{layers} layers at {share:.0%}": digest(case(layers, share)) for layers, share in CASES}))


def scaled() -> dict:
    from oocjax.schedule import PROFILES

    cpu, rows = PROFILES["cpu"], {}
    for layers, share in CASES:
        base = case(layers, share, profile=cpu)
        row = {"published": digest(base)}
        for family, fields in RATES.items():
            for scale in SCALES:
                profile = dataclasses.replace(cpu, **{f: getattr(cpu, f) * scale for f in fields})
                row[f"{family} x{scale}"] = digest(case(layers, share, profile=profile))
        rows[f"{layers} layers at {share:.0%}"] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        return child()
    started, root = time.perf_counter(), Path(__file__).resolve().parent.parent
    runs = []
    for _ in range(args.processes):  # one after another: each its own fresh process
        done = subprocess.run(
            [sys.executable, __file__, "--child"], cwd=root, capture_output=True, text=True, check=True
        )
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    same = {name: len({run[name]["sha"] for run in runs}) == 1 for name in runs[0]}
    rates = scaled()
    unchanged = {name: all(d["sha"] == row["published"]["sha"] for d in row.values()) for name, row in rates.items()}
    for name in runs[0]:
        print(
            f"{name}: the same plan in {args.processes} processes: {same[name]} ({runs[0][name]}); "
            f"with compute or link rates x0.75 and x1.25: unchanged {unchanged[name]}"
        )
    record = (
        dict(
            benchmark="plan_stability",
            model="tests/support/more_ways.py local_global",
            processes=runs,
            same_in_every_process=same,
            scaled_rates=rates,
            unchanged_when_scaled=unchanged,
            wall_s=time.perf_counter() - started,
        )
        | machine()
    )
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
