"""Donated arguments are deleted after a successful call, as ``jax.jit`` deletes them, whether the plan
copied them, a segment consumed them, or neither; a leaf the step returns as it is stays alive."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oocjax
from oocjax import ooc_jit
from oocjax.transforms.execute import observe_segments
from tests.support import zoo

FRACTIONS = {"moves nothing": 1.0, "moves values": 0.35}
# Planned by layer, the transformer keeps its state on the device at 35% (its activations move); at
# 30% its optimizer state streams, as the test of the second call needs.
STATE_MOVES = {"transformer_dropout_adamw": 0.3}


@functools.cache
def in_core_estimate(name: str) -> int:
    case = zoo.case(name)
    return ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes


def fresh(state):
    return jax.tree.map(lambda x: x.copy(), state)


def alive_leaves(tree) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path) for path, x in leaves if not x.is_deleted()]


def donating_step(name: str, budget_name: str):
    case = zoo.case(name)
    fraction = (
        STATE_MOVES.get(name, FRACTIONS[budget_name]) if budget_name == "moves values" else FRACTIONS[budget_name]
    )
    budget = int(in_core_estimate(name) * fraction)
    step = ooc_jit(case.step, budget=budget, donate_argnums=0, recompute="off", min_offload_bytes=4096)
    plan = step.plan(case.state, case.batches[0])
    assert bool(plan.moved_bytes) == (budget_name == "moves values"), plan  # the premise of the budget's name
    return step


def test_jax_jit_deletes_every_donated_leaf_of_the_zoos_states():
    for case in map(zoo.case, zoo.DONATED):
        state = fresh(case.state)
        jax.jit(case.step, donate_argnums=0)(state, case.batches[0])
        assert alive_leaves(state) == [], case.name


@pytest.mark.parametrize("budget_name", list(FRACTIONS))
@pytest.mark.parametrize("name", zoo.DONATED)
def test_every_donated_leaf_is_deleted_after_one_call_and_after_two(name, budget_name):
    case, step = zoo.case(name), donating_step(name, budget_name)
    state = fresh(case.state)
    for call, batch in enumerate(case.batches[:2], start=1):
        given = state
        state, _ = step(given, batch)
        assert alive_leaves(given) == [], f"alive after call {call}"
        assert len(alive_leaves(state)) == len(jax.tree.leaves(state)), "the new state is whole"
    if budget_name == "moves values":
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state)}
        assert "pinned_host" in kinds, "the second call was given state kept on host"


@pytest.mark.parametrize("name", zoo.DONATED)
def test_state_kept_on_host_given_to_a_step_that_moves_nothing_is_deleted_after_its_call(name):
    case = zoo.case(name)
    state = oocjax.to_host(fresh(case.state))
    new_state, _ = donating_step(name, "moves nothing")(state, case.batches[0])
    assert alive_leaves(state) == []
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new_state)} == {"device"}


def first_layer_then_its_own_work(state, x):
    """Reads the donated ``w`` once, first; no result has its shape and type, so XLA cannot write one
    over it and leaves its donation unused."""
    h = jnp.tanh(x @ state["w"])
    for _ in range(6):
        h = jnp.tanh(h @ h.T @ h)
    return h.sum()


def test_a_donated_leaf_no_result_can_reuse_is_deleted_at_its_last_use_as_the_plan_counts_it():
    w, x = jnp.ones((64, 256)) / 64, jnp.ones((512, 64))
    step = ooc_jit(first_layer_then_its_own_work, budget="1GiB", donate_argnums=0, min_segments=3)
    state = {"w": w.copy()}
    plan = step.plan(state, x)
    (w_buffer,) = [b for b, buffer in enumerate(plan.program.buffers) if buffer.label == "argument state['w']"]
    last_use = next(i for i, segment in enumerate(plan.segments) if w_buffer in segment.donated)
    assert last_use < len(plan.segments) - 1, "the premise: segments run after w's last use"
    deleted_at_launch = []
    with observe_segments(lambda launch: deleted_at_launch.append(state["w"].is_deleted())):
        loss = step(state, x)
    assert deleted_at_launch == [i > last_use for i in range(len(plan.segments))]
    np.testing.assert_allclose(float(loss), float(jax.jit(first_layer_then_its_own_work)({"w": w}, x)), rtol=1e-6)


def sgd_with_a_frozen_table(state, x):
    """Trains ``w``; returns the donated ``table`` as it is."""
    w, table = state["w"], state["table"]

    def loss(w):
        h = x
        for i in range(4):
            h = jnp.tanh(h @ w[i] + table[i])
        return (h**2).mean()

    value, grad = jax.value_and_grad(loss)(w)
    return {"w": w - 0.1 * grad, "table": table}, value


def test_a_donated_leaf_the_step_returns_as_it_is_stays_alive_and_the_others_are_deleted():
    w = jax.random.normal(jax.random.key(0), (4, 64, 64)) / 8
    table, x = jnp.ones((4, 64)), jax.random.normal(jax.random.key(1), (2048, 64))
    in_core = ooc_jit(sgd_with_a_frozen_table, budget=2**62).plan({"w": w, "table": table}, x).baseline_peak_bytes
    step = ooc_jit(
        sgd_with_a_frozen_table, budget=int(in_core * 0.5), donate_argnums=0, recompute="off", min_offload_bytes=4096
    )
    state = {"w": w.copy(), "table": table.copy()}
    assert step.plan(state, x).offloads
    expected = jax.jit(sgd_with_a_frozen_table)({"w": w, "table": table}, x)
    new_state, value = step(state, x)
    assert new_state["table"] is state["table"], "the chain returns the caller's array itself"
    assert alive_leaves(state) == ["['table']"]
    np.testing.assert_array_equal(np.asarray(new_state["table"]), np.asarray(table))
    np.testing.assert_allclose(np.asarray(new_state["w"]), np.asarray(expected[0]["w"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(value), float(expected[1]), rtol=1e-6)
