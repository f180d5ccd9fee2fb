"""One command for a GPU session (issue 53): its measurements in one JSON, rewritten after every part.

Parts, in this order, each in a fresh process (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, no memory cap):

1. ``activation_gpt``: the activation-bound GPT of ``gpu_check.py`` (16 layers, width 1024, batch 8 x
   1024, f32 AdamW), in one process: ``jax.jit``; ``ooc_jit`` at 7.72 GiB (the H200 check's budget);
   every block in ``nn.remat(nothing_saveable)``; ``ooc_jit`` at remat's allocator-measured peak; the
   7.72 GiB chain's programs back to back and each alone; per ``ooc_jit`` step the executor's host
   waits and their seconds, the bytes copied each way against the plan's, the allocator's peak. They
   run in the order of their peaks (remat, ``ooc_jit`` at its peak, ``ooc_jit`` at 7.72 GiB, back to
   back, ``jax.jit``): a process's ``peak_bytes_in_use`` only rises, so a row's peak is its own only
   where it is above the rows' before it (``peak_is_own``). The initial state waits in host memory
   (numpy) and each row starts from a fresh copy of it.
2. ``state_gpt``: the 1.34B GPT of ``state_offload_gpu.py`` (its ``measure``), its state on host, in
   one process: the link each way alone and both at once; ``ooc_jit`` at 4 and 14 GiB (bytes each way
   against the plan's, peaks); ``jax.jit`` and per-block ``nn.remat`` in device memory.
3. ``host_adamw``: a jitted ``optax.adamw`` update over 1.34e9 f32 parameters on the host CPU
   (``JAX_PLATFORMS=cpu``), and the host's memory bandwidth (a numpy copy on one thread, an XLA:CPU
   elementwise program on all).
4. Beside every measured step, the same step planned for ``profile="h200"`` on the host's CPU, nothing
   compiled: ``row["h200_plan"]`` with its ``step_time_s`` and ``in_core_time_s`` (the ``jax.jit`` rows:
   the in-core plan). Those plans run in CPU-only processes beside parts 1-2, niced: the ones whose
   budgets are known at the start, then part 1's ``ooc_jit`` rows at the budgets part 1 used.

Deadline (``--deadline``, 470 s: the suite must end within 8 minutes of a 15-minute device slot): a
part starts only if its first item fits before it, and inside a part an item that would end after it
(``ESTIMATES_S``: seconds per item, from the committed H200 runs) is skipped with a note. A part's
process is killed at the deadline; it rewrites its own partial record after every item, and that is
kept. The suite's JSON (device, driver, jax/jaxlib, commit, XLA flags, environment) is rewritten after
every part. It exits nonzero on a real failure: a part's process failing, an error in a row, a loss
that is not finite or differs from ``jax.jit``'s, an ``ooc_jit`` peak over its budget. It never asks
for unified (managed) memory: it refuses to start with ``TF_FORCE_UNIFIED_MEMORY`` set or a memory
fraction above 1.

    python benchmarks/gpu_suite.py --out "$OUT"      # on a GPU: gpu_suite-<device>-<date>.json there
    python benchmarks/gpu_suite.py --dry-run         # anywhere: tiny sizes on the CPU, every part, 31-69 s

The dry run (part of the test suite) checks the script: no memory statistics on a CPU, ``ooc_jit``'s
budget at half its plan's in-core estimate, and its timings mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings as warnings_module
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as ``python benchmarks/gpu_suite.py``: put the repository root on the path
    sys.path.insert(0, str(ROOT))
from benchmarks import gpu_check  # noqa: E402  (no jax at the top of either: the parent never starts a backend)
from benchmarks._machine import machine  # noqa: E402

GIB = 2**30
PARTS = ("activation_gpt", "state_gpt", "host_adamw")
ACTIVATION_BUDGET_BYTES = 8286266982  # segment_profile.H200_BUDGET_BYTES: the H200 check's 7.72 GiB
# A dry run's models, one layer each (fewer programs to compile on a CPU): gpu_check's dry GPT, and a
# GPT whose state-to-budget ratios are the 1.34B GPT's (narrower ones have values at those budgets
# that no plan can move: the embedding). Their H200 plans leave no headroom, as their rows ran on the
# CPU (at these sizes a GPU's 8% leaves the 4 GiB case no room).
DRY_ACTIVATION_MODEL = dict(layers=1, width=64, heads=4, batch=4, seq=32, vocab=256)
DRY_STATE_MODEL = dict(layers=1, width=512, heads=8, vocab=1024, batch=1, seq=16)
STATE_BUDGETS_GIB = (4.0, 14.0)
ADAMW_PARAMETERS = 1341803776  # the 1.34B GPT's (state_offload_gpu-*.json "parameters")
DRY_ADAMW_PARAMETERS = 1341803
DRY_BUDGET_SHARE = 0.7  # of the in-core estimate: the tiny GPT's values move (fewer segments than at half)
DRY_OPTIONS = dict(min_offload_bytes=16 * 1024)
DRY_PLAN_OPTIONS = dict(headroom_bytes=0)
LOSS_RTOL = 1e-3  # losses against jax.jit's from the same state: f32 segments fuse differently, no more
IN_CORE = 2**62  # a budget nothing exceeds: the plan of the step in core
# Seconds per item on an H200, what the deadline goes by, from the committed runs (benchmarks/results/).
# gpu-nvidia-h200-2026-11-26b.json: jax.jit compiled the step in 23 s, per-block remat in 28 s, ooc_jit
# planned and compiled in 24 s, and each of its processes took 83-86 s in all (~55 s of it starting,
# importing and making the state: the first item here); segment_profile's one process took ~140 s.
# state_offload_gpu-nvidia-h200-2026-11-28.json, one process, 339 s in all: the 4 GiB init 52 s and
# first call 54 s, the 14 GiB first call 33 s, jax.jit compiles 29 s and 33 s (remat), ~100 s outside
# those and the steps. host_adamw never ran: 37.6 GB of traffic a step at the 20-50 GB/s of a host.
# In all ~550 s: past the 470 s deadline, so a run at these timings skips the 1.34B GPT's remat and the
# host's AdamW (each row's item_s says what it took, to size the next run).
ESTIMATES_S = {
    "activation_gpt": dict(
        setup=40, remat=35, ooc_jit_at_remat_peak=45, ooc_jit=35, back_to_back=20, segments_alone=5, jax_jit=30
    ),
    "state_gpt": {
        "link": 30,  # with the process's start
        "ooc_jit at 4.0 GiB": 120,
        "ooc_jit at 14.0 GiB": 45,
        "jax.jit remat=False": 45,
        "jax.jit remat=True": 50,
    },
    "host_adamw": dict(setup=10, adamw=30, bandwidth=10),
}
DRY_ESTIMATES_S = {part: {item: 1 for item in items} for part, items in ESTIMATES_S.items()}
ENV_PREFIXES = ("XLA_", "JAX_", "TF_", "CUDA_", "NVIDIA_", "OOCJAX")


# -- in a part's process --------------------------------------------------------------------------------


class Clock:
    """An item starts only if its estimate ends before the deadline; one that would not is noted."""

    def __init__(self, seconds: float, estimates: dict, skipped: list):
        self.end, self.estimates, self.skipped = time.perf_counter() + seconds, estimates, skipped

    def allows(self, item: str) -> bool:
        left, needs = self.end - time.perf_counter(), self.estimates.get(item, 0)
        if needs <= left:
            return True
        self.skipped.append(
            dict(item=item, note=f"skipped: needs ~{needs:.0f} s, {max(left, 0):.0f} s to the deadline")
        )
        print(f"skipped {item}: past the deadline", flush=True)
        return False


def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def _put(tree, kind: str):
    """``tree`` (numpy arrays) in the device's memory of ``kind``. Where a put from numpy does not land
    there (not seen; a safeguard), it goes to the device first and across from there."""
    import jax

    device = jax.devices()[0]
    target = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
    put = jax.block_until_ready(jax.device_put(tree, target))
    if all(x.sharding.memory_kind == kind for x in jax.tree.leaves(put)):
        return put
    on_device = jax.device_put(tree, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))
    moved = jax.block_until_ready(jax.device_put(on_device, target))
    jax.tree.map(lambda x: x.delete(), on_device)
    return moved


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:3000]


def device_info() -> dict:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return dict(
        device=device.device_kind,
        platform=device.platform,
        platform_version=getattr(device.client, "platform_version", None),
        bytes_limit=stats.get("bytes_limit"),
    )


def _stepped(step, state, batch, loss_steps: int, timed_steps: int, row: dict, before: int | None):
    """``state_offload_gpu.steps_run``'s steps into ``row``: losses, first and timed step times, the
    allocator's peak after them and whether it is this row's own; the state after."""
    from benchmarks.state_offload_gpu import steps_run

    state, losses, first_s, timed = steps_run(step, state, batch, loss_steps, timed_steps)
    after = peak_bytes()
    row |= dict(losses=losses, first_step_s=first_s, timed_s=timed, s_per_step=statistics.median(timed))
    row |= dict(peak_bytes_in_use=after, peak_is_own=None if after is None or before is None else after > before)
    row["finite"] = all(math.isfinite(x) for x in losses)
    return state


def jit_row(step_fn, abstract_state, initial, batch, config: dict, plan_key: str) -> dict:
    """``jax.jit`` of ``step_fn`` (state donated) from a fresh device copy of ``initial``."""
    import jax

    from benchmarks.segment_profile import compiled_peak_bytes

    started = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=(0,)).lower(abstract_state, batch).compile()
    row = dict(
        plan_key=plan_key, compile_s=time.perf_counter() - started, compiled_peak_bytes=compiled_peak_bytes(compiled)
    )
    before = peak_bytes()
    _stepped(compiled, _put(initial, "device"), batch, config["loss_steps"], config["timed_steps"], row, before)
    return row


def plan_facts(plan) -> dict:
    """What a plan says it will do (the figures its run is held against)."""
    from oocjax.testing import segment_signature

    return dict(
        plan=repr(plan),
        segments=len(plan.segments),
        distinct_programs=len({segment_signature(plan.program, x.start, x.stop) for x in plan.segments}),
        planned_peak_bytes=plan.peak_bytes,
        executed_peak_bytes=plan.executed_peak_bytes,
        in_core_estimate_bytes=plan.baseline_peak_bytes,
        moved_bytes=plan.moved_bytes,
        planned_to_device_bytes=plan.timeline.h2d_bytes,
        planned_back_bytes=plan.timeline.d2h_bytes,
        host_kept_bytes=sum(h.nbytes for h in plan.host_inputs),
        recomputed=len(plan.recomputed),
        layer_policy=list(plan.layer_policy),
        simulated_step_s=plan.step_time_s,  # with this device's measured rates
        simulated_in_core_s=plan.in_core_time_s,
        attempts=list(plan.attempts),
    )


def ooc_row(step_fn, initial, batch, budget: int, options: dict, config: dict, plan_key: str) -> tuple:
    """``ooc_jit`` of ``step_fn`` at ``budget``, the state starting in host memory: its plan, steps,
    host waits per step, bytes copied each way per step; ``(row, step, state after)``."""
    from benchmarks.segment_profile import executor_costs
    from benchmarks.state_offload import copies_counted
    from oocjax import ooc_jit
    from oocjax.testing import with_seams

    before = peak_bytes()
    started = time.perf_counter()
    moved, access = copies_counted()  # every copy the executor makes, counted from here
    step = with_seams(ooc_jit(step_fn, budget=budget, donate_argnums=(0,), **options), device_access=access)
    state = _put(initial, "pinned_host")
    plan = step.plan(state, batch)
    row = dict(plan_key=plan_key, budget_bytes=budget, plan_s=time.perf_counter() - started, **plan_facts(plan))
    row["peak_before_steps_bytes"] = peak_bytes()
    with warnings_module.catch_warnings(record=True) as replanned:  # ooc_jit warns when it plans again
        warnings_module.simplefilter("always")
        state = _stepped(step, state, batch, config["loss_steps"], config["timed_steps"], row, before)
        carried, counted, earlier = [state], max(config["timed_steps"], 1), dict(moved)
        row |= executor_costs(step, carried, batch, counted)
    copied = {kind: moved[kind] - earlier[kind] for kind in moved}  # the timed steps' copies alone
    row |= dict(copied_to_device_bytes=copied["device"] / counted, copied_back_bytes=copied["pinned_host"] / counted)
    row["warnings"] = [str(w.message)[:400] for w in replanned][:5]
    final = step.plan(carried[0], batch)
    row["final_plan"] = repr(final) if repr(final) != row["plan"] else None  # planned again after measuring over
    row["peak_bytes_in_use"] = peak_bytes()
    row["within_budget"] = None if row["peak_bytes_in_use"] is None else row["peak_bytes_in_use"] <= budget
    return row, step, carried[0]


def activation_gpt(config: dict, clock: Clock, record: dict, save: Callable) -> None:
    """Part 1 (see the module's docstring), rows into ``record["rows"]`` by name."""
    import jax
    import numpy as np

    from benchmarks.executor_overhead import back_to_back, median_seconds
    from benchmarks.gpu_check import workload
    from benchmarks.segment_profile import segment_rows
    from oocjax import ooc_jit

    model, rows, dry = config["model"], record["rows"], config["dry_run"]
    record |= device_info()
    work, remat = workload(model), workload(model, "remat_block_nothing_saveable")
    record["model"] = dict(model, name=work.name, dtype="float32", optimizer="adamw")
    if not clock.allows("setup"):
        return
    state = jax.block_until_ready(jax.jit(work.init)(jax.random.key(0)))
    batch = jax.random.randint(jax.random.key(1), work.batch.shape, 0, model["vocab"], work.batch.dtype)
    initial = jax.tree.map(np.asarray, state)  # every row starts from a copy of it
    del state
    record["peak_after_setup_bytes"] = peak_bytes()
    save()
    options = DRY_OPTIONS if dry else {}

    def guarded(name: str, run: Callable) -> object:
        """``run()``, its row recorded under ``name`` (an error recorded instead); its other results."""
        print(f"{name} ...", flush=True)
        started = time.perf_counter()
        try:
            result = run()
        except Exception as error:  # recorded; the rows after it still run
            rows[name] = dict(error=_error(error), run_order=len(rows), item_s=time.perf_counter() - started)
            save()
            return None
        row, *more = result if isinstance(result, tuple) else (result,)
        rows[name] = dict(row, run_order=len(rows), item_s=time.perf_counter() - started)  # against ESTIMATES_S
        save()
        return more

    if clock.allows("remat"):
        guarded("remat", lambda: jit_row(remat.step, work.state, initial, batch, config, "activation/remat"))
    remat_row = rows.get("remat", {})
    if "s_per_step" in remat_row:
        measured = remat_row["peak_bytes_in_use"] if remat_row["peak_is_own"] else None
        budget = measured or remat_row["compiled_peak_bytes"]
        record["remat_peak_bytes"] = dict(bytes=budget, source="allocator" if measured else "compiled program")
        if clock.allows("ooc_jit_at_remat_peak"):
            key = "activation/ooc_jit_at_remat_peak"
            guarded("ooc_jit_at_remat_peak", lambda: ooc_row(work.step, initial, batch, budget, options, config, key))
    if dry:  # no memory to cap on a CPU: a share of the in-core estimate, so that the tiny model's values move
        in_core = rows.get("ooc_jit_at_remat_peak", {}).get("in_core_estimate_bytes")  # the same step's
        in_core = in_core or ooc_jit(work.step, budget=IN_CORE).plan(work.state, batch).baseline_peak_bytes
        budget = int(in_core * DRY_BUDGET_SHARE)
    else:
        budget = ACTIVATION_BUDGET_BYTES
    done = None
    if clock.allows("ooc_jit"):
        done = guarded(
            "ooc_jit", lambda: ooc_row(work.step, initial, batch, budget, options, config, "activation/ooc_jit")
        )
    if done and clock.allows("back_to_back"):
        step, state = done

        def programs():
            plain = back_to_back(step, (state, batch))
            before = peak_bytes()
            seconds = median_seconds(plain, max(config["timed_steps"], 1))
            after = peak_bytes()
            row = dict(plan_key="activation/ooc_jit", s_per_step=seconds, peak_bytes_in_use=after)
            row["peak_is_own"] = None if after is None or before is None else after > before
            if clock.allows("segments_alone"):
                row["segments_alone"] = segment_rows(step.plan(state, batch), plain, max(config["timed_steps"], 1))
                row["segments_alone_s"] = sum(r["solo_s"] for r in row["segments_alone"])
            return row

        guarded("back_to_back", programs)
        del state
    if clock.allows("jax_jit"):
        guarded("jax_jit", lambda: jit_row(work.step, work.state, initial, batch, config, "activation/in_core"))


def state_gpt(config: dict, clock: Clock, record: dict, save: Callable) -> None:
    """Part 2: ``state_offload_gpu.measure`` at 4 and 14 GiB, its rows keyed to their plans."""
    from benchmarks import state_offload_gpu

    record |= device_info() | dict(model=config["model"], optimizer="adamw f32", ooc_jit=[], jax_jit=[])
    settings = types.SimpleNamespace(
        dry_run=config["dry_run"], loss_steps=config["loss_steps"], timed_steps=config["timed_steps"], jit="plain,remat"
    )

    def saved() -> None:
        for row in record["ooc_jit"]:
            row.setdefault("plan_key", f"state/ooc_jit_{row['gib']:g}")
        for row in record["jax_jit"]:
            row.setdefault("plan_key", "state/remat" if row["remat"] else "state/in_core")
        state_offload_gpu.floors(record)
        save()

    state_offload_gpu.measure(record, config["model"], list(config["budgets_gib"]), settings, clock.allows, saved)


def host_adamw(config: dict, clock: Clock, record: dict, save: Callable) -> None:
    """Part 3, on the host CPU: a jitted AdamW update over ``parameters`` f32 values (state donated),
    bytes moved a step = 7 arrays' (reads parameters, gradients and both moments, writes three);
    the memory bandwidth of a numpy copy (one thread) and of an XLA:CPU program (its threads)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    n = config["parameters"]
    record |= device_info() | dict(parameters=n, cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)))
    optimizer = optax.adamw(1e-4)

    def update(params, grads, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if clock.allows("adamw"):
        params = jax.jit(lambda: jnp.full((n,), 0.5, jnp.float32))()
        grads = jax.jit(lambda: jnp.full((n,), 1e-3, jnp.float32))()
        opt_state = jax.jit(optimizer.init)(params)
        step = jax.jit(update, donate_argnums=(0, 2))
        times = []
        for _ in range(min(config["timed_steps"], 2) + 1):  # the first compiles; each takes seconds on a host
            started = time.perf_counter()
            params, opt_state = jax.block_until_ready(step(params, grads, opt_state))
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times[1:])
        record["adamw"] = dict(first_s=times[0], timed_s=times[1:], s_per_step=seconds, bytes_per_step=7 * 4 * n)
        record["adamw"]["GB_per_s"] = 7 * 4 * n / seconds / 1e9
        record["adamw"]["finite"] = bool(jnp.isfinite(params[:8]).all())
        del params, grads, opt_state
        save()
    if clock.allows("bandwidth"):
        a = np.full(min(n, GIB // 4), 1.0, np.float32)
        b = np.empty_like(a)
        copy = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
        x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
        scale = jax.jit(lambda x: x * 1.5 + 0.5)
        jax.block_until_ready(scale(x))
        xla = min(_timed(lambda: jax.block_until_ready(scale(x))) for _ in range(3))
        record["bandwidth"] = dict(
            numpy_copy_bytes=a.nbytes, numpy_copy_GB_per_s=2 * a.nbytes / copy / 1e9,
            xla_cpu_bytes=x.nbytes, xla_cpu_GB_per_s=2 * x.nbytes / xla / 1e9,
        )  # fmt: skip
        save()


def _timed(run: Callable) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def plans(config: dict, clock: Clock, record: dict, save: Callable) -> None:
    """Each spec of ``config["specs"]`` planned for ``profile="h200"`` (nothing compiled), by key."""
    record.setdefault("plans", {})
    for spec in config["specs"]:
        try:
            record["plans"][spec["key"]] = h200_plan(spec, config["dry_run"])
        except Exception as error:  # recorded: a plan that fails is a finding, not the suite's failure
            record["plans"][spec["key"]] = dict(error=_error(error))
        save()


def h200_plan(spec: dict, dry_run: bool) -> dict:
    """The step of ``spec`` (``family`` "activation" or "state", ``variant`` "plain" or "remat", a
    ``budget_bytes`` or ``gib``; neither: in core) planned for the H200 profile."""
    import jax
    import jax.numpy as jnp

    from benchmarks import gpu_check, state_offload_gpu
    from oocjax import ooc_jit

    model, remat = spec["model"], spec["variant"] == "remat"
    if spec["family"] == "activation":
        work = gpu_check.workload(model, "remat_block_nothing_saveable" if remat else "jax_jit")
        step_fn, args = work.step, (work.state, work.batch)
    else:
        init, step_fn = state_offload_gpu.gpt(model, remat=remat)
        tokens = jax.ShapeDtypeStruct((model["batch"], model["seq"] + 1), jnp.int32)
        args = (jax.eval_shape(init, jax.random.key(0)), tokens)
    budget = spec.get("budget_bytes") or IN_CORE
    if "gib" in spec:
        budget = int(spec["gib"] * GIB * state_offload_gpu.budget_scale(model, dry_run))
    started = time.perf_counter()
    plan = ooc_jit(step_fn, budget=budget, donate_argnums=(0,), **spec.get("options", {})).plan(*args, profile="h200")
    facts = plan_facts(plan)
    return dict(
        profile="h200",
        budget_bytes=None if budget == IN_CORE else budget,
        step_time_s=plan.step_time_s,
        in_core_time_s=plan.in_core_time_s,
        swap_only_time_s=plan.swap_only_time_s,
        compiled=plan.compiled,
        plan_s=time.perf_counter() - started,
        **{k: facts[k] for k in ("plan", "segments", "planned_peak_bytes", "in_core_estimate_bytes", "moved_bytes")},
        **{k: facts[k] for k in ("planned_to_device_bytes", "planned_back_bytes", "host_kept_bytes", "recomputed")},
        layer_policy=facts["layer_policy"],
    )


CHILDREN = dict(activation_gpt=activation_gpt, state_gpt=state_gpt, host_adamw=host_adamw, plans=plans, plans_ooc=plans)


def child(name: str, config: dict, partial: Path) -> None:
    """A part in this process: its record rewritten to ``partial`` after every item."""
    record: dict = dict(rows={}, skipped=[]) if name == "activation_gpt" else dict(skipped=[])
    clock = Clock(config["seconds"], config["estimates"], record["skipped"])

    def save() -> None:
        temporary = partial.with_suffix(".tmp")
        temporary.write_text(json.dumps(record, indent=1, default=str) + "\n")
        temporary.replace(partial)

    CHILDREN[name](config, clock, record, save)
    save()


# -- in the parent process ----------------------------------------------------------------------------


def refuse_managed_memory(environ=os.environ) -> None:
    """Unified (managed) memory beyond what the card has free can hang it: never asked for here.

    >>> refuse_managed_memory({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    >>> refuse_managed_memory({"TF_FORCE_UNIFIED_MEMORY": "1"})
    Traceback (most recent call last):
    SystemExit: gpu_suite asks for no unified memory: unset TF_FORCE_UNIFIED_MEMORY=1
    """
    if environ.get("TF_FORCE_UNIFIED_MEMORY", "").lower() not in ("", "0", "false"):
        raise SystemExit(
            f"gpu_suite asks for no unified memory: unset TF_FORCE_UNIFIED_MEMORY={environ['TF_FORCE_UNIFIED_MEMORY']}"
        )
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        if float(environ.get(name) or 0) > 1:
            raise SystemExit(f"gpu_suite asks for no more memory than the card has: {name}={environ[name]} is over 1")


def nvidia_smi() -> dict | None:
    """The GPU's name, driver and memory (MiB) as ``nvidia-smi`` reports them; None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ("name", "driver_version", "memory.total", "memory.used", "memory.free")
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if done.returncode or not done.stdout.strip():
        return dict(error=done.stderr[-500:])
    return dict(zip(fields, (v.strip() for v in done.stdout.splitlines()[0].split(","))))


def start(name: str, config: dict, folder: Path, cpu_only: bool = False) -> tuple:
    """A part's process, started: ``(process, its partial record's path, its stderr's path)``."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if cpu_only:
        env["JAX_PLATFORMS"] = "cpu"
    partial, stderr = folder / f"{name}.json", folder / f"{name}.stderr"
    command = [sys.executable, __file__, "--child", name, "--config", json.dumps(config), "--partial", str(partial)]
    niced = (lambda: os.nice(10)) if name == "plans" else None  # planning beside a measured part stays out of its way
    process = subprocess.Popen(command, env=env, stderr=stderr.open("w"), preexec_fn=niced)
    return process, partial, stderr


def finish(started: tuple, timeout: float) -> dict:
    """The part's record once its process ends (killed at ``timeout`` seconds): what it wrote, how it ended."""
    process, partial, stderr = started
    try:
        code = process.wait(timeout=max(timeout, 1))
        status = "done" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        process.kill()
        code, status = process.wait(), "cut short"
    record = json.loads(partial.read_text()) if partial.exists() else {}
    tail = stderr.read_text()[-2000:] if stderr.exists() else ""
    return dict(status=status, exit_code=code, record=record, stderr_tail=tail if status != "done" else tail[-300:])


def run_parts(names, run: Callable, seconds_left: Callable, first_item_s: Callable, after: Callable) -> list[dict]:
    """Each part in order, ``run(name, seconds)`` -> its result, unless even its first item would end
    after the deadline (``first_item_s(name)`` against ``seconds_left()``): then a note says so.
    ``after(results)`` follows every part, run or skipped (the suite rewrites its JSON there)."""
    results = []
    for name in names:
        left = seconds_left()
        if first_item_s(name) > left:
            note = f"skipped: its first item needs ~{first_item_s(name):.0f} s, {max(left, 0):.0f} s to the deadline"
            results.append(dict(part=name, status="skipped", note=note))
        else:
            results.append(dict(part=name, **run(name, left)))
        after(results)
    return results


def models(dry: bool) -> tuple[dict, dict]:
    """The activation-bound GPT's and the state GPT's sizes."""
    from benchmarks.gpu_check import GPU_MODEL
    from benchmarks.state_offload import MODEL

    return (DRY_ACTIVATION_MODEL, DRY_STATE_MODEL) if dry else (GPU_MODEL, MODEL)


def plan_specs(dry: bool, activation: dict | None = None, parts=PARTS) -> list[dict]:
    """The plans beside the measured rows: without ``activation`` (part 1's record), those known up
    front (per-block remat's in core, the state GPT's budgets) for ``parts``; with it, part 1's
    ``ooc_jit`` rows at the budgets they ran at. The ``jax.jit`` rows take the in-core figures of
    their model's plans."""
    a_model, s_model = models(dry)
    if activation is not None:
        options = DRY_OPTIONS | DRY_PLAN_OPTIONS if dry else {}
        plain = dict(family="activation", variant="plain", model=a_model, options=options)
        rows = [row for row in activation.get("rows", {}).values() if "budget_bytes" in row]
        return [dict(plain, key=row["plan_key"], budget_bytes=row["budget_bytes"]) for row in rows]
    specs = [dict(key="activation/remat", family="activation", variant="remat", model=a_model)]
    specs.append(dict(key="state/remat", family="state", variant="remat", model=s_model))
    plain = dict(family="state", variant="plain", model=s_model, options=DRY_PLAN_OPTIONS if dry else {})
    specs += [dict(plain, key=f"state/ooc_jit_{g:g}", gib=g) for g in STATE_BUDGETS_GIB]
    return [spec for spec in specs if f"{spec['family']}_gpt" in parts]


def measured_rows(record: dict) -> list[tuple[str, dict]]:
    """``(part/name, row)`` for every measured step of a suite record."""
    rows = []
    for part in record["parts"]:
        r = part.get("record") or {}
        rows += [(f"{part['part']}/{name}", row) for name, row in (r.get("rows") or {}).items()]
        rows += [(f"{part['part']}/ooc_jit_{row.get('gib', 0):g}", row) for row in r.get("ooc_jit") or []]
        rows += [(f"{part['part']}/{'remat' if row['remat'] else 'jax_jit'}", row) for row in r.get("jax_jit") or []]
    return rows


def merge_plans(record: dict) -> None:
    """Each measured row's ``h200_plan``: its plan's figures; a ``jax.jit`` row's (``.../in_core``),
    the in-core step of its model's first plan that has one (the same traced step)."""
    plans = record["plans"]
    for _, row in measured_rows(record):
        key = row.get("plan_key", "")
        if key in plans:
            row["h200_plan"] = plans[key]
        elif key.endswith("/in_core"):
            family = key.split("/")[0]
            found = [(k, p) for k, p in plans.items() if k.startswith(f"{family}/ooc_jit") and "in_core_time_s" in p]
            if found:
                k, seconds = found[0][0], found[0][1]["in_core_time_s"]
                row["h200_plan"] = dict(profile="h200", in_core_of=k, step_time_s=seconds, in_core_time_s=seconds)


def summarise(record: dict) -> dict:
    """What failed (the suite then exits nonzero), what was skipped, and the headline ratios."""
    failures, warnings, skipped = [], [], []
    for part in record["parts"]:
        name, r = part["part"], part.get("record") or {}
        if part["status"] == "skipped":
            skipped.append(f"{name}: {part['note']}")
        elif part["status"] == "cut short":  # the deadline's doing, not a failure: what it measured is kept
            skipped.append(f"{name}: cut short at the deadline; its items measured by then are kept")
        elif part["status"] != "done":
            failures.append(f"{name}: {part['status']} (exit {part['exit_code']}): {_last_line(part['stderr_tail'])}")
        skipped += [f"{name}/{s['item']}: {s['note']}" for s in r.get("skipped", [])]
    reference = {}
    for where, row in measured_rows(record):
        part = where.split("/")[0]
        if row.get("error"):
            failures.append(f"{where}: {_last_line(row['error'])}")
        elif row.get("finite") is False:
            failures.append(f"{where}: a loss is not finite: {row['losses']}")
        if where.endswith("/jax_jit") and row.get("losses"):
            reference[part] = row
    for where, row in measured_rows(record):
        jit = reference.get(where.split("/")[0])
        if jit and row.get("losses") and row is not jit:
            n = min(len(row["losses"]), len(jit["losses"]))
            row["loss_max_rel_diff"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"][:n], jit["losses"][:n])
            )
            row["vs_jax_jit"] = row["s_per_step"] / jit["s_per_step"]
            if row["loss_max_rel_diff"] > LOSS_RTOL:
                failures.append(f"{where}: losses differ from jax.jit's by {row['loss_max_rel_diff']:.2g} (relative)")
        if row.get("within_budget") is False and row.get("peak_is_own"):
            failures.append(f"{where}: peak {row['peak_bytes_in_use']} bytes over its budget {row['budget_bytes']}")
        if "plan_key" in row and "h200_plan" not in row:
            warnings.append(f"{where}: no h200 plan beside it")
        elif "error" in row.get("h200_plan", {}):
            warnings.append(f"{where}: its h200 plan failed: {_last_line(row['h200_plan']['error'])}")
    return dict(failures=failures, warnings=warnings, skipped=skipped)


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def describe(where: str, row: dict) -> str:
    if row.get("error"):
        return f"{where:<34} FAILED {_last_line(row['error'])}"
    parts = [f"{row['s_per_step'] * 1e3:9.2f} ms"] if "s_per_step" in row else []
    if row.get("vs_jax_jit"):
        parts.append(f"{row['vs_jax_jit']:.2f}x jax.jit")
    if row.get("peak_bytes_in_use"):
        parts.append(
            f"peak {row['peak_bytes_in_use'] / GIB:.2f} GiB{'' if row.get('peak_is_own') else ' (not its own)'}"
        )
    if row.get("budget_bytes"):
        parts.append(f"budget {row['budget_bytes'] / GIB:.3g} GiB")
    if "copied_to_device_bytes" in row:
        parts.append(
            f"copied {row['copied_to_device_bytes'] / GIB:.2f}/{row['copied_back_bytes'] / GIB:.2f} GiB "
            f"(plan {row['planned_to_device_bytes'] / GIB:.2f}/{row['planned_back_bytes'] / GIB:.2f})"
        )
    h200 = row.get("h200_plan") or {}
    if h200.get("step_time_s"):
        parts.append(f"h200 plan {h200['step_time_s'] * 1e3:.1f} ms (in core {h200['in_core_time_s'] * 1e3:.1f})")
    return f"{where:<34} " + ", ".join(parts)


class Suite:
    """The parent process: each part in a process of its own, in order (a dry run: two at a time,
    each still its own process; no timing there means anything), the plans beside them, and the
    suite's JSON rewritten after every part."""

    def __init__(self, dry: bool, names: list[str], deadline: float, common: dict, out: str | None):
        self.dry, self.names, self.deadline, self.common = dry, names, deadline, common
        self.estimates = DRY_ESTIMATES_S if dry else ESTIMATES_S
        self.began = time.perf_counter()
        activation, state = models(dry)
        self.configs = dict(
            activation_gpt=dict(common, model=activation),
            state_gpt=dict(common, model=state, budgets_gib=STATE_BUDGETS_GIB),
            host_adamw=dict(common, parameters=DRY_ADAMW_PARAMETERS if dry else ADAMW_PARAMETERS),
        )
        smi = nvidia_smi()
        now = datetime.datetime.now().isoformat(timespec="seconds")
        self.record = dict(
            benchmark="gpu_suite", dry_run=dry, **machine(), started=now,
            versions=gpu_check._versions(), env={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
            nvidia_smi=smi, driver=(smi or {}).get("driver_version"), device=(smi or {}).get("name"),
            settings=dict(common, deadline_s=deadline, estimates_s=self.estimates, parts=names), parts=[], plans={},
        )  # fmt: skip
        self.folder = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
        self.out = _out_path(out, dry, self.record)
        # The plans whose budgets are known start now, beside part 1; a dry run keeps its two cores for
        # the parts and plans them with part 1's (one process fewer).
        known, self.deferred, self.planning = plan_specs(dry, parts=names), [], []
        if dry and "activation_gpt" in names:
            self.deferred = known
        elif known:
            self.planning.append(self._plans("plans", known))
        self.early = {}
        if dry:  # every part's process started at once, two running at a time
            pool = concurrent.futures.ThreadPoolExecutor(2)
            self.early = {name: pool.submit(self._part, name, deadline) for name in names}
            pool.shutdown(wait=False)

    def seconds_left(self) -> float:
        return self.deadline - (time.perf_counter() - self.began)

    def _plans(self, name: str, specs: list[dict]) -> tuple:
        return start(name, dict(self.common, specs=specs, seconds=self.seconds_left(), estimates={}), self.folder, True)

    def _part(self, name: str, seconds: float) -> dict:
        config = dict(self.configs[name], seconds=seconds, estimates=self.estimates[name])
        started = time.perf_counter()
        result = finish(start(name, config, self.folder, cpu_only=name == "host_adamw"), seconds)
        return dict(result, wall_s=time.perf_counter() - started, ended_at_s=time.perf_counter() - self.began)

    def run(self, name: str, seconds: float) -> dict:
        result = self.early[name].result() if name in self.early else self._part(name, seconds)
        if name == "activation_gpt":
            specs = self.deferred + plan_specs(self.dry, result["record"])
            if specs:  # part 1's ooc_jit rows at the budgets it ran them at, planned beside part 2
                self.planning.append(self._plans("plans_ooc", specs))
            if not self.dry and result["record"].get("platform") == "cpu":
                raise SystemExit("no GPU here (jax.devices() is a CPU): run with --dry-run to check the script")
        return result

    def write(self, results: list) -> None:
        record = self.record
        record["parts"] = results
        for name in ("plans", "plans_ooc"):
            partial = self.folder / f"{name}.json"
            if partial.exists():
                record["plans"] |= json.loads(partial.read_text()).get("plans", {})
        on_gpu = [p["record"]["device"] for p in results if (p.get("record") or {}).get("platform") == "gpu"]
        record["device"] = next(iter(on_gpu), record["device"])
        merge_plans(record)
        record["summary"] = summarise(record)
        record["wall_s"] = time.perf_counter() - self.began
        self.out.write_text(json.dumps(record, indent=1, default=str) + "\n")

    def __call__(self) -> dict:
        first_item_s = lambda name: next(iter(self.estimates[name].values()))  # noqa: E731
        results = run_parts(self.names, self.run, self.seconds_left, first_item_s, self.write)
        self.record["planning"] = [finish(p, self.seconds_left()) | dict(record=None) for p in self.planning]
        self.write(results)
        return self.record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script")
    parser.add_argument("--out", help="a JSON file, or a folder for gpu_suite-<device>-<date>.json")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, in order (of {', '.join(PARTS)})")
    parser.add_argument("--deadline", type=float, help="seconds for everything (default 470; dry run 300)")
    parser.add_argument("--loss-steps", type=int, default=2, help="steps whose losses are recorded")
    parser.add_argument("--timed-steps", type=int, help="timed steps after those (default 5; dry run 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--partial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, json.loads(args.config), Path(args.partial))
    refuse_managed_memory()
    names = [n for n in args.parts.split(",") if n]
    if unknown := sorted(set(names) - set(PARTS)):
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if not args.dry_run and shutil.which("nvidia-smi") is None:
        raise SystemExit("no GPU here (no nvidia-smi): run with --dry-run to check the script")
    common = dict(
        dry_run=args.dry_run, loss_steps=args.loss_steps, timed_steps=args.timed_steps or (1 if args.dry_run else 5)
    )
    suite = Suite(args.dry_run, names, args.deadline or (300 if args.dry_run else 470), common, args.out)
    record = suite()
    for where, row in measured_rows(record):
        print(describe(where, row))
    summary = record["summary"]
    print(f"wrote {suite.out} ({record['wall_s']:.0f} s)")
    for line in summary["skipped"] + [f"warning: {w}" for w in summary["warnings"]]:
        print(line)
    if summary["failures"]:
        raise SystemExit("gpu_suite failed:\n  " + "\n  ".join(summary["failures"]))


def _out_path(out: str | None, dry: bool, record: dict) -> Path:
    name = f"gpu_suite-{'dry-run-' if dry else ''}{_slug(record['device'] or 'cpu')}-{record['date']}.json"
    if out is None:
        return (Path(tempfile.gettempdir()) if dry else ROOT / "benchmarks" / "results") / name
    return Path(out) / name if Path(out).is_dir() else Path(out)


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split()) or "unknown"


if __name__ == "__main__":
    main()
