"""Swap, recompute, or a user's own remat: the same GPT at the same budgets, on this CPU.

One small Flax GPT training step (float32, AdamW, the state donated), run at budgets that are
shares of the in-core estimate of the plain step (``ooc_jit(step, budget=2**62,
donate_argnums=(0,)).plan(...).baseline_peak_bytes``), in these ways:

- ``jax_jit``: the plain step under ``jax.jit``, the reference (1.00x) for time and losses; and
  ``jax_jit_nothing_saveable``, ``jax_jit_dots_saveable``: the same model with every block in
  ``nn.remat(policy=jax.checkpoint_policies.<policy>)``, remat as a user writes it, under ``jax.jit``;
- at each budget, under ``ooc_jit``: ``swap_only`` (``recompute="off"``: keep or move),
  ``hybrid`` (``recompute="auto"``: keep, move or recompute, chosen by simulated time), and
  ``remat_nothing_saveable``, ``remat_dots_saveable`` (the remat models with ``recompute="off"``:
  the user's remat, and oocjax moves what still does not fit in the budget).

Per row: the in-core estimate of its step (for a remat model, its ``jax.jit`` peak estimate), the
budget, whether the step fits it without moving anything, bytes moved per step
(``plan.moved_bytes``), the values oocjax recomputes (``plan.recomputed``), the equations and FLOPs
added over the plain step (a user's remat adds its own), the simulated step time
(``simulate_time(plan.program, plan.schedule, profile)``) with this machine's measured profile
(``measure_profile``, the one the planner chose with) and with the published ``h100-pcie`` profile
(the same plan, for reference), the measured CPU step time (median of ``--timed-steps`` steps after
the loss steps, each blocked on; the rows take turns, one step each) and its ratio to ``jax_jit``'s
(also for the fastest step: ``best_vs_jax_jit``), the executed peak (the compiled
segments' memory; the in-core estimate when nothing moves) against the budget, and the largest
difference of the ``--loss-steps`` losses from ``jax_jit``'s (every row starts from the same state
and batch). A ``jax_jit`` row's simulated time is the cost model's prediction of ``jax.jit``'s
step (in-core, nothing moved), next to its measured time.

``what_if`` (simulated only, nothing compiled): at each budget, ``plan_hybrid`` on the same traced
step with ``recompute="always"`` on this machine's profile (what recomputing buys, whether or not
``"auto"`` takes it) and with ``recompute="auto"`` on ``h100-pcie`` (what ``ooc_jit`` would choose
on that GPU).

    python benchmarks/hybrid.py            # ~2-3 min on a 2-core CPU: benchmarks/results/hybrid-cpu-<date>.json
    python benchmarks/hybrid.py --quick    # a tiny GPT at one budget, < 1 min; written to the temporary folder

Simulated times are the cost model's, not measurements. Measured times are this CPU's: a transfer
to ``pinned_host`` is a memory copy, and every segment of a plan is one more program launch. The
JSON records the machine's load average before and after: on a shared machine, read the ratios of
rows measured together, not the absolute times.
Exits nonzero (after writing the JSON) if an ``ooc_jit`` row's executed peak is over its budget,
or the hybrid moves more bytes than swap-only at a budget, or simulates slower by more than
``MOVE_MARGIN``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path

import flax.linen as nn
import jax
import optax

if __package__ in (None, ""):  # run as ``python benchmarks/hybrid.py``: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._machine import machine
from benchmarks.rates import measure_profile
from examples.models import Block, next_token_step
from oocjax import ooc_jit
from oocjax.schedule import keep_all, plan_hybrid, simulate, simulate_time
from oocjax.testing import MOVE_MARGIN, recomputable_steps, trace_step

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(layers=4, width=128, heads=4, batch=8, seq=128, vocab=512)
QUICK_MODEL = dict(layers=2, width=64, heads=4, batch=4, seq=32, vocab=256)
BUDGETS = (0.60, 0.35)
QUICK_BUDGETS = (0.5,)
MIN_OFFLOAD_BYTES = 256 * 1024  # the model's activations are 512 KiB and up, its weights 64-256 KiB
QUICK_MIN_OFFLOAD_BYTES = 16 * 1024
POLICIES = ("nothing_saveable", "dots_saveable")
GPU_PROFILE = "h100-pcie"
PROFILE_BUDGET_S = 4.0  # measure_profile's timing budget: the best of more runs, steadier on a busy machine
QUICK_PROFILE_BUDGET_S = 1.0  # the planner's default
JIT_ROWS = ("jax_jit", *(f"jax_jit_{p}" for p in POLICIES))
OOC_ROWS = ("swap_only", "hybrid", *(f"remat_{p}" for p in POLICIES))


class GPT(nn.Module):
    """A GPT-2-style decoder (``examples.models.Block``s, learned positions, final norm); with a
    ``policy`` (a name in ``jax.checkpoint_policies``) every block runs in ``nn.remat`` under it.
    The blocks are named, so that a remat'd model has the plain one's parameters."""

    vocab: int
    width: int
    heads: int
    layers: int
    policy: str | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (tokens.shape[1], self.width))
        layer = Block
        if self.policy is not None:
            layer = nn.remat(Block, policy=getattr(jax.checkpoint_policies, self.policy), static_argnums=(2,))
        for i in range(self.layers):
            x = layer(width=self.width, heads=self.heads, causal=True, name=f"block_{i}")(x, True)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def workload(model: dict, policy: str | None = None):
    """(step, state, tokens): the same initial state and batch whatever the policy."""
    gpt = GPT(vocab=model["vocab"], width=model["width"], heads=model["heads"], layers=model["layers"], policy=policy)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    tokens = jax.random.randint(jax.random.key(1), (model["batch"], model["seq"] + 1), 0, model["vocab"])
    params = gpt.init(jax.random.key(0), tokens[:, :-1])
    return next_token_step(gpt, optimizer), (params, optimizer.init(params)), tokens


class Runner:
    """One row's step and the state it trains, one step at a time (the state is donated)."""

    def __init__(self, step, state, tokens):
        self.step, self.state, self.tokens = step, fresh(state), tokens
        self.losses, self.times, self.warnings = [], [], []

    def __call__(self) -> float:
        """Runs one step, waits for it, and returns its seconds; keeps its loss."""
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:  # ooc_jit warns when it plans again
            warnings.simplefilter("always")
            self.state, loss = self.step(self.state, self.tokens)
            jax.block_until_ready((self.state, loss))
        self.losses.append(float(loss))
        self.warnings += [str(w.message)[:300] for w in caught]
        return time.perf_counter() - started


def run_all(runners: list[Runner], loss_steps: int, timed_steps: int) -> list[dict]:
    """Per runner: the losses of its first ``loss_steps`` steps (the first compiles or warms up),
    then ``timed_steps`` more timed round-robin, one step of each runner per round, so that a
    busy moment of the machine falls on every row alike; their median is the row's step time."""
    first = []
    for runner in runners:
        first.append(runner())
        for _ in range(loss_steps - 1):
            runner()
    for _ in range(timed_steps):
        for runner in runners:
            runner.times.append(runner())
    return [
        dict(
            losses=r.losses[:loss_steps],
            first_step_s=t,
            step_s=r.times,
            measured_s=statistics.median(r.times),
            best_s=min(r.times),
            warnings=r.warnings[:3],
        )
        for r, t in zip(runners, first)
    ]


def total_flops(program) -> int:
    return sum(s.flops for s in program.steps)


def fresh(tree):
    """A copy of the state to donate: every row starts from the same one."""
    return jax.tree.map(lambda x: x.copy(), tree)


def simulated(program, schedule, profiles: dict) -> dict:
    """Simulated step time of ``schedule`` per profile (name -> seconds)."""
    return {name: simulate_time(program, schedule, p).step_time_s for name, p in profiles.items()}


def added(program, plain: dict) -> dict:
    """Equations and FLOPs ``program`` runs beyond the plain step's."""
    flops = total_flops(program)
    return dict(
        extra_equations=len(program.steps) - plain["equations"],
        extra_flops=flops - plain["flops"],
        extra_flops_pct=100 * (flops - plain["flops"]) / plain["flops"],
    )


def jit_row(name: str, step, state, tokens, *, profiles: dict, plain: dict) -> tuple[dict, Runner]:
    """``jax.jit`` of a step, compiled, and the cost model's prediction of it (nothing moved); the
    runner that measures it."""
    in_core = ooc_jit(step, budget=2**62, donate_argnums=(0,)).plan(state, tokens)
    started = time.perf_counter()
    jitted = jax.jit(step, donate_argnums=(0,)).lower(state, tokens).compile()
    compile_s = time.perf_counter() - started
    program = in_core.program
    row = dict(
        row=name,
        budget_fraction=None,
        budget_bytes=None,
        in_core_bytes=in_core.baseline_peak_bytes,
        moved_bytes=0,
        recomputed_values=0,
        **added(program, plain),
        simulated_s=simulated(program, keep_all(program), profiles),
        compile_s=compile_s,
    )
    return row, Runner(jitted, state, tokens)


def ooc_row(
    name: str,
    step,
    state,
    tokens,
    fraction: float,
    budget: int,
    *,
    recompute: str,
    profiles: dict,
    plain: dict,
    min_offload: int,
) -> tuple[dict, Runner]:
    """``ooc_jit`` of a step at ``budget``: its plan (segments compiled), simulated; the runner that
    measures it."""
    started = time.perf_counter()
    ooc = ooc_jit(step, budget=budget, donate_argnums=(0,), recompute=recompute, min_offload_bytes=min_offload)
    plan = ooc.plan(state, tokens)
    plan_s = time.perf_counter() - started
    executed = plan.executed_peak_bytes
    peak = plan.peak_bytes if executed is None else executed  # nothing moves: jax.jit's own program runs
    row = dict(
        row=name,
        recompute=recompute,
        budget_fraction=fraction,
        budget_bytes=budget,
        in_core_bytes=plan.baseline_peak_bytes,
        fits_in_core=plan.baseline_peak_bytes <= budget,
        moved_bytes=plan.moved_bytes,
        offloads=len(plan.offloads),
        host_inputs=len(plan.host_inputs),
        recomputed_values=len(plan.recomputed),
        recomputed_bytes=sum(r.nbytes for r in plan.recomputed),
        plan_extra_flops=plan.extra_flops,
        **added(plan.program, plain),
        simulated_s=simulated(plan.program, plan.schedule, profiles),
        planned_step_time_s=plan.step_time_s,
        planned_swap_only_time_s=plan.swap_only_time_s,
        planned_peak_bytes=plan.peak_bytes,
        executed_peak_bytes=executed,
        within_budget=peak <= budget,
        segments=len(plan.segments),
        plan=repr(plan),
        plan_s=plan_s,
    )
    return row, Runner(ooc, state, tokens)


def what_if(traced, fraction: float, budget: int, *, profiles: dict, plain: dict, min_offload: int) -> list[dict]:
    """Simulated only: ``plan_hybrid`` forced to recompute on this machine's profile, and left to
    choose on the GPU profile, at the budget ``ooc_jit`` planned the other rows for."""
    recomputable = recomputable_steps(traced.flat).__getitem__
    rows = []
    for label, profile, mode in (("always", "measured", "always"), ("auto", GPU_PROFILE, "auto")):
        choice = plan_hybrid(
            traced.program,
            budget,
            recomputable=recomputable,
            profile=profiles[profile],
            recompute=mode,
            min_offload_bytes=min_offload,
        )
        timeline = simulate(choice.program, choice.schedule)
        swap = simulate(traced.program, choice.swap_only) if choice.swap_only is not None else None
        rows.append(
            dict(
                row=f"hybrid_{label}_planned_for_{profile}",
                recompute=mode,
                planned_with=profile,
                budget_fraction=fraction,
                budget_bytes=budget,
                moved_bytes=timeline.h2d_bytes + timeline.d2h_bytes,
                swap_only_moved_bytes=None if swap is None else swap.h2d_bytes + swap.d2h_bytes,
                recomputed_values=len(choice.rewrite.recomputed),
                **added(choice.program, plain),
                simulated_s=simulated(choice.program, choice.schedule, profiles),
                swap_only_simulated_s=None
                if choice.swap_only is None
                else simulated(traced.program, choice.swap_only, profiles),
                planned_peak_bytes=timeline.peak_bytes,
            )
        )
    return rows


def compare(rows: list[dict]) -> None:
    """Adds ``vs_jax_jit`` (median step time over ``jax_jit``'s), ``best_vs_jax_jit`` (the same for
    the fastest step) and ``loss_max_abs_diff`` to every row."""
    reference = next(r for r in rows if r["row"] == "jax_jit")
    for r in rows:
        r["vs_jax_jit"] = r["measured_s"] / reference["measured_s"]
        r["best_vs_jax_jit"] = r["best_s"] / reference["best_s"]
        n = min(len(r["losses"]), len(reference["losses"]))
        r["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(r["losses"][:n], reference["losses"][:n]))


def checks(rows: list[dict]) -> list[str]:
    """What the benchmark promises, as failures: every ``ooc_jit`` row within its budget; at each
    budget the hybrid moves no more bytes than swap-only, and simulates no slower than it by more than
    ``MOVE_MARGIN`` (the choice keeps the plan that moves fewer bytes unless the other is faster by
    more than that)."""
    failures = []
    for r in rows:
        if r["budget_fraction"] is not None and not r["within_budget"]:
            failures.append(f"{r['row']} at {r['budget_fraction']:.0%}: executed peak over the budget")
    for fraction in sorted({r["budget_fraction"] for r in rows if r["budget_fraction"] is not None}):
        at = {r["row"]: r for r in rows if r["budget_fraction"] == fraction}
        swap, hybrid = at["swap_only"], at["hybrid"]
        if hybrid["moved_bytes"] > swap["moved_bytes"]:
            failures.append(f"hybrid at {fraction:.0%} moves more bytes than swap-only")
        if hybrid["simulated_s"]["measured"] > swap["simulated_s"]["measured"] * (1 + MOVE_MARGIN):
            failures.append(f"hybrid at {fraction:.0%} simulates slower than swap-only by more than {MOVE_MARGIN:.0%}")
    return failures


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def table(rows: list[dict]) -> str:
    """The rows as a text table (MiB, milliseconds)."""
    lines = [
        f"{'row':<24} {'budget':>6} {'in-core':>8} {'budget':>8} {'moved':>8} {'recomp':>6} {'+flops':>6} "
        f"{'sim cpu':>8} {'sim h100':>8} {'cpu':>8} {'vs jit':>6} {'best':>5} {'peak':>8} {'ok':>3} {'loss diff':>9}",
        f"{'':<24} {'':>6} {'MiB':>8} {'MiB':>8} {'MiB':>8} {'values':>6} {'%':>6} {'ms':>8} {'ms':>8} "
        f"{'ms':>8} {'':>6} {'':>5} {'MiB':>8} {'':>3} {'':>9}",
    ]
    for r in rows:
        budgeted = r["budget_fraction"] is not None
        fraction = f"{r['budget_fraction']:.0%}" if budgeted else "-"
        ok = ("yes" if r["within_budget"] else "NO") if budgeted else "-"
        peak = (r["executed_peak_bytes"] or r["planned_peak_bytes"]) if budgeted else None
        lines.append(
            f"{r['row']:<24} {fraction:>6} {_mib(r['in_core_bytes']):>8} {_mib(r['budget_bytes']):>8} "
            f"{_mib(r['moved_bytes']):>8} {r['recomputed_values']:>6} {r['extra_flops_pct']:>6.1f} "
            f"{_ms(r['simulated_s']['measured']):>8} {r['simulated_s'][GPU_PROFILE] * 1e3:>8.3f} "
            f"{_ms(r['measured_s']):>8} {r['vs_jax_jit']:>6.2f} {r['best_vs_jax_jit']:>5.2f} "
            f"{_mib(peak):>8} {ok:>3} {r['loss_max_abs_diff']:>9.2g}"
        )
    return "\n".join(lines)


def what_if_table(rows: list[dict]) -> str:
    lines = [
        f"{'simulated only':<40} {'budget':>6} {'moved':>8} {'swap':>8} {'recomp':>6} {'+flops':>6} "
        f"{'sim cpu':>8} {'(swap)':>8} {'sim h100':>8} {'(swap)':>8}"
    ]
    for r in rows:
        swap = r["swap_only_simulated_s"] or {}
        lines.append(
            f"{r['row']:<40} {r['budget_fraction']:>6.0%} {_mib(r['moved_bytes']):>8} "
            f"{_mib(r['swap_only_moved_bytes']):>8} {r['recomputed_values']:>6} {r['extra_flops_pct']:>6.1f} "
            f"{_ms(r['simulated_s']['measured']):>8} {_ms(swap.get('measured')):>8} "
            f"{r['simulated_s'][GPU_PROFILE] * 1e3:>8.3f} {(swap.get(GPU_PROFILE) or 0) * 1e3:>8.3f}"
        )
    return "\n".join(lines)


def profile_record(profile) -> dict:
    fields = ("flops_per_s", "hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "op_overhead_s")
    fields += ("copy_latency_s", "h2d_latency_s", "d2h_latency_s")
    return dict(name=profile.name, **{f: getattr(profile, f) for f in fields}, source=profile.source)


def _versions() -> dict:
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT at one budget (< 1 min), for the tests")
    parser.add_argument("--out", help="a JSON file, or a folder for the default name hybrid-cpu-<date>.json")
    parser.add_argument("--budgets", help="shares of the in-core estimate (default 0.6,0.35; quick 0.5)")
    parser.add_argument("--loss-steps", type=int, default=3, help="steps whose losses are compared (first: warm-up)")
    parser.add_argument("--timed-steps", type=int, help="timed steps after those (default 20; quick 3)")
    parser.add_argument("--min-offload", type=int, help="ooc_jit's min_offload_bytes (default 256 KiB; quick 16 KiB)")
    for name in MODEL:
        parser.add_argument(f"--{name}", type=int)
    args = parser.parse_args()
    args.timed_steps = args.timed_steps or (3 if args.quick else 20)
    args.min_offload = args.min_offload or (QUICK_MIN_OFFLOAD_BYTES if args.quick else MIN_OFFLOAD_BYTES)
    model = dict(QUICK_MODEL if args.quick else MODEL)
    model |= {k: v for k in model if (v := getattr(args, k)) is not None}
    budgets = tuple(map(float, args.budgets.split(","))) if args.budgets else (QUICK_BUDGETS if args.quick else BUDGETS)

    started = time.perf_counter()
    where = machine()  # the commit the run starts from
    started_at = datetime.datetime.now().isoformat(timespec="seconds")
    load_before = os.getloadavg()
    # Measured first, with more time than the planner's default: the planner then uses this one
    # (measure_profile caches it per device kind for the process).
    profile_budget_s = QUICK_PROFILE_BUDGET_S if args.quick else PROFILE_BUDGET_S
    measured = measure_profile(budget_s=profile_budget_s)
    profiles = {"measured": measured, GPU_PROFILE: GPU_PROFILE}
    step, state, tokens = workload(model)
    traced = trace_step(step, state, tokens, donate_argnums=(0,))
    in_core = ooc_jit(step, budget=2**62, donate_argnums=(0,)).plan(state, tokens).baseline_peak_bytes
    plain = dict(flops=total_flops(traced.program), equations=len(traced.program.steps))
    common = dict(profiles=profiles, plain=plain)
    print(
        f"GPT {model['layers']}x{model['width']}, {model['heads']} heads, batch {model['batch']}, seq {model['seq']}, "
        f"vocab {model['vocab']} (float32, AdamW): in-core estimate {in_core / 2**20:.2f} MiB, "
        f"{plain['flops'] / 1e9:.2f} GFLOP/step; budgets {', '.join(f'{b:.0%}' for b in budgets)}",
        flush=True,
    )
    remat = {policy: workload(model, policy) for policy in POLICIES}
    built = [jit_row("jax_jit", step, state, tokens, **common)]
    for policy, (remat_step, remat_state, _) in remat.items():
        built.append(jit_row(f"jax_jit_{policy}", remat_step, remat_state, tokens, **common))
    print(f"  compiled the jax.jit rows ({time.perf_counter() - started:.0f} s)", flush=True)
    alternatives = []
    for fraction in budgets:
        budget = int(in_core * fraction)
        at = dict(fraction=fraction, budget=budget, min_offload=args.min_offload, **common)
        built.append(ooc_row("swap_only", step, state, tokens, **at, recompute="off"))
        built.append(ooc_row("hybrid", step, state, tokens, **at, recompute="auto"))
        for policy, (remat_step, remat_state, _) in remat.items():
            built.append(ooc_row(f"remat_{policy}", remat_step, remat_state, tokens, **at, recompute="off"))
        alternatives += what_if(traced, fraction, budget, profiles=profiles, plain=plain, min_offload=args.min_offload)
        print(f"  planned and compiled at {fraction:.0%} ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = [row for row, _ in built]
    for row, measured_steps in zip(rows, run_all([runner for _, runner in built], args.loss_steps, args.timed_steps)):
        row |= measured_steps
    print(f"  ran every row ({time.perf_counter() - started:.0f} s)", flush=True)
    compare(rows)
    failures = checks(rows)

    record = dict(
        benchmark="hybrid",
        quick=args.quick,
        **where,
        jax=jax.__version__,
        versions=_versions(),
        started=started_at,
        load_average=dict(before=list(load_before), after=list(os.getloadavg())),
        model=dict(model, name=f"gpt-{model['layers']}x{model['width']}", dtype="float32", optimizer="adamw"),
        settings=dict(
            budgets=list(budgets),
            loss_steps=args.loss_steps,
            timed_steps=args.timed_steps,
            min_offload_bytes=args.min_offload,
            policies=list(POLICIES),
            profile_budget_s=profile_budget_s,
        ),
        in_core_bytes=in_core,
        plain_flops=plain["flops"],
        plain_equations=plain["equations"],
        profiles={"measured": profile_record(measured), GPU_PROFILE: GPU_PROFILE},
        rows=rows,
        what_if=alternatives,
        failures=failures,
        wall_s=time.perf_counter() - started,
    )
    default = f"hybrid-cpu-{record['date']}{'-quick' if args.quick else ''}.json"
    out = Path(args.out) if args.out else Path(tempfile.gettempdir() if args.quick else ROOT / "benchmarks" / "results")
    if out.is_dir():
        out = out / default
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
    print(what_if_table(alternatives))
    print(f"wrote {out} ({record['wall_s']:.0f} s)")
    if failures:
        raise SystemExit("hybrid benchmark failed:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
