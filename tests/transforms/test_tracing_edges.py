"""Steps whose jaxprs hold less common things, at a budget that makes values move: nested jit calls
closing over constant arrays, ordered effects, and token values."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import AbstractToken

import oocjax
from oocjax import OocError, ooc_jit

KiB = 1024
PARAMS = [jnp.full((128, 128), 0.01 * (i + 1), dtype=jnp.float32) for i in range(4)]
X = jnp.linspace(-1, 1, 256 * 128).reshape(256, 128)
# The same arguments in host memory, as a caller passes state a step may stream in (passed in device
# memory and not donated, they would stay there, and at the tight budgets below not fit).
HOST_PARAMS, HOST_X = oocjax.to_host(PARAMS), oocjax.to_host(X)
SCALE = jnp.linspace(0.5, 1.5, 128 * 128, dtype=jnp.float32).reshape(128, 128)


def train(layer):
    """An SGD step of a 4-layer tanh MLP whose layers are ``layer(h, w)``."""

    def step(params, x):
        def loss_fn(params):
            h = x
            for w in params:
                h = layer(h, w)
            return jnp.mean(h**2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [w - 0.1 * g for w, g in zip(params, grads)], loss

    return step


def tight(step):
    """``step`` under ooc_jit at 40% of its in-core estimate: values must move."""
    in_core = ooc_jit(step, budget=2**62).plan(PARAMS, X).baseline_peak_bytes
    return ooc_jit(step, budget=in_core * 2 // 5, min_offload_bytes=4 * KiB)


def assert_same_results(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), actual, expected)


@jax.jit
def scaled_layer(h, w):
    return jnp.tanh(h @ (w * SCALE))  # SCALE is closed over: a constant of the inner jaxpr


def test_a_nested_jit_closing_over_a_constant_array_gives_jax_jits_numbers_when_values_move():
    step = train(scaled_layer)
    inner = [e for e in jax.jit(step).trace(PARAMS, X).jaxpr.eqns if e.primitive.name == "jit"]
    assert any(e.params["jaxpr"].consts for e in inner), "the forward calls keep SCALE as their own constant"
    ooc = tight(step)
    plan = ooc.plan(HOST_PARAMS, HOST_X)
    assert plan.offloads and len(plan.segments) > 1
    assert any(b.kind == "constant" and b.nbytes == SCALE.nbytes for b in plan.program.buffers)
    assert plan.executed_peak_bytes <= plan.budget_bytes
    assert_same_results(ooc(HOST_PARAMS, HOST_X), jax.jit(step)(PARAMS, X))


def test_an_ordered_effect_runs_once_per_call_in_order_when_values_move(capfd):
    def printing_layer(h, w):
        out = jnp.tanh(h @ w)
        jax.debug.print("layer mean {m}", m=out.mean(), ordered=True)
        return out

    step = train(printing_layer)
    expected = jax.jit(step)(PARAMS, X)
    jax.effects_barrier()
    reference = capfd.readouterr().out.splitlines()
    assert len(reference) == 4  # one line per layer of the forward pass
    ooc = tight(step)
    plan = ooc.plan(HOST_PARAMS, HOST_X)
    assert plan.offloads and len(plan.segments) > 1
    actual = ooc(HOST_PARAMS, HOST_X)
    jax.effects_barrier()
    assert capfd.readouterr().out.splitlines() == reference
    assert_same_results(actual, expected)


def token_step(params, x):
    """Creates a token before the forward pass and joins it with another after the update, so a
    token-typed value lives across the whole step. The join is returned: a token nobody reads is
    dead code, which the analysis drops."""
    first = jax.lax.create_token()
    new_params, loss = train(lambda h, w: jnp.tanh(h @ w))(params, x)
    return new_params, loss, jax.lax.after_all(first, jax.lax.create_token())


def test_a_token_living_across_segments_is_refused_by_name():
    equations = jax.jit(token_step).trace(PARAMS, X).jaxpr.eqns
    assert any(isinstance(v.aval, AbstractToken) for e in equations for v in e.outvars)
    # At this budget the same step without tokens is cut into segments, and the first token is
    # created before the first segment's work and joined after the last: it crosses a boundary.
    assert len(tight(train(lambda h, w: jnp.tanh(h @ w))).plan(HOST_PARAMS, HOST_X).segments) > 1
    buffers = ooc_jit(token_step, budget=2**62).plan(PARAMS, X).program.buffers
    first_token = next(i for i, b in enumerate(buffers) if b.label.startswith("output of create_token"))
    ooc = tight(token_step)
    for attempt in (ooc.plan, ooc):  # refused when planned, and again when called
        with pytest.raises(OocError) as caught:
            attempt(HOST_PARAMS, HOST_X)
        assert type(caught.value) is OocError
        message = str(caught.value)
        assert message.startswith("a token value (from jax.lax.create_token or after_all; buffers [")
        crossing = re.search(r"buffers \[([\d, ]+)\]", message).group(1)
        assert first_token in {int(b) for b in crossing.split(", ")}
        assert "lives across the separately compiled segments" in message
        assert "raise the budget to the in-core estimate" in message


def test_a_token_is_sized_as_nothing_and_the_plain_program_runs_it():
    # Where nothing has to move, ooc_jit runs jax.jit's own program: tokens are no problem there.
    ooc = ooc_jit(token_step, budget=2**62)
    plan = ooc.plan(PARAMS, X)
    assert plan.jaxpr is plan.source_jaxpr
    made = ("output of create_token", "output of after_all")  # and the join, returned as result[2]
    tokens = [b for b in plan.program.buffers if b.label.startswith(made) or b.label == "result[2]"]
    assert len(tokens) == 3 and all(b.nbytes == 0 for b in tokens)
    *actual, token = ooc(PARAMS, X)
    *expected, expected_token = jax.jit(token_step)(PARAMS, X)
    assert_same_results(actual, expected)
    assert type(token) is type(expected_token)  # a token comes back, as from jax.jit
