"""Saving plans: a small JSON summary by default; on request, all a ``Plan`` is rebuilt from: the
planner's program and schedule, and the chain of segments the step ran as, with what each measured."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from oocjax.schedule import Buffer, Offload, Prefetch, Program, Schedule, Step, chain_of, keep_all, simulate
from oocjax.schedule.segments import GatheringStep, Segment, SegmentCost

if TYPE_CHECKING:
    from oocjax.plan import Plan

FORMAT = "oocjax.plan/4"
# /1 held the program and schedule only; /2 had no recomputation (a /2 plan recomputes nothing);
# /3 had no segments (a /3 plan loads without them, as one that moves nothing).
READABLE = ("oocjax.plan/1", "oocjax.plan/2", "oocjax.plan/3", FORMAT)


def dumps(plan: Plan, *, full: bool = False) -> str:
    saved = {
        "format": FORMAT,
        "device": plan.device,
        "compiled": plan.compiled,
        "mesh": plan.mesh,
        "budget_bytes": plan.budget_bytes,
        "peak_bytes": plan.peak_bytes,
        "executed_peak_bytes": plan.executed_peak_bytes,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "host_peak_bytes": plan.host_peak_bytes,
        "moved_bytes": plan.moved_bytes,
        "segments": len(plan.segments),
        "attempts": list(plan.attempts),
        "offloads": [asdict(o) for o in plan.offloads],
        "host_inputs": [asdict(h) for h in plan.host_inputs],
        "host_outputs": list(plan.host_outputs),
        "recomputed": [asdict(r) for r in plan.recomputed],
        "extra_flops": plan.extra_flops,
        "postponed": plan.postponed,
        "step_time_s": plan.step_time_s,
        "swap_only_time_s": plan.swap_only_time_s,
        "swap_only_moved_bytes": plan.swap_only_moved_bytes,
        "in_core_time_s": plan.in_core_time_s,
        "layer_policy": list(plan.layer_policy),
        "layer_alternatives": list(plan.layer_alternatives),
    }
    if full:
        saved |= {
            "program": _program(plan.program),
            "schedule": _schedule(plan.schedule),
            "chain": [asdict(segment) for segment in plan.segments],
            "segment_costs": [asdict(cost) for cost in plan.segment_costs],
            "input_kinds": list(plan.input_kinds),
            "headroom_bytes": plan.headroom_bytes,
            "layers": [list(run) for run in plan.layers],
            "origin_step": list(plan.origin_step),
        }
    return json.dumps(saved, indent=1)


def loads(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``Plan.from_json`` rebuilds a plan from: the keywords of ``Plan.build``, and the fields
    restored as saved over what it computes (``recomputed`` as the fields of each ``RecomputeInfo``)."""
    data = json.loads(text)
    if data.get("format") not in READABLE:
        raise ValueError(f"not an oocjax plan (format {data.get('format')!r}, expected {FORMAT!r})")
    if "program" not in data:
        raise ValueError(
            "this plan was saved without its program and schedule, which rebuilding a Plan needs: save it with "
            "plan.to_json(full=True); a summary reads as plain JSON (json.loads)"
        )
    program, schedule = _read_program(data["program"]), _read_schedule(data["schedule"])
    segments = tuple(_read_segment(segment) for segment in data.get("chain", ()))
    built = dict(
        program=program,
        schedule=schedule,
        timeline=simulate(program, schedule),
        baseline_timeline=simulate(program, keep_all(program)),  # restored as saved below
        chain=chain_of(program, schedule, segments) if segments else None,
        jaxpr=None,
        source_jaxpr=None,
        budget_bytes=data.get("budget_bytes"),
        executed_peak_bytes=data.get("executed_peak_bytes"),
        attempts=tuple(data.get("attempts", ())),
        device=data.get("device", ""),
        compiled=data.get("compiled", True),
        mesh=data.get("mesh", ""),
        step_time_s=data.get("step_time_s"),
        swap_only_time_s=data.get("swap_only_time_s"),
        swap_only_moved_bytes=data.get("swap_only_moved_bytes"),
        in_core_time_s=data.get("in_core_time_s"),
        layer_policy=tuple(data.get("layer_policy", ())),
        layer_alternatives=tuple(data.get("layer_alternatives", ())),
        segments=segments,
        segment_costs=tuple(SegmentCost(**cost) for cost in data.get("segment_costs", ())),
        input_kinds=tuple(data.get("input_kinds", ())),
        headroom_bytes=data.get("headroom_bytes", 0),
        layers=tuple(tuple(run) for run in data.get("layers", ())),
    )
    # The saved program holds the copies, but what they recompute came from the planner's rewrite,
    # and the in-core peak from the step as traced: neither is saved, so both are restored as saved.
    restored = dict(recomputed=tuple(data.get("recomputed", ())), extra_flops=data.get("extra_flops", 0))
    restored |= dict(postponed=data.get("postponed", 0), origin_step=tuple(data.get("origin_step", ())))
    if "baseline_peak_bytes" in data:
        restored["baseline_peak_bytes"] = data["baseline_peak_bytes"]
    return built, restored


def _program(program: Program) -> dict:
    return {
        "steps": [asdict(step) | {"reads": list(step.reads), "writes": list(step.writes)} for step in program.steps],
        "buffers": [asdict(buffer) for buffer in program.buffers],
    }


def _schedule(schedule: Schedule) -> dict:
    return asdict(schedule) | {
        "host_inputs": sorted(schedule.host_inputs),
        "host_outputs": sorted(schedule.host_outputs),
        "segment_starts": sorted(schedule.segment_starts),
        "moves": [{type(m).__name__.lower(): asdict(m)} for m in schedule.moves],
    }


def _read_program(saved: dict) -> Program:
    def step(s: dict) -> Step:  # a contraction over a sharded dimension saves what it gathers
        kind = GatheringStep if "gathered_bytes" in s else Step
        return kind(**(s | {"reads": tuple(s["reads"]), "writes": tuple(s["writes"])}))

    steps = tuple(step(s) for s in saved["steps"])
    return Program(steps=steps, buffers=tuple(Buffer(**buffer) for buffer in saved["buffers"]))


def _read_segment(saved: dict) -> Segment:
    return Segment(**{field: tuple(v) if isinstance(v, list) else v for field, v in saved.items()})  # JSON lists


def _read_schedule(saved: dict) -> Schedule:
    kinds = {"offload": Offload, "prefetch": Prefetch}
    return Schedule(
        strategy=saved["strategy"],
        budget_bytes=saved["budget_bytes"],
        host_inputs=frozenset(saved["host_inputs"]),
        host_outputs=frozenset(saved["host_outputs"]),
        segment_starts=frozenset(saved.get("segment_starts", ())),
        moves=tuple(kinds[kind](**fields) for move in saved["moves"] for kind, fields in move.items()),
    )
