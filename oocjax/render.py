"""Plans for people: a text summary and an inline SVG memory timeline (the annotated jaxpr is
``jaxpr_view``).

Nothing here needs matplotlib (``oocjax.plotting`` does, lazily); jax is imported only to read one
flag, and only for a step that has a softmax the flag would change.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from oocjax.schedule import format_bytes
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.layer_plan import MOVE_MARGIN
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.schedule.units import counted
from oocjax.timeline_svg import svg_timeline

if TYPE_CHECKING:
    from oocjax.plan import Plan


# Under a plan that keeps state on host, what a user who evaluates it must know.
HOST_STATE_HINT = (
    "State kept on host cannot go to plain jax.jit: evaluate it with an ooc_jit step under the same budget "
    "(ooc_jit(eval_step, budget=...)(state, batch), without donating it), or move it back with "
    "oocjax.to_device(state) where the device has room for it."
)


def summary(plan: Plan, profile: DeviceProfile | str | None = None, *, largest: int = 10) -> str:
    """The plan as a text report: memory, traffic, the largest moves, and the timed simulation."""
    device = f" for {plan.device}" if plan.device else ""
    device += "" if plan.compiled else " from its profile: segments' memory estimated, nothing compiled"
    device += f" ({plan.mesh}, bytes per device)" if plan.mesh else ""
    lines = [f"oocjax plan{device} ({plan.schedule.strategy}, {len(plan.program.steps)} equations)"]
    lines += [f"  {name:<13} {value}" for name, value in _summary_rows(plan)]
    lines += _largest_moves(plan, largest)
    lines += _layer_policies(plan)
    lines += _recomputed_section(plan, largest)
    lines += _softmax_hint(plan)
    if plan.host_inputs or plan.host_outputs:
        lines += ["", HOST_STATE_HINT]
    if profile is not None:
        lines += _timed_simulation(plan, resolve_profile(profile))
    return "\n".join(lines)


def _summary_rows(plan: Plan) -> list[tuple[str, str]]:
    timeline, steps = plan.timeline, plan.program.steps
    peak_at = (
        ""
        if timeline.peak_step is None
        else f" at equation {timeline.peak_step} ({steps[timeline.peak_step].describe()})"
    )
    rows = [
        ("budget", format_bytes(plan.budget_bytes)),
        ("in-core peak", format_bytes(plan.baseline_peak_bytes)),
        ("planned peak", format_bytes(plan.peak_bytes) + peak_at),
    ]
    if plan.executed_peak_bytes is not None:
        measured = f"{format_bytes(plan.executed_peak_bytes)} in {counted(len(plan.segments), 'segment')} "
        rows.append(
            (
                "executed peak",
                measured
                + f"(measured from the compiled segments; planned for {format_bytes(plan.schedule.budget_bytes)})",
            )
        )
    if len(plan.attempts) > 1:
        over = ", ".join(format_bytes(peak) for peak in plan.attempts[:-1])
        rows.append(
            (
                "planned",
                f"{len(plan.attempts)} times: the compiled segments of the earlier plans measured {over}, over the "
                f"{format_bytes(plan.schedule.budget_bytes)} planned for; each later plan learnt what they allocate",
            )
        )
    host_inputs = sum(h.nbytes for h in plan.host_inputs)
    rows += [
        ("to host", f"{format_bytes(timeline.d2h_bytes)} in {len(plan.offloads)} offloads"),
        ("to device", f"{format_bytes(timeline.h2d_bytes)} in {len(plan.schedule.prefetches)} prefetches"),
        ("host peak", format_bytes(plan.host_peak_bytes)),
        (
            "kept on host",
            f"{counted(len(plan.host_inputs), 'argument')} ({format_bytes(host_inputs)}), "
            f"{counted(len(plan.host_outputs), 'result')}",
        ),
    ]
    if plan.step_time_s is not None and plan.in_core_time_s:
        rows.append(
            (
                "step time",
                f"{_seconds(plan.step_time_s)} simulated, {plan.step_time_s / plan.in_core_time_s:.2f}x the step "
                f"in core ({_seconds(plan.in_core_time_s)}), with the rates it was planned with",
            )
        )
    if plan.postponed:
        where = "run where the backward pass first reads their results: the forward pass does not"
        rows.append(("postponed", f"{counted(plan.postponed, 'equation')} {where}"))
    return rows + ([("loops", _loops(plan.loops))] if plan.loops else [])


def _largest_moves(plan: Plan, largest: int) -> list[str]:
    moves = _move_rows(plan)
    if not moves:
        return []
    shown = sorted(moves, key=lambda row: -row[1])[:largest]
    table = [(format_bytes(n), out, back, dist, label) for label, n, out, back, dist in shown]
    header = ("size", "out after", "back before", "distance", "value")
    return ["", f"Largest moves ({len(shown)} of {len(moves)}):", *_table([header, *table], "  ")]


def _table(rows: list[tuple[str, ...]], indent: str) -> list[str]:
    """Rows with every column but the last (a value's label, of any length) right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join([*(cell.rjust(w) for cell, w in zip(row, widths)), row[-1]]) for row in rows]


def _recomputed_section(plan: Plan, largest: int) -> list[str]:
    """What is recomputed, what it costs and what it saves: a reader weighs the FLOPs against the
    bytes, and the simulated times say why the planner took it over swapping alone."""
    recomputed = plan.recomputed
    if not recomputed:
        return []
    held = sum(r.nbytes for r in recomputed)
    lines = [
        "",
        f"Recomputed: {counted(len(recomputed), 'value')}, {format_bytes(held)} not held on the device "
        "between their early and late reads",
        f"  extra work    {_flops_share(plan)}",
    ]
    if plan.step_time_s is not None and plan.swap_only_time_s is not None:
        lines += [
            f"  step time     swap only would take {_seconds(plan.swap_only_time_s)}; "
            f"this plan {_seconds(plan.step_time_s)}",
            "                (simulated with the profile it was planned with: a model, not a measurement)",
            *_why_not_swap_only(plan),
        ]
    shown = sorted(recomputed, key=lambda r: -r.nbytes)[:largest]
    header = ("size", "dropped after", "recomputed at", "value")
    table = [(format_bytes(r.nbytes), str(r.dropped_after), str(r.recomputed_at), r.label) for r in shown]
    return [*lines, f"  largest ({len(shown)} of {len(recomputed)}):", *_table([header, *table], "    ")]


def _why_not_swap_only(plan: Plan) -> list[str]:
    """Where swap only simulated faster while moving more, why this plan was taken: under
    ``recompute="auto"`` one moving more replaces it only when faster by over ``MOVE_MARGIN``."""
    swap_bytes, moved = plan.swap_only_moved_bytes, plan.schedule.moved_bytes(plan.program)
    if plan.swap_only_time_s >= plan.step_time_s or swap_bytes is None or swap_bytes <= moved:
        return []
    return [
        f"  chosen        over swap only, which moves {format_bytes(swap_bytes)} a step to this plan's "
        f"{format_bytes(moved)}: under recompute='auto'",
        f"                a plan that moves more is taken only where it simulates faster by more than "
        f"{MOVE_MARGIN:.0%} (the model errs by more)",
    ]


def _flops_share(plan: Plan) -> str:
    """``38.3 MFLOP, 5.52% of the step's 693 MFLOP``: ``program`` holds the copies, so the step as
    written does the rest."""
    original = sum(step.flops for step in plan.program.steps) - plan.extra_flops
    share = f", {100 * plan.extra_flops / original:.3g}% of the step's {_flops(original)}" if original > 0 else ""
    return _flops(plan.extra_flops) + share


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} FLOP"


def _softmax_hint(plan: Plan) -> list[str]:
    """With ``jax_softmax_custom_jvp`` off, ``jax.nn.softmax`` is differentiated through its exp and
    division, so the backward keeps the exp as well as the result; with it on, only the result. The
    flag is the user's to set (it changes the program they trace), so this only says what it saves."""
    exps = _softmax_exps(plan.program)
    if not exps:
        return []
    import jax  # only here: a step with no such softmax renders without jax

    if getattr(jax.config, "jax_softmax_custom_jvp", True):
        return []
    kept = format_bytes(sum(plan.program.buffers[b].nbytes for b in exps))
    keep, their = ("keeps", "its") if len(exps) == 1 else ("keep", "their")
    return [
        "",
        f"Softmax: {counted(len(exps), 'softmax')} {keep} {their} exp ({kept}) for the backward besides {their} "
        "result, because jax_softmax_custom_jvp is off;",
        f'  jax.config.update("jax_softmax_custom_jvp", True) before tracing keeps only the result: about {kept} '
        "less (oocjax does not set it).",
    ]


def _softmax_exps(program) -> list[int]:
    """Outputs of ``exp`` that a ``reduce_sum`` and a ``div`` read (a softmax's numerator) and
    something reads again after the division: the backward's copy of it."""
    steps, reads = program.steps, program.uses.read_at
    found = []
    for step in steps:
        for b in step.writes if step.name == "exp" else ():
            names = [steps[r].name for r in reads[b]]
            divs = [r for r in reads[b] if steps[r].name == "div"]
            if "reduce_sum" in names and divs and reads[b][-1] > divs[0]:
                found.append(b)
    return found


def _timed_simulation(plan: Plan, model: DeviceProfile) -> list[str]:
    """The step timed on a model of a device, which says which device it models and its rates, and,
    for a plan made for another device (this machine's CPU), that the times are not that device's."""
    timed = simulate_time(plan.program, plan.schedule, model)
    rates = (
        f"{model.flops_per_s / 1e12:g} TFLOP/s sustained, "
        f"host link {model.h2d_bytes_per_s / 1e9:g} GB/s in, {model.d2h_bytes_per_s / 1e9:g} GB/s out"
    )
    lines = ["", f"Timed simulation on a model of {model.name}, not a measurement:"]
    lines.append(f"  device model  {model.name}: {rates}")
    if plan.device and plan.device != model.name:
        lines.append(
            f"  planned for   {plan.device} (the times below are the {model.name} model's, not {plan.device}'s)"
        )
    return [
        *lines,
        f"  step time     {_seconds(timed.step_time_s)} = compute {_seconds(timed.compute_time_s)}"
        f" + exposed transfers {_seconds(timed.exposed_transfer_s)}",
        f"  lower bound   {_seconds(timed.lower_bound_s)} (max of compute and each link's traffic)",
    ]


def _layer_policies(plan: Plan) -> list[str]:
    """The layer policy the plan was made by, one line per kind of layer, and why it was chosen
    over the other policies timed; where layers were found but no policy fit, that it was planned
    one operation at a time."""
    if plan.layer_policy:
        why = [f"  instead of    {line}" for line in plan.layer_alternatives]
        return ["", "Layers (planned by layer):", *(f"  {line}" for line in plan.layer_policy), *why]
    if any(kind.startswith("transpose ") for _, _, kind in plan.layers) and not plan.schedule.moves_nothing:
        return ["", "Layers: no layer policy fits the budget; planned one operation at a time"]
    return []


def _loops(loops) -> str:
    """``2 scans run one iteration at a time (model.py:40, length 12); 1 scan runs whole (...)``."""
    parts = []
    for unrolled, how in ((True, "run one iteration at a time"), (False, "run whole, as one operation")):
        chosen = [loop for loop in loops if loop.unrolled == unrolled]
        if chosen:
            where = ", ".join(f"{loop.label or 'unknown line'}, length {loop.length}" for loop in chosen[:3])
            more = f" and {len(chosen) - 3} more" if len(chosen) > 3 else ""
            verb = how if len(chosen) > 1 else how.replace("run ", "runs ", 1)
            parts.append(f"{counted(len(chosen), 'scan')} {verb} ({where}{more})")
    return "; ".join(parts)


def _move_rows(plan: Plan) -> list[tuple[str, int, str, str, str]]:
    """(label, bytes, out after, back before, distance) per offloaded value and per host argument."""
    rows = []
    for o in plan.offloads:
        back = "-" if o.prefetch_before is None else str(o.prefetch_before)
        distance = "stays on host" if o.prefetch_before is None else str(o.prefetch_before - o.offload_after)
        rows.append((o.label, o.nbytes, str(o.offload_after), back, distance))
    for h in plan.host_inputs:
        fetched = ", ".join(map(str, h.prefetch_before)) or "never read"
        rows.append((h.label, h.nbytes, "host", fetched, "-"))
    return rows


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def html_view(plan: Plan) -> str:
    return f"<div><pre>{html.escape(summary(plan))}</pre>{svg_timeline(plan)}</div>"
