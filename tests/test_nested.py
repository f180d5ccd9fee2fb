"""An ``ooc_jit`` step called inside ``jax.jit``, ``jax.grad`` or ``jax.vmap`` runs inline, as a nested
``jax.jit`` does, at every budget, and says once that its budget does not hold there."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oocjax import ooc_jit

DEPTH, WIDTH, BATCH = 6, 64, 2048


def loss(w, x):
    for i in range(DEPTH):
        x = jnp.tanh(x @ w[i])
    return (x**2).mean()


def regularised_loss(w, x):
    """A scalar of a whole training step (loss and gradient): at top level its plan moves activations
    kept for the backward pass; ``jax.grad`` of it is a second derivative."""
    value, grads = jax.value_and_grad(loss)(w, x)
    return value + (grads**2).sum()


@functools.cache
def arguments() -> tuple[jax.Array, jax.Array]:
    """The weights and a batch, made on first use (not when pytest collects the tests)."""
    w = jax.random.normal(jax.random.key(0), (DEPTH, WIDTH, WIDTH)) / WIDTH**0.5
    return w, jax.random.normal(jax.random.key(1), (BATCH, WIDTH))


@functools.cache
def in_core() -> int:
    return ooc_jit(regularised_loss, budget=2**62).plan(*arguments()).baseline_peak_bytes


FRACTIONS = {"moves nothing": 2.0, "moves values": 0.4}


def in_two_batches(w, x):
    return w, x.reshape(2, BATCH // 2, WIDTH)


# Each transformation, and the arguments it takes from (w, x).
TRANSFORMS = {
    "jit": (jax.jit, lambda w, x: (w, x)),
    "grad": (jax.grad, lambda w, x: (w, x)),
    "vmap": (lambda f: jax.vmap(f, in_axes=(None, 0)), in_two_batches),
}


def step_at(budget_name: str):
    step = ooc_jit(
        regularised_loss, budget=int(in_core() * FRACTIONS[budget_name]), recompute="off", min_offload_bytes="16KiB"
    )
    plan = step.plan(*arguments())
    assert bool(plan.offloads) == (budget_name == "moves values"), plan  # the premise of the budget's name
    return step


def nested_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "called inside a jax transformation" in str(w.message)]


@pytest.mark.parametrize("budget_name", list(FRACTIONS))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_an_ooc_jit_step_inside_a_transformation_gives_jax_jits_result_and_warns_that_its_budget_does_not_hold(
    transform, budget_name
):
    wrap, arrange = TRANSFORMS[transform]
    args = arrange(*arguments())
    step = step_at(budget_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = wrap(step)(*args)
    expected = wrap(jax.jit(regularised_loss))(*args)
    np.testing.assert_allclose(np.asarray(result), np.asarray(expected), rtol=1e-6, atol=1e-7)
    [message] = nested_warnings(caught)
    assert message.startswith("oocjax: regularised_loss was called inside a jax transformation")
    assert "does not apply" in message and "wrap the whole (differentiated) step in ooc_jit" in message
    assert caught[0].filename == __file__, "the warning points at the caller's line, not jax's internals"


def test_the_warning_comes_once_per_step_and_top_level_calls_still_plan_and_hold_the_budget():
    step, (w, x) = step_at("moves values"), arguments()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            jax.grad(step)(w, x)
        jax.jit(step)(w, x)
        top_level = step(w, x)
    assert len(nested_warnings(caught)) == 1
    np.testing.assert_allclose(float(top_level), float(jax.jit(regularised_loss)(w, x)), rtol=1e-6)
    other = step_at("moves values")  # another step warns for itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.vmap(other, in_axes=(None, 0))(*in_two_batches(w, x))
    assert len(nested_warnings(caught)) == 1
