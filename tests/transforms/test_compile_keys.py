"""Segments share a compiled program exactly when their jaxprs' keys are equal (``program_key``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oocjax.transforms.compile import program_key


def key_of(f, *args):
    return program_key(jax.make_jaxpr(f)(*args).jaxpr)


x, y = jnp.ones((4, 3)), jnp.ones((4, 3))


def test_the_same_step_traced_twice_has_one_key():
    def f(a, b):
        return jnp.tanh(a @ b.T).sum(axis=0) * 2.0

    assert key_of(f, x, y) == key_of(f, x, y)
    assert hash(key_of(f, x, y)) == hash(key_of(f, x, y))


def test_programs_that_differ_anywhere_have_different_keys():
    base = key_of(lambda a, b: (a - b).sum(axis=0), x, y)
    assert key_of(lambda a, b: (b - a).sum(axis=0), x, y) != base  # how values flow
    assert key_of(lambda a, b: (a - b).sum(axis=1), x, y) != base  # a parameter
    assert key_of(lambda a, b: (a + b).sum(axis=0), x, y) != base  # a primitive
    assert key_of(lambda a, b: (a - b).sum(axis=0), x[:2], y[:2]) != base  # a shape
    assert key_of(lambda a, b: (a - b).sum(axis=0), x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)) != base


def test_literals_and_parameters_equal_in_python_but_not_in_value_have_different_keys():
    assert key_of(lambda a: a * 0.0, x) != key_of(lambda a: a * -0.0, x)
    assert key_of(lambda a: a + np.float32(1.0), x) != key_of(lambda a: a + np.float32(2.0), x)
    assert key_of(lambda a: jax.lax.cumsum(a, reverse=True), x) != key_of(lambda a: jax.lax.cumsum(a), x)


def test_a_nested_jaxpr_is_keyed_by_what_it_computes():
    def with_loop(step):
        return lambda a: jax.lax.fori_loop(0, 3, lambda i, c: step(c), a)

    assert key_of(with_loop(jnp.sin), x) == key_of(with_loop(jnp.sin), x)
    assert key_of(with_loop(jnp.sin), x) != key_of(with_loop(jnp.cos), x)


@pytest.mark.parametrize("case", ["transformer_dropout_adamw", "cnn_batchnorm_momentum"])
def test_segments_read_off_the_flat_program_share_programs_exactly_when_their_traced_jaxprs_match(case):
    """``segment_key`` (no tracing) against each traced segment's printed jaxpr, at 30% of
    in-core: the transformer recomputes, moves and cuts alike layers alike; the CNN's ReLUs are
    ``custom_jvp`` calls, each with its own derivative rule (which no segment compiles)."""
    from oocjax import ooc_jit
    from oocjax.transforms.compile import segment_key, segment_specs
    from tests.support import zoo

    case = getattr(zoo, case)()
    in_core = ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes
    step = ooc_jit(case.step, budget=int(in_core * 0.3), min_offload_bytes=4096)
    segments = step.plan(case.state, case.batches[0]).segments
    (planner,) = step._planners.values()  # the chain's flat program and segment functions
    flat, functions = planner.built.flat, planner.built.segment_functions
    read = [segment_key(flat, s) for s in segments]
    traced = []
    for s, f in zip(segments, functions, strict=True):
        body = f.trace(*segment_specs(flat, s)).jaxpr
        traced.append((str(body.jaxpr), tuple(map(id, body.consts))))

    def partition(keys):
        first = {}
        return [first.setdefault(k, i) for i, k in enumerate(keys)]

    assert partition(read) == partition(traced)
    assert len(set(read)) < len(read)  # some segments do share a program
