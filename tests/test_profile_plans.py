"""Planning for a GPU from any machine: ``step.plan(*abstract_args, profile="h200")`` traces, plans with
the profile's rates and its platform's defaults, and estimates each segment's memory instead of
compiling it; nothing is compiled or allocated, and the plan says so."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from oocjax import Plan, ooc_jit
from oocjax.errors import OocError
from oocjax.schedule import PROFILES, check_segments, validate

ROOT = Path(__file__).parent.parent
GIB = 2**30


def layered_step(params, x):
    """A 6-layer tanh MLP's squared loss and SGD update, over a list of weights."""

    def loss(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    value, grads = jax.value_and_grad(loss)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], value


WIDTH, BATCH, DEPTH = 8192, 32768, 6  # 1.5 GiB of weights, 1 GiB per activation: H200-sized
ABSTRACT = (
    [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH,
    jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
)


def h200_plan(budget: str = "6GiB", **options) -> Plan:
    return ooc_jit(layered_step, budget=budget, donate_argnums=(0,), **options).plan(*ABSTRACT, profile="h200")


def test_a_plan_for_a_profile_says_it_was_planned_for_that_device_and_not_compiled():
    plan = h200_plan()
    assert plan.device == "h200" and plan.compiled is False and plan.executed_peak_bytes is None
    assert plan.segments and len(plan.segment_costs) == len(plan.segments) and plan.offloads
    first_line = plan.summary().splitlines()[0]
    assert first_line.startswith("oocjax plan for h200 from its profile: segments' memory estimated, nothing compiled")
    assert not validate(plan.program, plan.schedule)
    assert not check_segments(plan.program, plan.schedule, plan.segments)


def test_a_plan_for_a_gpu_profile_takes_the_gpus_defaults_unless_the_user_set_them():
    plan = h200_plan()
    assert plan.headroom_bytes == int(0.08 * 6 * GIB)  # a GPU's 8%, where this CPU's is 0
    assert plan.schedule.budget_bytes == 6 * GIB - plan.headroom_bytes
    assert h200_plan(headroom_bytes="100MiB").headroom_bytes == 100 * 2**20


def test_planning_for_a_profile_compiles_nothing_and_allocates_nothing(caplog):
    before = {id(x) for x in jax.live_arrays()}
    with jax.log_compiles(), caplog.at_level(logging.DEBUG):
        h200_plan("5GiB")
    compiled = [r.getMessage() for r in caplog.records if "compil" in r.getMessage().lower()]
    assert compiled == []
    assert {id(x) for x in jax.live_arrays()} <= before


def test_the_in_core_step_time_is_simulated_on_the_same_profile_printed_and_saved():
    plan = h200_plan()
    assert 0 < plan.in_core_time_s < plan.step_time_s  # offloading on an H200's link costs time here
    ratio = plan.step_time_s / plan.in_core_time_s
    assert f"{ratio:.2f}x the step in core" in plan.summary()
    again = Plan.from_json(plan.to_json(full=True))
    assert again.in_core_time_s == plan.in_core_time_s and again.step_time_s == plan.step_time_s
    assert again.compiled is False and again.device == "h200"
    assert json.loads(plan.to_json())["in_core_time_s"] == plan.in_core_time_s


def test_a_plan_made_on_this_machine_says_its_in_core_time_too():
    small = (
        [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 3,
        jax.ShapeDtypeStruct((512, 256), jnp.float32),
    )
    plan = ooc_jit(layered_step, budget="64MiB").plan(*small)
    assert plan.compiled and plan.device == jax.local_devices()[0].device_kind
    assert plan.in_core_time_s == pytest.approx(plan.step_time_s)  # nothing moves: the step is in core


def test_a_profile_name_that_does_not_exist_is_refused_with_the_names_that_do():
    step = ooc_jit(layered_step, budget="6GiB")
    with pytest.raises(ValueError, match="unknown device profile 'h300'; known: ") as refused:
        step.plan(*ABSTRACT, profile="h300")
    assert all(name in str(refused.value) for name in PROFILES)


def test_a_plan_for_a_gpu_is_held_to_xlas_pinned_host_pool_there(monkeypatch):
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "1")
    with pytest.raises(OocError, match=r"set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=\d+ \(GiB\) or more"):
        h200_plan()


@pytest.mark.slow  # 30-40 s: a fresh process, two plans of a 16-layer GPT
def test_a_7b_sized_gpt_is_planned_for_an_h200_from_this_cpu_in_little_memory(monkeypatch):
    # 85 GiB of f32 AdamW state on host: more than XLA's default pinned pool of 64 GiB, raised here
    # as a user planning it for such a machine would.
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "256")
    command = [sys.executable, "-m", "tests.support.plan_for_a_gpu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["state_bytes"] > 80 * GIB
    assert record["peak_rss_bytes"] < 2 * GIB and record["new_live_arrays"] == 0
    assert [row["budget_bytes"] for row in record["rows"]] == [72 * GIB, 24 * GIB]
    for row in record["rows"]:
        assert row["device"] == "h200" and row["compiled"] is False and row["executed_peak_bytes"] is None
        assert row["plan_violations"] == [] and row["chain_violations"] == []
        assert row["peak_bytes"] <= row["planned_for_bytes"] == row["budget_bytes"] - row["headroom_bytes"]
        assert row["estimated_segment_peak_bytes"] <= row["planned_for_bytes"]
        assert 0 < row["host_kept_bytes"] <= record["state_bytes"]
        assert row["step_time_s"] > row["in_core_time_s"] > 0
        assert row["seconds"] < 60
