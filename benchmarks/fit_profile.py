"""The H200 profile fitted to the committed H200 runs, and checked on the runs it was not fitted to.

A model, not a measurement: it reads ``benchmarks/results/`` and plans on this machine's CPU, nothing
runs on a GPU. Three fits, each on measurements of one kind, then every committed step time predicted:

* **compute** (``flops_per_s``, ``hbm_bytes_per_s``, ``op_overhead_s`` per equation, and a cost per
  program launch that ``DeviceProfile`` has no field for): the per-launch times of the committed runs,
  each program launched and waited for on its own: the 23 segment programs of
  ``segment_profile-nvidia-h200-2026-11-26.json`` (each alone, on the inputs the step gave it) and
  the 1.34B GPT's whole ``jax.jit`` step of ``state_offload_gpu-nvidia-h200-2026-11-28.json`` (one
  launch, wider matrix products: without it the fit cannot tell matrix products from the rest). A
  launch costs ``launch_s + sum(max(flops / flops_per_s, bytes / hbm_bytes_per_s) + op_overhead_s)``
  over its equations (``DeviceProfile.compute_seconds``); the four coefficients are fitted by
  non-negative least squares on relative errors, each equation's bound reclassified under the fitted
  rates until none changes (as ``rates.fit_step_costs``, which fits seconds, not ratios).
  The equations are those of the same model's plan made now, at the measured segments' bounds
  (matched by their FLOPs: the plan made now is cut differently, see ``segment_groups``);
* **link** (``h2d``/``d2h`` bandwidth and latency): every ``gpu_check`` run's copies, eager
  ``jax.device_put`` at 4 and 256 MiB and jitted at 1 GiB, one line per direction (seconds = latency
  + bytes / bandwidth); checked on the ``state_offload_gpu`` runs' 1 GiB copies. The both-ways figure
  (one program copying each way at once) is their mean; ``DeviceProfile`` has no field for it either.

Then each committed step (every ``gpu*-nvidia-h200`` and ``state_offload_gpu-nvidia-h200`` run) is
predicted, the plan's ``step_time_s`` with the fitted rates (``simulate_time`` of its program and moves):

* where the run recorded the rates it chose its plan by, the plan rebuilt at its commit (a ``git
  archive`` of it in a temporary folder, run with this jax), with those rates, nothing compiled
  (``HELPER``); it is the plan that ran where its moves are the run's (``same_as_ran``);
* a ``jax.jit`` or per-block remat step: the step in core, as traced here;
* else the same model at the same budget planned now for ``profile="h200"`` (the older swap-only
  runs: ``recompute="off"``, as every plan was then).

A plan made here is traced under this machine's jax (0.10.2; the GPU ran 0.11.2), so even a plan
rebuilt at its commit can differ from the one that ran: each row names both, and ``why_not_rebuilt``
says why. The 25% line is issue 53's. Writes the fit, the proposed profile beside the current
``PROFILES["h200"]``, the link check and every prediction to ``--out``.

    python benchmarks/fit_profile.py --out benchmarks/results/fit_profile-h200-<date>.json   # ~5 min, 2 cores

``--results-at <commit>`` reads the results files committed there instead: results/ keeps one run per
claim, and the committed fit (``fit_profile-h200-2026-12-01.json``, at 95c102b) was made from every H200
run committed then, ``--results-at 95c102b``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import nnls

if __package__ in (None, ""):  # run as ``python benchmarks/fit_profile.py``: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import gpu_check, state_offload_gpu
from benchmarks._machine import machine
from benchmarks.state_offload import MODEL as STATE_MODEL
from oocjax import ooc_jit
from oocjax.schedule import PROFILES, simulate_time

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SEGMENTS_FILE = "segment_profile-nvidia-h200-2026-11-26.json"
WHOLE_STEP_FIT = ("state_offload_gpu-nvidia-h200-2026-11-28.json", "jax_jit")  # the 1.34B GPT's one launch
ACTIVATION_BUDGET = 8286266982  # every gpu_check H200 run's ooc_jit budget (0.8 of its capped limit)
GIB = 2**30
WITHIN = 0.25  # issue 53: predicted within 25% of measured, per step
IN_CORE = 2**62


RESULTS_AT: str | None = None  # --results-at: the commit whose results files to read, instead of the working tree's


def load(pattern: str) -> list[tuple[str, dict]]:
    """The results files whose names match ``pattern``, by name: the working tree's, or those committed
    at ``RESULTS_AT`` (the fit of 2026-12-01 read runs that results/ no longer keeps)."""
    if RESULTS_AT is None:
        return [(f.name, json.loads(f.read_text())) for f in sorted(RESULTS.glob(pattern))]

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    names = git("ls-tree", "--name-only", f"{RESULTS_AT}:benchmarks/results").split()
    return [
        (name, json.loads(git("show", f"{RESULTS_AT}:benchmarks/results/{name}")))
        for name in sorted(names)
        if fnmatch.fnmatchcase(name, pattern)
    ]


# -- the plans made now --------------------------------------------------------------------------------


def activation_case(variant: str):
    """The activation-bound GPT of ``gpu_check.py``: ``(step, args)``, abstract; ``variant`` is
    "plain", "remat" (every block in ``nn.remat(nothing_saveable)``) or "whole_loss_remat"."""
    if variant == "whole_loss_remat":
        work = gpu_check.workload(gpu_check.GPU_MODEL)
        return work.make_step(jax.checkpoint_policies.nothing_saveable), (work.state, work.batch)
    work = gpu_check.workload(gpu_check.GPU_MODEL, "remat_block_nothing_saveable" if variant == "remat" else "jax_jit")
    return work.step, (work.state, work.batch)


def state_case(variant: str):
    """The 1.34B GPT of ``state_offload_gpu.py``: ``(step, args)``, abstract."""
    init, step = state_offload_gpu.gpt(STATE_MODEL, remat=variant == "remat")
    tokens = jax.ShapeDtypeStruct((STATE_MODEL["batch"], STATE_MODEL["seq"] + 1), jnp.int32)
    return step, (jax.eval_shape(init, jax.random.key(0)), tokens)


def plan_now(family: str, variant: str, budget: int, **options):
    """The step planned now for the H200 profile (nothing compiled). A run made with the rounds
    that recomputed moved values (``moved_rounds``, since deleted) is planned as any other now."""
    step, args = (activation_case if family == "activation" else state_case)(variant)
    options.pop("moved_rounds", None)
    return ooc_jit(step, budget=budget, donate_argnums=(0,), **options).plan(*args, profile="h200")


def plan_facts(plan) -> dict:
    """The plan made now; ``step_time_s`` is its own figure (the plan chooser's, with the datasheet
    rates, before the segments were cut: a prefetch cut to the end of its layer can expose copies
    that the chosen schedule hid), ``in_core_time_s`` the step in core on the same profile."""
    return dict(
        plan=repr(plan),
        step_time_s=plan.step_time_s,
        in_core_time_s=plan.in_core_time_s,
        segments=len(plan.segments),
        moved_bytes=plan.moved_bytes,
        recomputed=len(plan.recomputed),
        layer_policy=list(plan.layer_policy),
        equations=len(plan.program.steps),
    )


# -- the compute fit ----------------------------------------------------------------------------------


def segment_groups(plan, measured: list[dict]) -> list[tuple[list, float, dict]]:
    """The measured segments of ``SEGMENTS_FILE`` (a plan of 68cbafd, traced on the GPU) as groups of
    the equations of ``plan`` (made now, cut elsewhere): consecutive segments of ``plan`` taken
    together while that brings their FLOPs nearer the measured segment's, which they must match
    within 5%.
    ``(equations, seconds, match)`` per measured segment."""
    groups, k, steps = [], 0, plan.program.steps
    for row in measured:
        start, flops = k, 0
        target = row["flops"]
        while k < len(plan.segments) and (
            flops < 0.97 * target or abs(flops + plan.segments[k].flops - target) < abs(flops - target)
        ):  # up to the measured segment's FLOPs, and on while the next segment takes the sum nearer to them
            flops += plan.segments[k].flops
            k += 1
        if row is measured[-1]:  # the last one takes the rest (the optimizer's tail: few FLOPs)
            flops, k = flops + sum(x.flops for x in plan.segments[k:]), len(plan.segments)
        if not math.isclose(flops, row["flops"], rel_tol=0.05):
            raise ValueError(f"segment {row['segment']} ({row['flops']:.4g} FLOPs) matches none: {flops:.4g}")
        span = (plan.segments[start].start, plan.segments[k - 1].stop)
        match = dict(segment=row["segment"], now=[start, k - 1], flops_now=flops, flops_then=row["flops"])
        groups.append((steps[span[0] : span[1]], row["solo_s"], match))
    if k != len(plan.segments):
        raise ValueError(f"{len(plan.segments) - k} segments of the plan made now match no measured segment")
    return groups


def _features(steps, flops_per_s: float, bytes_per_s: float) -> tuple[float, float, float, float]:
    """A launch's time's factors of seconds per flop, per byte, per equation and per launch, each
    equation counted under its bound at these rates (as ``schedule.cost`` prices it)."""
    flops = nbytes = 0
    for step in steps:
        if step.flops / flops_per_s >= step.bytes_accessed / bytes_per_s:
            flops += step.flops
        else:
            nbytes += step.bytes_accessed
    return float(flops), float(nbytes), float(len(steps)), 1.0


def fit_compute(groups: list[tuple[list, float]], prior=PROFILES["h200"], rounds: int = 30) -> dict:
    """Seconds per flop, per byte, per equation and per launch, non-negative, minimising the squared
    relative errors of the groups' times; each equation's bound reclassified until stable."""
    measured = np.array([seconds for _, seconds in groups])
    flops_per_s, bytes_per_s = prior.flops_per_s, prior.hbm_bytes_per_s
    for made in range(1, rounds + 1):
        used = made
        rows = np.array([_features(steps, flops_per_s, bytes_per_s) for steps, _ in groups])
        scale = rows.max(axis=0)
        scale[scale == 0] = 1
        x, _ = nnls(rows / scale / measured[:, None], np.ones(len(groups)))
        per_flop, per_byte, per_step, launch = x / scale
        new = (1 / per_flop if per_flop else flops_per_s, 1 / per_byte if per_byte else bytes_per_s)
        stable = all(_features(steps, *new) == tuple(row) for (steps, _), row in zip(groups, rows, strict=True))
        flops_per_s, bytes_per_s = new
        if stable:
            break
    predicted = rows @ np.array([per_flop, per_byte, per_step, launch])
    ratios = predicted / measured
    return dict(
        flops_per_s=flops_per_s,
        hbm_bytes_per_s=bytes_per_s,
        op_overhead_s=per_step,
        launch_s=launch,
        rounds=used,
        relative_rms=float(np.sqrt(np.mean((ratios - 1) ** 2))),
        ratios=[float(r) for r in ratios],
    )


# -- the link fit -------------------------------------------------------------------------------------


def link_points() -> tuple[dict, dict]:
    """(fit points, check points) per direction, (bytes, seconds): the gpu_check runs' eager and
    jitted copies to fit; the state_offload_gpu runs' jitted copies to check, and their both-ways figures."""
    fit = {"h2d": [], "d2h": []}
    for name, r in load("gpu*-nvidia-h200-*.json"):
        link = r.get("link") or {}
        for probe in link.get("eager", {}).values():
            for way in fit:
                fit[way].append((probe["bytes"], probe[f"{way}_s"], f"{name} eager"))
        if link.get("jitted"):
            for way in fit:
                jitted = link["jitted"]
                fit[way].append(
                    (jitted["bytes"], jitted["bytes"] / (jitted[f"{way}_GB_per_s"] * 1e9), f"{name} jitted")
                )
    check = {"h2d": [], "d2h": [], "both_GB_per_s": []}
    for name, r in load("state_offload_gpu-nvidia-h200-*.json"):
        link = r["link"]
        for way in ("h2d", "d2h"):
            check[way].append((link["bytes"], link["bytes"] / (link[f"{way}_GB_per_s"] * 1e9), name))
        check["both_GB_per_s"].append((link["both_GB_per_s"], name))
    return fit, check


def fit_link(points: list[tuple[int, float, str]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of ``seconds = latency + bytes / bandwidth``, relative errors."""
    a = np.array([[1 / t, b / t] for b, t, _ in points])
    (latency, per_byte), _ = nnls(a, np.ones(len(points)))
    return 1 / per_byte, latency


# -- the committed runs, predicted ----------------------------------------------------------------------


def committed_runs() -> list[dict]:
    """Every committed H200 step time: its file, configuration, commit, seconds, the plan it ran,
    and which plan made now stands for it (``case``), or why none does (``not_rebuilt``)."""
    runs = []
    cases = dict(
        jax_jit=("activation", "plain", IN_CORE, {}),
        remat_nothing_saveable_capped=("activation", "remat", IN_CORE, {}),
        remat_nothing_saveable=("activation", "whole_loss_remat", IN_CORE, {}),
    )
    for name, r in load("gpu*-nvidia-h200-*.json"):
        for c in r["results"]:
            if not c.get("s_per_step"):
                continue
            run = dict(file=name, configuration=c["configuration"], commit=r["commit"], measured_s=c["s_per_step"])
            run |= dict(run_plan=c.get("plan"), note=c.get("run_note", "")[:300])
            if c["configuration"] in cases:
                run["case"] = cases[c["configuration"]]
            elif c["configuration"].startswith("ooc_jit"):
                swap = "values recomputed" not in c["plan"]  # every plan then was swap-only, none recomputed
                run["case"] = ("activation", "plain", ACTIVATION_BUDGET, dict(recompute="off") if swap else {})
                if c.get("profile"):  # it recorded the rates it chose its plan with: rebuilt from its commit
                    run["from_commit"] = dict(
                        family="activation", commit=r["commit"], budget_bytes=c["budget_bytes"],
                        headroom_bytes=c["headroom_bytes"], run_profile=c["profile"], ran_moved_bytes=c["moved_bytes"],
                    )  # fmt: skip
            else:
                run["not_rebuilt"] = (
                    "XLA's own host offload inside one program (jax's offload policy): no plan describes it"
                )
            runs.append(run)
    _, sp = load(SEGMENTS_FILE)[0]
    same = next((run["from_commit"] for run in runs if run.get("from_commit", {}).get("commit") == sp["commit"]), None)
    for key, what in (("jit_s", "jax_jit (no donation)"), ("ooc_s", "ooc_jit"), ("back_to_back_s", "back_to_back")):
        case = ("activation", "plain", IN_CORE if key == "jit_s" else ACTIVATION_BUDGET, {})
        run = dict(file=SEGMENTS_FILE, configuration=what, commit=sp["commit"], measured_s=sp[key], run_plan=sp["plan"])
        runs.append(run | dict(case=case, note="its segments alone are fitted to" if key != "jit_s" else ""))
        if key != "jit_s" and same:  # the plan of the gpu_check run at the same commit and budget
            runs[-1]["from_commit"] = same | dict(profile_from="the gpu_check run at the same commit")
    states = load("state_offload_gpu-nvidia-h200-*.json")
    first_profile = next((n, r["profile"]) for n, r in states if r.get("profile"))
    for name, r in states:
        rounds = r.get("moved_rounds") or 0
        for row in r["ooc_jit"]:
            if "s_per_step" in row:
                case = ("state", "plain", row["budget_bytes"], dict(moved_rounds=rounds))
                run = dict(file=name, configuration=f"ooc_jit at {row['gib']:g} GiB", commit=r["commit"])
                run |= dict(measured_s=row["s_per_step"], case=case, note=f"MOVED_ROUNDS {rounds}" if rounds else "")
                runs.append(run | dict(run_plan=_state_plan(row)))
                recipe = dict(family="state", commit=r["commit"], budget_bytes=row["budget_bytes"], moved_rounds=rounds)
                recipe["ran_moved_bytes"] = row["planned_to_device_bytes"] + row["planned_back_bytes"]
                recipe["run_profile"] = r.get("profile") or first_profile[1]
                if not r.get("profile"):  # the first run recorded none: the next run's, on the same machine kind
                    recipe["profile_from"] = first_profile[0]
                runs[-1]["from_commit"] = recipe
        for row in r["jax_jit"]:
            if "s_per_step" in row:
                case = ("state", "remat" if row["remat"] else "plain", IN_CORE, {})
                configuration = "remat" if row["remat"] else "jax_jit"
                run = dict(file=name, configuration=configuration, commit=r["commit"], measured_s=row["s_per_step"])
                runs.append(run | dict(case=case, run_plan="in core"))
    return runs


# Run inside a ``git archive`` of a run's commit (that commit's oocjax and benchmarks, this jax): the
# plan that commit makes for the run's step with the rates the run chose its plan with (recorded in
# the run), nothing compiled, timed there with each profile given. The activation-bound GPT: the
# plan chooser's schedule (``pipeline._choose``), which is the schedule that ran where nothing moves
# (cutting segments moves only prefetches); the 1.34B GPT: the whole plan as that commit's
# ``state_offload.py`` made it on a CPU (segments' memory estimated, not compiled).
HELPER = """
import dataclasses, json, sys, time
spec = json.loads(sys.argv[1])
from oocjax import pipeline
from oocjax.schedule import simulate_time
try:
    from oocjax.schedule.profiles import DeviceProfile
except ImportError:
    from oocjax.schedule.cost import DeviceProfile
fields = {f.name for f in dataclasses.fields(DeviceProfile)}
def profile(d):
    return DeviceProfile(**{k: v for k, v in d.items() if k in fields})
run_profile = profile(spec["run_profile"])
pipeline.measure_profile = lambda *a, **k: run_profile
started = time.perf_counter()
if spec["family"] == "activation":
    from benchmarks.gpu_check import GPU_MODEL, workload
    from oocjax.transforms.trace import trace_step
    work = workload(GPU_MODEL)
    traced = trace_step(work.step, work.state, work.batch, donate_argnums=(0,))
    options = pipeline.PlannerOptions.read(dict(headroom_bytes=spec["headroom_bytes"]), "gpu", spec["budget_bytes"])
    budget = pipeline.Budget(user_bytes=spec["budget_bytes"], headroom_bytes=options.headroom_bytes)
    choice = pipeline._choose(traced.program, traced.flat, budget, options)
    program, schedule, segments, recomputed = choice.program, choice.schedule, None, len(choice.rewrite.recomputed)
else:
    from benchmarks import state_offload
    from oocjax import ooc_jit
    from oocjax.schedule import hybrid
    pipeline.compile_segments = state_offload.estimated_costs
    if spec["moved_rounds"] or hasattr(hybrid, "MOVED_ROUNDS"):
        hybrid.MOVED_ROUNDS = spec["moved_rounds"]
    step, state, tokens = state_offload.abstract_case(state_offload.MODEL, False)
    b = spec["budget_bytes"]
    options = dict(headroom_bytes=int(0.08 * b), **state_offload.GPU_OPTIONS)
    plan = ooc_jit(step, budget=b, donate_argnums=(0,), **options).plan(state, tokens)
    program, schedule, segments, recomputed = plan.program, plan.schedule, len(plan.segments), len(plan.recomputed)
timed = {name: simulate_time(program, schedule, profile(p)) for name, p in spec["profiles"].items()}
nbytes = [b.nbytes for b in program.buffers]
print("REBUILT " + json.dumps(dict(
    equations=len(program.steps), recomputed=recomputed, segments=segments, plan_s=time.perf_counter() - started,
    to_device_bytes=sum(nbytes[p.buffer] for p in schedule.prefetches),
    back_bytes=sum(nbytes[o.buffer] for o in schedule.offloads),
    step_time_s={n: r.step_time_s for n, r in timed.items()},
    compute_time_s={n: r.compute_time_s for n, r in timed.items()},
)))
"""


def rebuild_from_commits(runs: list[dict], profiles: dict, folder: Path) -> None:
    """Each run with a ``from_commit`` recipe gets ``from_commit["result"]`` (``HELPER``'s figures,
    each plan made once) or ``from_commit["error"]`` (why it could not be rebuilt)."""
    made: dict = {}
    for run in runs:
        recipe = run.get("from_commit")
        if recipe is None:
            continue
        spec = {k: v for k, v in recipe.items() if k not in ("profile_from", "ran_moved_bytes")}
        spec["profiles"] = profiles | dict(run=recipe["run_profile"])  # also the rates it was chosen with
        key = json.dumps({k: v for k, v in spec.items() if k != "profiles"}, sort_keys=True)
        if key not in made:
            started = time.perf_counter()
            made[key] = _rebuilt(spec, folder)
            print(f"rebuilt at {recipe['commit']} in {time.perf_counter() - started:.0f} s: {made[key]}", flush=True)
        recipe |= made[key]
        if "result" in recipe:  # the same plan as ran, as far as its moves show
            result = recipe["result"]
            recipe["same_as_ran"] = result["to_device_bytes"] + result["back_bytes"] == recipe["ran_moved_bytes"]


def _rebuilt(spec: dict, folder: Path) -> dict:
    tree = folder / spec["commit"]
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", spec["commit"]], cwd=ROOT, capture_output=True, check=False)
        if archive.returncode:
            return dict(error=f"git archive {spec['commit']}: {archive.stderr.decode()[-300:]}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        (tree / "rebuild_helper.py").write_text(HELPER)
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "rebuild_helper.py", json.dumps(spec)], cwd=tree, env=env, capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REBUILT ")]
    if not lines:
        return dict(error=f"exit {done.returncode}: {done.stderr[-600:]}")
    return dict(result=json.loads(lines[-1].removeprefix("REBUILT ")))


def _state_plan(row: dict) -> str:
    return (
        f"{row['segments']} segments, {row['planned_to_device_bytes'] / GIB:.2f} GiB in and "
        f"{row['planned_back_bytes'] / GIB:.2f} GiB back a step"
    )


def predict(runs: list[dict], fitted, launch_s: float, alternatives: dict, plans: dict) -> None:
    """Each run's prediction, in place: its plan rebuilt from its commit where that was done
    (``rebuild_from_commits``), else the plan made now, timed with the fitted profile; beside it, the
    plan made now timed with the fitted profile and with each of ``alternatives`` (name -> profile).
    ``plans`` caches the plans made now by (model, variant, budget, options)."""
    for run in runs:
        if "case" not in run:
            continue
        family, variant, budget, options = run.pop("case")
        key = (family, variant, budget, tuple(sorted(options.items())))
        if key not in plans:
            started = time.perf_counter()
            plans[key] = plan_now(family, variant, budget, **dict(options))
            print(f"planned {key[:3]} in {time.perf_counter() - started:.0f} s: {plans[key]!r}", flush=True)
        plan, copies = plans[key], run["configuration"] != "back_to_back"  # back to back copies nothing

        def seconds(profile, plan=plan, copies=copies) -> float:
            timed = simulate_time(plan.program, plan.schedule, profile)
            return timed.step_time_s if copies else timed.compute_time_s

        now = seconds(fitted)
        recipe = run.get("from_commit") or {}
        rebuilt = recipe.get("result")
        which = "step_time_s" if copies else "compute_time_s"

        def timed(name: str, profile, rebuilt=rebuilt, which=which) -> float:  # the rebuilt plan's, where there is one
            return rebuilt[which][name] if rebuilt else seconds(profile)

        predicted = timed("fitted", fitted)
        launches = (rebuilt or {}).get("segments") or _segments(run.get("run_plan")) or len(plan.segments)
        if rebuilt:
            same = "the plan that ran" if recipe["same_as_ran"] else "not the plan that ran: its moves differ"
            basis = f"rebuilt at its commit {run['commit']} with the rates it chose by ({same})"
        elif budget == IN_CORE:
            basis = "in core: the step as traced here (no plan)"
        else:
            swap = options.get("recompute") == "off"
            basis = "planned now (the current code): " + ("swap-only, as every plan then" if swap else "a new plan")
        run |= dict(
            basis=basis,
            rebuilt=bool(rebuilt and recipe["same_as_ran"]) or budget == IN_CORE,
            rebuilt_as=dict(
                model=family, variant=variant, budget_bytes=None if budget == IN_CORE else budget, **options
            ),
            plan_now=plan_facts(plan),
            predicted_s=predicted,
            ratio=predicted / run["measured_s"],
            within=abs(predicted / run["measured_s"] - 1) <= WITHIN,
            predicted_plan_now_s=now,
            launches=max(launches, 1),
            predicted_with_launches_s=predicted + launch_s * max(launches, 1),
            datasheet_h200_s=timed("h200", PROFILES["h200"]),
            **{f"predicted_{name}_s": timed(name, profile) for name, profile in alternatives.items()},
        )


def table(runs: list[dict]) -> str:
    lines = [
        f"{'run':<66} {'measured':>9} {'predicted':>9} {'ratio':>6}  the plan timed (the plan that ran)",
    ]
    for run in runs:
        where = f"{run['file'].removesuffix('.json')} {run['configuration']}"
        if "predicted_s" not in run:
            lines.append(
                f"{where:<66} {run['measured_s'] * 1e3:8.1f}ms {'-':>9} {'-':>6}  not rebuilt: {run['not_rebuilt']}"
            )
            continue
        flag = "" if run["within"] else " OUTSIDE 25%"
        fitted = "" if run["held_out"] else " (fitted)"
        now, rebuilt = run["plan_now"], (run.get("from_commit") or {}).get("result")
        same = (run.get("from_commit") or {}).get("same_as_ran")
        plan = (
            f"{'=' if same else '!='} ran, from {run['commit']}: {rebuilt['recomputed']} recomputed, "
            f"{(rebuilt['to_device_bytes'] + rebuilt['back_bytes']) / GIB:.1f} GiB moved"
            if rebuilt
            else f"now: {now['segments']} segments, {now['moved_bytes'] / GIB:.1f} GiB moved, "
            f"{now['recomputed']} recomputed"
        )
        lines.append(
            f"{where:<66} {run['measured_s'] * 1e3:8.1f}ms {run['predicted_s'] * 1e3:8.1f}ms "
            f"{run['ratio']:6.2f}{flag}{fitted}  {plan}; ran: {(run.get('run_plan') or '-')[:80]}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the JSON to write (default: print only)")
    parser.add_argument("--plan-now-only", action="store_true", help="no plans rebuilt from the runs' commits")
    parser.add_argument("--results-at", help="read the results files committed at this commit (e.g. 95c102b)")
    args = parser.parse_args()
    global RESULTS_AT
    RESULTS_AT = args.results_at
    began = time.perf_counter()
    _, sp = load(SEGMENTS_FILE)[0]
    budget_plan = plan_now("activation", "plain", sp["budget_bytes"])
    groups = segment_groups(budget_plan, sp["segments"])
    whole = plan_now("state", "plain", IN_CORE)
    jit_s = next(r for r in load(WHOLE_STEP_FIT[0])[0][1]["jax_jit"] if not r["remat"])
    launches = [(steps, seconds) for steps, seconds, _ in groups] + [(whole.program.steps, jit_s["s_per_step"])]
    compute = fit_compute(launches)
    segments_only = fit_compute(launches[:-1])

    fit_points, check_points = link_points()
    link = {way: fit_link(fit_points[way]) for way in ("h2d", "d2h")}
    both = statistics.mean(value for value, _ in check_points["both_GB_per_s"]) * 1e9
    fitted = dataclasses.replace(
        PROFILES["h200"],
        flops_per_s=compute["flops_per_s"],
        hbm_bytes_per_s=compute["hbm_bytes_per_s"],
        op_overhead_s=compute["op_overhead_s"],
        h2d_bytes_per_s=link["h2d"][0],
        d2h_bytes_per_s=link["d2h"][0],
        h2d_latency_s=link["h2d"][1],
        d2h_latency_s=link["d2h"][1],
        copy_latency_s=(link["h2d"][1] + link["d2h"][1]) / 2,
        source=(
            "fitted by benchmarks/fit_profile.py to the committed H200 runs: compute to the 23 segment programs of "
            f"{SEGMENTS_FILE} and the 1.34B GPT's jax.jit step of {WHOLE_STEP_FIT[0]}; the link to the copies "
            "of every gpu*-nvidia-h200 run"
        ),
    )
    link_check = [
        dict(
            way=way, run=run, measured_GB_per_s=b / t / 1e9, predicted_GB_per_s=b / fitted_seconds(fitted, way, b) / 1e9
        )
        for way in ("h2d", "d2h")
        for b, t, run in check_points[way]
    ]
    runs = committed_runs()
    for run in runs:  # what the fit saw: the segments' programs alone, the 1.34B GPT's one jax.jit launch
        run["held_out"] = not (run["file"] == SEGMENTS_FILE and run["configuration"] != "jax_jit (no donation)")
        run["held_out"] &= (run["file"], run["configuration"]) != WHOLE_STEP_FIT
        run["same_program_as_fitted"] = (
            run["file"].startswith("state_offload_gpu") and run["configuration"] == "jax_jit"
        )
    segments_fitted = dataclasses.replace(
        fitted, **{k: segments_only[k] for k in ("flops_per_s", "hbm_bytes_per_s", "op_overhead_s")}
    )
    shared = dataclasses.replace(fitted, h2d_bytes_per_s=both / 2, d2h_bytes_per_s=both / 2)
    made = {
        ("activation", "plain", sp["budget_bytes"], ()): budget_plan,
        ("state", "plain", IN_CORE, ()): whole,
    }
    alternatives = dict(segments_only_fit=segments_fitted, link_shared=shared)
    profiles = {name: dataclasses.asdict(x) for name, x in dict(fitted=fitted, h200=PROFILES["h200"]).items()}
    profiles |= {name: dataclasses.asdict(x) for name, x in alternatives.items()}
    if not args.plan_now_only:
        with tempfile.TemporaryDirectory() as folder:
            rebuild_from_commits(runs, profiles, Path(folder))
    predict(runs, fitted, compute["launch_s"], alternatives, made)
    print(table(runs))
    for run in runs:
        if not run.get("rebuilt"):
            run["why_not_rebuilt"] = why_not_rebuilt(run)
    held = [r for r in runs if "predicted_s" in r and r["held_out"]]
    rebuilt = [r for r in held if r["rebuilt"]]
    record = dict(
        benchmark="fit_profile",
        kind="model",
        label="A PROFILE FITTED TO COMMITTED H200 MEASUREMENTS, and its predictions: not a measurement",
        **machine(),
        jax=jax.__version__,
        current_profile=dataclasses.asdict(PROFILES["h200"]),
        proposed_profile=dataclasses.asdict(fitted) | dict(launch_s=compute["launch_s"], both_bytes_per_s=both),
        fit=dict(
            compute=compute | dict(fitted_to=[f"{SEGMENTS_FILE}: segments alone", f"{WHOLE_STEP_FIT[0]}: jax_jit"]),
            segments=[dict(m, seconds=s) for (_, s, m) in groups],
            compute_segments_only=segments_only | dict(note="the same fit without the 1.34B GPT's step"),
            link=dict(
                {f"{way}_bytes_per_s": link[way][0] for way in link}
                | {f"{way}_latency_s": link[way][1] for way in link},
                both_bytes_per_s=both,
                fitted_to=sorted({p[2].split(" ")[0] for way in fit_points for p in fit_points[way]}),
                points=len(fit_points["h2d"]),
                checked_on=link_check,
            ),
        ),
        predictions=runs,
        held_out=dict(
            runs=len(held),
            within=sum(r["within"] for r in held),
            worst_ratio=max((r["ratio"] for r in held), key=lambda x: abs(x - 1)),
            rebuilt_runs=len(rebuilt),
            rebuilt_within=sum(r["within"] for r in rebuilt),
            rebuilt_worst_ratio=max((r["ratio"] for r in rebuilt), key=lambda x: abs(x - 1)),
        ),
        wall_s=time.perf_counter() - began,
    )
    print(json.dumps({k: record[k] for k in ("proposed_profile", "held_out")}, indent=1, default=_plain))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1, default=_plain) + "\n")
        print(f"wrote {args.out}")


def _segments(plan_repr: str | None) -> int | None:
    """The segment count a plan's repr gives ("..., 23 segments, ..."), if any."""
    found = re.search(r"(\d+) segments", plan_repr or "")
    return int(found.group(1)) if found else None


def why_not_rebuilt(run: dict) -> str:
    """Why a run's own plan was not rebuilt (it is then predicted with the nearest plan made here)."""
    recipe = run.get("from_commit") or {}
    if "not_rebuilt" in run:
        return run["not_rebuilt"]
    if recipe.get("error"):
        return f"its commit's plan failed here: {recipe['error'][:300]}"
    if "result" in recipe:
        result = recipe["result"]
        return (
            f"rebuilt at {run['commit']} with its recorded rates, the plan differs from the one that ran "
            f"({result['segments']} segments and {(result['to_device_bytes'] + result['back_bytes']) / GIB:.2f} GiB "
            f"moved against {run['run_plan']}): the run planned from the GPU's trace (jax 0.11.2) and its compiled "
            "segments' measured memory, here the trace is this machine's (jax 0.10.2) and each segment's memory the "
            "planner's estimate"
        )
    return (
        f"its commit ({run['commit']}) recorded no rates it chose by and planned from its compiled segments' "
        "measured memory (hundreds of segments, compiled only on a GPU); predicted with the current swap-only plan "
        "of the same step and budget"
    )


def _plain(value):
    """numpy's scalars as Python's, for JSON."""
    return value.item() if hasattr(value, "item") else str(value)


def fitted_seconds(profile, way: str, nbytes: int) -> float:
    return profile.h2d_seconds(nbytes) if way == "h2d" else profile.d2h_seconds(nbytes)


if __name__ == "__main__":
    main()
