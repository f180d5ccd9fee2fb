"""Random bits in segments: Threefry lowered unrolled on the CPU, the same bits as jax's loop.

XLA:CPU compiles jax's rolled Threefry loop about ten times slower than the unrolled rounds, and a
chain has several programs that make random bits where ``jax.jit`` has one (``compat.unrolled_threefry``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from oocjax import ooc_jit
from oocjax.transforms import compat as jc


def dropout(key, x):
    return jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 3), 0.9, x.shape), x / 0.9, 0.0)


def compiled_text(lowered) -> str:
    return lowered.compile().as_text()


def test_unrolled_threefry_makes_the_same_bits_without_a_loop_and_restores_jaxs_lowering():
    key, x = jax.random.key(0), jnp.arange(4096.0).reshape(64, 64)
    with jc.unrolled_threefry():
        unrolled = jax.jit(dropout).lower(key, x)
    jax.clear_caches()
    rolled = jax.jit(dropout).lower(key, x)  # after the block: jax's own lowering again
    assert " while(" not in compiled_text(unrolled)
    assert " while(" in compiled_text(rolled)
    np.testing.assert_array_equal(unrolled.compile()(key, x), rolled.compile()(key, x))


def test_segments_of_a_dropout_step_make_random_bits_without_a_loop_and_match_jax_jit():
    optimizer = optax.adam(1e-2)
    params = {"w1": jnp.ones((64, 128)) / 8, "w2": jnp.ones((128, 8)) / 11}

    def step(state, batch):
        params, opt_state, key = state
        key, used = jax.random.split(key)

        def loss(p):
            h = dropout(used, jnp.tanh(batch @ p["w1"]))
            return jnp.mean((dropout(jax.random.fold_in(used, 1), h) @ p["w2"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return (optax.apply_updates(params, updates), opt_state, key), value

    state = (params, optimizer.init(params), jax.random.key(1))
    batch = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    expected = jax.jit(step)(state, batch)
    stepped = ooc_jit(step, budget="1GiB", min_segments=3, min_segment_flops=0)
    got = stepped(state, batch)
    (planner,) = stepped._planners.values()
    programs = {id(p): p for p in planner.built.programs}.values()
    assert len(planner.built.programs) >= 3
    assert sum("shift-right-logical" in p.as_text() for p in programs) >= 1  # some segment makes random bits
    assert not any(" while(" in p.as_text() for p in programs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_inner_block_ending_leaves_the_outer_one_unrolled():
    key, x = jax.random.key(0), jnp.ones((8, 8))
    with jc.unrolled_threefry():
        with jc.unrolled_threefry():  # another thread's compile, say
            pass
        jax.clear_caches()
        assert " while(" not in compiled_text(jax.jit(dropout).lower(key, x))
    jax.clear_caches()
    assert " while(" in compiled_text(jax.jit(dropout).lower(key, x))
