"""Plans by layer (``schedule.layer_plan``), each policy checked on a synthetic training step whose
layers are known (a forward pass, a loss, the backward pass in reverse, an Adam update per layer):
a test per policy fails where the policy is planned wrong (a parameter fetched once too often, a
moment sent back twice, a layer's activations kept past its backward)."""

import dataclasses

import pytest

from oocjax.schedule import MiB, Offload, replay, simulate
from oocjax.schedule.layer_plan import (
    LayerPlan,
    LayerPolicy,
    layer_rewrite,
    layer_schedule,
    layers_after,
    layers_of,
    plan_layers,
    replan_layers,
)
from oocjax.schedule.segments import cut_segments
from oocjax.schedule.synthetic import layered_training_step

LAYERS, OPS = 4, 4
PROGRAM = layered_training_step(LAYERS, OPS)
FORWARD = [(i * OPS, (i + 1) * OPS, "Block") for i in range(LAYERS)]
BACKWARD = [(LAYERS * OPS + 2 + j * OPS, LAYERS * OPS + 2 + (j + 1) * OPS, "transpose Block") for j in range(LAYERS)]
UPDATES = [(2 * LAYERS * OPS + 2 + j, 2 * LAYERS * OPS + 3 + j, "update Block") for j in range(LAYERS)]
RUNS = (*FORWARD, *BACKWARD, *UPDATES)
LAYER_OF = layers_of(PROGRAM, RUNS)
UNLIMITED = 10**12


def recomputable(step: int) -> bool:
    return PROGRAM.steps[step].name != "adam"


def planned(budget_bytes: int = UNLIMITED, **policy):
    """The rewrite and the schedule of ``policy`` (``LayerPolicy`` fields) at ``budget_bytes``."""
    policy = LayerPolicy(**policy)
    rewrite = layer_rewrite(PROGRAM, LAYER_OF, policy, recomputable)
    layers = layers_after(rewrite, LAYER_OF)
    schedule = layer_schedule(rewrite.program, layers, policy, budget_bytes)
    assert not replay(rewrite.program, schedule)[1]
    return rewrite.program, schedule, layers


def labelled(program, label: str) -> int:
    return next(b for b, buffer in enumerate(program.buffers) if buffer.label == label)


def test_each_forward_run_pairs_with_the_backward_and_update_runs_that_read_its_parameters():
    assert [layer.runs for layer in LAYER_OF] == [
        (FORWARD[i][:2], BACKWARD[LAYERS - 1 - i][:2], UPDATES[i][:2]) for i in range(LAYERS)
    ]


def test_a_run_without_a_partner_is_no_layer():
    assert layers_of(PROGRAM, FORWARD) == ()


def test_fetched_parameters_come_to_the_device_once_for_each_pass_that_reads_them_and_never_go_back():
    program, schedule, layers = planned(parameters="fetched", state="streamed")
    for i, layer in enumerate(layers):
        params = labelled(program, f"params[{i}]")
        fetches = schedule.prefetches_by_buffer[params]
        assert params in schedule.host_inputs and params not in schedule.offload_by_buffer
        # Once before the forward run, the backward run and the update run each: three passes.
        assert [next(j for j, (a, y) in enumerate(layer.runs) if a <= p.use_step < y) for p in fetches] == [0, 1, 2]


def test_kept_parameters_and_state_never_move():
    _, schedule, _ = planned(activations="recomputed")
    assert schedule.moves_nothing


def test_streamed_state_is_fetched_once_and_its_replacement_sent_back_once():
    program, schedule, _ = planned(state="streamed")
    for i in range(LAYERS):
        for moment in ("mu", "nu"):
            old, new = labelled(program, f"{moment}[{i}]"), labelled(program, f"new_{moment}[{i}]")
            assert len(schedule.prefetches_by_buffer[old]) == 1
            assert [m.buffer for m in schedule.offloads].count(new) == 1 and new in schedule.host_outputs
            assert new not in schedule.prefetches_by_buffer
        assert labelled(program, f"params[{i}]") not in schedule.host_inputs


def test_offloaded_activations_are_off_the_device_between_a_layers_forward_and_its_backward():
    program, schedule, layers = planned(activations="offloaded")
    timeline_steps = len(program.steps)
    for i, layer in enumerate(layers):
        (_, fy), (ba, by), _ = layer.runs
        saved = [
            b
            for b in range(len(program.buffers))
            if program.uses.defined_at[b] is not None
            and program.uses.defined_at[b] < fy
            and any(ba <= r < by for r in program.uses.read_at[b])
            and not program.buffers[b].never_moves(MiB)
        ]
        assert saved, i
        for b in saved:
            stays = schedule.device_stays(program, b)
            assert len(stays) == 2, program.buffers[b].label  # the forward's copy, then the one fetched back
            assert stays[0].end < ba and stays[1].start < ba and stays[1].end < by < timeline_steps
            assert len(schedule.prefetches_by_buffer[b]) == 1 and b in schedule.offload_by_buffer


def test_recomputed_layers_read_nothing_of_their_forward_in_their_backward_but_their_input():
    program, _, layers = planned(activations="recomputed")
    for layer in layers[:-1]:  # the top one's last activation is read at once by the backward: kept
        (fa, fy), (ba, by), _ = layer.runs
        from_forward = {
            b
            for step in program.steps[ba:by]
            for b in step.reads
            if program.buffers[b].kind == "computed" and fa <= program.uses.defined_at[b] < fy
        }
        assert not from_forward, [program.buffers[b].label for b in from_forward]


def test_input_offloaded_moves_what_each_layers_backward_and_update_read_from_before_them_once_each_way():
    program, schedule, layers = planned(activations="input offloaded")
    uses, crossing = program.uses, set()
    for layer in layers:
        for (start, _), (later, stop) in zip(layer.runs, layer.runs[1:]):  # forward to backward, backward to update
            crossing |= {
                b
                for step in program.steps[later:stop]
                for b in step.reads
                if program.buffers[b].kind == "computed"
                and uses.defined_at[b] < later - 1  # made right before: read at once, kept
                and uses.read_at[b][0] >= start
                and not program.buffers[b].never_moves(MiB)
            }
    # Recomputed, a layer's backward reads only its input from its forward (here its input is too
    # small to move, and the top layer's last activation is read at once): the gradients, read by
    # the updates after the backward pass, are what moves.
    assert {program.buffers[m.buffer].label for m in schedule.offloads} == {program.buffers[b].label for b in crossing}
    assert all(len(schedule.prefetches_by_buffer[b]) == 1 for b in crossing)


def test_the_last_layers_relaxed_take_the_cheaper_policy():
    _, schedule, layers = planned(activations="offloaded", relaxed=2)
    forward = [layer.runs[0] for layer in layers]
    moved = {i for m in schedule.offloads for i, (a, y) in enumerate(forward) if a <= m.after_step < y}
    assert moved == {0, 1}


def test_copies_are_issued_and_waited_for_where_units_begin():
    _, schedule, _ = planned(parameters="fetched", state="streamed", activations="offloaded")
    assert schedule.copy_steps <= schedule.segment_starts


def test_with_memory_to_spare_a_widened_fetch_is_issued_at_the_first_layer_unit_after_its_last_read():
    program, schedule, layers = planned(parameters="fetched", state="streamed", widened=True)
    forward, backward, _ = schedule.prefetches_by_buffer[labelled(program, "params[2]")]
    # The forward's at the step's start; the backward's where the backward pass begins, not across the loss.
    assert forward.issue_step == 0 and backward.issue_step == layers[-1].runs[1][0] > layers[-1].runs[0][1]


@pytest.mark.parametrize("share", [1.0, 0.9])
def test_a_copy_is_given_no_more_time_only_where_one_cut_more_would_exceed_the_budget(share):
    policy = dict(parameters="fetched", state="streamed", activations="offloaded", widened=True)
    roomy = planned(**policy)
    budget = int(simulate(roomy[0], roomy[1]).peak_bytes * share)
    program, schedule, layers = planned(budget, **policy)
    # Per step, its segment's estimate; the steps outside the layers (the loss) are no copy's to cross.
    device, cuts = [budget] * len(program.steps), sorted(schedule.segment_starts)
    for segment in cut_segments(program, schedule, budget_bytes=budget):
        if any(a <= segment.start and segment.stop <= y for layer in layers for a, y in layer.runs):
            device[segment.start : segment.stop] = [segment.estimate_bytes] * (segment.stop - segment.start)
    reads = program.uses.read_at
    for m in schedule.moves:
        nbytes = program.buffers[m.buffer].nbytes
        if isinstance(m, Offload):
            if m.done_before_step is None:
                continue
            refetched = [
                p.issue_step for p in schedule.prefetches_by_buffer.get(m.buffer, ()) if p.issue_step > m.after_step
            ]
            later = [k for k in cuts if m.done_before_step < k <= min(refetched, default=len(device) - 1)]
            span = range(m.done_before_step, later[0]) if later else None
        else:
            done = schedule.offload_by_buffer.get(m.buffer)
            first = max([r + 1 for r in reads[m.buffer] if r < m.use_step] + [done.done_before_step if done else 0])
            earlier = [k for k in cuts if first <= k < m.issue_step]
            span = range(earlier[-1], m.issue_step) if earlier else None
        assert span is None or max(device[k] for k in span) + nbytes > budget, m


def test_where_a_run_does_not_fit_whole_every_run_of_its_kind_is_cut_alike():
    policy = dict(activations="offloaded", parameters="fetched", state="streamed", ahead=0)
    program, whole, layers = planned(**policy)
    assert whole.strategy == "layers"
    _, schedule, layers = planned(simulate(program, whole).peak_bytes * 9 // 10, **policy)
    assert schedule.strategy == "layers in pieces"
    cuts = [sorted(s - a for s in schedule.segment_starts if a < s < y) for a, y in (layer.runs[1] for layer in layers)]
    assert cuts[0] and all(c == cuts[0] for c in cuts)


def test_a_plan_that_cannot_fit_raises_rather_than_exceed_the_budget():
    from oocjax.errors import BudgetInfeasibleError

    with pytest.raises(BudgetInfeasibleError):
        planned(8 * MiB, activations="kept")


def test_the_plan_recomputes_where_that_fits_and_says_its_policy_per_kind_of_layer():
    plan = plan_layers(PROGRAM, RUNS, 160 * MiB, recomputable=recomputable, profile="h100-pcie")
    assert plan.policy.activations == "recomputed" and plan.schedule.moves_nothing
    assert plan.describe()[0].startswith("layers 0-") and "(Block): recomputed from its input" in plan.describe()[0]


def test_a_plan_made_again_with_more_scratch_holds_less_with_the_same_layers_recomputed():
    policy = LayerPolicy(activations="input offloaded", relaxed=LAYERS)  # every layer recomputed, nothing moved
    rewrite = layer_rewrite(PROGRAM, LAYER_OF, policy, recomputable)
    layers = layers_after(rewrite, LAYER_OF)
    schedule = layer_schedule(rewrite.program, layers, policy, 160 * MiB)
    plan = LayerPlan(policy=policy, rewrite=rewrite, schedule=schedule, step_time_s=0.0, layers=layers)
    program = rewrite.program
    more = simulate(program, schedule).peak_bytes // 10
    scratch = dataclasses.replace(
        program, steps=tuple(dataclasses.replace(s, transient_bytes=s.transient_bytes + more) for s in program.steps)
    )
    again = replan_layers(scratch, plan, 160 * MiB)
    assert again.policy.activations == "input offloaded" and again.policy.relaxed < LAYERS
    assert again.schedule.moves and not replay(scratch, again.schedule)[1]


@pytest.mark.parametrize(("profile", "widened"), [("cpu", False), ("h100-pcie", True)])
def test_copies_are_given_more_time_only_where_they_run_beside_compute(profile, widened):
    plan = plan_layers(PROGRAM, RUNS, 160 * MiB, recomputable=recomputable, profile=profile)
    assert plan.policy.widened is widened
