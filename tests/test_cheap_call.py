"""A call like an earlier one (the same arrays' types, shardings and memory kinds) finds its plan
without deriving the step's signature again, and any other call still gets its own."""

import jax
import jax.numpy as jnp
import numpy as np

from oocjax import ooc_jit, to_host
from oocjax.arguments import ArgumentSpec


def counting_signatures(monkeypatch) -> list:
    made, signature = [], ArgumentSpec.signature

    def counted(self, args, kwargs):
        made.append(args)
        return signature(self, args, kwargs)

    monkeypatch.setattr(ArgumentSpec, "signature", counted)
    return made


def loss(w, x):
    return jnp.tanh(x @ w).sum()


def test_calls_alike_derive_the_signature_once(monkeypatch):
    made = counting_signatures(monkeypatch)
    step, w, x = ooc_jit(loss, budget="1GiB"), jnp.ones((4, 4)), jnp.ones((2, 4))
    for _ in range(3):
        np.testing.assert_allclose(step(w, x), jax.jit(loss)(w, x))
    assert len(made) == 1
    np.testing.assert_allclose(step(w, jnp.ones((3, 4))), jax.jit(loss)(w, jnp.ones((3, 4))))  # another shape
    assert len(made) == 2


def test_a_leaf_moved_to_host_memory_is_another_call_with_its_own_plan(monkeypatch):
    made = counting_signatures(monkeypatch)
    step, w, x = ooc_jit(loss, budget="1GiB"), jnp.ones((4, 4)), jnp.ones((2, 4))
    step(w, x)
    np.testing.assert_allclose(step(to_host(w), x), jax.jit(loss)(w, x))
    assert len(made) == 2 and len(step._planners) == 2


def test_a_call_with_a_leaf_that_is_not_an_array_takes_the_full_path_every_time(monkeypatch):
    made = counting_signatures(monkeypatch)

    def scaled(w, s):
        return (w * s).sum()

    step, w = ooc_jit(scaled, budget="1GiB"), jnp.ones((4, 4))
    for s in (2.0, 3.0):
        np.testing.assert_allclose(step(w, s), jax.jit(scaled)(w, s))
    assert len(made) == 2 and len(step._traces) == 1
