"""Plan.plot(ax=...) draws into the user's own matplotlib Axes, leaving the rest of their figure alone."""

import pytest

from oocjax.plan import Plan
from oocjax.schedule import keep_all, plan_window, simulate
from tests.support.plans import wide_plan
from tests.support.programs import MiB, mlp_chain

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture
def plan() -> Plan:
    program = mlp_chain()
    schedule = plan_window(program, 16 * MiB)
    timelines = dict(timeline=simulate(program, schedule), baseline_timeline=simulate(program, keep_all(program)))
    return Plan.build(program=program, schedule=schedule, jaxpr=None, source_jaxpr=None, **timelines)


@pytest.fixture(autouse=True)
def close_figures():
    plt.close("all")  # figures other tests left open
    yield
    plt.close("all")


def test_the_memory_view_is_drawn_into_the_given_axes_and_returned(plan):
    figure, (left, right) = plt.subplots(1, 2)
    returned = plan.plot(ax=right)
    assert returned is right
    assert plt.get_fignums() == [figure.number], "no figure of its own"
    assert not left.lines and not left.collections, "the other axes are untouched"
    lines = {line.get_label(): line for line in right.get_lines()}
    planned = next(line for label, line in lines.items() if label.startswith("planned"))
    in_core = next(line for label, line in lines.items() if label.startswith("in-core"))
    assert list(planned.get_ydata()) == [b / MiB for b in plan.timeline.device_bytes]
    assert list(in_core.get_ydata()) == [b / MiB for b in plan.baseline_timeline.device_bytes]
    assert list(lines["budget"].get_ydata()) == [16, 16]
    assert list(lines["offload"].get_xdata()) == [m.after_step for m in plan.schedule.offloads]
    assert list(lines["prefetch"].get_xdata()) == [m.issue_step for m in plan.schedule.prefetches]
    assert right.get_legend() is not None and right.get_title() == "2 offloads, 2 arguments on host"


def test_with_a_profile_the_stream_view_joins_the_given_axes_figure(plan):
    figure, ax = plt.subplots()
    memory_ax, stream_ax = plan.plot(ax=ax, profile="h100-pcie")
    assert memory_ax is ax and ax.get_lines()
    assert stream_ax.figure is figure and stream_ax is not ax
    assert plt.get_fignums() == [figure.number]
    assert len(stream_ax.collections) == 3  # compute, host-to-device, device-to-host


def test_a_gradient_steps_phases_are_shaded_and_named_in_the_given_axes_and_no_table_is_added():
    figure, ax = plt.subplots(figsize=(8, 3))
    wide_plan().plot(ax=ax)  # a plain jax gradient step: phases, no modules to name as layers
    assert figure.axes == [ax], "the tables of moves need a figure of the plot's own"
    assert [t.get_text().strip() for t in ax.texts if t.get_visible()] == ["forward", "backward", "optimizer"]
    assert len(ax.patches) == 3  # one shaded span per phase
