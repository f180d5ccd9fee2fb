"""Training state larger than the device, planned for a GPU on this CPU: bytes moved against the floor.

The project's GPT (``examples.models.Transformer``) with unmodified ``optax.adamw`` and f32 state,
its blocks in a Python loop and in an ``nn.scan``, at GPU budgets, planned for an H200 from this
machine (``step.plan(state, tokens, profile="h200")``): the step traced over abstract arguments
(nothing is allocated), its state donated, the H200's published rates for the recompute-or-move
choice and a GPU's defaults (the smallest segment, 8% headroom, XLA's pinned host pool). Nothing is
compiled: each segment's memory is the planner's own estimate (a GPU run measures it and may plan
again).

Per case it prints what a step moves against the floor, where the floor is each byte of the state
kept in host memory once each way (to the device: the host-kept state; back: the state returned to
host), the segments per layer, and the host peak against the host-kept state. The floor moves with
the plan: state a plan keeps on the device is off it. So it also prints what the step moves both
ways together, the figure the link's time follows, against the whole state once each way. Issue 31's targets
(to the device at most 1.5x the floor at 4 GiB and 1.3x at 14 GiB, back 1.3x and 1.2x, at most 4
segments per layer, a host peak at most 1.2x) are printed beside each figure.

With ``--end-to-end`` it runs instead, on this machine's device, a GPT scaled down to 8 layers of
width 512 whose state is 3x the budget, and the decoder of ``examples/decoders.py`` written four
ways (4 layers, budget 0.8 of the state), as ``ooc_jit`` plans them here: per step the loss beside
``jax.jit``'s, the chain's executed peak (its compiled programs' sizes and the arrays it holds)
against the budget, and the bytes the executor copied each way against the plan's.

    python benchmarks/state_offload.py --out benchmarks/results/state_offload-plan-<date>.json
    python benchmarks/state_offload.py --dry-run     # a small GPT at scaled budgets: checks the script
    python benchmarks/state_offload.py --end-to-end --out benchmarks/results/state_offload-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

if __package__ in (None, ""):  # run as ``python benchmarks/state_offload.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from examples.decoders import WAYS, decoder_case
from examples.models import Transformer, next_token_step
from oocjax import BudgetInfeasibleError, ooc_jit
from oocjax.testing import DeviceAccess, put, segment_signature, with_seams

GIB = 2**30
MODEL = dict(layers=24, width=2048, heads=16, vocab=32000, batch=8, seq=1024)  # 1.34B parameters
DRY_MODEL = dict(layers=4, width=512, heads=8, vocab=1024, batch=1, seq=32)  # state-dominated, as the GPU case
BUDGETS_GIB = (4, 14)
TARGETS = {4: dict(to_device=1.5, back=1.3), 14: dict(to_device=1.3, back=1.2)}
SEGMENTS_PER_LAYER, HOST_PEAK = 4, 1.2
PROFILE = "h200"


def abstract_case(model: dict, scan: bool, dtype=None):
    """The step and its abstract arguments: the state (parameters and AdamW's moments, float32) and
    a batch; ``dtype``: the compute dtype (``jnp.bfloat16`` over float32 parameters), default float32."""
    sizes = {k: model[k] for k in ("vocab", "width", "heads", "layers")}
    gpt = Transformer(**sizes, causal=True, scan=scan, dtype=dtype)
    optimizer = optax.adamw(1e-4)
    tokens = jax.ShapeDtypeStruct((model["batch"], model["seq"] + 1), jnp.int32)
    params = jax.eval_shape(gpt.init, jax.random.key(0), jnp.zeros((1, model["seq"]), jnp.int32))
    state = (params, jax.eval_shape(optimizer.init, params))
    return next_token_step(gpt, optimizer), state, tokens


def plan_case(model: dict, scan: bool, budget_bytes: int, dtype=None) -> dict:
    step_fn, state, tokens = abstract_case(model, scan, dtype)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    started = time.perf_counter()
    step = ooc_jit(step_fn, budget=budget_bytes, donate_argnums=(0,))
    try:
        plan = step.plan(state, tokens, profile=PROFILE)
    except BudgetInfeasibleError as error:
        return dict(scan=scan, budget_bytes=budget_bytes, state_bytes=state_bytes, infeasible=str(error).split("\n")[0])
    seconds = time.perf_counter() - started
    buffers = plan.program.buffers
    floor_in = sum(buffers[b].nbytes for b in plan.schedule.host_inputs)
    floor_out = sum(buffers[b].nbytes for b in plan.schedule.host_outputs)
    timeline = plan.timeline
    return dict(
        scan=scan,
        dtype="float32" if dtype is None else jnp.dtype(dtype).name,
        budget_bytes=budget_bytes,
        state_bytes=state_bytes,
        host_kept_bytes=floor_in,
        returned_to_host_bytes=floor_out,
        to_device_bytes=timeline.h2d_bytes,
        back_bytes=timeline.d2h_bytes,
        to_device_vs_floor=timeline.h2d_bytes / floor_in if floor_in else None,
        back_vs_floor=timeline.d2h_bytes / floor_out if floor_out else None,
        segments=len(plan.segments),
        segments_per_layer=len(plan.segments) / model["layers"],
        distinct_programs=len({segment_signature(plan.program, s.start, s.stop) for s in plan.segments}),
        host_peak_bytes=plan.host_peak_bytes,
        host_peak_vs_kept=plan.host_peak_bytes / floor_in if floor_in else None,
        recomputed=len(plan.recomputed),
        layer_policy=[line.strip() for line in plan.summary().splitlines() if line.startswith("  layer")],
        step_time_s=plan.step_time_s,
        in_core_time_s=plan.in_core_time_s,
        plan_seconds=seconds,
    )


def copies_counted() -> tuple[dict, DeviceAccess]:
    """A device access under which every copy the executor makes is counted in bytes, by the
    memory it goes to, and the counts."""
    moved = {"device": 0, "pinned_host": 0}

    def counted(values, target):
        copies = put(values, target)
        for copy in copies:
            moved[copy.sharding.memory_kind] += copy.nbytes
        return copies

    return moved, DeviceAccess(put=counted)


END_TO_END_MODEL = dict(layers=8, width=512, heads=8, vocab=1024, batch=4, seq=128)
WAYS_LAYERS, WAYS_SHARE = 4, 0.8  # the decoders' activations need more than a third of their state


def end_to_end_cases():
    """``(name, layers, step, state, batch, budget)``: the scaled GPT at a third of its state, and the
    decoder written four ways (``examples.decoders``) at WAYS_SHARE of theirs."""
    model = END_TO_END_MODEL
    gpt = Transformer(
        vocab=model["vocab"], width=model["width"], heads=model["heads"], layers=model["layers"], causal=True
    )
    optimizer = optax.adamw(1e-4)

    def init(key):
        params = gpt.init(key, jnp.zeros((1, model["seq"]), jnp.int32))
        return params, optimizer.init(params)

    state = jax.jit(init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (model["batch"], model["seq"] + 1), 0, model["vocab"])
    name = f"gpt {model['layers']}x{model['width']}"
    yield name, model["layers"], next_token_step(gpt, optimizer), state, tokens, _state_bytes(state) // 3
    for way in WAYS:
        step, state, batch = decoder_case(way, WAYS_LAYERS)
        yield way, WAYS_LAYERS, step, state, batch, int(_state_bytes(state) * WAYS_SHARE)


def _state_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def end_to_end(name: str, layers: int, step_fn, state, batch, budget: int, steps: int = 3) -> dict:
    """``steps`` steps under ``jax.jit`` and under ``ooc_jit`` at ``budget``, from the same state."""
    expected, carried = [], jax.tree.map(lambda x: x.copy(), state)
    jitted = jax.jit(step_fn)
    for _ in range(steps):
        state, loss = jitted(state, batch)
        expected.append(float(loss))
    moved, access = copies_counted()
    ooc = ooc_jit(step_fn, budget=budget, donate_argnums=(0,), min_offload_bytes=4096)  # as the tests plan
    ooc = with_seams(ooc, device_access=access)
    started = time.perf_counter()
    plan = ooc.plan(carried, batch)
    plan_seconds = time.perf_counter() - started
    losses = []
    for _ in range(steps):
        carried, loss = ooc(carried, batch)
        losses.append(float(loss))
    (planner,) = ooc._planners.values()
    return dict(
        name=name,
        layers=layers,
        steps=steps,
        state_bytes=_state_bytes(carried),
        budget_bytes=budget,
        host_kept_bytes=sum(h.nbytes for h in plan.host_inputs),
        strategy=plan.schedule.strategy,
        jit_losses=expected,
        ooc_losses=losses,
        largest_relative_difference=max(abs(a - b) / abs(b) for a, b in zip(losses, expected)),
        executed_peak_bytes=plan.executed_peak_bytes,
        planned_to_device_bytes=steps * plan.timeline.h2d_bytes,
        planned_back_bytes=steps * plan.timeline.d2h_bytes,
        copied_to_device_bytes=moved["device"],
        copied_back_bytes=moved["pinned_host"],
        segments=len(plan.segments),
        segments_per_layer=len(plan.segments) / layers,
        distinct_programs=len({id(p) for p in planner.built.programs}),
        plan_seconds=plan_seconds,
    )


def show_end_to_end(row: dict) -> None:
    kib = 2**10
    print(
        f"{row['name']}: state {row['state_bytes'] / kib:.0f} KiB, budget {row['budget_bytes'] / kib:.0f} KiB, "
        f"{row['host_kept_bytes'] / kib:.0f} KiB kept on host ({row['strategy']})\n"
        f"  losses, jax.jit: {row['jit_losses']}\n  losses, ooc_jit: {row['ooc_losses']} "
        f"(largest relative difference {row['largest_relative_difference']:.1e})\n"
        f"  executed peak {row['executed_peak_bytes'] / kib:.0f} KiB, budget {row['budget_bytes'] / kib:.0f} KiB\n"
        f"  copied in {row['steps']} steps: to the device {row['copied_to_device_bytes']} B (plan: "
        f"{row['planned_to_device_bytes']} B), back {row['copied_back_bytes']} B "
        f"(plan: {row['planned_back_bytes']} B)\n"
        f"  {row['segments']} segments = {row['segments_per_layer']:.1f} per layer, {row['distinct_programs']} "
        f"distinct programs; first plan (with compiling) {row['plan_seconds']:.0f} s",
        flush=True,
    )


def show(row: dict, targets: dict | None) -> None:
    name = f"{'scan' if row['scan'] else 'loop'} at {row['budget_bytes'] / GIB:.3g} GiB"
    if "infeasible" in row:
        print(f"{name}: infeasible: {row['infeasible']}")
        return
    target = targets or {}
    moved = row["to_device_bytes"] + row["back_bytes"]

    def ratio(key: str, limit: float | None) -> str:
        value = row[key]
        shown = "-" if value is None else f"{value:.2f}x"
        return shown + (f" (target <= {limit}x)" if limit else "")

    print(
        f"{name}: state {row['state_bytes'] / GIB:.2f} GiB, {row['host_kept_bytes'] / GIB:.2f} GiB kept on host; "
        f"to the device {row['to_device_bytes'] / GIB:.2f} GiB = {ratio('to_device_vs_floor', target.get('to_device'))}"
        f" the floor, back {row['back_bytes'] / GIB:.2f} GiB = {ratio('back_vs_floor', target.get('back'))}; "
        f"both ways {moved / GIB:.2f} GiB = {moved / (2 * row['state_bytes']):.2f}x the state once each way; "
        f"{row['segments']} segments = {row['segments_per_layer']:.1f} per layer (target <= {SEGMENTS_PER_LAYER}), "
        f"{row['distinct_programs']} distinct programs; "
        f"host peak {ratio('host_peak_vs_kept', HOST_PEAK)} the host-kept state; "
        f"{row['recomputed']} values recomputed; simulated step {row['step_time_s']:.3f} s = "
        f"{row['step_time_s'] / row['in_core_time_s']:.2f}x in core; planned in {row['plan_seconds']:.0f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a small GPT at budgets scaled to its state")
    parser.add_argument("--variants", default="loop,scan")
    parser.add_argument("--end-to-end", action="store_true", help="train the scaled GPT on this machine's device")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.end_to_end:
        rows = []
        for case in end_to_end_cases():
            rows.append(end_to_end(*case))
            show_end_to_end(rows[-1])
        if args.out:
            record = dict(benchmark="state_offload_end_to_end", gpt=END_TO_END_MODEL, rows=rows) | machine()
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {args.out}")
        return
    model = DRY_MODEL if args.dry_run else MODEL
    rows = []
    for scan in [variant == "scan" for variant in args.variants.split(",")]:
        for gib in BUDGETS_GIB:
            if args.dry_run:  # the GPU case's ratio of state to budget
                _, state, _ = abstract_case(model, scan)
                _, full, _ = abstract_case(MODEL, scan)
                ratio = sum(x.size for x in jax.tree.leaves(full)) * 12 / (gib * GIB)  # f32 AdamW: 12 B a parameter
                budget = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / ratio)
            else:
                budget = gib * GIB
            rows.append(plan_case(model, scan, budget))
            show(rows[-1], TARGETS[gib])
    if args.out:
        out = Path(args.out)
        record = dict(benchmark="state_offload", model=model, optimizer="adamw f32", profile=PROFILE, rows=rows)
        out.write_text(json.dumps(record | machine(), indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
