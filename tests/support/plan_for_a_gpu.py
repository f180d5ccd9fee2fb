"""A 7B-sized GPT's training step planned for an H200 from this CPU, for ``tests/test_profile_plans.py``.

Run as ``python -m tests.support.plan_for_a_gpu`` in a fresh process, so that its peak resident memory is
the planning's alone: it prints one JSON object of what it planned and measured, and the parent
test asserts on it. The state (parameters and AdamW's moments, float32) is abstract
(``jax.eval_shape``): 85 GiB of it, more than this machine has.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from examples.models import Transformer, next_token_step
from oocjax import ooc_jit
from oocjax.schedule import check_segments, validate

GIB = 2**30
MODEL = dict(vocab=32000, width=6144, heads=48, layers=16)  # 7.45e9 parameters
BATCH, SEQ = 4, 1024
BUDGETS_GIB = (72, 24)


def abstract_step():
    """The step, its abstract state and a batch of token ids."""
    model = Transformer(**MODEL, causal=True)
    optimizer = optax.adamw(1e-4)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    state = (params, jax.eval_shape(optimizer.init, params))
    return next_token_step(model, optimizer), state, jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started its program (Linux: ``VmHWM``).
    Not ``getrusage``'s ``ru_maxrss``: that keeps the parent's peak across ``exec``."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024


def main() -> None:
    step, state, tokens = abstract_step()
    live_before = len(jax.live_arrays())
    rows = []
    for gib in BUDGETS_GIB:
        started = time.perf_counter()
        plan = ooc_jit(step, budget=gib * GIB, donate_argnums=(0,)).plan(state, tokens, profile="h200")
        rows.append(
            dict(
                budget_bytes=gib * GIB,
                seconds=time.perf_counter() - started,
                device=plan.device,
                compiled=plan.compiled,
                executed_peak_bytes=plan.executed_peak_bytes,
                peak_bytes=plan.peak_bytes,
                planned_for_bytes=plan.schedule.budget_bytes,
                headroom_bytes=plan.headroom_bytes,
                segments=len(plan.segments),
                estimated_segment_peak_bytes=max(
                    s.held_bytes + c.launch_bytes for s, c in zip(plan.segments, plan.segment_costs, strict=True)
                ),
                host_kept_bytes=sum(h.nbytes for h in plan.host_inputs),
                plan_violations=[v.message for v in validate(plan.program, plan.schedule)],
                chain_violations=[v.message for v in check_segments(plan.program, plan.schedule, plan.segments)],
                step_time_s=plan.step_time_s,
                in_core_time_s=plan.in_core_time_s,
                summary=plan.summary(),
            )
        )
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    peak_rss = peak_resident_bytes()
    new_arrays = len(jax.live_arrays()) - live_before
    print(json.dumps(dict(state_bytes=state_bytes, peak_rss_bytes=peak_rss, new_live_arrays=new_arrays, rows=rows)))


if __name__ == "__main__":
    main()
