"""Simulated schedule quality: every model x budget x strategy x device profile, on the CPU.

For each GPU-sized model of ``benchmarks.models.gpu_suite`` (traced abstractly through
``ooc_jit(...).plan(..., profile=...)`` at a budget nothing exceeds: nothing is allocated or
compiled, and the plan's program is the step as ``ooc_jit`` traces it), budgets go down from the
in-core peak by factors of sqrt(2) to 1/8 of it and below, until no schedule can fit. Each
strategy is planned (the window planner) or applied (the fixed baselines, which take no budget:
they fit or they do not) and timed by ``simulate_time`` on an H100 PCIe and a GH200 profile
(in-core: the plan's ``in_core_time_s`` on each). Per cell: whether it fits, step time / in-core time, step time /
lower bound, bytes each way. Per model, strategy and profile: the largest in-core-to-budget ratio
whose step time stays within 1.25x of in-core.

    python benchmarks/simulated.py [--out benchmarks/results/simulated-DATE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as ``python benchmarks/simulated.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.baselines import fixed_lookahead, swap_all_just_in_time
from benchmarks.models import gpu_suite
from oocjax import ooc_jit
from oocjax.schedule import (
    format_bytes,
    keep_all,
    plan_window,
    required_bytes,
    simulate,
    simulate_time,
)

PROFILES = ("h100-pcie", "gh200")
STRATEGIES = ("window", "swap_all_just_in_time", "fixed_lookahead_4", "keep_all")
WITHIN = 1.25  # "close to in-core speed"
AMPLE = 2**62  # a budget nothing exceeds: the plan moves nothing, and its program is the step as traced


def in_core_plans(workload) -> dict:
    """Per profile, the step planned in core by ``ooc_jit`` for it (traced once, nothing compiled):
    its ``program`` is the step as ``ooc_jit`` traces it (the batch marked held by the caller: no
    strategy moves it), its ``in_core_time_s`` the in-core step simulated on that profile."""
    step = ooc_jit(workload.step, budget=AMPLE, donate_argnums=(0,))
    return {p: step.plan(workload.state, workload.batch, profile=p) for p in PROFILES}


def budgets(in_core: int, smallest: int) -> list[tuple[float, int]]:
    """Fractions 1, 1/sqrt(2), 1/2, ... down to 1/8 at least, and on until a budget that nothing can
    meet (kept: it shows where the limit is)."""
    out, k = [], 0
    while True:
        fraction = 2 ** (-k / 2)
        out.append((fraction, int(in_core * fraction)))
        if out[-1][1] < smallest and fraction <= 1 / 8:
            return out
        k += 1


def run_model(workload) -> dict:
    started = time.perf_counter()
    plans = in_core_plans(workload)
    program = plans[PROFILES[0]].program
    in_core = simulate(program, keep_all(program)).peak_bytes
    smallest = max(required_bytes(program))
    fixed = {
        "swap_all_just_in_time": swap_all_just_in_time(program),
        "fixed_lookahead_4": fixed_lookahead(program, 4),
        "keep_all": keep_all(program),
    }
    fixed_peaks = {name: simulate(program, s).peak_bytes for name, s in fixed.items()}
    in_core_time = {p: plan.in_core_time_s for p, plan in plans.items()}
    cells = []
    for fraction, budget in budgets(in_core, smallest):
        window = plan_window(program, budget) if budget >= smallest else None
        for strategy in STRATEGIES:
            schedule = window if strategy == "window" else fixed[strategy]
            fits = schedule is not None and (strategy == "window" or fixed_peaks[strategy] <= budget)
            for profile in PROFILES:
                cell = dict(strategy=strategy, profile=profile, fraction=fraction, budget_bytes=budget, fits=fits)
                if fits:
                    timed = simulate_time(program, schedule, profile)
                    cell |= dict(
                        peak_bytes=simulate(program, schedule).peak_bytes,
                        step_time_s=timed.step_time_s,
                        vs_in_core=timed.step_time_s / in_core_time[profile],
                        vs_lower_bound=timed.step_time_s / timed.lower_bound_s,
                        h2d_bytes=timed.h2d_bytes,
                        d2h_bytes=timed.d2h_bytes,
                    )
                cells.append(cell)
    headline = {}
    for strategy in STRATEGIES:
        for profile in PROFILES:
            ok = [
                c
                for c in cells
                if c["strategy"] == strategy
                and c["profile"] == profile
                and c["fits"]
                and c["fraction"] < 1
                and c["vs_in_core"] <= WITHIN
            ]
            headline[f"{strategy}/{profile}"] = max((in_core / c["budget_bytes"] for c in ok), default=None)
    print(
        f"{workload.name}: {len(program.steps)} equations, in-core {format_bytes(in_core)}, smallest feasible "
        f"{format_bytes(smallest)} ({time.perf_counter() - started:.0f}s)"
    )
    return dict(
        model=workload.name,
        equations=len(program.steps),
        in_core_bytes=in_core,
        smallest_feasible_bytes=smallest,
        in_core_step_time_s=in_core_time,
        fixed_strategy_peak_bytes=fixed_peaks,
        largest_ratio_within_1_25x=headline,
        cells=cells,
    )


def print_table(results: list[dict]) -> None:
    print(f"\nLargest in-core/budget ratio below in-core with step time <= {WITHIN}x in-core (simulated; - none):")
    print(f"{'model':<28}" + "".join(f"{s[:14] + '/' + p[:5]:>22}" for s in STRATEGIES[:3] for p in PROFILES))
    for r in results:
        row = r["largest_ratio_within_1_25x"]
        cells = [row[f"{s}/{p}"] for s in STRATEGIES[:3] for p in PROFILES]
        print(f"{r['model']:<28}" + "".join(f"{'-' if v is None else f'{v:.2f}x':>22}" for v in cells))


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(PROFILES), len(results), figsize=(4 * len(results), 3.2 * len(PROFILES)), squeeze=False
    )
    for col, r in enumerate(results):
        for row, profile in enumerate(PROFILES):
            ax = axes[row][col]
            for strategy in STRATEGIES[:3]:
                cells = [c for c in r["cells"] if c["strategy"] == strategy and c["profile"] == profile and c["fits"]]
                ax.plot([1 / c["fraction"] for c in cells], [c["vs_in_core"] for c in cells], "o-", label=strategy)
            ax.axhline(WITHIN, color="0.6", linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{r['model']}\n{profile}", fontsize=9)
            ax.set_xlabel("in-core / budget")
            ax.set_ylabel("step time / in-core")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    today = datetime.date.today().isoformat()
    parser.add_argument("--out", default=f"benchmarks/results/simulated-{today}.json")
    parser.add_argument("--plot", default=f"benchmarks/results/simulated-{today}.png")
    args = parser.parse_args()
    started = time.perf_counter()
    results = [run_model(w) for w in gpu_suite()]
    print_table(results)
    record = dict(
        benchmark="simulated",
        within=WITHIN,
        profiles=PROFILES,
        strategies=STRATEGIES,
        seconds=time.perf_counter() - started,
        **machine(),
        models=results,
    )
    Path(args.out).write_text(json.dumps(record, indent=1, default=_finite) + "\n")
    plot(results, args.plot)
    print(f"\nwrote {args.out} and {args.plot} in {time.perf_counter() - started:.0f}s")


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


if __name__ == "__main__":
    main()
