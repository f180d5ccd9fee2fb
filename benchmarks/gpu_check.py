"""The GPU check: does ``ooc_jit`` run a step that ``jax.jit`` cannot fit, within its budget, and at what cost?

One Flax GPT training step (``models.gpt2`` in float32, AdamW; 16 layers, width 1024, 16 heads,
batch 8, seq 1024, vocabulary 1024 by default), each configuration in a fresh process with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so that its runtime peak is its own:

- ``link``: host<->device bandwidth per direction and both at once, pinned host memory: jitted 1 GiB copies, and
  eager ``jax.device_put`` at 4 MiB and 256 MiB;
- ``jax_jit``: the step under ``jax.jit``, no cap: the reference peak, step time and losses;
- ``jax_jit_capped``: the same under ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set so that the allocator's
  ``bytes_limit`` is about 1/3 of ``jax_jit``'s peak: it should run out of memory (recorded as a
  result, not a failure);
- ``ooc_jit_capped``: ``ooc_jit`` under the same cap with a budget of 0.8x ``bytes_limit``
  (``recompute="auto"``, the default: it swaps or recomputes): its runtime ``peak_bytes_in_use``
  must stay within the budget, and its losses should equal ``jax_jit``'s;
- ``remat_nothing_saveable_capped``, ``remat_dots_saveable_capped``, ``remat_offload_dots_capped``:
  what a user would write instead, every block in ``nn.remat`` under ``nothing_saveable``,
  ``dots_saveable`` or ``offload_dot_with_no_batch_dims("device", "pinned_host")``, under
  ``jax.jit`` and the same cap (running out of memory is a result, not a failure);
- run only when ``--configurations`` names them: ``ooc_jit_swap_only_capped`` (``recompute="off"``,
  the adaptive window alone), and ``remat_nothing_saveable``, ``remat_offload_dots`` (the whole
  loss in one ``jax.checkpoint``, no cap: the earlier runs' baselines);
- ``ooc_jit_capped_account``, run only when ``--configurations`` names it: ``ooc_jit_capped`` with
  the executor's allocator gate switched off (``DeviceAccess.allocator_gate``: waits on its own byte
  account alone), the baseline the gate is measured against.

An ``ooc_jit`` configuration also looks for memory the executor does not account for. Its first
step, and one more step after the timed ones, run *synced*: at every segment launch all device
work is finished first, then the allocator's ``bytes_in_use`` (before and after that),
``peak_bytes_in_use`` and the bytes of live device arrays are recorded against the executor's
account (``held`` + ``in flight``) and the segment's ``memory_analysis``. Summarised in the
record's ``synced_first_step`` / ``synced_last_step`` (``summarise_synced``): memory freed only
once the sync finished work (late frees), memory in use beyond what the executor holds once
nothing runs (a persistent gap), how much of it no live array explains, and, where the peak rose
between two launches, what the segment really took against its ``launch_bytes``. The first step
is the one where the peak rises most (it starts from the peak of planning), the last one is in
steady state. The second loss step samples the same without syncing (``boundaries``).

Each step configuration runs a few steps recording their losses (the first compiles), then times
more steps one by one; ``s_per_step`` is their median. A process took 20-40 s on an H200 and
96-113 s on the H100 machines lent on 2026-11-26 (about 70 s of it outside compiling and stepping),
so all six configurations can take 11 minutes there: name the ones a run needs. ``--deadline``
(330 s) skips what would start later, and each process has ``--timeout``.

    python benchmarks/gpu_check.py                  # on a GPU: writes benchmarks/results/gpu-<device>-<date>.json
    python benchmarks/gpu_check.py --out "$OUT"     # the same file name, in that folder
    python benchmarks/gpu_check.py --dry-run        # anywhere, ~30 s on 2 cores: a CPU-tiny GPT, every code path

The dry run (part of the test suite) checks the script, not a GPU: there is no memory cap on a
CPU (no ``memory_stats``), ``ooc_jit``'s budget is half its plan's in-core estimate, and its
timings mean nothing. Exits nonzero if a configuration fails other than by the expected
out-of-memory error, or if on a GPU ``ooc_jit``'s runtime peak exceeds its budget (after writing
the JSON, which is rewritten after every configuration).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings as warnings_module
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "GPU_CHECK_RESULT "
# name -> (strategy, under the memory cap, an out-of-memory error is a result rather than a failure)
# In this order: the cap comes from jax_jit's peak, and ooc_jit_capped is the point of the check;
# then what a user would otherwise write under the same cap, and the proof that jax.jit does not fit.
CONFIGURATIONS = {
    "jax_jit": ("jax_jit", False, False),
    "ooc_jit_capped": ("ooc_jit", True, False),
    "remat_nothing_saveable_capped": ("remat_block_nothing_saveable", True, True),
    "remat_dots_saveable_capped": ("remat_block_dots_saveable", True, True),
    "jax_jit_capped": ("jax_jit", True, True),
    "remat_offload_dots_capped": ("remat_block_offload_dots", True, True),
}
# Run only when --configurations names them: comparisons and diagnostics, not part of the check.
ACCOUNT_ONLY_CONFIGURATIONS = {"ooc_jit_capped_account": ("ooc_jit", True, False)}
NAMED_ONLY_CONFIGURATIONS = ACCOUNT_ONLY_CONFIGURATIONS | {
    "ooc_jit_swap_only_capped": ("ooc_jit", True, False),
    "remat_nothing_saveable": ("remat_nothing_saveable", False, False),
    "remat_offload_dots": ("remat_offload_dots", False, False),
}
ALL_CONFIGURATIONS = CONFIGURATIONS | NAMED_ONLY_CONFIGURATIONS
SYNCED_ROWS_KEPT = 20  # per synced step, the launches with the largest gap: keeps the JSON small
GPU_MODEL = dict(layers=16, width=1024, heads=16, batch=8, seq=1024, vocab=1024)
DRY_MODEL = dict(layers=2, width=64, heads=4, batch=4, seq=32, vocab=256)
DRY_RUN_PROCESSES = 2  # a dry run's processes at a time (a GPU run's: one)
ENV_VARS = (
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
    "JAX_PLATFORMS",
    "JAX_DEFAULT_MATMUL_PRECISION",
    "CUDA_VISIBLE_DEVICES",
)
DEFAULT_MEM_FRACTION = 0.75  # XLA's GPU allocator limit when no fraction is set
FALLBACK_MEM_FRACTION = 0.1  # the cap when jax_jit gave no peak: ~14 GiB on a 141 GiB H200


# -- in the child process -----------------------------------------------------------------------------


def checkpoint_policy(name: str):
    """The ``jax.checkpoint_policies`` policy a strategy's name ends in."""
    import jax

    if name.endswith("offload_dots"):
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return getattr(jax.checkpoint_policies, name.removeprefix("remat_").removeprefix("block_"))


def workload(model: dict, strategy: str = "jax_jit"):
    """The GPT; for a ``remat_block_*`` strategy, with every block in ``nn.remat`` under its policy
    (the same parameters, initial state and losses as without)."""
    import jax.numpy as jnp

    try:
        from benchmarks import models
    except ImportError:
        import models
    block_policy = checkpoint_policy(strategy) if strategy.startswith("remat_block_") else None
    return models.gpt2(**model, dtype=jnp.float32, remat_policy=block_policy)


def run_step(config: dict) -> dict:
    """One step configuration, in this (fresh) process. Errors are recorded, not raised."""
    import jax

    from benchmarks.rates import measure_profile
    from oocjax import ooc_jit
    from oocjax.testing import DeviceAccess, with_seams

    strategy, capped, expect_oom = ALL_CONFIGURATIONS[config["configuration"]]
    access = DeviceAccess(allocator_gate=config["configuration"] not in ACCOUNT_ONLY_CONFIGURATIONS)
    device = jax.devices()[0]
    record = dict(
        configuration=config["configuration"],
        strategy=strategy,
        capped=capped,
        expect_oom=expect_oom,
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        env=_env(),
        remat_pass=getattr(jax.config, "jax_compiler_enable_remat_pass", None),
        bytes_limit=_memory_stat(device, "bytes_limit"),
        allocator_gate=access.allocator_gate if strategy == "ooc_jit" else None,
    )
    phase = "setup"
    try:
        work = workload(config["model"], strategy)
        record["model"] = work.name
        state = jax.jit(work.init)(jax.random.key(0))
        batch = jax.random.randint(jax.random.key(1), work.batch.shape, 0, config["model"]["vocab"], work.batch.dtype)
        jax.block_until_ready((state, batch))
        phase = "plan" if strategy == "ooc_jit" else "compile"
        started = time.perf_counter()
        if strategy == "ooc_jit":
            if config["dry_run"]:
                # No memory cap on a CPU: half the in-core estimate, letting the tiny model's tensors move.
                in_core = ooc_jit(work.step, budget=2**62).plan(state, batch).baseline_peak_bytes
                budget, options = int(in_core * config["dry_budget_fraction"]), dict(min_offload_bytes=16 * 1024)
            elif record["bytes_limit"]:
                budget, options = int(record["bytes_limit"] * config["budget_of_limit"]), {}
            else:
                raise RuntimeError(f"{device.device_kind} reports no memory_stats()['bytes_limit'] to size a budget")
            if config["configuration"] == "ooc_jit_swap_only_capped":
                options["recompute"] = "off"
            step = with_seams(ooc_jit(work.step, budget=budget, donate_argnums=(0,), **options), device_access=access)
            plan = step.plan(state, batch)
            segments = getattr(plan, "segments", None)
            record |= dict(
                budget_bytes=plan.budget_bytes,
                planned_peak_bytes=plan.peak_bytes,
                in_core_estimate_bytes=plan.baseline_peak_bytes,
                host_peak_bytes=getattr(plan, "host_peak_bytes", None),
                offloads=len(plan.offloads),
                host_inputs=len(plan.host_inputs),
                executed_peak_bytes=getattr(plan, "executed_peak_bytes", None),
                segments=None if segments is None else len(segments),
                compiled_peak_bytes=getattr(plan, "compiled_peak_bytes", None),
                moved_bytes=getattr(plan, "moved_bytes", None),
                headroom_bytes=getattr(plan, "headroom_bytes", None),
                plan=repr(plan),
                plan_s=time.perf_counter() - started,
                # Why the plan is what it is, for a reader without the device: what it planned for
                # (less than the budget where a chain measured over it was planned again), the
                # executed peak of each attempt, the rates it was chosen with, and its summary.
                planned_for_bytes=plan.schedule.budget_bytes,
                attempts=list(plan.attempts),
                simulated_step_s=plan.step_time_s,
                swap_only_simulated_s=plan.swap_only_time_s,
                profile=dataclasses.asdict(measure_profile()),
                summary=plan.summary()[:8000],
            )
            # ooc_jit moves each argument to the memory its plan wants it in, but does not free a donated
            # device array it copies to host: started on the device, the state kept on host would be held
            # twice during the first step. Start it in host memory; ooc_jit brings what it needs in.
            host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
            state = jax.block_until_ready(jax.device_put(state, host))
            record["state_starts_in"] = "pinned_host"
            # The runtime peak cannot be reset: record what initialisation and planning reached.
            record["peak_before_steps_bytes"] = _memory_stat(device, "peak_bytes_in_use")
        else:
            # The whole loss in one jax.checkpoint (remat_nothing_saveable, remat_offload_dots); per-block
            # remat is in the model (workload).
            whole_loss = strategy in ("remat_nothing_saveable", "remat_offload_dots")
            policy = checkpoint_policy(strategy) if whole_loss else None
            step = jax.jit(work.make_step(policy), donate_argnums=(0,)).lower(state, batch).compile()
            record["compile_s"] = time.perf_counter() - started
            analysis = step.memory_analysis()
            record["compiled"] = {
                name: getattr(analysis, name, None)
                for name in (
                    "peak_memory_in_bytes",
                    "argument_size_in_bytes",
                    "output_size_in_bytes",
                    "alias_size_in_bytes",
                    "temp_size_in_bytes",
                    "host_temp_size_in_bytes",
                )
            }
        phase = "steps"
        with warnings_module.catch_warnings(record=True) as replan_warnings:  # ooc_jit warns when it plans again
            warnings_module.simplefilter("always")
            state = _run_steps(step, state, batch, strategy, device, config, record)
        record["warnings"] = [str(w.message)[:400] for w in replan_warnings][:5]
        if strategy == "ooc_jit":
            final = step.plan(state, batch)  # a call measured over the budget plans again: the plan in use now
            record["final_plan"] = dict(
                plan=repr(final),
                headroom_bytes=final.headroom_bytes,
                executed_peak_bytes=final.executed_peak_bytes,
                segments=len(final.segments),
                moved_bytes=final.moved_bytes,
            )
            phase = "synced step"
            with _synced(device, record, "synced_last_step"):
                jax.block_until_ready(step(state, batch))
    except Exception as error:  # recorded: the expected OOM, and any failure, are results
        text = f"{type(error).__name__}: {error}"
        record |= dict(error=text[:3000], phase=phase, oom=is_oom(text))
    record.setdefault("runtime_peak_bytes", _memory_stat(device, "peak_bytes_in_use"))
    return record


def _run_steps(step, state, batch, strategy: str, device, config: dict, record: dict):
    """The loss steps (the first compiles or warms up), then the timed ones; the state after."""
    import jax

    losses, times = [], []
    for i in range(config["loss_steps"]):
        started = time.perf_counter()
        with _sampled(strategy, i, device, record):
            state, loss = step(state, batch)
        losses.append(float(loss))
        times.append(time.perf_counter() - started)
    record |= dict(losses=losses, first_step_s=times[0])
    times = []
    for _ in range(config["timed_steps"]):
        started = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - started)
    record |= dict(step_s=times, s_per_step=statistics.median(times), final_loss=float(loss))
    record["finite"] = all(math.isfinite(x) for x in [*losses, record["final_loss"]])
    record["runtime_peak_bytes"] = _memory_stat(device, "peak_bytes_in_use")  # the synced step's is apart
    return state


def _sampled(strategy: str, step: int, device, record: dict):
    """What samples the ``step``-th loss step: for ``ooc_jit`` the first is synced, the second sampled."""
    if strategy == "ooc_jit" and step == 0:
        return _synced(device, record, "synced_first_step")
    if strategy == "ooc_jit" and step == 1:
        return _boundaries_sampled(device, record)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _boundaries_sampled(device, record: dict):
    """During one ooc_jit step, at every segment launch: the allocator's bytes in use against the
    executor's own account (held + in flight), and with the launch's own bytes added. On a CPU the
    allocator reports nothing and this records nothing."""
    from oocjax.testing import observe_segments

    worst = dict(
        in_use_over_account_bytes=None,
        in_use_plus_launch_bytes=None,
        segment=None,
        gate_reading_over_account_bytes=None,  # the allocator as the executor's gate last read it
        foreign_bytes=None,
    )

    def raise_to(name: str, value: int | None) -> bool:
        if value is None or (worst[name] is not None and value <= worst[name]):
            return False
        worst[name] = value
        return True

    def sample(launch) -> None:
        account = launch.held_bytes + launch.in_flight_bytes
        if launch.allocator_bytes is not None:
            raise_to("gate_reading_over_account_bytes", launch.allocator_bytes - account)
            raise_to("foreign_bytes", launch.foreign_bytes)
        in_use = _memory_stat(device, "bytes_in_use")
        if in_use is not None:
            raise_to("in_use_over_account_bytes", in_use - account)
            if raise_to("in_use_plus_launch_bytes", in_use + launch.cost.launch_bytes):
                worst["segment"] = launch.segment

    with observe_segments(sample):
        yield
    record["boundaries"] = worst


@contextlib.contextmanager
def _synced(device, record: dict, key: str):
    """During one ooc_jit step, at every segment launch: all device work finished first, then the
    allocator read against the executor's account (``_synced_row``); also before and after the
    step. ``record[key]`` is their summary. Values the device does not report are None."""
    from oocjax.testing import observe_segments

    rows = [_synced_row(device)]
    with observe_segments(lambda launch: rows.append(_synced_row(device, launch))):
        yield
    rows.append(_synced_row(device))
    record[key] = summarise_synced(rows)


def _synced_row(device, launch=None) -> dict:
    """The allocator before and after finishing all device work, the live device arrays after,
    and (at a launch) the executor's account and the segment's memory."""
    import jax

    unsynced = _memory_stat(device, "bytes_in_use")
    live = jax.live_arrays()
    for x in live:
        x.block_until_ready()
    stats = device.memory_stats() or {}
    row = dict(
        segment=None if launch is None else launch.segment,
        unsynced_in_use=unsynced,
        in_use=stats.get("bytes_in_use"),
        peak=stats.get("peak_bytes_in_use"),
        live_device=sum(x.nbytes for x in live if x.sharding.memory_kind == "device"),
    )
    if launch is not None:
        cost = launch.cost
        row |= dict(
            held=launch.held_bytes,
            in_flight=launch.in_flight_bytes,
            foreign=launch.foreign_bytes,
            gate_reading=launch.allocator_bytes,
            temp=cost.temp_bytes,
            output=cost.output_bytes,
            alias=cost.alias_bytes,
            launch_bytes=cost.launch_bytes,
        )
    return row


def summarise_synced(rows: list[dict], kept: int = SYNCED_ROWS_KEPT) -> dict:
    """What the rows of one synced step (``_synced_row``: before the step, at each launch, after it)
    say about memory the executor does not account for. Each ``max_*`` is ``{"bytes", "segment"}``
    at the launch where it is largest (None without allocator statistics):

    - ``max_late_freed``: in use before the sync, free after it: memory given back only once work
      finished (async dispatch), which the account had already let go of or never counted;
    - ``max_unsynced_over_account``: before the sync, beyond ``held + in_flight`` (what the
      unsynced ``boundaries`` measure);
    - ``max_in_use_over_held``: after the sync (nothing runs, so nothing is in flight), beyond what
      the executor holds: the persistent gap; ``max_in_use_over_account`` subtracts the account's
      ``in_flight`` too;
    - ``max_in_use_over_live``: after the sync, beyond every live device array (allocator rounding,
      programs' constants, buffers no array owns); ``max_live_over_held``: live arrays the
      executor does not hold (the caller's, the chain's constants after their last use).

    ``transients``: where ``peak_bytes_in_use`` rose between two samples, the rise over what was in
    use before the segment launched in between (``segment``; None: the argument moves before the
    first launch), against its ``launch_bytes`` (``excess_bytes``: scratch ``memory_analysis``
    does not see, or prefetches issued in the same interval, which ``held_rise_bytes`` shows);
    the 5 largest. ``rows``: the ``kept`` launches with the largest persistent gap.
    """
    launches = [r for r in rows if "held" in r and r["in_use"] is not None]

    def worst(gap: Callable[[dict], int]) -> dict | None:
        if not launches:
            return None
        r = max(launches, key=gap)
        return dict(bytes=gap(r), segment=r["segment"])

    transients = _peak_rises(rows)
    return dict(
        launches=sum("held" in r for r in rows),
        peak_after_bytes=rows[-1]["peak"] if rows else None,
        max_late_freed=worst(lambda r: r["unsynced_in_use"] - r["in_use"]),
        max_unsynced_over_account=worst(lambda r: r["unsynced_in_use"] - r["held"] - r["in_flight"]),
        max_in_use_over_held=worst(lambda r: r["in_use"] - r["held"]),
        max_in_use_over_account=worst(lambda r: r["in_use"] - r["held"] - r["in_flight"]),
        max_in_use_over_live=worst(lambda r: r["in_use"] - r["live_device"]),
        max_live_over_held=worst(lambda r: r["live_device"] - r["held"]),
        max_foreign=worst(lambda r: r["foreign"]),
        peak_rises=len(transients),
        transients=transients[:5],
        rows=sorted(launches, key=lambda r: r["in_use"] - r["held"], reverse=True)[:kept],
    )


def _peak_rises(rows: list[dict]) -> list[dict]:
    """Between consecutive synced samples where the runtime peak rose, what the interval really
    took over what was in use before it, against its segment's launch bytes; largest excess first."""
    rises = []
    for before, after in itertools.pairwise(rows):
        if None in (before["peak"], after["peak"], before["in_use"]) or after["peak"] <= before["peak"]:
            continue
        rise, launch = after["peak"] - before["in_use"], before.get("launch_bytes")
        rises.append(
            dict(
                segment=before["segment"],
                in_use_before=before["in_use"],
                peak=after["peak"],
                transient_bytes=rise,
                launch_bytes=launch,
                excess_bytes=None if launch is None else rise - launch,
                held_rise_bytes=after["held"] - before["held"] if "held" in before and "held" in after else None,
                temp=before.get("temp"),
            )
        )
    return sorted(
        rises, key=lambda t: t["transient_bytes"] if t["excess_bytes"] is None else t["excess_bytes"], reverse=True
    )


def link_probe(megabytes: int = 1024, repeats: int = 5) -> dict:
    """Host<->device bandwidth of a jitted copy to and from pinned host memory, per direction, and
    both at once (one program copying an array each way: both ways' bytes over its time)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    to_host = jax.jit(lambda a: a, out_shardings=host)
    to_device = jax.jit(lambda a: a, in_shardings=host, out_shardings=on_device)
    both = jax.jit(lambda h, d: (h, d), in_shardings=(host, on_device), out_shardings=(on_device, host))
    h = jax.block_until_ready(to_host(x))
    result = {}
    runs = (("d2h_GB_per_s", to_host, (x,)), ("h2d_GB_per_s", to_device, (h,)), ("both_GB_per_s", both, (h, x)))
    for name, fn, args in runs:
        jax.block_until_ready(fn(*args))
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best = min(best, time.perf_counter() - started)
        result[name] = len(args) * x.nbytes / max(best, 1e-9) / 1e9
    return dict(bytes=x.nbytes, **result)


def eager_probe(megabytes: int, repeats: int = 5) -> dict:
    """Bandwidth of one eager ``jax.device_put`` to a pinned_host sharding and back, best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    x = jax.block_until_ready(jnp.ones((megabytes * 2**20 // 4,), jnp.float32))
    h = jax.block_until_ready(jax.device_put(x, host))
    jax.block_until_ready(jax.device_put(h, on_device))  # warm both directions (and the pinned pool)
    best = {"d2h": float("inf"), "h2d": float("inf")}
    for _ in range(repeats):
        started = time.perf_counter()
        h = jax.block_until_ready(jax.device_put(x, host))
        best["d2h"] = min(best["d2h"], time.perf_counter() - started)
        started = time.perf_counter()
        jax.block_until_ready(jax.device_put(h, on_device))
        best["h2d"] = min(best["h2d"], time.perf_counter() - started)
    return dict(
        bytes=x.nbytes,
        landed_in=h.sharding.memory_kind,
        **{f"{way}_GB_per_s": x.nbytes / max(s, 1e-9) / 1e9 for way, s in best.items()},
        **{f"{way}_s": s for way, s in best.items()},
    )


def run_link(config: dict) -> dict:
    import jax

    device = jax.devices()[0]
    record = dict(
        configuration="link",
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        env=_env(),
        bytes_limit=_memory_stat(device, "bytes_limit"),
    )
    try:
        record["jitted"] = link_probe(config["jitted_mib"])
        record["eager"] = {f"{mib}MiB": eager_probe(mib) for mib in config["eager_mib"]}
    except Exception as error:
        record |= dict(error=f"{type(error).__name__}: {error}"[:3000], oom=is_oom(str(error)))
    return record


def _memory_stat(device, name: str) -> int | None:
    stats = device.memory_stats()
    return stats.get(name) if stats else None


def _env() -> dict:
    return {name: os.environ[name] for name in ENV_VARS if name in os.environ}


def is_oom(text: str) -> bool:
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# -- in the parent process ----------------------------------------------------------------------------


def in_fresh_process(payload: dict, mem_fraction: float | None, timeout_s: float) -> dict:
    """Runs one configuration in a new Python process; its record, or one saying why it has none."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if mem_fraction is not None:
        env.pop("XLA_CLIENT_MEM_FRACTION", None)  # jaxlib refuses both names at once
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.4f}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(payload)],
            capture_output=True,
            text=True,
            env=env,
            timeout=max(timeout_s, 1),
            check=False,
        )
    except subprocess.TimeoutExpired as timeout:
        stderr = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else timeout.stderr or ""
        record = dict(error=f"timed out after {timeout_s:.0f} s\n{stderr[-2000:]}", oom=False)
    else:
        lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
        if lines:
            record = json.loads(lines[-1][len(MARKER) :])
        else:
            text = f"exit status {done.returncode}\n{done.stderr[-3000:]}"
            record = dict(error=text, oom=is_oom(text))
        record["stderr_tail"] = done.stderr[-1500:]
    record.setdefault("configuration", payload["configuration"])
    record["process_s"] = time.perf_counter() - started
    record["mem_fraction"] = mem_fraction
    return record


def cap_fraction(jax_jit: dict, uncapped_limit_bytes: int | None, of_peak: float, environ=os.environ) -> float | None:
    """The ``XLA_PYTHON_CLIENT_MEM_FRACTION`` whose ``bytes_limit`` is ``of_peak`` x the ``jax_jit``
    record's runtime peak; None when that record has no peak to size it from.

    XLA's GPU allocator limit is the fraction times the device's total memory, so the total is
    the uncapped limit over the uncapped fraction (0.75 unless the environment sets one).

    >>> jit = dict(runtime_peak_bytes=30 * 2**30, bytes_limit=105 * 2**30)  # a 140 GiB card
    >>> cap_fraction(jit, None, 1 / 3, environ={})
    0.0714
    """
    peak = jax_jit.get("runtime_peak_bytes")
    limit = jax_jit.get("bytes_limit") or uncapped_limit_bytes
    if jax_jit.get("error") or not peak or not limit:
        return None
    uncapped = float(
        environ.get("XLA_CLIENT_MEM_FRACTION") or environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or DEFAULT_MEM_FRACTION
    )
    return round(min(max(peak * of_peak / (limit / uncapped), 0.01), 0.9), 4)


def summarise(record: dict) -> dict:
    """Comparisons against ``jax_jit``, and what made the check fail; also written into the records."""
    by = {r["configuration"]: r for r in record["results"]}
    reference = by.get("jax_jit", {})
    failures, warnings = [], []
    for r in [record["link"], *record["results"]] if record["link"] else record["results"]:
        if r.get("error") and not (r.get("expect_oom") and r.get("oom")):
            failures.append(f"{r['configuration']}: {_first_line(r['error'])}")
        elif r.get("finite") is False:
            failures.append(f"{r['configuration']}: a loss is not finite: {r['losses']}, {r['final_loss']}")
    for r in record["results"]:
        if reference.get("losses") and r.get("losses") and r is not reference:
            n = min(len(r["losses"]), len(reference["losses"]))
            r["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(r["losses"][:n], reference["losses"][:n]))
        if reference.get("s_per_step") and r.get("s_per_step"):
            r["vs_jax_jit"] = r["s_per_step"] / reference["s_per_step"]
    for r in record["results"]:  # every ooc_jit run keeps to its budget, whatever it is compared with
        if r.get("runtime_peak_bytes") is not None and r.get("budget_bytes") and not r.get("error"):
            r["within_budget"] = r["runtime_peak_bytes"] <= r["budget_bytes"]
            if not r["within_budget"]:
                failures.append(
                    f"{r['configuration']}: runtime peak {_bytes(r['runtime_peak_bytes'])} exceeds its budget "
                    f"{_bytes(r['budget_bytes'])}"
                )
    ooc = by.get("ooc_jit_capped", {})
    within = ooc.get("within_budget")
    capped = by.get("jax_jit_capped", {})
    diagnostics = {r["configuration"]: _memory_digest(r) for r in record["results"] if r.get("strategy") == "ooc_jit"}
    if not record["dry_run"] and capped and not capped.get("error"):
        warnings.append("jax_jit_capped did not run out of memory: the cap does not prove that the step does not fit")
    return dict(
        jax_jit_peak_bytes=reference.get("runtime_peak_bytes"),
        jax_jit_s_per_step=reference.get("s_per_step"),
        capped_bytes_limit=capped.get("bytes_limit") or ooc.get("bytes_limit"),
        capped_jax_jit_oom=capped.get("oom"),
        ooc_budget_bytes=ooc.get("budget_bytes"),
        ooc_runtime_peak_bytes=ooc.get("runtime_peak_bytes"),
        ooc_within_budget=within,
        ooc_vs_jax_jit=ooc.get("vs_jax_jit"),
        ooc_loss_max_abs_diff=ooc.get("loss_max_abs_diff"),
        ooc_memory=diagnostics,
        failures=failures,
        warnings=warnings,
    )


def _memory_digest(r: dict) -> dict:
    """An ``ooc_jit`` record's memory against its budget, and the headline figures of its synced
    steps (``summarise_synced``): bytes, or None where the device reports none."""
    budget, peak = r.get("budget_bytes"), r.get("runtime_peak_bytes")
    first, last = r.get("synced_first_step") or {}, r.get("synced_last_step") or {}

    def figure(synced: dict, name: str) -> int | None:
        return (synced.get(name) or {}).get("bytes")

    worst = next(iter(first.get("transients") or []), {})
    return dict(
        allocator_gate=r.get("allocator_gate"),
        runtime_peak_bytes=peak,
        over_budget_bytes=None if peak is None or not budget else peak - budget,
        s_per_step=r.get("s_per_step"),
        unsynced_over_account_bytes=(r.get("boundaries") or {}).get("in_use_over_account_bytes"),
        late_freed_bytes=figure(last, "max_late_freed"),
        persistent_gap_bytes=figure(last, "max_in_use_over_held"),
        not_in_live_arrays_bytes=figure(last, "max_in_use_over_live"),
        live_not_held_bytes=figure(last, "max_live_over_held"),
        synced_first_step_peak_bytes=first.get("peak_after_bytes"),
        worst_transient_excess_bytes=worst.get("excess_bytes"),
        worst_transient_segment=worst.get("segment"),
    )


def describe(r: dict) -> str:
    """One line per configuration."""
    name = f"{r['configuration']:<24}"
    if r["configuration"] == "link":
        if r.get("error"):
            return f"{name}FAILED {_first_line(r['error'])}"
        jitted = r["jitted"]
        eager = ", ".join(
            f"{size} {e['d2h_GB_per_s']:.1f}/{e['h2d_GB_per_s']:.1f}" for size, e in r.get("eager", {}).items()
        )
        return (
            f"{name}{r['device']}: jitted {jitted['bytes'] / 2**20:.0f} MiB to host {jitted['d2h_GB_per_s']:.1f} GB/s, "
            f"to device {jitted['h2d_GB_per_s']:.1f} GB/s; eager device_put (to host/to device GB/s) {eager}"
        )
    parts = [f"peak {_bytes(r.get('runtime_peak_bytes'))}", f"limit {_bytes(r.get('bytes_limit'))}"]
    if "budget_bytes" in r:
        parts.append(f"budget {_bytes(r['budget_bytes'])} (planned {_bytes(r.get('planned_peak_bytes'))})")
    if r.get("error"):
        status = "out of memory (a result)" if r.get("expect_oom") and r.get("oom") else "FAILED"
        return f"{name}{status} in {r.get('phase', '?')}: {_first_line(r['error'])[:160]}; {', '.join(parts)}"
    parts.append(f"{r['s_per_step']:.4f} s/step")
    if r.get("vs_jax_jit"):
        parts.append(f"{r['vs_jax_jit']:.2f}x jax.jit")
    if "loss_max_abs_diff" in r:
        parts.append(f"losses max |diff| {r['loss_max_abs_diff']:.3g}")
    if r["configuration"] == "jax_jit_capped" and r.get("platform") != "cpu":
        parts.append("did NOT run out of memory")
    if r.get("strategy") == "ooc_jit":
        d = _memory_digest(r)
        parts.append(
            f"gate {'on' if d['allocator_gate'] else 'off'}; synced: late frees {_bytes(d['late_freed_bytes'])}, "
            f"gap {_bytes(d['persistent_gap_bytes'])} ({_bytes(d['not_in_live_arrays_bytes'])} in no live array), "
            f"worst scratch excess {_bytes(d['worst_transient_excess_bytes'])} (segment {d['worst_transient_segment']})"
        )
    return name + ", ".join(parts)


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _versions() -> dict:
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "jax-cuda12-plugin", "jax-cuda13-plugin", "oocjax"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a CPU-tiny GPT, no cap: checks the script, not a GPU")
    parser.add_argument("--out", help="a JSON file, or a folder for the default name gpu-<device>-<date>.json")
    parser.add_argument(
        "--configurations",
        default=",".join(CONFIGURATIONS),
        help=f"which step configurations (also: {', '.join(NAMED_ONLY_CONFIGURATIONS)})",
    )
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--mem-fraction", type=float, help="the cap (default: bytes_limit at 1/3 of jax_jit's peak)")
    parser.add_argument("--cap-of-peak", type=float, default=1 / 3, help="cap's bytes_limit over jax_jit's peak")
    parser.add_argument("--budget-of-limit", type=float, default=0.8, help="ooc_jit's budget over the capped limit")
    parser.add_argument("--loss-steps", type=int, help="steps whose losses are recorded (default 4; dry run 2)")
    parser.add_argument("--timed-steps", type=int, help="timed steps after those (default 10; dry run 2)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per configuration")
    parser.add_argument("--deadline", type=float, default=330, help="seconds for everything; later ones are skipped")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        payload = json.loads(args.child)
        record = run_link(payload) if payload["configuration"] == "link" else run_step(payload)
        print(MARKER + json.dumps(record), flush=True)
        return

    try:
        from benchmarks._machine import machine
    except ImportError:
        from _machine import machine

    dry = args.dry_run
    model = dict(DRY_MODEL if dry else GPU_MODEL)
    model |= {k: v for k in model if (v := getattr(args, k)) is not None}
    names = args.configurations.split(",")
    unknown = sorted(set(names) - set(ALL_CONFIGURATIONS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {list(ALL_CONFIGURATIONS)}")
    common = dict(
        dry_run=dry,
        model=model,
        loss_steps=args.loss_steps or (2 if dry else 4),
        timed_steps=args.timed_steps or (2 if dry else 10),
        budget_of_limit=args.budget_of_limit,
        dry_budget_fraction=0.5,
    )
    started = time.perf_counter()
    record = dict(
        benchmark="gpu_check",
        dry_run=dry,
        **machine(),
        started=datetime.datetime.now().isoformat(timespec="seconds"),
        versions=_versions(),
        env=_env() | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        model=dict(model, name=f"gpt2-{model['layers']}x{model['width']}", dtype="float32", optimizer="adamw"),
        settings={k: v for k, v in common.items() if k != "model"} | dict(cap_of_peak=args.cap_of_peak),
        link=None,
        results=[],
    )

    def remaining() -> float:
        return min(args.timeout, args.deadline - (time.perf_counter() - started))

    def write() -> str:
        record["summary"] = summarise(record)
        record["wall_s"] = time.perf_counter() - started
        out = args.out
        default = f"gpu-{_slug(record.get('device') or 'unknown')}-{record['date']}.json"
        if out is None:
            folder = Path(tempfile.gettempdir()) if dry else ROOT / "benchmarks" / "results"
            out = folder / (f"gpu_check-dry-run-{default[4:]}" if dry else default)
        elif Path(out).is_dir():
            out = Path(out) / default
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        return str(out)

    def run(name: str, mem_fraction: float | None) -> dict:
        """One configuration in a fresh process, or a record that the deadline skipped it."""
        left = remaining()
        if left < 10:
            return dict(configuration=name, error=f"skipped: the {args.deadline:.0f} s deadline was reached")
        return in_fresh_process(dict(common, configuration=name), mem_fraction, left)

    link = dict(configuration="link", jitted_mib=64 if dry else 1024, eager_mib=[4, 16] if dry else [4, 256])
    dry_runs = {}
    if dry:
        # A dry run starts its processes DRY_RUN_PROCESSES at a time, each still its own process: on a
        # CPU no cap is sized from jax_jit's peak and no timing means anything, and one process keeps
        # about one core busy. A GPU run starts one at a time, so that each runtime peak is its own.
        pool = concurrent.futures.ThreadPoolExecutor(DRY_RUN_PROCESSES)
        dry_runs["link"] = pool.submit(in_fresh_process, link, None, remaining())
        dry_runs |= {name: pool.submit(run, name, None) for name in names}
        pool.shutdown(wait=False)
    record["link"] = dry_runs["link"].result() if dry else in_fresh_process(link, None, remaining())
    record["device"] = record["link"].get("device")
    print(describe(record["link"]), flush=True)
    if record["link"].get("platform") == "cpu" and not dry:  # nothing written: it would read as a GPU result
        raise SystemExit("no GPU here (jax.devices() is a CPU): run with --dry-run to check the script")
    mem_fraction = None if dry else args.mem_fraction
    for name in names:
        _, capped, _ = ALL_CONFIGURATIONS[name]
        if capped and not dry and mem_fraction is None:
            jit = next((r for r in record["results"] if r["configuration"] == "jax_jit"), {})
            mem_fraction = cap_fraction(jit, record["link"].get("bytes_limit"), args.cap_of_peak)
            if mem_fraction is None:
                mem_fraction = FALLBACK_MEM_FRACTION
                print(f"no jax_jit peak to size the cap from: MEM_FRACTION={mem_fraction}", flush=True)
        if capped:
            record["settings"]["mem_fraction"] = mem_fraction
        result = dry_runs[name].result() if dry else run(name, mem_fraction if capped else None)
        record["results"].append(result)
        record["device"] = record["device"] or result.get("device")
        out = write()
        print(describe(result), flush=True)
    out = write()
    summary = record["summary"]
    print(f"wrote {out} ({record['wall_s']:.0f} s)")
    for warning in summary["warnings"]:
        print(f"warning: {warning}")
    if summary["failures"]:
        raise SystemExit("gpu_check failed:\n  " + "\n  ".join(summary["failures"]))
    if dry:
        print("dry run passed: every configuration built, planned, compiled and ran")


if __name__ == "__main__":
    main()
