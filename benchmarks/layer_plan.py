"""Plans by layer for an H200, made on this machine (``step.plan(..., profile="h200")``): the figures
the layer-plan issue asks for, each printed beside its target. A model, not a measurement.

- The project's 1.34B GPT (``state_offload.MODEL``: 24 layers of width 2048), unmodified
  ``optax.adamw`` with float32 state donated and kept on host: at 4 GiB with float32 and with
  bfloat16 compute, to the device at most 1.4x the state kept on host, back at most 1.1x, at most 3
  segments per layer, the simulated step at most 1.5x the in-core one; at 14 GiB each way at most
  1.05x and at most 3 segments per layer; its ``nn.scan`` twin at 4 GiB within 1.5x each way.
- The activation-bound GPT of ``gpu_check.py`` (16 layers of width 1024, batch 8 x 1024, float32
  AdamW) at 7.72 GiB and at the in-core peak of its per-block ``nn.remat`` twin
  (``nothing_saveable``): the simulated step at most the twin's simulated in-core step, at most 3
  segments per layer. At the twin's peak twice: with the GPU's default headroom (8% of the budget
  left to the allocator, so the arrays get less than the twin's), and with none, the arrays of both
  held to the same bytes.

    python benchmarks/layer_plan.py --out benchmarks/results/layer_plan-h200-<date>.json   # ~2 min on 2 cores
    python benchmarks/layer_plan.py --dry-run   # small models at the same shares of their state: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as ``python benchmarks/layer_plan.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import models
from benchmarks._machine import machine
from benchmarks.gpu_check import DRY_MODEL as DRY_ACTIVATIONS
from benchmarks.gpu_check import GPU_MODEL
from benchmarks.state_offload import DRY_MODEL, MODEL, abstract_case, plan_case
from oocjax import ooc_jit

GIB = 2**30
PROFILE = "h200"
STATE_CASES = (  # (name, scan, dtype, budget GiB, targets)
    ("f32 at 4 GiB", False, None, 4, dict(to_device=1.4, back=1.1, segments_per_layer=3, vs_in_core=1.5)),
    ("bf16 at 4 GiB", False, jnp.bfloat16, 4, dict(to_device=1.4, back=1.1, segments_per_layer=3, vs_in_core=1.5)),
    ("f32 at 14 GiB", False, None, 14, dict(to_device=1.05, back=1.05, segments_per_layer=3)),
    ("scan f32 at 4 GiB", True, None, 4, dict(to_device=1.5, back=1.5)),
)
ACTIVATION_BUDGET = int(7.72 * GIB)
ROUNDING = 1e-9  # relative: two simulated times this close are the same sum of step times
STATE_GIB = 15.0  # the 1.34B GPT's state: the dry run keeps the budgets' shares of it


def state_rows(model: dict, scale: float) -> list[dict]:
    rows = []
    for name, scan, dtype, gib, targets in STATE_CASES:
        row = plan_case(model, scan, int(gib * GIB * scale), dtype)
        row |= dict(case=name, targets=targets, met=_met(row, targets, model["layers"]))
        rows.append(row)
        _show_state(row)
    return rows


def _met(row: dict, targets: dict, layers: int) -> dict:
    """Per target, whether the row meets it (None where the plan was refused)."""
    if "infeasible" in row:
        return {name: None for name in targets}
    figures = dict(
        to_device=row["to_device_vs_floor"],
        back=row["back_vs_floor"],
        segments_per_layer=row["segments"] / layers,
        vs_in_core=row["step_time_s"] / row["in_core_time_s"],
    )
    return {name: figures[name] is not None and figures[name] <= limit for name, limit in targets.items()}


def _show_state(row: dict) -> None:
    if "infeasible" in row:
        print(f"{row['case']}: refused: {row['infeasible']}", flush=True)
        return
    t = row["targets"]
    figures = [
        f"to the device {row['to_device_vs_floor']:.2f}x (target {t.get('to_device')})",
        f"back {row['back_vs_floor']:.2f}x (target {t.get('back')})",
        f"{row['segments_per_layer']:.2f} segments a layer (target {t.get('segments_per_layer', '-')})",
        f"step {row['step_time_s'] / row['in_core_time_s']:.2f}x in core (target {t.get('vs_in_core', '-')})",
    ]
    print(f"{row['case']}: " + ", ".join(figures) + f"; met {row['met']}", flush=True)
    for line in row["layer_policy"]:
        print(f"    {line}", flush=True)


def activation_rows(model: dict, budget_bytes: int | None, **options) -> list[dict]:
    """The activation-bound GPT at ``budget_bytes`` (None: a third of its in-core estimate) and at
    its per-block remat twin's in-core peak."""
    plain = models.gpt2(**model, dtype=jnp.float32)
    if budget_bytes is None:
        in_core = ooc_jit(plain.step, budget=2**62, donate_argnums=(0,)).plan(plain.state, plain.batch, profile=PROFILE)
        budget_bytes = in_core.baseline_peak_bytes // 3
    twin = models.gpt2(**model, dtype=jnp.float32, remat_policy=jax.checkpoint_policies.nothing_saveable)
    twin_plan = ooc_jit(twin.step, budget=2**62, donate_argnums=(0,)).plan(twin.state, twin.batch, profile=PROFILE)
    rows, at_peak = [], "at per-block remat's in-core peak"
    cases = (("at 7.72 GiB", budget_bytes, {}), (at_peak, twin_plan.peak_bytes, {}))
    for name, budget, extra in (*cases, (f"{at_peak}, no headroom", twin_plan.peak_bytes, dict(headroom_bytes=0))):
        started = time.perf_counter()
        step = ooc_jit(plain.step, budget=budget, donate_argnums=(0,), **options | extra)
        plan = step.plan(plain.state, plain.batch, profile=PROFILE)
        row = dict(
            case=name,
            budget_bytes=budget,
            headroom_bytes=plan.headroom_bytes,
            step_time_s=plan.step_time_s,
            in_core_time_s=plan.in_core_time_s,
            remat_in_core_time_s=twin_plan.in_core_time_s,
            remat_peak_bytes=twin_plan.peak_bytes,
            moved_bytes=plan.moved_bytes,
            segments=len(plan.segments),
            segments_per_layer=len(plan.segments) / model["layers"],
            recomputed=len(plan.recomputed),
            layer_policy=[line.strip() for line in plan.summary().splitlines() if line.startswith("  layer")],
            plan_seconds=time.perf_counter() - started,
        )
        # At most: equal counts (the same steps' times summed in another order differ in the last bits).
        at_most = plan.step_time_s <= twin_plan.in_core_time_s * (1 + ROUNDING)
        row["met"] = dict(faster_than_remat=at_most, segments=row["segments_per_layer"] <= 3)
        rows.append(row)
        print(
            f"activation-bound GPT {name} ({budget / GIB:.2f} GiB): step {plan.step_time_s * 1e3:.1f} ms against "
            f"per-block remat's {twin_plan.in_core_time_s * 1e3:.1f} ms in core (target: at most), "
            f"{row['segments_per_layer']:.2f} segments a layer (target 3), {plan.moved_bytes / GIB:.2f} GiB moved; "
            f"met {row['met']}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="small models at the same shares of their state")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.dry_run:
        small_state = abstract_case(DRY_MODEL, False)[1]
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(small_state))
        rows = state_rows(DRY_MODEL, state_bytes / (STATE_GIB * GIB))
        activations = activation_rows(DRY_ACTIVATIONS, None, min_offload_bytes=4096)
    else:
        rows, activations = state_rows(MODEL, 1.0), activation_rows(GPU_MODEL, ACTIVATION_BUDGET)
    record = dict(benchmark="layer_plan", kind="model", profile=PROFILE, state=rows, activations=activations)
    record |= dict(model=DRY_MODEL if args.dry_run else MODEL, wall_s=time.perf_counter() - started) | machine()
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
