"""Plans for people: a text summary, an inline SVG memory timeline, an annotated jaxpr.

Nothing here needs matplotlib (``oocjax.plotting`` does, lazily) or jax.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from oocjax.schedule import Offload, format_bytes
from oocjax.schedule.cost import DeviceProfile, resolve_profile, simulate_time

if TYPE_CHECKING:
    from oocjax.plan import Plan


def summary(plan: Plan, profile: DeviceProfile | str | None = None, *, largest: int = 10) -> str:
    """The plan as a text report: memory, traffic, the largest moves, and the timed simulation."""
    device = f" for {plan.device}" if plan.device else ""
    lines = [f"oocjax plan{device} ({plan.schedule.strategy}, {len(plan.program.steps)} equations)"]
    lines += [f"  {name:<13} {value}" for name, value in _summary_rows(plan)]
    lines += _largest_moves(plan, largest)
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
    return rows + ([("loops", _loops(plan.loops))] if plan.loops else [])


def _largest_moves(plan: Plan, largest: int) -> list[str]:
    moves = _move_rows(plan)
    if not moves:
        return []
    shown = sorted(moves, key=lambda row: -row[1])[:largest]
    lines = ["", f"Largest moves ({len(shown)} of {len(moves)}):"]
    table = [("size", "out after", "back before", "distance", "value")]
    table += [(format_bytes(n), out, back, dist, label) for label, n, out, back, dist in shown]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        lines.append("  " + "  ".join(row[i].rjust(widths[i]) for i in range(4)) + "  " + row[4])
    return lines


def _timed_simulation(plan: Plan, model: DeviceProfile) -> list[str]:
    timed = simulate_time(plan.program, plan.schedule, model)
    planned_on = f"; this plan is for {plan.device}" if plan.device else ""
    return [
        "",
        f"Timed simulation on {model.name}, a model of that device, not a measurement{planned_on} "
        f"({model.flops_per_s / 1e12:g} TFLOP/s sustained, "
        f"host link {model.h2d_bytes_per_s / 1e9:g} GB/s in, {model.d2h_bytes_per_s / 1e9:g} GB/s out):",
        f"  step time     {_seconds(timed.step_time_s)} = compute {_seconds(timed.compute_time_s)}"
        f" + exposed transfers {_seconds(timed.exposed_transfer_s)}",
        f"  lower bound   {_seconds(timed.lower_bound_s)} (max of compute and each link's traffic)",
    ]


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


def counted(n: int, noun: str) -> str:
    """``1 segment``, ``3 segments``, ``2 prefetches``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("h") else f"{n} {noun}s"


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


# -- SVG -----------------------------------------------------------------------------------------

_WIDTH, _HEIGHT, _PAD = 720, 260, 56


def svg_timeline(plan: Plan) -> str:
    """Device memory over the equations: in-core and planned curves, the budget line, and one mark
    per move (down triangles: offloads, up triangles: prefetches). Plain SVG, no dependencies."""
    planned, in_core = plan.timeline.device_bytes, plan.baseline_timeline.device_bytes
    n = max(len(planned), 1)
    top = max([plan.budget_bytes, *planned, *in_core, 1]) * 1.05
    inner_w, inner_h = _WIDTH - 2 * _PAD, _HEIGHT - 2 * _PAD

    def x(step: float) -> float:
        return _PAD + inner_w * step / n

    def y(nbytes: float) -> float:
        return _PAD + inner_h * (1 - nbytes / top)

    def curve(values, css: str) -> str:
        points = " ".join(f"{x(k):.1f},{y(v):.1f} {x(k + 1):.1f},{y(v):.1f}" for k, v in enumerate(values))
        return f'<polyline class="{css}" fill="none" points="{points}"/>'

    marks = []
    for move in plan.schedule.moves:
        if isinstance(move, Offload):
            cx, tip, base = x(move.after_step + 1), _HEIGHT - _PAD + 14, _HEIGHT - _PAD + 6
            kind, what = "offload", f"offload after equation {move.after_step}"
        else:
            cx, tip, base = x(move.issue_step), _HEIGHT - _PAD + 6, _HEIGHT - _PAD + 14
            kind, what = "prefetch", f"prefetch at equation {move.issue_step}"
        label = html.escape(f"{what}: {plan.program.buffers[move.buffer].label}")
        marks.append(
            f'<polygon class="move {kind}" points="{cx - 3:.1f},{base} {cx + 3:.1f},{base} {cx:.1f},{tip}">'
            f"<title>{label}</title></polygon>"
        )
    budget_y = y(plan.budget_bytes)
    axes = _svg_axes(x, y, n, top)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT + 20}" '
            f'viewBox="0 0 {_WIDTH} {_HEIGHT + 20}" font-family="sans-serif" font-size="11">',
            "<style>.in-core{stroke:#999;stroke-width:1.5}.planned{stroke:#1f77b4;stroke-width:2}"
            ".budget{stroke:#d62728;stroke-dasharray:6 4}.offload{fill:#ff7f0e}.prefetch{fill:#2ca02c}</style>",
            *axes,
            curve(in_core, "in-core"),
            curve(planned, "planned"),
            f'<line class="budget" x1="{_PAD}" y1="{budget_y:.1f}" x2="{_WIDTH - _PAD}" y2="{budget_y:.1f}"/>',
            f'<text x="{_WIDTH - _PAD}" y="{budget_y - 4:.1f}" text-anchor="end" fill="#d62728">'
            f"budget {html.escape(format_bytes(plan.budget_bytes))}</text>",
            f'<text x="{_PAD}" y="{_PAD - 10}">device memory: in-core (grey), planned (blue); '
            "moves: offload (orange), prefetch (green)</text>",
            f'<text x="{_WIDTH / 2}" y="{_HEIGHT + 14}" text-anchor="middle">equation</text>',
            *marks,
            "</svg>",
        ]
    )


def _svg_axes(x, y, n: int, top: float) -> list[str]:
    """Both axes with five numbered ticks each: bytes up the left, equations along the bottom."""
    bottom = _HEIGHT - _PAD
    parts = [
        f'<line x1="{_PAD}" y1="{bottom}" x2="{_WIDTH - _PAD}" y2="{bottom}" stroke="#333"/>',
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{bottom}" stroke="#333"/>',
    ]
    for k in range(5):
        nbytes, step = top / 1.05 * k / 4, round(n * k / 4)
        parts += [
            f'<text class="tick" x="{_PAD - 4}" y="{y(nbytes) + 4:.1f}" text-anchor="end" font-size="9">'
            f"{html.escape(format_bytes(int(nbytes)))}</text>",
            f'<text class="tick" x="{x(step):.1f}" y="{bottom + 26}" text-anchor="middle" font-size="9">{step}</text>',
        ]
    return parts


def html_view(plan: Plan) -> str:
    return f"<div><pre>{html.escape(summary(plan))}</pre>{svg_timeline(plan)}</div>"


# -- the rewritten jaxpr, annotated ----------------------------------------------------------------


def pretty_jaxpr(plan: Plan, *, full: bool = False) -> str:
    """The step as it runs, in order: each segment with the transfers and waits around it, what
    moves and where it comes from. ``full=True`` appends the chain's jaxpr as jax prints it (each
    segment call holds its part of the step)."""
    if plan.jaxpr is None:
        raise ValueError("this plan has no jaxpr (it was loaded from JSON); plan the step again to see it")
    if not plan.segments:
        lines = ["one program: jax.jit's own (nothing moves)"]
    else:
        lines = _chain_lines(plan)
    if full:
        lines += ["", str(plan.jaxpr.pretty_print(use_color=False))]
    return "\n".join(lines)


def _chain_lines(plan: Plan) -> list[str]:
    """One block per segment; a run of blocks that repeats (a loop's iterations, or layers alike)
    is shown once, with how many more times it runs."""
    blocks = _segment_blocks(plan)
    kinds = _segment_kinds(plan)
    lines, i = [], 0
    while i < len(blocks):
        period, copies = _repetition(kinds, i)
        for block in blocks[i : i + period]:
            lines += block
        if copies > 1:
            first, last = i + period, i + period * copies - 1
            moved = sum(
                plan.program.buffers[b].nbytes
                for segment in plan.segments[first : last + 1]
                for b in (*segment.prefetches, *segment.offloads)
            )
            lines.append(
                f"... segments {first}..{last}: the same {counted(period, 'segment')} {copies - 1} more times "
                f"(same programs and transfers), moving {format_bytes(moved)}"
            )
        i += period * copies
    return lines


MIN_COPIES, MAX_PERIOD = 3, 64  # a run of blocks shown once when it repeats at least this often


def _repetition(kinds: list, i: int) -> tuple[int, int]:
    """(period, copies) of the shortest run of blocks starting at ``i`` that repeats at least
    ``MIN_COPIES`` times back to back; (1, 1) where none does."""
    for period in range(1, min(MAX_PERIOD, (len(kinds) - i) // MIN_COPIES) + 1):
        run = kinds[i : i + period]
        copies = 1
        while kinds[i + copies * period : i + (copies + 1) * period] == run:
            copies += 1
        if copies >= MIN_COPIES:
            return period, copies
    return 1, 1


def _segment_kinds(plan: Plan) -> list[tuple]:
    """Per segment, what makes two alike: its compiled program and what it moves (labels, sizes)."""
    programs = [str(e.params["jaxpr"].jaxpr) for e in plan.jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    buffers = plan.program.buffers

    def moved(bs: tuple[int, ...]) -> tuple:
        return tuple((buffers[b].label, buffers[b].nbytes) for b in bs)

    return [
        (program, moved(s.waits), moved(s.prefetches), moved(s.offloads))
        for program, s in zip(programs, plan.segments, strict=True)
    ]


def _segment_blocks(plan: Plan) -> list[list[str]]:
    buffers, steps = plan.program.buffers, plan.program.steps
    uses = {b: [p.use_step for p in fetches] for b, fetches in plan.schedule.prefetches_by_buffer.items()}

    def value(b: int) -> str:
        return f"{buffers[b].label} ({format_bytes(buffers[b].nbytes)})"

    def offload(b: int, after: int) -> str:
        later = [u for u in uses.get(b, ()) if u > after]
        return f"not needed again until equation {min(later)}" if later else "stays on host"

    def prefetch(b: int, start: int) -> str:
        served = [u for u in uses.get(b, ()) if u >= start]
        return f"read at equation {min(served)}" if served else "read in this segment"

    blocks = []
    costs = plan.segment_costs or (None,) * len(plan.segments)
    for i, (segment, cost) in enumerate(zip(plan.segments, costs)):
        lines = [f"  wait  {value(b)}: its offload must end before its device memory is reused" for b in segment.waits]
        lines += [f"  >>>   prefetch {value(b)}: {prefetch(b, segment.start)}" for b in segment.prefetches]
        where = list(dict.fromkeys(s.label for s in steps[segment.start : segment.stop] if s.label))
        measured = "" if cost is None else f", scratch {format_bytes(cost.temp_bytes)}"
        lines.append(
            f"segment {i}: equations {segment.start}..{segment.stop - 1}, holds {format_bytes(segment.held_bytes)} "
            f"at launch{measured}" + (f"  [{', '.join(where[:3])}{', ...' if len(where) > 3 else ''}]" if where else "")
        )
        lines += [f"  <<<   offload {value(b)}: {offload(b, segment.stop - 1)}" for b in segment.offloads]
        blocks.append(lines)
    return blocks
