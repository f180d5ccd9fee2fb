"""Where the GPU GPT's training state lives as the budget shrinks, by the calibrated cost model.

A model, not a measurement.

The H100 check (``results/gpu-nvidia-h100-80gb-hbm3-2026-11-26.json``) ran ``ooc_jit`` on the GPT of
``gpu_check.py`` at 2.61x ``jax.jit``: its plan kept all 297 arrays of the training state on host,
moving 6.12 GiB a step, with 2.7 GiB of its budget unused. This traces the same step abstractly on
the CPU, calibrates the cost model to that run (``hybrid_gpu_model.calibrated``: its measured link,
compute rates scaled so that the in-core step simulates in ``jax.jit``'s measured time), and plans
it as ``ooc_jit`` would for that GPU (``ooc_jit(step, budget=...).plan(state, batch,
profile=calibrated)``: ``recompute="auto"``, the GPU's 8% headroom, the segments cut and each one's
memory estimated) at shares of the run's budget. Per budget: bytes moved, the state arrays and
bytes kept on host, the planned peak, the step time of the plan's final schedule simulated on that
profile and its ratio to ``jax.jit``'s measured one.

    python benchmarks/state_homes_model.py    # ~50 s on a 2-core CPU: results/state_homes_model-<device>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as ``python benchmarks/state_homes_model.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import models
from benchmarks._machine import machine
from benchmarks.gpu_check import GPU_MODEL, _slug
from benchmarks.hybrid_gpu_model import calibrated, read_measured, traced
from oocjax import OocError, ooc_jit
from oocjax.schedule import MiB, simulate_time

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "gpu-nvidia-h100-80gb-hbm3-2026-11-26.json"
SHARES = (1.0, 0.97, 0.94, 0.9, 0.8, 0.7)
LABEL = "MODEL, NOT A MEASUREMENT: the cost model calibrated to the gpu_check run named, on a step traced on a CPU"


def row(work, budget: int, profile, jit_s: float) -> dict:
    """The plan at ``budget``, or why ``ooc_jit`` refuses it (``refused``: the error's first line)."""
    started = time.perf_counter()
    step = ooc_jit(work.step, budget=budget, donate_argnums=(0,), min_offload_bytes=MiB)
    try:
        plan = step.plan(work.state, work.batch, profile=profile)
    except OocError as error:
        return dict(budget_bytes=budget, refused=str(error).split("\n")[0], plan_s=time.perf_counter() - started)
    plan_s = time.perf_counter() - started
    step_s = simulate_time(plan.program, plan.schedule, profile).step_time_s  # its final schedule's
    arguments = [b for b in plan.program.buffers if b.kind == "input"]
    return dict(
        budget_bytes=budget,
        planned_bytes=budget - plan.headroom_bytes,
        moved_bytes=plan.moved_bytes,
        arguments=len(arguments),
        arguments_on_host=len(plan.host_inputs),
        argument_bytes_on_host=sum(h.nbytes for h in plan.host_inputs),
        argument_bytes=sum(b.nbytes for b in arguments),
        planned_peak_bytes=plan.peak_bytes,
        recomputed_values=len(plan.recomputed),
        segments=len(plan.segments),
        simulated_s=step_s,
        vs_jax_jit=step_s / jit_s,
        plan_step_time_s=plan.step_time_s,  # the plan's first choice, before its segments' estimates
        plan_s=plan_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default=str(MEASURED), help="the gpu_check JSON to calibrate against")
    parser.add_argument("--out", help="a JSON file, or a folder for the default name")
    args = parser.parse_args()
    measured = read_measured(Path(args.measured))
    work = models.gpt2(**GPU_MODEL, dtype=jnp.float32)
    cal = calibrated(traced(work.step, work.state, work.batch), measured)
    budget = measured["ooc_budget_bytes"]
    rows = [dict(share=s, **row(work, int(budget * s), cal["profile"], measured["jax_jit_s"])) for s in SHARES]
    for r in rows:
        if "refused" in r:
            print(f"{r['share']:.2f} of {budget / 2**30:.2f} GiB: refused: {r['refused']}")
            continue
        on_host = f"{r['argument_bytes_on_host'] / 2**30:.2f} of {r['argument_bytes'] / 2**30:.2f} GiB"
        print(
            f"{r['share']:.2f} of {budget / 2**30:.2f} GiB (planned for {r['planned_bytes'] / 2**30:.2f}): moves "
            f"{r['moved_bytes'] / 2**30:.2f} GiB, {r['arguments_on_host']}/{r['arguments']} arguments on host "
            f"({on_host}), peak {r['planned_peak_bytes'] / 2**30:.2f} GiB, {r['simulated_s']:.3f} s "
            f"({r['vs_jax_jit']:.2f}x jax.jit's measured {measured['jax_jit_s']:.3f} s)"
        )
    record = dict(
        benchmark="state_homes_model",
        kind="model",
        label=LABEL,
        **machine(),
        jax=jax.__version__,
        measured_reference={k: measured[k] for k in ("file", "device", "commit", "jax_jit_s", "ooc_s", "ooc_plan")},
        measured_moved_bytes=measured["ooc_moved_bytes"],
        budget_bytes=budget,
        calibration_factor=cal["factor"],
        rows=rows,
    )
    default = f"state_homes_model-{_slug(measured['device'])}-{record['date']}.json"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    if out.is_dir():
        out = out / default
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{LABEL}\nwrote {out}")


if __name__ == "__main__":
    main()
