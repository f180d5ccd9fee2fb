"""A segment's memory estimate against what XLA allocates for it.

New parameters written over the old ones they replace (``Buffer.aliased_input``, an optimizer's
update of a donated state) take no memory of their own when the old ones are donated to the same
segment: XLA updates them in place. The hand-worked program (sizes in MiB):

    step 0  grad:   w, x -> g   (4)
    step 1  update: w, g -> w2  (4; the new w, returned, replaces w)
"""

import jax
import pytest

from oocjax import ooc_jit
from oocjax.schedule import MiB, Program, keep_all
from oocjax.schedule.segments import cut_segments
from tests.support.zoo import mlp_adam


def optimizer_step(*, donated: bool) -> Program:
    sizes = {"w": 4 * MiB, "x": MiB, "g": 4 * MiB, "w2": 4 * MiB}
    ops = [("grad", ["w", "x"], ["g"]), ("update", ["w", "g"], ["w2"])]
    return Program.from_ops(
        ops,
        sizes,
        inputs=["w", "x"],
        outputs=["w2"],
        donated=["w"] if donated else [],
        aliases={"w2": "w"} if donated else None,
    )


def one_segment(program: Program):
    (segment,) = cut_segments(program, keep_all(program), budget_bytes=64 * MiB)
    return segment


def test_new_parameters_written_over_donated_old_ones_take_no_memory_of_their_own():
    segment = one_segment(optimizer_step(donated=True))
    assert segment.held_bytes == 5 * MiB  # w and x
    assert segment.estimate_bytes == 5 * MiB + 4 * MiB  # and g while it lives; w2 is written over w


def test_new_parameters_of_kept_old_ones_are_allocated_when_the_segment_is_launched():
    segment = one_segment(optimizer_step(donated=False))
    assert segment.estimate_bytes == 5 * MiB + 4 * MiB + 4 * MiB  # w2 beside w


def test_a_segment_that_reads_the_old_parameters_again_later_does_not_count_them_replaced():
    program = optimizer_step(donated=True)
    segments = cut_segments(program, keep_all(program), budget_bytes=64 * MiB, cut_before=[1])
    grad, update = segments
    assert update.estimate_bytes == update.held_bytes  # w2 over w, donated here at its last read
    assert grad.estimate_bytes == grad.held_bytes + 4 * MiB  # g, needed by the next segment


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_xla_writes_the_new_parameters_over_the_donated_old_ones_as_the_estimate_counts(fraction):
    """On the CPU, in every compiled segment that writes new parameters over donated old ones, XLA
    aliases at least those bytes (``memory_analysis``), and the chain holds its budget."""
    case = mlp_adam()
    in_core = ooc_jit(case.step, budget=2**40).plan(case.state, case.batches[0]).baseline_peak_bytes
    budget = int(in_core * fraction)
    step = ooc_jit(case.step, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    plan = step.plan(case.state, case.batches[0])
    buffers = plan.program.buffers
    in_place = [
        (sum(buffers[b].nbytes for b in segment.outputs if buffers[b].aliased_input in segment.donated), cost)
        for segment, cost in zip(plan.segments, plan.segment_costs, strict=True)
    ]
    assert sum(nbytes for nbytes, _ in in_place) == sum(b.nbytes for b in buffers if b.aliased_input is not None)
    for nbytes, cost in in_place:
        assert cost.alias_bytes >= nbytes
    assert plan.executed_peak_bytes <= budget
    jax.block_until_ready(step(jax.tree.map(lambda x: x.copy(), case.state), case.batches[0]))


# -- ranges the estimate cuts, measured whole ------------------------------------------------------


def four_steps() -> Program:
    """x (1 MiB) -> a -> b -> c (4 MiB each) -> y (1 MiB): estimated at 10 MiB as one segment."""
    sizes = {"x": MiB, "a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB, "y": MiB}
    ops = [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["c"], ["y"])]
    return Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"])


def test_a_range_the_estimate_cuts_but_might_fit_is_offered_whole_to_be_measured():
    from oocjax.schedule.layer_cuts import segment_signature
    from oocjax.schedule.segments import CutOptions, cut_and_probes

    program = four_steps()
    plan = keep_all(program)
    cut, probes = cut_and_probes(program, plan, CutOptions(budget_bytes=9 * MiB))
    assert len(cut) > 1  # 10 MiB by the estimate
    assert cut == cut_segments(program, plan, budget_bytes=9 * MiB)
    assert [(s.start, s.stop) for s in probes.values()] == [(0, 4)]
    assert list(probes) == [segment_signature(program, 0, 4)]
    # Measured once, it is not offered again; and where it would not fit even a quarter lower, never.
    measured = tuple(dict.fromkeys(probes, 8 * MiB).items())
    assert cut_and_probes(program, plan, CutOptions(budget_bytes=9 * MiB, measured=measured))[1] == {}
    assert cut_and_probes(program, plan, CutOptions(budget_bytes=7 * MiB))[1] == {}


def test_a_range_whose_program_measured_within_the_budget_stays_one_segment():
    from oocjax.schedule.layer_cuts import segment_signature

    program = four_steps()
    plan, signature = keep_all(program), segment_signature(program, 0, 4)
    fits = cut_segments(program, plan, budget_bytes=9 * MiB, measured={signature: 6 * MiB})
    assert [(s.start, s.stop) for s in fits] == [(0, 4)]  # 1 MiB held + 6 launched
    over = cut_segments(program, plan, budget_bytes=9 * MiB, measured={signature: 8 * MiB + 1})
    assert len(over) > 1


def test_a_range_measured_over_the_budget_but_under_its_estimate_is_cut_by_the_estimate_scaled_alike():
    from oocjax.schedule.layer_cuts import segment_signature

    names = "xabcdey"  # x (1 MiB) -> a .. e (4 MiB each) -> y (1 MiB), each step alone by the estimate at 7 MiB
    sizes = {name: (MiB if name in "xy" else 4 * MiB) for name in names}
    steps = [(f"f{i}", [names[i]], [names[i + 1]]) for i in range(6)]
    program = Program.from_ops(steps, sizes, inputs=["x"], outputs=["y"])
    plan, signature = keep_all(program), segment_signature(program, 0, 6)
    by_estimate = [(s.start, s.stop) for s in cut_segments(program, plan, budget_bytes=7 * MiB)]
    assert by_estimate == [(k, k + 1) for k in range(6)]
    # Estimated to allocate 9 MiB as one, it measured 6.5: 7.5 MiB with the 1 held, over the budget.
    # Its first two steps, estimated at 1 + 8 MiB, by the same measure take 1 + 5.8: one segment.
    scaled = cut_segments(program, plan, budget_bytes=7 * MiB, measured={signature: 13 * MiB // 2})
    assert [(s.start, s.stop) for s in scaled] == [(0, 2), *by_estimate[2:]]
    # A range that measured over its estimate is cut as the estimate says, never into longer pieces.
    over = cut_segments(program, plan, budget_bytes=7 * MiB, measured={signature: 10 * MiB})
    assert [(s.start, s.stop) for s in over] == by_estimate


def test_a_probe_over_the_budget_only_by_what_is_held_at_its_start_is_planned_around():
    from oocjax.schedule import plan_window
    from oocjax.schedule.measured import with_probed_scratch

    # w (4 MiB) is read at steps 0 and 5 only; steps 1-4 each hold 6 MiB by the plan (w, their
    # operand and result), within 7 MiB. Run as one program they measured 3 MiB besides what they
    # hold at launch (w and a: 5 MiB): 8 MiB, over. Shown that peak, the plan moves w out across them.
    names = "abcde"
    sizes = {"w": 4 * MiB, "x": MiB, **dict.fromkeys(names, MiB), "y": MiB}
    ops = [
        ("f0", ["w", "x"], ["a"]),
        *((f"f{i}", [names[i - 1]], [names[i]]) for i in range(1, 5)),
        ("g", ["w", "e"], ["y"]),
    ]
    program = Program.from_ops(ops, sizes, inputs=["w", "x"], outputs=["y"], donated=["w", "x"])
    budget = 7 * MiB
    plan = plan_window(program, budget)
    assert plan.moves_nothing
    probe = next(s for s in cut_segments(program, plan, budget_bytes=64 * MiB, cut_before=(1, 5)) if s.start == 1)
    assert probe.stop == 5 and probe.held_bytes == 5 * MiB
    assert with_probed_scratch(program, plan, [probe], [2 * MiB], budget) is None  # 7 MiB: it fits
    learnt = with_probed_scratch(program, plan, [probe], [3 * MiB], budget)
    replanned = plan_window(learnt, budget)
    (again,) = (s for s in cut_segments(learnt, replanned, budget_bytes=64 * MiB, cut_before=(1, 5)) if s.start == 1)
    assert again.held_bytes + 3 * MiB <= budget


def test_prefetches_issued_alike_in_every_layer_keep_their_cuts_so_the_copies_overlap_the_layers():
    """Three layers alike (f, g), each fetching a piece of the update's state at its middle: every
    layer is cut there alike (the pieces share programs), and the copies overlap the layers."""
    from oocjax.schedule.moves import Prefetch, Schedule

    names = ["x", "a1", "h1", "a2", "h2", "a3", "h3", "s1", "s2", "s3", "out"]
    steps = [("f", ["x"], ["a1"]), ("g", ["a1"], ["h1"]), ("f", ["h1"], ["a2"]), ("g", ["a2"], ["h2"])]
    steps += [("f", ["h2"], ["a3"]), ("g", ["a3"], ["h3"]), ("update", ["h3", "s1", "s2", "s3"], ["out"])]
    program = Program.from_ops(steps, dict.fromkeys(names, MiB), inputs=["x", "s1", "s2", "s3"], outputs=["out"])
    state = [names.index(name) for name in ("s1", "s2", "s3")]
    fetches = tuple(Prefetch(buffer=b, issue_step=k, use_step=6) for b, k in zip(state, (1, 3, 5), strict=True))
    plan = Schedule(strategy="hand", budget_bytes=None, host_inputs=frozenset(state), moves=fetches)
    layers = [(0, 2, "Block"), (2, 4, "Block"), (4, 6, "Block")]
    segments = cut_segments(program, plan, budget_bytes=64 * MiB, layers=layers)
    assert [(x.start, x.stop) for x in segments] == [(k, k + 1) for k in range(7)]
    assert [x.prefetches for x in segments[1:6:2]] == [(b,) for b in state]
