"""How well the cost model predicts ``jax.jit``'s step time on this machine, and what measuring helps.

``measure_profile`` times this device's matmul rate, memory rate and host link (latency and
bandwidth per direction). Then, for a few small float32 Flax training steps (``examples/models.py``:
an MLP, a CNN with batch norm, a GPT-style decoder), the in-core step (``keep_all``) is traced and
its time predicted by ``simulate_time`` with three profiles, next to the measured ``jax.jit`` step
(median of ``--steps`` runs after a warm-up):

- ``default``: the published profile for this platform (``PROFILES``);
- ``measured``: ``measure_profile``'s;
- ``calibrated``: the measured one with its compute rates fitted (``fit_step_costs``) to the
  timed segments of the *other* models (each step cut into ``--segments`` separately compiled
  programs, ``time_segments``), so the figure is a prediction, not a fit; a whole ``jax.jit`` step
  pays the fitted launch cost once.

    python benchmarks/calibration.py [--out benchmarks/results/calibration-<platform>-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from oocjax.schedule import cut_segments, keep_all, simulate_time
from oocjax.testing import trace_step

if __package__ in (None, ""):  # run as ``python benchmarks/calibration.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.rates import default_profile, fit_step_costs, measure_profile, time_segments
from examples.models import CNN, MLP, Transformer, next_token_step


def classifier_step(model, optimizer, *, mutable=False):
    """``step((params, extra, opt_state), (x, y)) -> (state, loss)`` for a classifier; ``extra``
    holds batch-norm statistics when ``mutable``."""

    def step(state, batch):
        params, extra, opt_state = state
        x, y = batch

        def loss_fn(p):
            variables = {"params": p, **extra}
            logits, updated = (
                model.apply(variables, x, mutable=["batch_stats"]) if mutable else (model.apply(variables, x), {})
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated

        (loss, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), {**extra, **updated}, opt_state), loss

    return step


def workloads() -> list[tuple[str, object, tuple]]:
    """(name, step, (state, batch)) with real arrays, each taking milliseconds on a 2-core CPU."""
    key = jax.random.key(0)
    found = []
    mlp, x = MLP(width=512, depth=4, classes=10), jax.random.normal(key, (256, 512))
    params = mlp.init(key, x)["params"]
    opt = optax.adam(1e-3)
    found.append(
        ("mlp-4x512-b256", classifier_step(mlp, opt), ((params, {}, opt.init(params)), (x, jnp.zeros(256, jnp.int32))))
    )
    cnn, images = CNN(), jax.random.normal(key, (32, 32, 32, 3))
    variables = cnn.init(key, images)
    params, extra = variables["params"], {"batch_stats": variables["batch_stats"]}
    opt = optax.sgd(0.1, momentum=0.9)
    step = classifier_step(cnn, opt, mutable=True)
    found.append(("cnn-6conv-b32-32px", step, ((params, extra, opt.init(params)), (images, jnp.zeros(32, jnp.int32)))))
    gpt = Transformer(vocab=1024, width=128, heads=4, layers=4, causal=True)
    tokens = jax.random.randint(key, (8, 129), 0, 1024)
    params = gpt.init(key, tokens[:, :-1])
    opt = optax.adamw(3e-4)
    found.append(("gpt-4x128-b8-s128", next_token_step(gpt, opt), ((params, opt.init(params)), tokens)))
    return found


def median_step_s(step, args, steps: int) -> float:
    jitted = jax.jit(step)
    jax.block_until_ready(jitted(*args))  # compile and warm up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_model(name, step, args, *, steps: int, segments: int, profiles: dict) -> dict:
    traced = trace_step(step, *args)
    program = traced.program
    jit_s = median_step_s(step, args, steps)
    predicted = {k: simulate_time(program, keep_all(program), p).step_time_s for k, p in profiles.items()}
    cut = cut_segments(program, keep_all(program), budget_bytes=2**60, min_segments=segments)
    timed = time_segments(traced, jax.tree.leaves(args), cut, repeats=5)
    return dict(
        model=name,
        equations=len(program.steps),
        gflops=sum(s.flops for s in program.steps) / 1e9,
        unfused_gbytes=sum(s.bytes_accessed for s in program.steps) / 1e9,
        jit_s=jit_s,
        predicted_s=predicted,
        segments=[dict(steps=[r.start, r.stop], measured_s=t) for r, t in timed],
        segments_sum_s=sum(t for _, t in timed),
        _groups=[([program.steps[k] for k in r], t) for r, t in timed],
        _steps=program.steps,
    )


def calibrate_out_of_sample(rows: list[dict], prior) -> None:
    """Adds each model's ``calibrated`` prediction, fitted on the other models' segments only."""
    for row in rows:
        others = [group for other in rows if other is not row for group in other["_groups"]]
        fit = fit_step_costs(others, prior=prior)
        row["predicted_s"]["calibrated"] = fit.predict_s(row["_steps"])
        row["calibration"] = fit_record(fit)


def fit_record(fit) -> dict:
    return dict(
        flops_per_s=fit.profile.flops_per_s,
        hbm_bytes_per_s=fit.profile.hbm_bytes_per_s,
        op_overhead_s=fit.profile.op_overhead_s,
        launch_s=fit.launch_s,
        relative_rms=fit.relative_rms,
        total_ratio=fit.total_ratio,
        segments=len(fit.measured_s),
        rounds=fit.rounds,
    )


def profile_record(profile) -> dict:
    fields = ("flops_per_s", "hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "op_overhead_s")
    fields += ("copy_latency_s", "h2d_latency_s", "d2h_latency_s")
    return dict(name=profile.name, **{f: getattr(profile, f) for f in fields}, source=profile.source)


def print_table(rows: list[dict]) -> None:
    kinds = list(rows[0]["predicted_s"])
    print(f"{'model':22s} {'eqns':>5s} {'GFLOP':>6s} {'jax.jit':>9s} " + " ".join(f"{k:>18s}" for k in kinds))
    for r in rows:
        cells = " ".join(f"{r['predicted_s'][k] * 1e3:9.2f} ms {r['predicted_s'][k] / r['jit_s']:5.2f}x" for k in kinds)
        print(f"{r['model']:22s} {r['equations']:5d} {r['gflops']:6.2f} {r['jit_s'] * 1e3:6.2f} ms {cells}")


def describe_profile(p, seconds: float) -> str:
    return (
        f"measured in {seconds:.2f} s: {p.flops_per_s / 1e9:.1f} GFLOP/s, memory {p.hbm_bytes_per_s / 1e9:.1f} GB/s, "
        f"to host {p.d2h_bytes_per_s / 1e9:.2f} GB/s + {p.d2h_latency_s * 1e6:.0f} us, "
        f"to device {p.h2d_bytes_per_s / 1e9:.2f} GB/s + {p.h2d_latency_s * 1e6:.0f} us"
    )


def describe_fit(fit) -> str:
    p = fit.profile
    return (
        f"fitted to all {len(fit.measured_s)} segments: {p.flops_per_s / 1e9:.1f} GFLOP/s, memory "
        f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s, {p.op_overhead_s * 1e6:.1f} us per equation, {fit.launch_s * 1e6:.0f} us "
        f"per launch; segment times within {fit.relative_rms:.0%} (relative rms), their sum {fit.total_ratio:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed jax.jit steps per model")
    parser.add_argument("--segments", type=int, default=8, help="segments each model is cut into for calibration")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    started, load_before = time.perf_counter(), os.getloadavg()[0]
    measured = measure_profile()
    measure_s = time.perf_counter() - started
    print(describe_profile(measured, measure_s))
    profiles = {"default": default_profile(), "measured": measured}
    rows = [measure_model(*w, steps=args.steps, segments=args.segments, profiles=profiles) for w in workloads()]
    calibrate_out_of_sample(rows, measured)
    fitted_on_all = fit_step_costs([g for r in rows for g in r["_groups"]], prior=measured)
    print_table(rows)
    print(describe_fit(fitted_on_all))
    if args.out:
        record = dict(
            benchmark="calibration",
            platform=jax.devices()[0].platform,
            device=str(jax.devices()[0]),
            measure_s=measure_s,
            profiles={k: profile_record(p) for k, p in profiles.items()},
            steps=args.steps,
            segments_per_model=args.segments,
            models=[{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
            fitted_on_all_segments=fit_record(fitted_on_all),
            jax=jax.__version__,
            wall_s=time.perf_counter() - started,
            # Other work on the machine skews every timing: the 1-minute load average around the run.
            load_average=dict(before=load_before, after=os.getloadavg()[0]),
            **machine(),
        )
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
