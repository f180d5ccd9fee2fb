"""The plan's memory timeline as an SVG picture, for notebooks: the in-core and planned device
bytes per step, the budget, and a mark per move and recomputation (hover titles name them)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from oocjax.schedule import Offload, format_bytes
from oocjax.schedule.units import counted

if TYPE_CHECKING:
    from oocjax.plan import Plan

_WIDTH, _HEIGHT, _PAD = 720, 260, 56
_COLUMN_PX = 2  # the curves keep each 2 pixels' largest figure: a peak never drops out of the picture
_MARK_PX = 6  # a mark's width: moves of one kind closer than this share one mark, which names them
_NAMED_PER_MARK = 2  # the largest values a shared mark's hover title names


def svg_timeline(plan: Plan) -> str:
    """Device memory over the equations: in-core and planned curves, the budget line, marks for the
    moves (down triangles: offloads, up triangles: prefetches; moves closer than a mark's width
    share one) and one per recomputed value (purple dots). Plain SVG, no dependencies, a few tens of
    kilobytes whatever the step's length: the curves are drawn at the picture's resolution."""
    planned, in_core = plan.timeline.device_bytes, plan.baseline_timeline.device_bytes
    n = max(len(planned), 1)
    top = max([plan.budget_bytes, *planned, *in_core, 1]) * 1.05
    inner_w, inner_h = _WIDTH - 2 * _PAD, _HEIGHT - 2 * _PAD

    def x(step: float) -> float:
        return _PAD + inner_w * step / n

    def y(nbytes: float) -> float:
        return _PAD + inner_h * (1 - nbytes / top)

    marks = _svg_marks(plan, x)
    budget_y = y(plan.budget_bytes)
    axes = _svg_axes(x, y, n, top)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT + 20}" '
            f'viewBox="0 0 {_WIDTH} {_HEIGHT + 20}" font-family="sans-serif" font-size="11">',
            "<style>.in-core{stroke:#999;stroke-width:1.5}.planned{stroke:#1f77b4;stroke-width:2}"
            ".budget{stroke:#d62728;stroke-dasharray:6 4}.offload{fill:#ff7f0e}.prefetch{fill:#2ca02c}"
            ".recompute{fill:#9467bd}</style>",
            *axes,
            _svg_curve(in_core, in_core_steps(plan), "in-core", x, y),
            _svg_curve(planned, list(range(len(planned))), "planned", x, y),
            f'<line class="budget" x1="{_PAD}" y1="{budget_y:.1f}" x2="{_WIDTH - _PAD}" y2="{budget_y:.1f}"/>',
            f'<text x="{_WIDTH - _PAD}" y="{budget_y - 4:.1f}" text-anchor="end" fill="#d62728">'
            f"budget {html.escape(format_bytes(plan.budget_bytes))}</text>",
            f'<text x="{_PAD}" y="{_PAD - 10}">device memory: in-core (grey), planned (blue); '
            f"moves: offload (orange), prefetch (green){'; recomputed (purple)' if plan.recomputed else ''}</text>",
            f'<text x="{_WIDTH / 2}" y="{_HEIGHT + 14}" text-anchor="middle">equation</text>',
            *marks,
            "</svg>",
        ]
    )


def _svg_curve(values, at: list[int], css: str, x, y) -> str:
    """A step curve as one path, one level per ``_COLUMN_PX`` pixels: the largest figure of the
    steps drawn there. Whole pixels, and only the corners: a step's worth of SVG per column at most."""
    columns: dict[int, int] = {}
    for step, value in zip(at, values):
        column = int((x(step) - _PAD) // _COLUMN_PX)
        columns[column] = max(columns.get(column, 0), value)
    if not columns:
        return f'<path class="{css}" fill="none" d=""/>'
    first, last = min(columns), max(columns)
    level = [columns.get(c) for c in range(first, last + 1)]
    for i in range(1, len(level)):  # a column no step starts in continues the one before
        level[i] = level[i - 1] if level[i] is None else level[i]
    corners, height = [f"M{_PAD + first * _COLUMN_PX},{round(y(level[0]))}"], round(y(level[0]))
    for i, value in enumerate(level[1:], first + 1):
        if round(y(value)) != height:
            height = round(y(value))
            corners.append(f"H{_PAD + i * _COLUMN_PX}V{height}")
    corners.append(f"H{_PAD + (last + 1) * _COLUMN_PX}")
    return f'<path class="{css}" fill="none" d="{"".join(corners)}"/>'


def in_core_steps(plan: Plan) -> list[int]:
    """Where each step of the in-core estimate runs in ``plan.program``: in a recomputing program,
    the first step that runs it (``Plan.origin_step``; the copies come later), so that the in-core
    curve lines up with the planned one; as is in a plan of its own program."""
    first: dict[int, int] = {}
    for at, k in enumerate(plan.origin_step):
        first.setdefault(k, at)
    return [first[k] for k in sorted(first)] if first else list(range(len(plan.baseline_timeline.device_bytes)))


def _svg_marks(plan: Plan, x) -> list[str]:
    """Marks below the axis for the moves (down triangles: offloads, up triangles: prefetches), one
    per ``_MARK_PX`` pixels and kind, whose hover title counts the moves it stands for and names
    the largest; and purple dots just above it where values are recomputed, one per ``_MARK_PX``
    pixels likewise."""
    buffers = plan.program.buffers
    shared: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (kind, column) -> (equation, buffer)
    for move in plan.schedule.moves:
        kind, at = ("offload", move.after_step) if isinstance(move, Offload) else ("prefetch", move.issue_step)
        where = x(at + 1) if kind == "offload" else x(at)
        shared.setdefault((kind, int(where // _MARK_PX)), []).append((at, move.buffer))
    marks = []
    low, high = _HEIGHT - _PAD + 6, _HEIGHT - _PAD + 14
    for (kind, _), moves in shared.items():
        steps = sorted({at for at, _ in moves})
        cx = x(steps[0] + 1) if kind == "offload" else x(steps[0])
        tip, base = (high, low) if kind == "offload" else (low, high)
        title = html.escape(_mark_title(kind, steps, [b for _, b in moves], buffers), quote=False)
        marks.append(
            f'<polygon class="move {kind}" points="{cx - 3:.1f},{base} {cx + 3:.1f},{base} {cx:.1f},{tip}">'
            f"<title>{title}</title></polygon>"
        )
    columns: dict[int, list] = {}  # column -> the values recomputed there
    for r in plan.recomputed:
        columns.setdefault(int(x(r.recomputed_at) // _MARK_PX), []).append(r)
    for values in columns.values():
        at = sorted(r.recomputed_at for r in values)
        named = _largest([(r.label, r.nbytes) for r in values])
        title = html.escape(f"{counted(len(values), 'value')} recomputed at {_equations(at)}: {named}", quote=False)
        circle = f'<circle class="recompute" cx="{x(at[0]):.0f}" cy="{_HEIGHT - _PAD - 4}" r="3">'
        marks.append(f"{circle}<title>{title}</title></circle>")
    return marks


def _mark_title(kind: str, steps: list[int], moved: list[int], buffers) -> str:
    """``offload after equation 12: a1 (4 MiB)``, or for a shared mark ``3 offloads after equations
    12..14 (6 MiB): a1 (4 MiB), a2 (1 MiB) and 1 more``."""
    where = f"{'after' if kind == 'offload' else 'at'} {_equations(steps)}"
    named = _largest([(buffers[b].label, buffers[b].nbytes) for b in moved])
    if len(moved) == 1:
        return f"{kind} {where}: {named}"
    total = format_bytes(sum(buffers[b].nbytes for b in moved))
    return f"{counted(len(moved), kind)} {where} ({total}): {named}"


def _equations(steps: list[int]) -> str:
    """``equation 12``, or ``equations 12..14`` for more (ascending)."""
    return f"equations {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"equation {steps[0]}"


def _largest(values: list[tuple[str, int]]) -> str:
    """The largest ``_NAMED_PER_MARK`` of ``(label, bytes)``: ``a1 (4 MiB), a2 (1 MiB) and 1 more``."""
    largest = sorted(values, key=lambda v: -v[1])
    named = ", ".join(f"{label} ({format_bytes(nbytes)})" for label, nbytes in largest[:_NAMED_PER_MARK])
    return named + (f" and {len(values) - _NAMED_PER_MARK} more" if len(values) > _NAMED_PER_MARK else "")


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
