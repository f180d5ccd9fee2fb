"""Matplotlib figures of a plan. matplotlib is an optional extra, imported only here, only when used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oocjax.render import counted, in_core_steps
from oocjax.schedule import MiB
from oocjax.schedule.cost import DeviceProfile, resolve_profile, simulate_time

if TYPE_CHECKING:
    from oocjax.plan import Plan

LABELLED_MOVES = 5  # the largest moves get their value's name on the plot


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
    """Device memory per equation: in-core and planned, the budget, offloads, prefetches and where
    values are recomputed. With a profile, a second panel shows the compute and copy streams of the
    timed simulation.

    Returns the memory axes, or (memory axes, stream axes) with a profile.
    """
    plt = _pyplot()
    own_figure = ax is None  # a user's own figure keeps the layout they gave it
    if ax is None:
        rows = 2 if profile is not None else 1
        _, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), squeeze=False)
        ax, stream_ax = axes[0][0], (axes[1][0] if profile is not None else None)
    else:
        stream_ax = ax.figure.add_axes([0.1, -0.45, 0.8, 0.35]) if profile is not None else None
    _memory_panel(ax, plan)
    if stream_ax is not None:
        _stream_panel(stream_ax, plan, resolve_profile(profile))
    if own_figure:
        ax.figure.tight_layout()  # keeps the x label inside a plain savefig
    return ax if stream_ax is None else (ax, stream_ax)


def _memory_panel(ax: Any, plan: Plan) -> None:
    steps = range(len(plan.timeline.device_bytes))
    ax.step(
        in_core_steps(plan),  # the program as it runs has recomputing copies among the traced steps
        [b / MiB for b in plan.baseline_timeline.device_bytes],
        where="post",
        color="0.55",
        label=f"in-core ({plan.baseline_peak_bytes / MiB:.1f} MiB peak)",
    )
    ax.step(
        steps,
        [b / MiB for b in plan.timeline.device_bytes],
        where="post",
        color="tab:blue",
        linewidth=2,
        label=f"planned ({plan.peak_bytes / MiB:.1f} MiB peak)",
    )
    ax.axhline(plan.budget_bytes / MiB, color="tab:red", linestyle="--", label="budget")
    offloads = [m.after_step for m in plan.schedule.offloads]
    prefetches = [m.issue_step for m in plan.schedule.prefetches]
    ax.plot(offloads, [0] * len(offloads), "v", color="tab:orange", markersize=5, label="offload")
    ax.plot(prefetches, [0] * len(prefetches), "^", color="tab:green", markersize=5, label="prefetch")
    if plan.recomputed:  # only then: a plan that recomputes nothing keeps its legend as it was
        again = [r.recomputed_at for r in plan.recomputed]
        ax.plot(again, [0] * len(again), "D", color="tab:purple", markersize=4, label="recomputed")
    _label_largest_moves(ax, plan)
    ax.set_xlabel("equation")
    ax.set_ylabel("device memory (MiB)")
    ax.set_ylim(bottom=-0.04 * max(plan.baseline_peak_bytes / MiB, 1))
    ax.legend(loc="upper right", fontsize="small")
    recomputed = f", {counted(len(plan.recomputed), 'value')} recomputed" if plan.recomputed else ""
    ax.set_title(
        f"{counted(len(plan.offloads), 'offload')}, {counted(len(plan.host_inputs), 'argument')} on host{recomputed}"
    )


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


def _label_largest_moves(ax: Any, plan: Plan) -> None:
    """Names the values of the largest offloads (and host-kept arguments) next to their markers: a
    PNG has no hover titles."""
    rows = [(o.nbytes, o.offload_after, o.label) for o in plan.offloads]
    rows += [(h.nbytes, h.prefetch_before[0], h.label) for h in plan.host_inputs if h.prefetch_before]
    for nbytes, step, label in sorted(rows, key=lambda row: -row[0])[:LABELLED_MOVES]:
        ax.annotate(
            f"{label} ({nbytes / MiB:.3g} MiB)",
            (step, 0),
            xytext=(2, 8),
            textcoords="offset points",
            rotation=35,
            fontsize="x-small",
            color="0.25",
        )
