"""Does planning cost more than tracing? A 48-layer GPT-2-style Flax training step, on the CPU.

Times, best of ``--repeats``, each on a freshly built step function so that no JAX cache helps:
  trace:   ``jax.jit(step).trace(state, batch)`` (what ``ooc_jit`` does first, and ``jax.jit`` too);
  plan:    what ``ooc_jit`` plans with now, at half the in-core estimate: analyse (flatten, size,
           label) + the hybrid planner (``schedule.plan_hybrid``, ``recompute="auto"``: the window
           plan of the step, the recompute selector's Program rewrite and the window plan of that,
           each timed with ``rates.measure_profile()``, measured once before the
           timing as ``ooc_jit`` does once per process; ``recomputable_steps`` included) + the
           rewrite of the flat equations where something is recomputed (``apply_rewrite``) +
           cutting segments (``cut_segments``, a copy starting its own segment on a CPU as in
           ``ooc_jit``);
  rewrite: tracing the chain of segments (segment calls and transfers), reported apart: it replaces the
           trace ``jax.jit`` would do on the first call.
Also reported: the check of the plan (``validate_s``, outside the ratio) and, for comparison with the
earlier results, the window planner alone (``window_s``, the old ``planner_s``), cutting its
swap-only schedule and the old ratio (analyse + window + its segments) / trace
(``earlier_plan_stage``). ``planner_s`` is now the hybrid planner's time (``hybrid_s``).
Prints the equation count and the ratio plan / trace (the target is at most 1).

    python benchmarks/plan_vs_trace.py [--layers 48] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from oocjax.schedule import (
    chain_of,
    cut_segments,
    keep_all,
    plan_hybrid,
    plan_window,
    simulate,
    simulate_time,
    validate,
)
from oocjax.testing import (
    apply_rewrite,
    chain_function,
    chain_jaxpr,
    flatten,
    recomputable_steps,
    segment_functions,
    to_program,
)

if __package__ in (None, ""):  # run as ``python benchmarks/plan_vs_trace.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.rates import measure_profile
from examples.models import Transformer, next_token_step


def gpt(layers: int) -> Transformer:
    """The GPT-2-style decoder this benchmark plans: small in width, long in layers."""
    return Transformer(vocab=256, width=64, heads=4, layers=layers, causal=True)


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


MIN_OFFLOAD_BYTES = 64 * 1024
MIN_SEGMENT_FLOPS = 4 * 10**11  # ooc_jit's GPU default, as in the earlier results
MERGES_COPIES = {"cpu"}  # platforms where ooc_jit starts a segment at each run of recomputed steps


def copy_group_starts(rewrite) -> tuple[int, ...]:
    """The first step of each run of recomputed (copied) steps: where ``ooc_jit`` cuts on a CPU."""
    copied = set(rewrite.copied_steps)
    return tuple(k for k in sorted(copied) if k - 1 not in copied)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    load_before = os.getloadavg()

    model, optimizer = gpt(args.layers), optax.adamw(1e-3)
    tokens = jnp.zeros((8, 65), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
    state = (params, jax.eval_shape(optimizer.init, params))
    profile = measure_profile()  # once per process in ooc_jit too: outside the timing

    trace_s, traced = best_of(args.repeats, lambda: jax.jit(next_token_step(model, optimizer)).trace(state, tokens))
    labels = [f"leaf {i}" for i in range(len(jax.tree.leaves(state)) + 1)]
    donated = [False] * len(labels)

    def analyse():
        flat = flatten(traced.jaxpr)
        return flat, to_program(flat, input_labels=labels, donated=donated)

    analyse_s, (flat, program) = best_of(args.repeats, analyse)
    budget = simulate(program, keep_all(program)).peak_bytes // 2

    def hybrid():
        recomputable = recomputable_steps(flat).__getitem__
        return plan_hybrid(
            program, budget, recomputable=recomputable, profile=profile, min_offload_bytes=MIN_OFFLOAD_BYTES
        )

    hybrid_s, choice = best_of(args.repeats, hybrid)
    rewrite, schedule = choice.rewrite, choice.schedule
    validate_s, violations = best_of(1, lambda: validate(choice.program, schedule))
    assert not violations, violations[:3]
    apply_s, planned_flat = best_of(args.repeats, lambda: apply_rewrite(flat, rewrite) if rewrite.recomputed else flat)
    cut_before = copy_group_starts(rewrite) if jax.devices()[0].platform in MERGES_COPIES else ()
    segment_s, segments = best_of(
        args.repeats,
        lambda: cut_segments(
            choice.program, schedule, budget_bytes=budget, min_segment_flops=MIN_SEGMENT_FLOPS, cut_before=cut_before
        ),
    )
    # The earlier plan stage, for comparison: the window planner alone and its segments.
    window_s, swap_only = best_of(
        args.repeats, lambda: plan_window(program, budget, min_offload_bytes=MIN_OFFLOAD_BYTES)
    )
    swap_segment_s, swap_segments = best_of(
        1, lambda: cut_segments(program, swap_only, budget_bytes=budget, min_segment_flops=MIN_SEGMENT_FLOPS)
    )

    def rewrite_chain():
        functions = segment_functions(planned_flat, segments)
        kinds = ["pinned_host" if b in schedule.host_inputs else "device" for b in range(planned_flat.num_inputs)]
        chain = chain_of(choice.program, schedule, segments, planned_flat.result_buffers)
        return chain_jaxpr(chain_function(planned_flat, chain, functions), planned_flat, kinds)

    rewrite_s, _ = best_of(1, rewrite_chain)
    plan_s = analyse_s + hybrid_s + apply_s + segment_s
    old_plan_s = analyse_s + window_s + swap_segment_s
    moved = simulate(choice.program, schedule)
    swap_moved = simulate(program, swap_only)
    flops = sum(step.flops for step in program.steps)
    recomputes = f"recomputes {len(rewrite.recomputed)} values and " if rewrite.recomputed else ""
    print(
        f"GPT-2-style step, {args.layers} layers: {len(flat.equations)} equations after inlining; at half the "
        f"in-core estimate the hybrid planner {recomputes}"
        f"makes {len(schedule.moves)} moves ({(moved.h2d_bytes + moved.d2h_bytes) / 2**20:.1f} MiB; swap-only "
        f"{len(swap_only.moves)} moves, {(swap_moved.h2d_bytes + swap_moved.d2h_bytes) / 2**20:.1f} MiB)"
    )
    print(f"trace   {trace_s:7.3f} s")
    print(
        f"plan    {plan_s:7.3f} s  (analyse {analyse_s:.3f} s + hybrid planner {hybrid_s:.3f} s + apply_rewrite "
        f"{apply_s:.3f} s + segments {segment_s:.3f} s: {len(segments)})"
    )
    print(
        f"hybrid  {hybrid_s:7.3f} s  (rewrite + selector + window; window alone {window_s:.3f} s): "
        f"{hybrid_s / trace_s:.2f} x trace"
    )
    print(f"earlier {old_plan_s:7.3f} s  (analyse + window + its {len(swap_segments)} segments {swap_segment_s:.3f} s)")
    print(f"rewrite {rewrite_s:7.3f} s  (tracing the chain of segments; replaces jax.jit's own trace)")
    print(f"plan / trace = {plan_s / trace_s:.2f}  (target: at most 1; earlier plan stage {old_plan_s / trace_s:.2f})")
    if args.out:
        record = dict(
            benchmark="plan_vs_trace",
            layers=args.layers,
            equations=len(flat.equations),
            moves=len(schedule.moves),
            trace_s=trace_s,
            analyse_s=analyse_s,
            planner_s=hybrid_s,  # what ooc_jit's planner runs now (report.py adds it to analyse_s)
            hybrid_s=hybrid_s,
            hybrid_ratio=hybrid_s / trace_s,
            window_s=window_s,
            validate_s=validate_s,
            apply_rewrite_s=apply_s,
            segment_s=segment_s,
            segments=len(segments),
            rewrite_s=rewrite_s,
            ratio=plan_s / trace_s,
            earlier_plan_stage=dict(
                plan_s=old_plan_s,
                ratio=old_plan_s / trace_s,
                moves=len(swap_only.moves),
                segments=len(swap_segments),
                segment_s=swap_segment_s,
            ),
            hybrid=dict(
                chosen="hybrid" if rewrite.recomputed else "swap-only",
                recomputed_values=len(rewrite.recomputed),
                copied_equations=len(rewrite.copied_steps),
                extra_flops_pct=100 * rewrite.extra_flops / flops,
                moved_bytes=moved.h2d_bytes + moved.d2h_bytes,
                swap_only_moved_bytes=swap_moved.h2d_bytes + swap_moved.d2h_bytes,
                simulated_s=simulate_time(choice.program, schedule, profile).step_time_s,
                swap_only_simulated_s=choice.swap_only_time_s,
            ),
            settings=dict(
                repeats=args.repeats,
                budget_bytes=budget,
                min_offload_bytes=MIN_OFFLOAD_BYTES,
                min_segment_flops=MIN_SEGMENT_FLOPS,
                cut_before_copies=bool(cut_before),
                profile=dict(
                    name=profile.name,
                    flops_per_s=profile.flops_per_s,
                    hbm_bytes_per_s=profile.hbm_bytes_per_s,
                    h2d_bytes_per_s=profile.h2d_bytes_per_s,
                    d2h_bytes_per_s=profile.d2h_bytes_per_s,
                    h2d_latency_s=profile.h2d_latency_s,
                    d2h_latency_s=profile.d2h_latency_s,
                ),
            ),
            fields=(
                "ratio = (analyse_s + hybrid_s + apply_rewrite_s + segment_s) / trace_s; planner_s = hybrid_s "
                "(before 2026-11-26-hybrid it was the window planner alone, now window_s)"
            ),
            load_average=dict(before=list(load_before), after=list(os.getloadavg())),
            jax=jax.__version__,
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
