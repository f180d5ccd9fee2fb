"""Layers are found on models written any way: by name where the name stack numbers them, by the
program's structure where it does not (``transforms.layers``).

The decoder of ``examples/decoders.py`` is written four ways (Flax auto names, explicit numeric names
under a parent, NNX with a list of blocks, a plain function over a list of weight dicts). A layer
found is checked against the model's own layers through the parameters it reads: forward layer
``i`` reads all of block ``i``'s parameters and no other block's, backward layer ``i`` reads block
``depth - 1 - i``'s.
"""

from __future__ import annotations

import re
from itertools import pairwise

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.decoders import WAYS, decoder_case
from oocjax.transforms.flatten import flatten
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.reorder import updates_by_layer_of
from tests.support import more_ways

DEPTH = 4
# The block index in a parameter's path: Block_3, h/'3', blocks[3].
_BLOCK = re.compile(r"\['Block_(\d+)'\]|\['h'\]\['(\d+)'\]|\['(?:blocks|layers)'\]\[(\d+)\]")


def traced(step, *args):
    closed = jax.make_jaxpr(step)(*args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    return flatten(closed), paths


def block_of(path: str) -> int | None:
    match = _BLOCK.search(path) if path.startswith("[0][0]") else None  # parameters, not optimizer state
    return None if match is None else int(next(g for g in match.groups() if g is not None))


def blocks_read(flat, paths, start: int, stop: int) -> set[int]:
    return {
        block_of(paths[ref])
        for fe in flat.equations[start:stop]
        for ref in fe.inputs
        if type(ref) is int and ref < flat.num_inputs and block_of(paths[ref]) is not None
    }


@pytest.mark.parametrize("way", WAYS)
def test_the_layers_found_are_the_models_blocks_forward_and_backward(way):
    flat, paths = traced(*decoder_case(way, DEPTH))
    runs = layer_runs(flat)
    forward = [r for r in runs if not r[2].startswith("transpose")]
    backward = [r for r in runs if r[2].startswith("transpose")]

    assert len(forward) == DEPTH and len(backward) == DEPTH
    assert all(a < y for a, y, _ in runs) and all(y1 <= a2 for (_, y1, _), (a2, _, _) in pairwise(runs))
    assert [blocks_read(flat, paths, a, y) for a, y, _ in forward] == [{i} for i in range(DEPTH)]
    assert [blocks_read(flat, paths, a, y) for a, y, _ in backward] == [{i} for i in reversed(range(DEPTH))]
    # Every read of a block's parameters in the forward pass lies inside that block's run.
    for i, (a, y, _) in enumerate(forward):
        assert blocks_read(flat, paths, forward[0][0], a) <= set(range(i))
        assert blocks_read(flat, paths, y, forward[-1][1]) <= set(range(i + 1, DEPTH))


@pytest.mark.parametrize("way", ["local_global", "equinox"])
def test_a_layer_like_the_others_but_not_the_same_is_found_beside_them(way):
    # local_global: the fourth layer attends globally, the three before it within a window (its mask
    # takes fewer operations); equinox: the first layer's backward also holds the embedding's gradient.
    flat, paths = traced(*more_ways.case(way, DEPTH))
    runs = layer_runs(flat)
    forward = [r for r in runs if not r[2].startswith("transpose")]
    backward = [r for r in runs if r[2].startswith("transpose")]

    assert len({y - a for a, y, _ in forward + backward}) > 2  # not every layer of a pass is alike
    assert [blocks_read(flat, paths, a, y) for a, y, _ in forward] == [{i} for i in range(DEPTH)]
    assert [blocks_read(flat, paths, a, y) for a, y, _ in backward] == [{i} for i in reversed(range(DEPTH))]


@pytest.mark.parametrize("way", WAYS)
def test_the_optimizer_updates_grouped_by_layer_are_found_as_one_run_per_block(way):
    flat, paths = traced(*decoder_case(way, DEPTH))
    assert not [r for r in layer_runs(flat) if r[2].startswith("update")]  # optax's order: by operation
    grouped = updates_by_layer_of(flat)
    runs = layer_runs(grouped)
    updates = [r for r in runs if r[2].startswith("update")]

    assert len(updates) == DEPTH and updates[0][0] >= max(y for _, y, kind in runs if kind.startswith("transpose"))
    # In the backward pass's order, each reads one block's parameters: the top block's first.
    assert [blocks_read(grouped, paths, a, y) for a, y, _ in updates] == [{i} for i in reversed(range(DEPTH))]
    primitives = [[fe.eqn.primitive.name for fe in grouped.equations[a:y]] for a, y, _ in updates]
    assert all(p == primitives[0] for p in primitives)
    assert sorted(id(fe) for fe in grouped.equations) == sorted(id(fe) for fe in flat.equations)


@pytest.mark.parametrize("way", ["linen_auto", "linen_named"])
def test_layers_named_by_the_model_are_called_by_its_names(way):
    flat, _ = traced(*decoder_case(way, DEPTH))
    kinds = {kind for _, _, kind in layer_runs(flat)}
    assert kinds == ({"Block", "transpose Block"} if way == "linen_auto" else {"h", "transpose h"})


@pytest.mark.parametrize("way", ["nnx", "plain"])
def test_layers_without_names_are_found_by_structure(way):
    flat, _ = traced(*decoder_case(way, DEPTH))
    assert {kind for _, _, kind in layer_runs(flat)} == {"layer", "transpose layer"}


def test_layers_alike_have_alike_equations():
    flat, _ = traced(*decoder_case("plain", DEPTH))
    forward = [r for r in layer_runs(flat) if r[2] == "layer"]
    primitives = [[fe.eqn.primitive.name for fe in flat.equations[a:y]] for a, y, _ in forward]
    assert all(p == primitives[0] for p in primitives)


class Funnel(nn.Module):
    """Dense layers of different widths: no two alike."""

    @nn.compact
    def __call__(self, x):
        for width in (48, 32, 16, 8):
            x = nn.relu(nn.Dense(width)(x))
        return x.sum()


def plain_funnel(weights, x):
    for w in weights:
        x = jnp.tanh(x @ w)
    return x.sum()


def sgd_step(loss):
    optimizer = optax.sgd(0.1)

    def step(state, x):
        params, opt_state = state
        grads = jax.grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    return step, optimizer


def test_a_model_without_repeated_layers_has_none():
    x = jnp.ones((4, 64))
    model = Funnel()
    step, optimizer = sgd_step(lambda p, x: model.apply(p, x))
    params = model.init(jax.random.key(0), x)
    flat, _ = traced(step, (params, optimizer.init(params)), x)
    assert layer_runs(flat) == ()

    widths = [64, 48, 32, 16, 8]
    weights = [jnp.ones((m, n)) for m, n in pairwise(widths)]
    step, optimizer = sgd_step(plain_funnel)
    flat, _ = traced(step, (weights, optimizer.init(weights)), x)
    assert layer_runs(flat) == ()


def test_layers_of_a_few_operations_are_too_small_to_cut_by():
    step, optimizer = sgd_step(plain_funnel)
    weights = [jnp.ones((64, 64)) / 64 for _ in range(6)]
    x = jnp.ones((4, 64))
    flat, _ = traced(step, (weights, optimizer.init(weights)), x)
    # Each layer is two equations forward (dot, tanh), three backward: fewer than MIN_LAYER_EQUATIONS.
    assert layer_runs(flat) == ()


def test_each_layers_update_runs_in_its_backward_layers_program_and_trains_as_jax_jit():
    """With the state donated, each parameter's update follows its gradient: a layer's backward pass
    and its update are one run of equations, alike from layer to layer, so they run one program."""
    from oocjax import ooc_jit

    step, state, batch = decoder_case("linen_named", DEPTH)
    budget = int(ooc_jit(step, budget=2**62).plan(state, batch).baseline_peak_bytes * 0.3)
    expected = jax.jit(step)(state, batch)
    wrapped = ooc_jit(step, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    got = wrapped(jax.tree.map(jnp.copy, state), batch)

    (planner,) = wrapped._planners.values()
    plan, program = planner.built.plan, planner.built.plan.program
    backward = [(a, y) for a, y, kind in plan.layers if kind.startswith("transpose")]
    assert len(backward) == DEPTH and not any(kind.startswith("update") for _, _, kind in plan.layers)
    # Every new parameter of a layer is written inside that layer's backward run.
    new = [b for b, buffer in enumerate(program.buffers) if buffer.aliased_input is not None]
    outside = [b for b in new if not any(a <= program.uses.defined_at[b] < y for a, y in backward)]
    assert len(outside) < len(new) / 4
    assert not any("['h']" in program.buffers[b].label for b in outside)  # the embedding's, the head's, ...
    starts = [s.start for s in plan.segments]
    programs = {id(planner.built.programs[starts.index(a)]) for a, _ in backward if a in starts}
    assert len(programs) == 1
    # AdamW's first step moves each parameter by about its learning rate (1e-3) whatever the
    # gradient's size: where a gradient is rounding noise (the key bias's is zero but for rounding),
    # programs that round otherwise move it otherwise (1.2e-4 in the traced order too).
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(expected)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-4)


@pytest.mark.parametrize("way", ["linen_auto", "linen_named", "nnx"])
def test_the_backward_layers_run_one_program_the_top_and_bottom_ones_included(way):
    """Backward layers alike run one compiled program each, and so do the updates, whichever way the
    plan recomputes: the selector's choices are made alike in them (a bias gradient recomputed for
    the updates of two of four backward layers left those two with programs of their own); the top
    one, whose program measured 7 KB over the budget with what the plan held when it starts, is
    planned around rather than cut in two; and the bottom one's copy of the embedding output,
    recomputed for it, runs before it rather than inside it. The step still trains as ``jax.jit``'s."""
    from oocjax import ooc_jit

    step, state, batch = decoder_case(way, DEPTH)
    budget = int(ooc_jit(step, budget=2**62).plan(state, batch).baseline_peak_bytes * 0.3)
    wrapped = ooc_jit(step, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    plan = wrapped.plan(state, batch)
    assert plan.recomputed

    (planner,) = wrapped._planners.values()
    ranges = [(s.start, s.stop) for s in plan.segments]
    runs = plan.layers  # the layers as the plan's program has them
    backward = [(a, y) for a, y, kind in runs if kind.startswith("transpose")]
    updates = [(a, y) for a, y, kind in runs if kind.startswith("update")]
    for alike in (backward, updates) if updates else (backward,):
        assert all(run in ranges for run in alike), (alike, ranges)
        assert len({id(planner.built.programs[ranges.index(run)]) for run in alike}) == 1
    assert len(plan.attempts) == 1 and plan.executed_peak_bytes <= budget
    expected = jax.jit(step)(state, batch)
    got = wrapped(jax.tree.map(jnp.copy, state), batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-4)
