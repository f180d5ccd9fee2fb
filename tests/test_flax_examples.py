"""The examples written in Flax's own style (its ImageNet and lm1b training steps) train like ``jax.jit``
under a budget that makes ``ooc_jit`` move or recompute values; and they run as users run them.

The scripts' processes start with the module's first test, two at a time (``tests/support/background.py``):
they run while the tests in this process plan and train.
"""

import itertools
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from examples import train_lm, train_resnet
from oocjax import ooc_jit
from tests.support.background import Processes

EXAMPLES = Path(__file__).parent.parent / "examples"
STEPS = 3
SCRIPTS = ["train_resnet.py", "train_lm.py"]

# As in test_ooc_jit_reference.py: segments compiled separately may reassociate float32 arithmetic, and
# Adam's division by the root of small second moments enlarges those last-bit differences.
FLOAT32_TOLERANCE = dict(atol=2e-5, rtol=1e-5)


def fresh(state):
    """A copy the step may donate without touching the test's state."""
    return jax.tree.map(lambda x: x.copy(), state)


def first_batches(batches) -> list:
    return [jax.device_put(batch) for batch in itertools.islice(batches, STEPS)]


def in_core_estimate(step_fn, *args) -> int:
    return ooc_jit(step_fn, budget=2**62).plan(*args).baseline_peak_bytes


def train(step, state, batches, *extra) -> list:
    """The state and metrics after each step, fetched to the host."""
    results = []
    for batch in batches:
        state, metrics = step(state, batch, *extra)
        results.append(jax.device_get((state, metrics)))
    return results


def assert_trains_like_jax_jit(actual: list, expected: list) -> None:
    for i, (got, want) in enumerate(zip(actual, expected)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            where = f"step {i}, {jax.tree_util.keystr(path)}"
            if np.asarray(a).dtype == np.float32:
                np.testing.assert_allclose(a, b, **FLOAT32_TOLERANCE, err_msg=where)
            else:
                np.testing.assert_array_equal(a, b, err_msg=where)


def assert_moves_or_recomputes_within(plan, budget: int) -> None:
    assert plan.moved_bytes > 0 or plan.recomputed, plan
    assert plan.segments and plan.peak_bytes <= budget and plan.executed_peak_bytes <= budget, plan


@pytest.mark.slow  # 23-29 s on this project's 2-core CPU
def test_the_resnet_example_updates_batch_stats_like_jax_jit_at_a_budget_that_recomputes_or_moves_values():
    learning_rate_fn = train_resnet.create_learning_rate_fn(0.1, warmup_steps=1, total_steps=STEPS)
    state = train_resnet.create_train_state(jax.random.key(0), train_resnet.create_model(), learning_rate_fn)
    step_fn = train_resnet.make_train_step(learning_rate_fn)
    batches = first_batches(train_resnet.synthetic_batches(0, batch_size=32))

    budget = int(in_core_estimate(step_fn, state, batches[0]) * 0.85)  # the example's default
    step = ooc_jit(step_fn, budget=budget, donate_argnums=(0,), min_offload_bytes=train_resnet.MIN_OFFLOAD_BYTES)
    assert_moves_or_recomputes_within(step.plan(state, batches[0]), budget)

    expected = train(jax.jit(step_fn), state, batches)
    # The running statistics do change (mutable=["batch_stats"] reaches the state), so comparing them means something.
    before, after = jax.tree.leaves(state.batch_stats), jax.tree.leaves(expected[-1][0].batch_stats)
    assert all(not np.allclose(a, b) for a, b in zip(before, after))
    assert_trains_like_jax_jit(train(step, fresh(state), batches), expected)


@pytest.mark.slow  # 23-29 s on this project's 2-core CPU
def test_the_language_model_example_draws_the_same_dropout_masks_as_jax_jit_at_a_budget_that_recomputes_or_moves():
    learning_rate_fn = train_lm.create_learning_rate_schedule(3e-3, warmup_steps=1)
    init_key, dropout_rng = jax.random.split(jax.random.key(0))
    state = train_lm.create_train_state(init_key, train_lm.create_model(), learning_rate_fn)
    step_fn = train_lm.make_train_step(learning_rate_fn)
    batches = first_batches(train_lm.synthetic_batches(0, batch_size=32))

    # At half the in-core estimate the plan recomputes values; the example's default, 0.35, also moves
    # some, but cuts twice as many segments to compile.
    budget = int(in_core_estimate(step_fn, state, batches[0], dropout_rng) * 0.5)
    step = ooc_jit(step_fn, budget=budget, donate_argnums=(0,))
    assert_moves_or_recomputes_within(step.plan(state, batches[0], dropout_rng), budget)

    expected = train(jax.jit(step_fn), state, batches, dropout_rng)
    # Dropout is on: another key gives another loss, so equal losses mean equal masks.
    _, other = jax.jit(step_fn)(state, batches[0], jax.random.key(1))
    assert abs(float(other["loss"]) - float(expected[0][1]["loss"])) > 1e-3
    assert_trains_like_jax_jit(train(step, fresh(state), batches, dropout_rng), expected)


@pytest.fixture(scope="module", autouse=True)
def scripts(request):
    """The scripts the selected tests of this module run, started now."""
    processes = Processes()
    for item in request.session.items:
        if getattr(item, "function", None) is test_the_flax_style_examples_run_as_scripts_and_print_a_loss_per_step:
            script = item.callspec.params["script"]
            processes.queue(script, [sys.executable, EXAMPLES / script, "--steps", "3"])
    yield processes
    processes.close()


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_flax_style_examples_run_as_scripts_and_print_a_loss_per_step(script, scripts):
    result = scripts.result(script, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in losses] == ["step 0", "step 1", "step 2"], result.stdout
    assert "Plan(" in result.stdout, result.stdout
