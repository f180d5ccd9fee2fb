"""Steps on a mesh of 8 virtual CPU devices: the budget is per device, layouts go through the whole
pipeline, and results match ``jax.jit``'s.

``XLA_FLAGS`` must hold the device count before jax starts, so each layout runs in its own process
(``tests/support/sharded_steps.py``), which prints what it measured as JSON; the assertions are here. Each
layout runs its step at 100%, 60% and 40% of its per-device in-core estimate (35% was 2% under the
smallest budget the model layout holds once each update follows its gradient).

The layouts' processes run two at a time (``tests/support/background.py``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from tests.support.background import Processes, cpu_devices_env

ROOT = Path(__file__).resolve().parent.parent
FAST = ["data", "model", "explicit", "shard_map"]
# fsdp, the slowest, first: the tests ask for the layouts in this order, and asking for one queues it
# and those after it (fsdp's tests are slow: a run without them never starts its process).
LAYOUTS = [pytest.param("fsdp", marks=pytest.mark.slow), *FAST]
ORDER = ["fsdp", *FAST]
processes = Processes()


@pytest.fixture(scope="module", autouse=True)
def no_layout_process_outlives_the_module():
    yield
    processes.close()


@functools.cache
def measured(layout: str) -> dict:
    env = cpu_devices_env(8)
    for queued in ORDER[ORDER.index(layout) :]:
        processes.queue(queued, [sys.executable, "-m", "tests.support.sharded_steps", queued], cwd=ROOT, env=env)
    done = processes.result(layout)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    return report


@pytest.mark.slow  # about 55 s for the five layouts, two at a time, on this project's 2-core CPU
@pytest.mark.parametrize("layout", LAYOUTS)
def test_at_the_in_core_estimate_a_sharded_step_is_jax_jits_program_bitwise(layout):
    run = measured(layout)["fractions"]["1.0"]
    assert run["segments"] == 0 and run["moved_bytes"] == 0
    assert run["exact"] and run["same_shardings"] and run["single_device_results"] == 0
    assert run["sizes_match_shards"] and run["second_call_reuses_plan"]


def _below(layout: str, fraction: str) -> dict:
    report = measured(layout)
    run = report["fractions"][fraction]
    assert "error" not in run, run["error"]
    return run


@pytest.mark.parametrize("fraction", ["0.6", "0.4"])
@pytest.mark.parametrize("layout", ["data", "model", "explicit", "shard_map"])
def test_below_the_in_core_estimate_a_sharded_step_matches_jax_jit_within_the_per_device_budget(layout, fraction):
    run = _below(layout, fraction)
    assert run["moved_bytes"] > 0 or run["recomputed"] > 0  # the budget really made the plan move or recompute
    assert run["segments"] > 0 and run["launches"] > 0
    assert run["close"], run["max_abs_difference"]
    assert run["same_shardings"] and run["single_device_results"] == 0
    assert set(run["result_kinds"]) <= {"device", "pinned_host"}
    # Every launch, on every device: live device bytes (from shardings and shard shapes) plus what it allocates.
    assert run["worst_launch"] <= run["budget"], run
    assert run["peak_bytes"] <= run["budget"] and run["executed_peak_bytes"] <= run["budget"]
    assert run["sizes_match_shards"] and run["second_call_reuses_plan"]
    assert run["held_arrays_off_their_planned_bytes"] == []  # every array between segments: its shard bytes


@pytest.mark.parametrize("layout", ["data", "model", "explicit", "shard_map"])
def test_a_plan_on_a_mesh_says_so_and_counts_per_device(layout):
    report = measured(layout)
    run = report["fractions"]["0.6"]
    mesh = "8 devices, mesh data=2 model=4" if layout == "model" else "8 devices, mesh data=8"
    assert run["mesh"] == mesh
    assert mesh in run["summary_first_line"] and mesh in run["repr"]
    # Per device: replicated parameters cost each device all of them, sharded ones a part.
    if layout == "model":
        assert report["in_core_bytes"] < report["argument_global_bytes"]
        assert run["gathering_steps"] > 0  # products over the sharded 'model' dimension
    assert run["json_keeps_the_program"]  # a saved plan reads back with its gathering steps
    assert run["lowered_on_the_mesh"]  # step.lower: a program per segment, its arguments in their layouts


def test_a_shard_map_call_runs_whole_with_its_bodys_per_device_peak():
    # Each layer's shard_map call and its transpose are one step of the plan: the cuts fall between them.
    run = _below("shard_map", "0.4")
    assert run["shard_map_steps"] == 2 * run["layers"]


def test_another_layout_of_the_same_step_gets_another_plan_and_two_meshes_are_refused():
    report = measured("data")
    assert report["layouts"] == dict(traces=2, plans=2, distinct=True)
    assert report["two_meshes"].startswith("OocError: ooc_jit: the arguments live on 2 different meshes")
    assert "Fixes:" in report["two_meshes"]


def test_a_constant_the_step_closes_over_on_the_mesh_keeps_its_layout():
    closed_over = measured("data")["closed_over"]
    assert closed_over["specs"] == ["P('data',)"]  # not replicated: never gathered
    assert closed_over["segments"] > 0 and closed_over["close"]


@pytest.mark.slow  # about 17 s on 2 CPU cores (12 layers planned at three budgets)
@pytest.mark.parametrize("fraction", ["0.6", "0.4"])
def test_an_fsdp_step_below_the_in_core_estimate_matches_jax_jit_within_the_per_device_budget(fraction):
    """Parameters and Adam's moments sharded on their first dimension, 12 layers: the compiled
    segments hold the budget although XLA gathers whole weights inside them (each segment counts
    every gather it runs: ``schedule.segments.GatheringStep``).

    The updated parameters are not compared at the float32 tolerance: Adam's first update
    ``lr * g / (|g| + eps)`` moves by up to ``lr / eps`` per unit of gradient near ``g = 0``, and
    reductions in another order (other programs, gathered in other places) round the gradients
    differently. Measured (8 CPU devices, jax 0.10.2): the gradients of ooc_jit at 60% and 35% differed
    from jax.jit's by 1.6e-9 (largest gradient 3.0e-3), the loss is bitwise equal, and the updated
    parameters differ by 2.7e-4 and 4.4e-4; jax.jit itself, run on replicated (data-parallel) instead
    of FSDP parameters, differs from jax.jit by 1.8e-9 in the gradients and 3.2e-4 in the parameters.
    So the gradients (Adam's ``mu``), ``nu`` and the loss are compared at the float32 tolerance, and
    each parameter within it plus the bound Adam's update puts on that element's measured gradient
    difference (``sharded_steps.adam_comparison``), which jax.jit's own layout change meets as well.
    """
    run = _below("fsdp", fraction)
    assert run["moved_bytes"] > 0 or run["recomputed"] > 0
    assert run["segments"] > 0 and run["launches"] > 0
    adam = run["adam"]
    assert adam["moments_and_loss_close"] and adam["loss_difference"] <= 1e-6, adam
    assert adam["gradient_difference"] <= 1e-5 * adam["largest_gradient"], adam  # a reduction's rounding, no more
    assert adam["params_within_adam_bound"], adam
    jit = measured("fsdp")["jit_data_parallel"]  # jax.jit against itself on another layout, for scale
    assert jit["moments_and_loss_close"] and jit["params_within_adam_bound"], jit
    assert run["same_shardings"] and run["single_device_results"] == 0
    assert run["worst_launch"] <= run["budget"], run
    assert run["peak_bytes"] <= run["budget"] and run["executed_peak_bytes"] <= run["budget"]
    assert run["sizes_match_shards"] and run["second_call_reuses_plan"]


def test_host_memory_is_counted_for_every_device_of_the_process():
    host = measured("data")["host_budget"]
    assert host["per_device"] > 0 and host["just_enough"] == "planned"
    assert host["one_byte_short"].startswith("OocError: the plan needs") and "of host memory" in host["one_byte_short"]


def test_a_sharded_steps_plan_is_stored_and_read_back_by_a_fresh_wrapper():
    cached = measured("data")["plan_cache"]
    assert cached["stored"] == 1 and cached["made"] == 1  # the second wrapper planned and compiled nothing
    assert cached["same_results"] and cached["same_shardings"]
