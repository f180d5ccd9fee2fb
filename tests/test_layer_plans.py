"""Plans by layer: where the training state is larger than the budget, each layer's parameters are
fetched once for its forward and once for its backward, its optimizer state once and sent back
once, what its forward saves is gone once its backward has read it, and the copies are issued where
segments begin. Each policy is checked on plans made for a GPU profile (nothing compiled) of the
project's GPT and of models written other ways."""

import functools

import jax
import pytest

from benchmarks.state_offload import DRY_MODEL, abstract_case
from oocjax import Plan, ooc_jit
from oocjax.schedule import check_segments, validate
from tests.support import more_ways

# Budgets as shares of the state, where every layer's state streams through the device (a
# Llama-style layer's own state and activations need half of it to be held whole; at a third of
# its state the encoder's backward, recomputing its layer, has no room to hold a kernel through it,
# and the plan fetches it a third time).
SHARES = {"gpt": 1 / 3, "llama": 1 / 2, "encoder": 1 / 2}


def state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


@functools.cache
def planned(model: str, share: float) -> Plan:
    """The project's GPT (4 layers of width 512) or a model of ``tests.support.more_ways`` (4 layers, one
    example a batch: its state outweighs its activations), planned for an H200 at ``share`` of its
    state."""
    if model == "gpt":
        step, state, batch = abstract_case(DRY_MODEL, scan=False)
    else:
        step, state, batch = more_ways.case(model, 4, batch=1)
        state, batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    budget = int(state_bytes(state) * share)
    return ooc_jit(step, budget=budget, donate_argnums=(0,), min_offload_bytes=4096).plan(state, batch, profile="h200")


PLANS = {model: functools.partial(planned, model, share) for model, share in SHARES.items()}


def roles(plan: Plan):
    """Per step, ``"forward"`` or ``"backward"`` where a layer runs it, else None."""
    role = [None] * len(plan.program.steps)
    for a, y, kind in plan.layers:
        role[a:y] = ["backward" if kind.startswith("transpose ") else "forward"] * (y - a)
    return role


def layer_inputs(plan: Plan) -> tuple[list[int], list[int]]:
    """The arguments kept on host that layers read: those the forward reads too (parameters), and
    those only the backward reads (optimizer state)."""
    role, schedule, uses = roles(plan), plan.schedule, plan.program.uses
    parameters, state = [], []
    for b in sorted(schedule.host_inputs):
        reads = {role[k] for k in uses.read_at[b]}
        if reads <= {"forward", "backward"} and "backward" in reads:
            (parameters if "forward" in reads else state).append(b)
    return parameters, state


@pytest.mark.parametrize("model", PLANS)
def test_a_layers_parameters_are_fetched_once_for_its_forward_and_once_for_its_backward(model):
    # At most: one the device has room to hold from its forward to its backward is fetched once.
    plan = PLANS[model]()
    parameters, _ = layer_inputs(plan)
    assert parameters, "the plan keeps no layer's parameters on host: nothing to check"
    fetches = {plan.program.buffers[b].label: len(plan.schedule.prefetches_by_buffer.get(b, ())) for b in parameters}
    assert set(fetches.values()) <= {1, 2} and 2 in fetches.values(), fetches


@pytest.mark.parametrize("model", PLANS)
def test_a_layers_optimizer_state_is_fetched_once_and_sent_back_once(model):
    plan = PLANS[model]()
    _, state = layer_inputs(plan)
    assert state, "the plan keeps no optimizer state on host: nothing to check"
    schedule, replaced_by = plan.schedule, plan.program.replaced_by
    for b in state:
        new = replaced_by[b]  # the updated moment, written over the old
        assert len(schedule.prefetches_by_buffer.get(b, ())) == 1, plan.program.buffers[b].label
        assert new in schedule.host_outputs and new not in schedule.prefetches_by_buffer
        assert sum(m.buffer == new for m in schedule.offloads) == 1


@pytest.mark.parametrize("model", PLANS)
def test_what_a_layers_forward_saves_is_off_the_device_once_its_backward_has_read_it(model):
    plan = PLANS[model]()
    program, schedule, role = plan.program, plan.schedule, roles(plan)
    ends = {}  # per forward run's step: the end of the backward run of its layer
    forward = [(a, y) for a, y, kind in plan.layers if " " not in kind]
    backward = [(a, y) for a, y, kind in plan.layers if kind.startswith("transpose ")][::-1]
    for (fa, fy), (_, by) in zip(forward, backward, strict=True):
        ends.update((k, by) for k in range(fa, fy))
    saved = [
        b
        for b, buffer in enumerate(program.buffers)
        if buffer.kind == "computed" and program.uses.defined_at[b] in ends
        if any(role[k] == "backward" for k in program.uses.read_at[b])
    ]
    assert saved
    for b in saved:
        held_until = max(stay.end for stay in schedule.device_stays(program, b))
        assert held_until < ends[program.uses.defined_at[b]], program.buffers[b].label


@pytest.mark.parametrize("model, share", [("gpt", 0.8), ("llama", 0.7), ("encoder", 0.7)])
def test_a_plan_by_layer_copies_where_its_units_begin_and_cuts_each_layer_in_few_alike(model, share):
    """Where a layer's state and activations fit the budget, each layer's forward runs as one
    program, and its backward with its update as three at most, cut alike in every layer: the
    copies are issued where the units the plan was made in begin, never inside them."""
    plan = planned(model, share)
    layers = [(a, y) for a, y, _ in plan.layers]
    issued = {p.issue_step for p in plan.schedule.prefetches} | {
        m.done_before_step for m in plan.schedule.offloads if m.done_before_step is not None
    }
    assert plan.schedule.segment_starts and issued <= plan.schedule.segment_starts
    pieces = [sum(a <= s.start < y for s in plan.segments) for a, y in layers]  # segments each layer run starts
    forward = [n for n, (_, _, kind) in zip(pieces, plan.layers) if " " not in kind]
    backward = [n for n, (_, _, kind) in zip(pieces, plan.layers) if kind.startswith("transpose ")]
    assert set(forward) == {1} and max(backward) <= 3 and len(set(backward[1:])) == 1, pieces
    assert not validate(plan.program, plan.schedule) and not check_segments(plan.program, plan.schedule, plan.segments)


def test_a_plan_by_layer_says_its_policy_per_kind_of_layer_and_why_it_was_chosen_over_the_others_timed():
    plan = planned("encoder", 0.7)
    summary = plan.summary()
    assert plan.layer_policy and plan.layer_alternatives
    assert all(f"  {line}" in summary for line in plan.layer_policy)
    assert all(f"  instead of    {line}" in summary for line in plan.layer_alternatives)
    assert all(line.endswith(("slower", "moving more")) for line in plan.layer_alternatives)
    assert Plan.from_json(plan.to_json(full=True)).layer_policy == plan.layer_policy
