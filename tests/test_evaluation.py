"""Evaluating a training state the plan keeps in host memory: an ``ooc_jit`` eval step under the same
budget reads it where it is; ``oocjax.to_device`` brings it back, or says why it cannot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import oocjax
import oocjax.placement
import oocjax.render
from examples.models import MLP
from oocjax import OocError, ooc_jit
from tests.support.zoo import mlp_adam

MODEL = MLP(width=96, depth=6)  # the zoo case's model


@functools.cache
def case():
    return mlp_adam()


@functools.cache
def budget() -> int:
    """35% of the case's in-core estimate."""
    return int(ooc_jit(case().step, budget=2**62).plan(case().state, case().batches[0]).baseline_peak_bytes * 0.35)


def eval_step(state, batch):
    params, _ = state
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(params, x), y).mean()


@functools.cache
def training_step():
    """The zoo's Flax MLP's step at 35% of its in-core estimate, its state donated: planned once, and
    each test trains a state of its own with it."""
    return ooc_jit(case().step, budget=budget(), donate_argnums=0, recompute="off", min_offload_bytes=4096)


def trained_state_kept_on_host():
    """The zoo's Flax MLP after one donated step at 35% of its in-core estimate: the plan keeps part of
    the state (parameters among it) in host memory between steps."""
    train = training_step()
    state, _ = train(jax.tree.map(jnp.copy, case().state), case().batches[0])
    params_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state[0])}
    assert "pinned_host" in params_kinds, "the plan keeps parameters on host"
    return train, state


def kinds(tree) -> list:
    return [x.sharding.memory_kind for x in jax.tree.leaves(tree)]


def test_plain_jax_jit_refuses_the_host_kept_state():
    _, state = trained_state_kept_on_host()
    with pytest.raises(ValueError, match="memory_space of all inputs"):
        jax.jit(eval_step)(state, case().batches[1])


def test_an_ooc_jit_eval_step_under_the_training_budget_reads_host_kept_state_as_jax_jit_reads_device_copies():
    train, state = trained_state_kept_on_host()
    where = kinds(state)
    evaluate = ooc_jit(eval_step, budget=budget(), min_offload_bytes=4096)
    expected = jax.jit(eval_step)(oocjax.to_device(state), case().batches[1])
    for _ in range(2):
        np.testing.assert_allclose(float(evaluate(state, case().batches[1])), float(expected), rtol=1e-6)
    plan = evaluate.plan(state, case().batches[1])
    assert plan.peak_bytes <= budget() and plan.host_inputs, "the parameters are streamed in from host"
    assert not any(x.is_deleted() for x in jax.tree.leaves(state)), "evaluation does not consume the state"
    assert kinds(state) == where, "and leaves it where it was"
    state, _ = train(state, case().batches[2])  # training goes on from the evaluated state
    assert len(jax.tree.leaves(state)) == len(kinds(state))


def test_to_device_brings_host_kept_state_back_for_jax_jit():
    _, state = trained_state_kept_on_host()
    on_device = oocjax.to_device(state)
    assert set(kinds(on_device)) == {"device"}
    assert not any(x.is_deleted() for x in jax.tree.leaves(state)), "the host copy stays the caller's"


def test_to_device_says_what_to_do_when_the_device_has_no_room():
    _, state = trained_state_kept_on_host()
    on_host = [x for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host"]
    with pytest.raises(OocError) as caught:
        oocjax.to_device(state, free_bytes=1024)
    message = str(caught.value)
    assert message.startswith(f"to_device: the {len(on_host)} leaves kept in host memory need ")
    assert "which has 1 KiB free" in message
    assert "ooc_jit(eval_step, budget=...)(state, batch), without donating the state" in message
    assert set(kinds(state)) == {"device", "pinned_host"}, "nothing moved"


def test_the_hint_for_host_kept_state_names_both_ways_to_evaluate_it():
    hint = oocjax.render.HOST_STATE_HINT
    assert "ooc_jit(eval_step, budget=...)(state, batch)" in hint and "oocjax.to_device(state)" in hint
    assert callable(oocjax.to_device)


def test_the_summary_of_a_plan_that_keeps_state_on_host_says_how_to_evaluate_it():
    train, state = trained_state_kept_on_host()
    plan = train.plan(state, case().batches[1])
    assert plan.host_inputs and oocjax.render.HOST_STATE_HINT in plan.summary()
    in_core = ooc_jit(case().step, budget=2**62).plan(case().state, case().batches[0])
    assert oocjax.render.HOST_STATE_HINT not in in_core.summary()
