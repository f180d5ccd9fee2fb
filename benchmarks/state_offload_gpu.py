"""Training state larger than the device, trained on a GPU in one process: the 1.34B GPT at 4 and 14 GiB.

The model of ``state_offload.py`` (24 layers, width 2048, batch 8 x 1024, vocabulary 32000,
unmodified ``optax.adamw``, f32 state: 15 GiB), in one process and in this order, so that no run
raises the device's peak before an earlier one is read:

1. **The link**: a jitted copy of 1 GiB from pinned host memory to the device, one back, and both at
   once (one program copying one array each way), best of five each.
2. **``ooc_jit`` at each budget** (4 GiB, then 14 GiB): the state made as the README says, by an
   ``ooc_jit``-wrapped init under the 4 GiB budget, and put in host memory (``to_host``); then
   ``ooc_jit(step, budget=..., donate_argnums=(0,))`` with its defaults: the first call (trace,
   plan, compile, run) and the plans it made, the losses of the first steps, the median time of the
   timed steps, the bytes the executor copied each way per step against the plan's, and the device's
   ``peak_bytes_in_use`` against the budget (read after the init too: the init's plan measures the
   device's rates first; and when the first call's first segment launches, after compiling, and
   after each first step, to tell which raised it), and per launch of the last step its time, the
   host's waits before it, the chain's operations before it and the executor's account (to find
   where a step's time goes).
3. **``jax.jit`` in device memory**, from the same initial state (``jax.jit(init)``): the plain step
   (its time is the compute floor), then every block in ``nn.remat`` (nothing saved). Their losses
   and step times. Every run's model TFLOP/s divide the same count (``model_flops``).

``peak_bytes_in_use`` is the process's peak so far: each row's is its own where it is above the
rows' before it (the remat run's is below the plain one's, so it is not measured).

Per budget it prints the step time against max(transfer floor, compute floor). The transfer floor
is the state the plan keeps in host memory copied to the device once and the state it returns
copied back once, at the link's measured rates, each way alone or both at once, whichever is slower;
the compute floor is plain ``jax.jit``'s step time. Issue 31's targets: at most 1.5x at 4 GiB and
1.3x at 14 GiB. ``--deadline`` skips what would start too late; the JSON is rewritten after each run.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/state_offload_gpu.py --out "$OUT"
    python benchmarks/state_offload_gpu.py --dry-run     # anywhere: a small GPT at scaled budgets
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

if __package__ in (None, ""):  # run as ``python benchmarks/state_offload_gpu.py``: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.gpu_check import link_probe
from benchmarks.rates import measure_profile
from benchmarks.state_offload import BUDGETS_GIB, DRY_MODEL, MODEL, copies_counted
from examples.models import Transformer, next_token_step
from oocjax import ooc_jit, to_host
from oocjax.testing import Launch, observe_segments, with_seams

GIB = 2**30
FLOOR_TARGETS = {4: 1.5, 14: 1.3}  # step time over max(transfer floor, compute floor)


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def gpt(model: dict, remat: bool = False):
    """``(init, step)`` of the GPT with AdamW: ``init(key) -> (params, opt_state)``."""
    network = Transformer(
        vocab=model["vocab"], width=model["width"], heads=model["heads"], layers=model["layers"], causal=True,
        remat=remat,
    )  # fmt: skip
    optimizer = optax.adamw(1e-4)

    def init(key):
        params = network.init(key, jnp.zeros((1, model["seq"]), jnp.int32))
        return params, optimizer.init(params)

    return init, next_token_step(network, optimizer)


def steps_run(step, state, tokens, loss_steps: int, timed_steps: int, peaks: list | None = None) -> tuple:
    """Runs ``loss_steps`` steps recording losses (the first one timed on its own: a first call's
    time), then ``timed_steps`` timed one by one. ``(state, losses, first_s, timed_s)``. ``peaks``
    gets the device's peak so far after each loss step (which call raised it)."""
    losses, timed = [], []
    started = time.perf_counter()
    state, loss = jax.block_until_ready(step(state, tokens))
    first_s = time.perf_counter() - started
    losses.append(float(loss))
    for _ in range(loss_steps - 1):
        if peaks is not None:
            peaks.append(peak_bytes())
        state, loss = jax.block_until_ready(step(state, tokens))
        losses.append(float(loss))
    if peaks is not None:
        peaks.append(peak_bytes())
    for _ in range(timed_steps):
        started = time.perf_counter()
        state, loss = jax.block_until_ready(step(state, tokens))
        timed.append(time.perf_counter() - started)
        losses.append(float(loss))
    return state, losses, first_s, timed


def ooc_run(model: dict, make, key, tokens, budget: int, loss_steps: int, timed_steps: int) -> dict:
    _, step_fn = gpt(model)
    started = time.perf_counter()
    state = jax.block_until_ready(to_host(make(key)))
    init_s = time.perf_counter() - started
    moved, access = copies_counted()  # every copy the executor makes, counted from here
    step = with_seams(ooc_jit(step_fn, budget=budget, donate_argnums=(0,)), device_access=access)
    row = dict(budget_bytes=budget, init_s=init_s, state_bytes=sum(x.nbytes for x in jax.tree.leaves(state)))
    row["peak_after_init_bytes"] = peak_bytes()
    row["peak_after_each_first_step_bytes"] = peaks = []
    first_launch: list = []  # the device's peak when the first call's first segment launches: after compiling

    def compiled(at) -> None:
        if not first_launch:
            first_launch.append(peak_bytes())

    with observe_segments(compiled):
        state, losses, first_s, _ = steps_run(step, state, tokens, loss_steps, 0, peaks)
    row["peak_at_first_launch_bytes"] = first_launch[0] if first_launch else None
    row["peak_after_first_steps_bytes"] = peak_bytes()
    launches: list[tuple] = []  # (when, the executor's account, its waits so far, seconds blocked so far)

    def launched(at) -> None:
        memory = _built(step).executor.memory
        launches.append((time.perf_counter(), at, memory.waits, memory.blocked_s))

    earlier = dict(moved)
    with observe_segments(launched):
        state, more, _, timed = steps_run(step, state, tokens, 1, timed_steps)
    moved = {kind: moved[kind] - earlier[kind] for kind in moved}  # these steps' copies alone
    last = max(i for i, (_, at, *_) in enumerate(launches) if at.segment == 0)
    row["last_step_launch_ms"] = [round((t - launches[last][0]) * 1e3, 3) for t, *_ in launches[last:]]
    # Per launch of the last step: the allocator's count, what the executor holds and has in flight,
    # and what the launch allocates (a peak above the budget is where these do not add up); the
    # host's waits on the device before it and their milliseconds (a gap between launches that is
    # not a wait is the host's own work); and the chain's operations before it.
    row["last_step_launches"] = [
        (at.allocator_bytes, at.held_bytes, at.in_flight_bytes, at.cost.launch_bytes) for _, at, *_ in launches[last:]
    ]
    row["last_step_waits"] = [
        (waits - before[0], round((blocked - before[1]) * 1e3, 3))
        for (*_, waits, blocked), before in zip(launches[last:], [(0, 0.0)] + [x[2:] for x in launches[last:]])
    ]
    built = _built(step)
    executor = built.executor
    row["operations_before_launches"] = operations_before_launches(executor.chain.operations)
    peak = (jax.local_devices()[0].memory_stats() or {}).get(
        "peak_bytes_in_use"
    )  # the process's, as the executor reads it
    row |= dict(process_peak_bytes=peak, foreign_bytes=executor.memory.foreign_bytes)
    plan = step.plan(state, tokens)
    per_step = timed_steps + 1
    kept_in = sum(h.nbytes for h in plan.host_inputs)
    buffers = plan.program.buffers
    row |= dict(
        first_call_s=first_s,
        plans_in_first_call=len(plan.attempts),
        losses=losses + more,
        timed_s=timed,
        s_per_step=statistics.median(timed),
        peak_bytes_in_use=peak_bytes(),
        strategy=plan.schedule.strategy,
        segments=len(plan.segments),
        segments_per_layer=len(plan.segments) / model["layers"],
        distinct_programs=len({id(p) for p in built.programs}),
        host_kept_bytes=kept_in,
        returned_to_host_bytes=sum(buffers[b].nbytes for b in plan.schedule.host_outputs),
        planned_to_device_bytes=plan.timeline.h2d_bytes,
        planned_back_bytes=plan.timeline.d2h_bytes,
        copied_to_device_bytes=moved["device"] / per_step,
        copied_back_bytes=moved["pinned_host"] / per_step,
        executed_peak_bytes=plan.executed_peak_bytes,
        host_peak_bytes=plan.host_peak_bytes,
    )
    del state
    gc.collect()
    return row


def _built(step):
    """The plan and chain an ``ooc_jit`` step of one signature runs now."""
    (planner,) = step._planners.values()
    return planner.built


def operations_before_launches(operations) -> list[dict]:
    """Per launch of a chain, how many operations of each other kind (prefetches, offloads, waits)
    come between it and the launch before it."""
    counts: list[Counter] = [Counter()]
    for op in operations:
        if isinstance(op, Launch):
            counts.append(Counter())
        else:
            counts[-1][type(op).__name__] += 1
    return [dict(c) for c in counts[:-1]]


def jit_run(model: dict, key, tokens, remat: bool, loss_steps: int, timed_steps: int) -> dict:
    init, step_fn = gpt(model, remat=remat)
    state = jax.block_until_ready(jax.jit(init)(key))
    started = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=(0,)).lower(state, tokens).compile()
    compile_s = time.perf_counter() - started
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    state, losses, _, timed = steps_run(compiled, state, tokens, loss_steps, timed_steps)
    row = dict(
        remat=remat,
        compile_s=compile_s,
        xla_flops=cost.get("flops") if cost else None,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        losses=losses,
        timed_s=timed,
        s_per_step=statistics.median(timed),
        peak_bytes_in_use=peak_bytes(),
    )
    del state
    gc.collect()
    return row


def model_flops(model: dict, parameters: int) -> int:
    """A step's model FLOPs: 6 per parameter and token (the forward pass and the backward's two
    products), and the attention's scores and weighted sums, 12 x layers x batch x seq^2 x width
    (every position against every other: the model materialises the whole score matrix).
    Recomputation is not counted: the TFLOP/s divide the same work for every run. XLA's own count
    (``cost_analysis``) leaves out the matrix products a GPU hands to cuBLAS."""
    tokens = model["batch"] * model["seq"]
    return 6 * parameters * tokens + 12 * model["layers"] * tokens * model["seq"] * model["width"]


def floors(record: dict) -> None:
    """Per ``ooc_jit`` row: the transfer floor, the compute floor and the step time against their max;
    every run's model TFLOP/s."""
    rates, flops = record.get("link"), record.get("model_flops")
    plain = next((r for r in record["jax_jit"] if not r["remat"] and "s_per_step" in r), None)
    for row in record["jax_jit"] + record["ooc_jit"]:
        if flops and "s_per_step" in row:
            row["model_TFLOP_per_s"] = flops / row["s_per_step"] / 1e12
    for row in record["ooc_jit"]:
        if "s_per_step" not in row or not rates:
            continue
        kept_in, out = row["host_kept_bytes"], row["returned_to_host_bytes"]
        row["transfer_floor_s"] = max(
            kept_in / (rates["h2d_GB_per_s"] * 1e9),
            out / (rates["d2h_GB_per_s"] * 1e9),
            (kept_in + out) / (rates["both_GB_per_s"] * 1e9),
        )
        row["compute_floor_s"] = plain["s_per_step"] if plain else None
        floor = max(row["transfer_floor_s"], row["compute_floor_s"] or 0)
        row["vs_floor"] = row["s_per_step"] / floor


def show(record: dict) -> None:
    if "link" in record:
        r = record["link"]
        print(
            f"link, 1 GiB jitted copies: to the device {r['h2d_GB_per_s']:.1f} GB/s, back {r['d2h_GB_per_s']:.1f}"
            f" GB/s, both at once {r['both_GB_per_s']:.1f} GB/s (both ways' bytes)"
        )
    for r in record["jax_jit"]:
        name = "jax.jit, per-block nn.remat" if r["remat"] else "jax.jit"
        if "error" in r:
            print(f"{name}: {r['error'][:300]}")
            continue
        print(
            f"{name}: {r['s_per_step'] * 1e3:.0f} ms a step, {r.get('model_TFLOP_per_s', 0):.0f} TFLOP/s, peak "
            f"{(r['peak_bytes_in_use'] or 0) / GIB:.2f} GiB, compiled in {r['compile_s']:.0f} s, losses {r['losses']}"
        )
    for r in record["ooc_jit"]:
        name = f"ooc_jit at {r['budget_bytes'] / GIB:.3g} GiB"
        if "error" in r:
            print(f"{name}: {r['error'][:300]}")
            continue
        floor = (
            f"{r['vs_floor']:.2f}x max(transfer floor {r['transfer_floor_s'] * 1e3:.0f} ms, compute floor "
            f"{(r['compute_floor_s'] or 0) * 1e3:.0f} ms) (target <= {FLOOR_TARGETS.get(r['gib'], '-')}x)"
            if "vs_floor" in r
            else "no floor"
        )
        print(
            f"{name}: {r['s_per_step'] * 1e3:.0f} ms a step = {floor}, {r.get('model_TFLOP_per_s', 0):.0f} TFLOP/s;"
            f" peak {(r['peak_bytes_in_use'] or 0) / GIB:.2f} GiB (after the init "
            f"{(r.get('peak_after_init_bytes') or 0) / GIB:.2f}); first call {r['first_call_s']:.0f} s "
            f"({r['plans_in_first_call']} plans), state made in {r['init_s']:.0f} s; {r['segments']} segments "
            f"({r['segments_per_layer']:.1f} per layer, {r['distinct_programs']} programs, {r['strategy']}); "
            f"copied a step {r['copied_to_device_bytes'] / GIB:.2f} GiB in "
            f"(plan {r['planned_to_device_bytes'] / GIB:.2f}), {r['copied_back_bytes'] / GIB:.2f} GiB back "
            f"(plan {r['planned_back_bytes'] / GIB:.2f}); "
            f"host kept {r['host_kept_bytes'] / GIB:.2f} GiB, host peak {r['host_peak_bytes'] / GIB:.2f} GiB; "
            f"losses {r['losses']}",
            flush=True,
        )


def budget_scale(model: dict, dry_run: bool) -> float:
    """What a budget in GiB is multiplied by: 1 on a GPU; in a dry run, the small model's state over
    the GPU model's 15 GiB, so that the dry run keeps the GPU's state-to-budget ratio."""
    init, _ = gpt(model)
    shapes = jax.eval_shape(init, jax.random.key(0))
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    return state_bytes / (15.0 * GIB) if dry_run else 1.0


def measure(record: dict, model: dict, gibs: list[float], args, in_time, save) -> None:
    """The runs of ``main``, in its order, into ``record``: the link, ``ooc_jit`` at each budget of
    ``gibs`` (GiB), then ``jax.jit`` (``args.jit``: plain, remat). ``args`` has ``dry_run``,
    ``loss_steps``, ``timed_steps`` and ``jit``; ``in_time(name)`` says whether a run may still start
    (else it is skipped); ``save()`` is called after each run."""
    began = time.perf_counter()
    record["link"] = link_probe(16 if args.dry_run else 1024)
    save()
    key = jax.random.key(0)
    tokens = jax.random.randint(jax.random.key(1), (model["batch"], model["seq"] + 1), 0, model["vocab"])
    init, _ = gpt(model)
    record["parameters"] = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init, key)[0]))
    record["model_flops"] = model_flops(model, record["parameters"])
    scale = budget_scale(model, args.dry_run)
    make = ooc_jit(init, budget=int(min(gibs) * GIB * scale))  # the state, made within the smallest budget
    for gib in gibs:
        if not in_time(f"ooc_jit at {gib} GiB"):
            continue
        print(f"{time.perf_counter() - began:.0f} s: ooc_jit at {gib} GiB", flush=True)
        try:
            row = ooc_run(model, make, key, tokens, int(gib * GIB * scale), args.loss_steps, args.timed_steps)
        except Exception as error:  # recorded, and the runs after it still run
            row = dict(budget_bytes=int(gib * GIB * scale), error=f"{type(error).__name__}: {error}"[:3000])
        record["ooc_jit"].append(row | dict(gib=gib))
        save()
        show(dict(ooc_jit=[record["ooc_jit"][-1]], jax_jit=[]))
    record["profile"] = dataclasses.asdict(measure_profile())  # as the plans measured it (cached)
    for remat in [name == "remat" for name in args.jit.split(",") if name]:
        if not in_time(f"jax.jit remat={remat}"):
            continue
        print(f"{time.perf_counter() - began:.0f} s: jax.jit, remat={remat}", flush=True)
        try:
            row = jit_run(model, key, tokens, remat, args.loss_steps + 1, args.timed_steps)
        except Exception as error:
            row = dict(remat=remat, error=f"{type(error).__name__}: {error}"[:3000])
        record["jax_jit"].append(row)
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a small GPT at budgets scaled to its state")
    parser.add_argument("--out", help="a JSON file, or a folder for state_offload_gpu-<device>-<date>.json")
    parser.add_argument("--commit", help="the commit that runs, where the checkout has no .git")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS_GIB)), help="GiB, in the order run")
    parser.add_argument("--loss-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=480, help="seconds; a run that would start later is skipped")
    parser.add_argument("--reserve", type=float, default=60, help="seconds left for each run, at least")
    parser.add_argument("--jit", default="plain,remat", help="the jax.jit runs, in the order run")
    args = parser.parse_args()
    began = time.perf_counter()
    model = DRY_MODEL if args.dry_run else MODEL
    device = jax.devices()[0]
    record = dict(benchmark="state_offload_gpu", model=model, optimizer="adamw f32", dry_run=args.dry_run)
    record |= machine() | dict(device=device.device_kind, jax=jax.__version__)
    record["env"] = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}
    if args.commit:
        record["commit"] = args.commit
    record |= dict(ooc_jit=[], jax_jit=[], skipped=[])
    out = Path(args.out) if args.out else None
    if out and out.is_dir():
        out = out / f"state_offload_gpu-{device.device_kind.lower().replace(' ', '-')}-{datetime.date.today()}.json"

    def save():
        floors(record)
        if out:
            out.write_text(json.dumps(record, indent=1) + "\n")

    def in_time(name: str) -> bool:
        if time.perf_counter() - began + args.reserve <= args.deadline:
            return True
        record["skipped"].append(name)
        print(f"skipped {name}: past the deadline", flush=True)
        return False

    measure(record, model, [float(g) for g in args.budgets.split(",")], args, in_time, save)
    record["wall_s"] = time.perf_counter() - began
    save()
    print()
    show(record)
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
