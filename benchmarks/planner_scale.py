"""How the window planner's time grows with program size.

Plans synthetic layered training steps (``oocjax.schedule.synthetic``) of about 1k to 200k steps at
50% and 20% of their in-core peak, and prints the time per size and the fitted growth exponent
(time ~ steps^k; n log n shows as k slightly above 1 over this range). Every plan is validated.

    python benchmarks/planner_scale.py [--sizes 1000,10000,100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

from oocjax.schedule import keep_all, plan_window, simulate, validate
from oocjax.testing import layered_training_step

try:
    from benchmarks._machine import machine
except ImportError:  # run as a script from benchmarks/
    from _machine import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,3000,10000,30000,100000,200000")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    targets = [int(s) for s in args.sizes.split(",")]
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'steps':>8} {'fraction':>8} {'seconds':>8} {'us/step':>8} {'moves':>7}  valid")
    rows: dict[float, list[tuple[int, float]]] = {}
    for target in targets:
        program = layered_training_step(max(1, (target - 2) // 9))
        steps = len(program.steps)
        in_core = simulate(program, keep_all(program)).peak_bytes
        for fraction in (0.5, 0.2):
            budget = int(in_core * fraction)
            best = math.inf
            for _ in range(args.repeats):
                start = time.perf_counter()
                schedule = plan_window(program, budget)
                best = min(best, time.perf_counter() - start)
            valid = not validate(program, schedule)
            rows.setdefault(fraction, []).append((steps, best))
            print(f"{steps:>8} {fraction:>8} {best:>8.3f} {best / steps * 1e6:>8.1f} {len(schedule.moves):>7}  {valid}")
    exponents = {}
    for fraction, points in rows.items():
        if len(points) >= 2:
            xs = [math.log(s) for s, _ in points]
            ys = [math.log(t) for _, t in points]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            exponents[fraction] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            print(f"growth exponent at {fraction:.0%} of in-core: {exponents[fraction]:.2f} (1.0 linear)")
    if args.out:
        record = dict(
            benchmark="planner_scale",
            seconds={str(f): [[steps, t] for steps, t in points] for f, points in rows.items()},
            growth_exponent={str(f): e for f, e in exponents.items()},
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
