"""ooc_jit's edges behave as jax.jit's do on the same input, and its own options read as the budget does."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oocjax import ooc_jit
from oocjax.errors import BudgetInfeasibleError
from tests.support.seams import capture_stages, plans_made

X = jnp.arange(8.0)


def scaled_sum(x, n):
    return (x * n).sum()


def test_a_budget_string_below_one_is_a_fraction_of_device_memory_as_the_float_is():
    # The CPU reports no memory size, so a fraction is refused for that reason, not as "not positive".
    for budget in (0.8, "0.8"):
        with pytest.raises(ValueError, match="fraction of device memory, but cpu does not report its memory size"):
            ooc_jit(scaled_sum, budget=budget)


def test_a_budget_string_that_is_neither_a_fraction_nor_whole_bytes_is_refused_not_read_as_one_byte():
    with pytest.raises(ValueError, match=r"fractional budget must be in \(0, 1\].*budget='1.5GiB'"):
        ooc_jit(scaled_sum, budget="1.5")


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint64, int])
def test_a_budget_of_any_integer_type_is_bytes(integer):
    assert ooc_jit(scaled_sum, budget=integer(2**30)).budget_bytes == 2**30


def test_byte_options_take_the_units_the_budget_takes():
    step = ooc_jit(scaled_sum, budget="2GiB", window_bytes="3GiB", min_offload_bytes="1MiB")
    assert (step.options.window_bytes, step.options.min_offload_bytes) == (3 * 2**30, 2**20)
    assert ooc_jit(scaled_sum, budget="2GiB", min_offload_bytes=np.int64(0)).options.min_offload_bytes == 0


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"min_offload_bytes": -5}, ValueError, "min_offload_bytes must be non-negative"),
        ({"window_bytes": 0}, ValueError, "window_bytes must be positive"),
        ({"window_bytes": "lots"}, ValueError, "window_bytes: cannot read 'lots' as a number of bytes"),
        ({"min_offload_bytes": 1.5}, TypeError, "min_offload_bytes must be an int number of bytes or a string"),
        ({"min_segments": 0}, ValueError, "min_segments must be a whole number >= 1"),
        ({"min_segment_flops": -1}, ValueError, "min_segment_flops must be a whole number >= 0"),
        ({"window": 5}, TypeError, r"unknown planner options \['window'\]"),
    ],
)
def test_a_bad_planner_option_says_what_is_wrong(options, error, words):
    with pytest.raises(error, match=words):
        ooc_jit(scaled_sum, budget="1GiB", **options)


def test_static_argnums_given_as_a_string_is_a_type_error_naming_the_option():
    with pytest.raises(TypeError, match="static_argnums must be an int or a sequence of ints"):
        ooc_jit(scaled_sum, budget="1GiB", static_argnums="1")


def test_an_unhashable_static_value_is_refused_as_jax_jit_refuses_it():
    with pytest.raises(ValueError, match="Non-hashable static arguments are not supported"):
        jax.jit(scaled_sum, static_argnums=1)(X, [1, 2])
    with pytest.raises(ValueError, match=r"Non-hashable static arguments are not supported.*'n' of"):
        ooc_jit(scaled_sum, budget="1GiB", static_argnums=1)(X, [1, 2])


def test_a_string_leaf_is_named_by_its_path_and_static_argnums_is_suggested():
    def step(d):
        return d["x"].sum()

    batch = {"x": X, "name": "abc"}
    with pytest.raises(TypeError, match=r"path d\['name'\]") as from_jax:
        jax.jit(step)(batch)
    with pytest.raises(TypeError, match=r"path d\['name'\](.|\n)*static_argnums") as from_ooc:
        ooc_jit(step, budget="1GiB")(batch)
    assert type(from_ooc.value) is type(from_jax.value)


def test_ooc_jit_without_a_function_is_a_decorator_factory():
    @ooc_jit(budget="1GiB", static_argnames="n")
    def step(x, n):
        return (x * n).sum()

    assert float(step(X, n=3)) == float(jax.jit(scaled_sum, static_argnames="n")(X, n=3)) == 84.0
    assert step.__name__ == "step" and step.plan(X, n=3).peak_bytes > 0


def test_a_static_argument_passed_by_position_then_by_keyword_is_planned_once(caplog):
    capture_stages(caplog)
    step = ooc_jit(scaled_sum, budget="1GiB", static_argnums=1)
    assert float(step(X, 3)) == float(step(X, n=3)) == 84.0
    assert plans_made(caplog) == 1
    step(X, 4)  # another static value is another signature
    assert plans_made(caplog) == 2


@pytest.mark.parametrize("collecting", [True, False])
def test_tracing_and_planning_leave_the_cyclic_collector_as_the_caller_had_it(collecting):
    # The trace and the build pause it while they run, also where the plan is refused.
    (gc.enable if collecting else gc.disable)()
    try:
        assert float(ooc_jit(scaled_sum, budget="1GiB")(X, 3.0)) == 84.0
        assert gc.isenabled() is collecting
        with pytest.raises(BudgetInfeasibleError, match="too small"):
            ooc_jit(lambda x: jnp.outer(x, x).sum(), budget=64)(X)
        assert gc.isenabled() is collecting
    finally:
        gc.enable()
