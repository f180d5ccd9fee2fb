"""Where the GPU GPT's training state lives as the budget shrinks, by the calibrated cost model.

A model, not a measurement.

The H100 check (``results/gpu-nvidia-h100-80gb-hbm3-2026-11-26.json``) ran ``ooc_jit`` on the GPT of
``gpu_check.py`` at 2.61x ``jax.jit``: its plan kept all 297 arrays of the training state on host,
moving 6.12 GiB a step, with 2.7 GiB of its budget unused. This traces the same step abstractly on
the CPU, calibrates the cost model to that run (``hybrid_gpu_model.calibrated``: its measured link,
compute rates scaled so that the in-core step simulates in ``jax.jit``'s measured time), and plans
it with ``recompute="auto"`` at shares of the planned budget of the run (its budget less the GPU
headroom). Per budget: bytes moved, the state arrays and bytes kept on host, the planned peak, the
simulated step time and its ratio to ``jax.jit``'s measured one.

    python benchmarks/state_homes_model.py    # ~20 s: results/state_homes_model-<device>-<date>.json
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
from benchmarks.hybrid_gpu_model import calibrated, read_measured
from oocjax.pipeline import DEFAULT_HEADROOM
from oocjax.schedule import MiB, simulate, simulate_time
from oocjax.schedule.hybrid import plan_hybrid
from oocjax.transforms.recompute import recomputable_steps
from oocjax.transforms.trace import trace_step

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "gpu-nvidia-h100-80gb-hbm3-2026-11-26.json"
SHARES = (1.0, 0.97, 0.94, 0.9, 0.8, 0.7)
LABEL = "MODEL, NOT A MEASUREMENT: the cost model calibrated to the gpu_check run named, on a step traced on a CPU"


def row(traced, budget: int, profile, jit_s: float) -> dict:
    program = traced.program
    recomputable = recomputable_steps(traced.flat).__getitem__
    started = time.perf_counter()
    plan = plan_hybrid(program, budget, recomputable=recomputable, profile=profile, min_offload_bytes=MiB)
    plan_s = time.perf_counter() - started
    timeline = simulate(plan.program, plan.schedule)
    step_s = simulate_time(plan.program, plan.schedule, profile).step_time_s
    arguments = [b for b, buffer in enumerate(program.buffers) if buffer.kind == "input"]
    return dict(
        budget_bytes=budget,
        moved_bytes=timeline.h2d_bytes + timeline.d2h_bytes,
        arguments=len(arguments),
        arguments_on_host=len(plan.schedule.host_inputs),
        argument_bytes_on_host=sum(program.buffers[b].nbytes for b in plan.schedule.host_inputs),
        argument_bytes=sum(program.buffers[b].nbytes for b in arguments),
        planned_peak_bytes=timeline.peak_bytes,
        recomputed_values=len(plan.rewrite.recomputed),
        simulated_s=step_s,
        vs_jax_jit=step_s / jit_s,
        plan_s=plan_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default=str(MEASURED), help="the gpu_check JSON to calibrate against")
    parser.add_argument("--out", help="a JSON file, or a folder for the default name")
    args = parser.parse_args()
    measured = read_measured(Path(args.measured))
    work = models.gpt2(**GPU_MODEL, dtype=jnp.float32)
    traced = trace_step(work.step, work.state, work.batch, donate_argnums=(0,))
    cal = calibrated(traced.program, measured)
    planned = measured["ooc_budget_bytes"] - int(measured["ooc_budget_bytes"] * DEFAULT_HEADROOM["gpu"])
    rows = [dict(share=s, **row(traced, int(planned * s), cal["profile"], measured["jax_jit_s"])) for s in SHARES]
    for r in rows:
        on_host = f"{r['argument_bytes_on_host'] / 2**30:.2f} of {r['argument_bytes'] / 2**30:.2f} GiB"
        print(
            f"{r['share']:.2f} of {planned / 2**30:.2f} GiB: moves {r['moved_bytes'] / 2**30:.2f} GiB, "
            f"{r['arguments_on_host']}/{r['arguments']} arguments on host ({on_host}), "
            f"peak {r['planned_peak_bytes'] / 2**30:.2f} GiB, {r['simulated_s']:.3f} s "
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
        planned_budget_bytes=planned,
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
