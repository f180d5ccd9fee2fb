"""A call the device measures over the budget is planned again with that much more headroom.

A CPU reports no allocator statistics, so the device's peak is faked here: ``peak_reader`` gives
the executor a process peak that a call raises to a chosen number of bytes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oocjax import ooc_jit
from oocjax.api import MAX_RUNTIME_REPLANS
from oocjax.transforms.account import DeviceAccess
from tests.support.seams import with_seams


def mlp_step(params, x):
    def loss(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return (h**2).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return [p - 0.1 * g for p, g in zip(params, grads)], value


PARAMS = [jnp.eye(128) * 0.9 for _ in range(6)]
X = jnp.linspace(-1, 1, 512 * 128).reshape(512, 128)


@pytest.fixture(scope="module")
def budget() -> int:
    """60% of the step's in-core estimate, planned once for the module (not when pytest collects it)."""
    return int(ooc_jit(mlp_step, budget=2**62).plan(PARAMS, X).baseline_peak_bytes * 0.6)


def measured(step, peak_of_call):
    """``step`` on a device whose every call reads the peak before (0) and after
    (``peak_of_call(i)`` for the i-th call)."""
    reads = itertools.count()
    access = DeviceAccess(peak_reader=lambda device: lambda: 0 if next(reads) % 2 == 0 else peak_of_call())
    return with_seams(step, device_access=access)


def test_a_call_measured_over_the_budget_is_planned_again_with_the_excess_as_headroom(budget):
    calls = itertools.count()
    step = ooc_jit(mlp_step, budget=budget, min_offload_bytes=4096)
    step = measured(step, lambda: budget + budget // 10 if next(calls) == 0 else budget - 1)
    assert step.plan(PARAMS, X).headroom_bytes == 0  # a CPU starts with none
    with pytest.warns(UserWarning, match=r"over its budget of .*; planned again with .* of headroom"):
        params, _ = step(PARAMS, X)
    plan = step.plan(PARAMS, X)
    assert plan.headroom_bytes >= budget // 10
    assert plan.executed_peak_bytes <= budget - plan.headroom_bytes and plan.budget_bytes == budget
    params, loss = step(params, X)  # measured within the budget now: no warning, no new plan
    assert step.plan(PARAMS, X) is plan
    reference = jax.jit(mlp_step)
    expected, expected_loss = reference(*reference(PARAMS, X)[:1], X)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p, e, atol=2e-5)


def test_a_step_that_stays_over_is_planned_again_a_bounded_number_of_times_then_only_warned_about(budget):
    step = measured(ooc_jit(mlp_step, budget=budget, min_offload_bytes=4096), lambda: budget + 2**16)
    plans = [step.plan(PARAMS, X)]
    for _ in range(MAX_RUNTIME_REPLANS):
        with pytest.warns(UserWarning, match="planned again with"):
            step(PARAMS, X)
        plans.append(step.plan(PARAMS, X))
    assert [p.headroom_bytes for p in plans] == sorted({p.headroom_bytes for p in plans})  # grows each time
    with pytest.warns(UserWarning, match=f"planned again {MAX_RUNTIME_REPLANS} times already: raise headroom_bytes"):
        step(PARAMS, X)
    assert step.plan(PARAMS, X) is plans[-1]


def test_headroom_can_be_set_with_units_and_is_left_free_by_the_plan(budget):
    step = ooc_jit(mlp_step, budget=budget, min_offload_bytes=4096, headroom_bytes="64KiB")
    plan = step.plan(PARAMS, X)
    assert plan.headroom_bytes == 64 * 1024
    assert plan.executed_peak_bytes <= budget - 64 * 1024
    with pytest.raises(ValueError, match=r"headroom_bytes .* must be below the budget"):
        ooc_jit(mlp_step, budget="1MiB", headroom_bytes="1MiB")


def test_in_a_multi_process_run_a_call_over_the_budget_is_only_warned_about_with_the_headroom_to_pass(
    monkeypatch, budget
):
    # Another plan in one process alone would launch other programs than the others run.
    step = measured(ooc_jit(mlp_step, budget=budget, min_offload_bytes=4096), lambda: budget + 2**16)
    plan = step.plan(PARAMS, X)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.warns(UserWarning, match=r"not planned again, because every process .* pass headroom_bytes=\d+"):
        step(PARAMS, X)
    assert step.plan(PARAMS, X) is plan
