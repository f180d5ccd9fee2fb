"""Matplotlib figures of a plan. matplotlib is an optional extra, imported only here, only when used.

The x axis is the planner's equations, numbered as ``summary()`` and ``pretty_jaxpr()`` number them.
A reader maps those numbers to their model through the step's phases (forward, backward, optimizer)
and layers, which the plot shades and names. Both come from where JAX's tracing put each equation,
its ``name_stack``: ``jvp(Transformer)/Block_2/Dense_0`` is in the forward of a Flax module's
``Block_2``, ``transpose(jvp(Transformer))/Block_1/...`` in the backward of ``Block_1``, and what
follows the last transposed equation is the update (``step_regions``). No text is placed by
guesswork: the largest moves go in a table under the plot, not beside their markers, and a phase or
layer name that would overlap another is left out (``_drop_colliding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oocjax.schedule import MiB, format_bytes
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.schedule.units import counted
from oocjax.timeline_svg import in_core_steps

if TYPE_CHECKING:
    from oocjax.plan import Plan

LARGEST_ROWS = 5  # rows of each table under the plot (moves, recomputed values); summary() lists more
MAX_LABEL_CHARS = 64  # a value's label in that table is shortened in its middle beyond this

# -- phases and layers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """Equations ``start .. stop - 1``, named: a phase of the step or one of its layers."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRegions:
    """Where a step's phases and layers are, in equations.

    Attributes:
      phases: ``forward``, ``backward`` and ``optimizer``, those the step has, in order; empty for a
        step that takes no gradient (nothing to tell its phases apart by).
      layers: per phase, the runs of equations of each of the model's top-level modules
        (``Block_0``, ``Dense_0``), in order; equations outside any module (the loss, the update)
        belong to none.
    """

    phases: tuple[Span, ...] = ()
    layers: tuple[Span, ...] = ()

    def where(self, step: int) -> str:
        """``"backward, Block_3"``: the phase and layer of an equation, as far as they are known."""
        names = [s.name for spans in (self.phases, self.layers) for s in spans if s.start <= step < s.stop]
        return ", ".join(names)


# A name stack's outermost transform says which phase its equation belongs to; the first rule
# that matches decides (a transposed jvp is the backward, not the forward).
phase_rules: tuple[tuple[str, str], ...] = (("transpose(", "backward"), ("jvp(", "forward"))


def step_regions(name_stacks: Sequence[str]) -> StepRegions:
    """The phases and layers of a step from its equations' name stacks, in order.

    A gradient step runs its forward (``jvp(...)``), then the backward (``transpose(...)``), then
    the update. The backward is the span from the first to the last transposed equation; what comes
    before it is the forward (with whatever prepares the batch), what comes after it the optimizer.
    A layer is the second name of the stack with its transforms peeled (``Block_2`` in
    ``jvp(Transformer)/Block_2/Dense_0``), so for a Flax model the root module's children; a run of
    one layer's equations goes on through equations of no layer (the residual adds between its
    modules) until another layer's begins, and never across a phase boundary.

    >>> stacks = ["", "jvp(Net)/Dense_0", "jvp(Net)/Dense_1", "jvp()", "transpose(jvp())",
    ...           "transpose(jvp(Net))/Dense_1", "transpose(jvp(Net))/Dense_0", "", ""]
    >>> regions = step_regions(stacks)
    >>> [(s.name, s.start, s.stop) for s in regions.phases]
    [('forward', 0, 4), ('backward', 4, 7), ('optimizer', 7, 9)]
    >>> [(s.name, s.start, s.stop) for s in regions.layers]
    [('Dense_0', 1, 2), ('Dense_1', 2, 3), ('Dense_1', 5, 6), ('Dense_0', 6, 7)]
    """
    kinds = [_phase_of(stack) for stack in name_stacks]
    backward = [i for i, kind in enumerate(kinds) if kind == "backward"]
    if not backward:
        return StepRegions()
    bounds = [("forward", 0, backward[0]), ("backward", backward[0], backward[-1] + 1)]
    bounds.append(("optimizer", backward[-1] + 1, len(kinds)))
    phases = tuple(Span(name=name, start=a, stop=b) for name, a, b in bounds if b > a)
    layers = [_layer_of(stack) for stack in name_stacks]
    return StepRegions(phases=phases, layers=tuple(s for p in phases for s in _layer_runs(layers, p.start, p.stop)))


def _phase_of(name_stack: str) -> str | None:
    return next((phase for marker, phase in phase_rules if marker in name_stack), None)


def _layer_of(name_stack: str) -> str | None:
    """``Block_2`` for ``transpose(jvp(Transformer))/Block_2/Dense_0``; None above the layers."""
    names = [_peeled(part) for part in name_stack.split("/")]
    return (names[1] or None) if len(names) > 1 else None


def _peeled(name: str) -> str:
    """``Transformer`` for ``transpose(jvp(Transformer))``."""
    while name.endswith(")") and "(" in name:
        name = name[name.index("(") + 1 : -1]
    return name


def _layer_runs(layers: Sequence[str | None], start: int, stop: int) -> list[Span]:
    runs: list[Span] = []
    for i in range(start, stop):
        layer = layers[i]
        if layer is None:
            continue
        if runs and runs[-1].name == layer:
            runs[-1] = Span(name=layer, start=runs[-1].start, stop=i + 1)
        else:
            runs.append(Span(name=layer, start=i, stop=i + 1))
    return runs


def plan_regions(plan: Plan) -> StepRegions:
    """The phases and layers of ``plan``'s program (its equations, recomputing copies included);
    none for a plan without its traced step (built by hand, or loaded from JSON)."""
    stacks = _name_stacks(plan)
    return StepRegions() if stacks is None else step_regions(stacks)


def _name_stacks(plan: Plan) -> list[str] | None:
    """Each equation's full name stack. An equation of a called jaxpr (an inlined ``jit``) carries a
    stack relative to its call, so the call's stack goes in front. One jitted function called in
    several places (Flax's dropout in every block) is one jaxpr, so its equations are matched to
    their calls in order: the k-th time ``flatten`` emits an equation is its k-th call. An equation
    ``flatten`` made itself (an unrolled scan's slices, or a call's body it has already placed under
    its caller) carries its own stack."""
    if plan.source_jaxpr is None:
        return None
    from oocjax.transforms import compat as jc  # jax only here, only for a traced plan
    from oocjax.transforms.flatten import flatten
    from oocjax.transforms.reorder import reorder_tail

    occurrences: dict[int, list[str]] = {}

    def walk(jaxpr: Any, outer: str) -> None:
        for eqn in jaxpr.eqns:
            stack = "/".join(s for s in (outer, str(eqn.source_info.name_stack)) if s)
            occurrences.setdefault(id(eqn), []).append(stack)
            for _, sub in jc.sub_jaxprs(eqn.params):
                walk(getattr(sub, "jaxpr", sub), stack)

    walk(plan.source_jaxpr.jaxpr, "")
    flat = flatten(plan.source_jaxpr)  # in the order the step was planned in (``transforms.reorder``)
    flat = reorder_tail(flat, [buffer.donated for buffer in plan.program.buffers[: flat.num_inputs]])
    if len(flat.equations) != len(plan.baseline_timeline.device_bytes):
        return None  # not the program this plan's in-core estimate is of: no regions rather than wrong ones
    seen: dict[int, int] = {}
    traced: list[str] = []
    for fe in flat.equations:
        stacks = occurrences.get(id(fe.eqn)) or [str(fe.eqn.source_info.name_stack)]
        k = seen[id(fe.eqn)] = seen.get(id(fe.eqn), -1) + 1
        traced.append(stacks[k % len(stacks)])  # an unrolled scan emits its body once per iteration
    # A recomputing copy, or an equation run where its results are first read, keeps its own stack.
    return [traced[k] for k in plan.origin_step] if plan.origin_step else traced


# -- the figure ------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "Plan.plot needs matplotlib, an optional extra: pip install 'oocjax[plot]' "
            "(or pip install matplotlib). Plan.summary() and the notebook view need nothing more."
        ) from None
    return plt


def plot(plan: Plan, ax: Any = None, profile: DeviceProfile | str | None = None) -> Any:
    """Device memory per equation: in-core and planned, the budget, what is on host, offloads,
    prefetches and where values are recomputed, over the step's phases and layers. In a figure of
    its own, tables of the largest moves and recomputed values under it; with a profile, a panel
    with the compute and copy streams of the timed simulation.

    Returns the memory axes, or (memory axes, stream axes) with a profile.
    """
    plt = _pyplot()
    regions = plan_regions(plan)
    own_figure = ax is None  # a user's own figure keeps the layout they gave it, and gets no table
    lines = _table_lines(_tables(plan, regions)) if own_figure else []
    if own_figure:
        # The tables sit right under the memory panel, whose equations they name; the streams last.
        heights = [3.4] + ([0.1 + 0.13 * len(lines)] if lines else []) + ([1.6] if profile is not None else [])
        figure = plt.figure(figsize=(11, sum(heights) + 0.6), layout="constrained")
        grid = figure.add_gridspec(len(heights), 1, height_ratios=heights)
        ax = figure.add_subplot(grid[0])
        if lines:
            _tables_panel(figure.add_subplot(grid[1]), lines)
        stream_ax = figure.add_subplot(grid[-1]) if profile is not None else None
    else:
        stream_ax = ax.figure.add_axes([0.1, -0.45, 0.8, 0.35]) if profile is not None else None
    labels = _memory_panel(ax, plan, regions, legend_outside=own_figure)
    if stream_ax is not None:
        _stream_panel(stream_ax, plan, resolve_profile(profile))
    _drop_colliding(ax, labels)
    return ax if stream_ax is None else (ax, stream_ax)


_PHASE_COLOURS = {"forward": "#e8f0fa", "backward": "#fbefe3", "optimizer": "#eaf5e9"}
_CURVE_COLOURS = ("0.55", "tab:blue", "tab:brown")  # in-core, planned, on host
_HEADROOM = 1.28  # the top of the memory axes over the largest curve: room for phase and layer names


def _memory_panel(ax: Any, plan: Plan, regions: StepRegions, *, legend_outside: bool) -> list[Any]:
    """Draws the memory view; returns its phase and layer names with their spans' ends, in the
    order they claim room (``_region_names``)."""
    steps = range(len(plan.timeline.device_bytes))
    curves = [  # the program as it runs has recomputing copies among the traced steps
        (in_core_steps(plan), plan.baseline_timeline.device_bytes, "in-core", plan.baseline_peak_bytes, {}),
        (steps, plan.timeline.device_bytes, "planned", plan.peak_bytes, dict(linewidth=2)),
        (steps, plan.timeline.host_bytes, "on host", plan.host_peak_bytes, dict(linestyle=":", linewidth=1.5)),
    ]
    for (xs, ys, name, peak, style), color in zip(curves[: 2 + (plan.host_peak_bytes > 0)], _CURVE_COLOURS):
        label = f"{name} ({format_bytes(peak)} peak)"
        ax.step(xs, [b / MiB for b in ys], where="post", color=color, label=label, **style)
    ax.axhline(plan.budget_bytes / MiB, color="tab:red", linestyle="--", label="budget")
    offloads = [m.after_step for m in plan.schedule.offloads]
    prefetches = [m.issue_step for m in plan.schedule.prefetches]
    ax.plot(offloads, [0] * len(offloads), "v", color="tab:orange", markersize=5, label="offload")
    ax.plot(prefetches, [0] * len(prefetches), "^", color="tab:green", markersize=5, label="prefetch")
    if plan.recomputed:  # only then: a plan that recomputes nothing keeps its legend as it was
        again = [r.recomputed_at for r in plan.recomputed]
        ax.plot(again, [0] * len(again), "D", color="tab:purple", markersize=4, label="recomputed")
    top = max(plan.budget_bytes, plan.baseline_peak_bytes, plan.peak_bytes, plan.host_peak_bytes, 1) / MiB
    ax.set_xlim(0, max(len(steps), 1))
    ax.set_ylim(-0.04 * top, top * (_HEADROOM if regions.phases else 1.08))
    ax.set_xlabel("equation (numbered as in summary() and pretty_jaxpr())")
    ax.set_ylabel("device memory (MiB)")
    if legend_outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize="small")
    else:
        ax.legend(loc="lower right", fontsize="small")
    recomputed = f", {counted(len(plan.recomputed), 'value')} recomputed" if plan.recomputed else ""
    ax.set_title(
        f"{counted(len(plan.offloads), 'offload')}, {counted(len(plan.host_inputs), 'argument')} on host{recomputed}"
    )
    return _region_names(ax, regions)


def _region_names(ax: Any, regions: StepRegions) -> list[tuple[Any, int]]:
    """Phases shaded and named in a band at the top, layers' first equations marked by thin lines
    and named under the phases. Each name starts at its span's first equation, inside the axes;
    returns (name, the span's end) pairs, phases first, then layers widest first: the order in
    which they claim room."""
    from matplotlib.transforms import blended_transform_factory

    along = blended_transform_factory(ax.transData, ax.transAxes)  # x in equations, y in the axes' height
    names = []
    for phase in regions.phases:
        ax.axvspan(phase.start, phase.stop, color=_PHASE_COLOURS.get(phase.name, "0.95"), zorder=0, linewidth=0)
        text = ax.text(phase.start, 0.975, f" {phase.name}", transform=along, va="top", fontsize="small")
        names.append((text, phase.stop))
    if regions.layers:
        starts = [s.start for s in regions.layers]
        ax.vlines(starts, 0, 0.9, transform=along, colors="0.75", linewidths=0.6, zorder=0.5)
    for layer in sorted(regions.layers, key=lambda s: s.start - s.stop):
        text = ax.text(layer.start, 0.895, f" {layer.name}", transform=along, va="top", fontsize="x-small", color="0.3")
        names.append((text, layer.stop))
    return names


def _drop_colliding(ax: Any, names: list[tuple[Any, int]]) -> None:
    """Hides each name that does not fit in its span or would overlap one kept before it: a narrow
    layer goes unnamed rather than written over its neighbour. Measured once the figure is laid out."""
    if not names:
        return
    figure = ax.figure
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    right = min(ax.get_window_extent(renderer).x1, ax.transData.transform((ax.get_xlim()[1], 0))[0])
    kept: list[Any] = []
    for text, stop in names:
        box = text.get_window_extent(renderer)
        fits = box.x1 <= min(right, ax.transData.transform((stop, 0))[0])
        if fits and not any(box.overlaps(other) for other in kept):
            kept.append(box)
        else:
            text.set_visible(False)


Table = tuple[str, tuple[str, ...], list[tuple[str, ...]]]  # title, header, rows


def _tables(plan: Plan, regions: StepRegions) -> list[Table]:
    """The largest moves (size, out after, back before, value) and the largest recomputed values
    (size, dropped after, recomputed at, value), each equation with its phase and layer."""

    def at(step: int) -> str:
        where = regions.where(step)
        return f"{step} ({where})" if where else str(step)

    moves = [
        (
            o.nbytes,
            at(o.offload_after),
            "stays on host" if o.prefetch_before is None else at(o.prefetch_before),
            o.label,
        )
        for o in plan.offloads
    ]
    for h in plan.host_inputs:
        first = at(h.prefetch_before[0]) if h.prefetch_before else "never read"
        more = f" and {len(h.prefetch_before) - 1} more" if len(h.prefetch_before) > 1 else ""
        moves.append((h.nbytes, "kept on host", first + more, h.label))
    again = [(r.nbytes, at(r.dropped_after), at(r.recomputed_at), r.label) for r in plan.recomputed]
    tables = []
    for what, header, rows in (
        ("moves", ("size", "out after", "back before", "value"), moves),
        ("recomputed values", ("size", "dropped after", "recomputed at", "value"), again),
    ):
        shown = sorted(rows, key=lambda row: -row[0])[:LARGEST_ROWS]
        if shown:
            title = f"Largest {what} ({len(shown)} of {len(rows)})"
            tables.append((title, header, [(format_bytes(n), a, b, _shortened(label)) for n, a, b, label in shown]))
    return tables


def _shortened(label: str) -> str:
    if len(label) <= MAX_LABEL_CHARS:
        return label
    half = (MAX_LABEL_CHARS - 3) // 2
    return f"{label[:half]}...{label[-half:]}"


def _table_lines(tables: list[Table]) -> list[str]:
    """The tables as monospaced lines, columns aligned across them, as ``summary()`` lays them out."""
    columns = [row[:-1] for _, header, rows in tables for row in (header, *rows)]
    widths = [max(len(row[i]) for row in columns) for i in range(len(columns[0]))]
    lines = []
    for title, header, rows in tables:
        lines += ["", title] if lines else [title]  # a blank line between the tables
        lines += ["   ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in (header, *rows)]
    return lines


def _tables_panel(ax: Any, lines: list[str]) -> None:
    """One monospaced text, so its cells cannot overlap; equations are numbered as on the x axis."""
    ax.set_axis_off()
    ax.text(0, 1, "\n".join(lines), transform=ax.transAxes, va="top", family="monospace", fontsize=7.5)


def _stream_panel(ax: Any, plan: Plan, model: DeviceProfile) -> None:
    timed = simulate_time(plan.program, plan.schedule, model)
    lanes = [
        ("compute", timed.compute_spans, "tab:blue"),
        ("host to device", timed.h2d_spans, "tab:green"),
        ("device to host", timed.d2h_spans, "tab:orange"),
    ]
    for row, (_, spans, color) in enumerate(lanes):
        ax.broken_barh([(start * 1e3, (end - start) * 1e3) for start, end in spans], (row - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in lanes])
    ax.set_xlabel("time (ms)")
    ax.set_title(
        f"timed simulation on a model of {model.name}: step {timed.step_time_s * 1e3:.3g} ms, "
        f"exposed transfers {timed.exposed_transfer_s * 1e3:.3g} ms"
    )
