"""The examples run as users run them, and do what they say: train under half their in-core memory.

Each runs in its own process, two at a time (``tests/support/background.py``)."""

import json
import sys
from pathlib import Path

import pytest

from tests.support.background import Processes

EXAMPLES = Path(__file__).parent.parent / "examples"
# In the order the tests ask for them: asking for one queues it and those after it.
RUNS = {
    "flax": ("train_flax.py", "--steps", "150"),
    "nnx": ("train_nnx.py", "--steps", "150"),
    "sharded": ("train_sharded.py", "--steps", "3"),
}


@pytest.fixture(scope="module")
def run_example(tmp_path_factory):
    """``run_example(name)``: the figures example run ``name`` wrote (``--json``)."""
    processes, folder = Processes(), tmp_path_factory.mktemp("examples")

    def run(name: str) -> dict:
        for queued in list(RUNS)[list(RUNS).index(name) :]:
            script, *options = RUNS[queued]
            processes.queue(queued, [sys.executable, EXAMPLES / script, *options, "--json", folder / f"{queued}.json"])
        result = processes.result(name)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads((folder / f"{name}.json").read_text())

    yield run
    processes.close()


def assert_trained_under_half_the_in_core_estimate(
    figures: dict, *, lowered_by: tuple[str, ...] = ("offloads",)
) -> None:
    in_core, budget = figures["in_core_estimate_bytes"], figures["budget_bytes"]
    assert budget <= in_core // 2
    # The budget forces offloading (or, where named, recomputing), and the segments fit it: planned,
    # and as the compiled programs measure.
    assert any(figures[way] > 0 for way in lowered_by)
    assert 0 < figures["planned_peak_bytes"] <= budget
    assert 0 < figures["executed_peak_bytes"] <= budget
    losses = figures["losses"]
    assert losses[-1] < 0.5 * losses[0]


def test_the_check_fails_when_the_budget_forces_no_offloads_or_is_exceeded():
    figures = dict(
        in_core_estimate_bytes=1000,
        budget_bytes=500,
        planned_peak_bytes=480,
        executed_peak_bytes=490,
        offloads=3,
        losses=[2.0, 1.5, 0.9],
    )
    assert_trained_under_half_the_in_core_estimate(figures)
    for broken in (
        dict(offloads=0),
        dict(budget_bytes=1000, planned_peak_bytes=900, executed_peak_bytes=900),
        dict(executed_peak_bytes=510),
        dict(losses=[2.0, 1.5, 1.1]),
    ):
        with pytest.raises(AssertionError):
            assert_trained_under_half_the_in_core_estimate(figures | broken)


@pytest.mark.slow
def test_the_flax_example_trains_under_half_its_in_core_memory(run_example):
    figures = run_example("flax")
    assert len(figures["losses"]) == 150
    assert_trained_under_half_the_in_core_estimate(figures)


@pytest.mark.slow
def test_the_nnx_example_trains_under_half_its_in_core_memory(run_example):
    figures = run_example("nnx")
    assert len(figures["losses"]) == 150
    # Its blocks are found by structure (NNX names none), and recomputing them by block fits half.
    assert_trained_under_half_the_in_core_estimate(figures, lowered_by=("offloads", "recomputed"))


@pytest.mark.slow
def test_the_sharded_example_trains_data_parallel_on_8_devices_within_its_per_device_budget(run_example):
    figures = run_example("sharded")
    assert figures["devices"] == 8 and figures["parameter_devices"] == [8]  # never gathered onto one device
    assert figures["budget_bytes"] <= figures["in_core_estimate_bytes"] // 2
    assert figures["moved_bytes"] or figures["recomputed"]
    assert figures["launches"] > 0 and 0 < figures["measured_peak_bytes"] <= figures["budget_bytes"]
    assert abs(figures["losses"][0] - figures["jax_jit_first_loss"]) <= 1e-5 * abs(figures["jax_jit_first_loss"])
    assert figures["losses"][-1] < figures["losses"][0]
