"""One chain, four readers: what the executor runs, what the plan's jaxpr shows, what the replay
checks and what the printer lists are the same operations in the same order, for random steps
and budgets."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oocjax import ooc_jit
from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.chain import OPERATION_NAMES, CopyIn, CopyOut, Launch, Wait, chain_of, check_segments

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def random_step(widths: list[int]):
    """An MLP training step over ``widths``: its loss, and the parameters after one SGD update."""

    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return (x**2).mean()

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return [w - 0.1 * g for w, g in zip(params, grads)], value

    keys = jax.random.split(jax.random.key(len(widths)), len(widths))
    params = [jax.random.normal(k, (a, b)) / a**0.5 for k, a, b in zip(keys[1:], widths, widths[1:])]
    return step, params, jax.random.normal(keys[0], (64, widths[0]))


def expanded(chain) -> list[tuple[str, int]]:
    """The chain's operations one buffer at a time, as the view has one equation per transfer."""
    out = []
    for op in chain.operations:
        if isinstance(op, Launch):
            out.append(("segment", op.segment))
        else:
            out += [(OPERATION_NAMES[type(op)], b) for b in op.buffers]
    return out


def printed_lines(plan, chain) -> list[str]:
    """How each operation's line begins in ``plan.pretty_jaxpr()``, less the runs of segments it
    shows once (``... segments 7..22: the same 4 segments 4 more times``)."""
    elided = set()
    for first, last in re.findall(r"^\.\.\. segments (\d+)\.\.(\d+):", plan.pretty_jaxpr(), re.MULTILINE):
        elided |= set(range(int(first), int(last) + 1))
    begins = {Wait: "  wait  {}", CopyIn: "  >>>   prefetch {}", CopyOut: "  <<<   offload {}"}
    labels = [b.label for b in plan.program.buffers]
    lines = []
    for op in chain.operations:
        if op.segment in elided:
            continue
        if isinstance(op, Launch):
            lines.append(f"segment {op.segment}: ")
        else:
            lines += [begins[type(op)].format(labels[b]) + " (" for b in op.buffers]
    return lines


def shown(plan) -> list[tuple[str, str]]:
    """The plan's jaxpr's top-level equations, as (what, whose label or segment number)."""
    found = []
    for eqn in plan.jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "jit":
            found.append(("segment", int(eqn.params["name"].removeprefix("segment_"))))
            continue
        named = re.search(r"oocjax\.(wait|prefetch|offload)\((.*)\)", str(eqn.source_info.name_stack))
        if named:
            found.append((named[1], named[2]))
    return found


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.sampled_from([48, 96, 160]), min_size=3, max_size=6),
    fraction=st.sampled_from([0.35, 0.5, 0.7, 1.0]),
)
def test_the_executor_the_view_the_replay_and_the_printer_follow_one_chain(widths, fraction):
    step, params, x = random_step(widths)
    in_core = ooc_jit(step, budget=2**62).plan(params, x).baseline_peak_bytes
    ooc = ooc_jit(step, budget=int(fraction * in_core), donate_argnums=(0,), min_offload_bytes=4096, min_segments=2)
    try:
        plan = ooc.plan(params, x)
    except BudgetInfeasibleError:
        return  # below the smallest feasible budget: the error names it (tested elsewhere)
    chain = plan.chain
    (planner,) = ooc._planners.values()
    assert planner.built.executor.chain is chain  # what runs is what the plan shows
    assert chain.operations == chain_of(plan.program, plan.schedule, plan.segments).operations
    assert check_segments(plan.program, plan.schedule, plan.segments) == ()
    labels = [b.label.replace("/", "|") for b in plan.program.buffers]
    assert shown(plan) == [(what, b if what == "segment" else labels[b]) for what, b in expanded(chain)]
    lines = [line for line in plan.pretty_jaxpr().splitlines() if not line.startswith(("...", "  +++"))]
    expected = printed_lines(plan, chain)
    assert len(lines) == len(expected) and all(map(str.startswith, lines, expected)), (lines, expected)
    expected = jax.jit(step)(params, x)[1]
    np.testing.assert_allclose(ooc(params, x)[1], expected, rtol=1e-5)


def test_each_segment_waits_then_prefetches_then_launches_then_offloads():
    step, params, x = random_step([160, 160, 160, 160, 160])
    in_core = ooc_jit(step, budget=2**62).plan(params, x).baseline_peak_bytes
    plan = ooc_jit(step, budget=int(0.4 * in_core), donate_argnums=(0,), min_offload_bytes=4096).plan(params, x)
    chain = chain_of(plan.program, plan.schedule, plan.segments)
    order = {Wait: 0, CopyIn: 1, Launch: 2, CopyOut: 3}
    assert any(isinstance(op, CopyOut) for op in chain.operations), "the budget should make the plan move"
    for i, operations in chain.by_segment():
        kinds = [order[type(op)] for op in operations]
        assert kinds == sorted(set(kinds)) and 2 in kinds, (i, operations)


def test_every_slot_is_dropped_at_most_once_and_never_read_after_its_drop():
    step, params, x = random_step([96, 160, 96, 160])
    in_core = ooc_jit(step, budget=2**62).plan(params, x).baseline_peak_bytes
    plan = ooc_jit(step, budget=int(0.4 * in_core), donate_argnums=(0,), min_offload_bytes=4096).plan(params, x)
    chain = chain_of(plan.program, plan.schedule, plan.segments)
    host, dropped = chain.host_offset, set()
    for op in chain.operations:
        if isinstance(op, Launch):
            reads = set(op.inputs)
        elif isinstance(op, CopyOut):
            reads = set(op.buffers)
        else:
            reads = {b + host for b in op.buffers}
        assert not reads & dropped, op
        assert not set(op.dropped) & dropped and set(op.dropped) <= reads, op
        dropped |= set(op.dropped)
        if isinstance(op, Launch):
            dropped -= set(op.outputs)
        elif isinstance(op, CopyIn):
            dropped -= set(op.buffers)
        elif isinstance(op, CopyOut):
            dropped -= {b + host for b in op.buffers}
    assert not dropped & {s for s in chain.result_slots if s is not None}
