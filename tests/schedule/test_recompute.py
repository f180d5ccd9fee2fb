"""Recomputation as a program rewrite, the pressure bound on swap-only plans, and the greedy selector.

Random programs are checked against a tiny reference interpreter: every value is a hash of the
original step that computes it and of the values it reads, so a rewritten program computes the
same values exactly when each of its buffers holds the value of its ``origin_buffer``.
"""

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oocjax.schedule import (
    Program,
    keep_all,
    plan_window,
    required_bytes,
    resolve_profile,
    simulate,
    simulate_time,
    validate,
)
from oocjax.schedule.bounds import pressure_bound
from oocjax.schedule.recompute import choose_recompute
from oocjax.schedule.rewrite import Rewrite, recompute_program
from oocjax.schedule.synthetic import layered_training_step
from tests.support.programs import MiB, mlp_chain, programs


def values(program: Program, origin_step=None, origin_buffer=None) -> list[int]:
    """The reference interpreter: an argument's value names its original buffer; a step's results
    hash the original step it runs, which result, and the values it reads."""
    origin_step = origin_step or range(len(program.steps))
    origin_buffer = origin_buffer or range(len(program.buffers))
    value: list[int | None] = [
        hash(("argument", origin_buffer[b])) if buffer.kind != "computed" else None
        for b, buffer in enumerate(program.buffers)
    ]
    for step, origin in zip(program.steps, origin_step):
        read = tuple(value[b] for b in step.reads)
        for j, b in enumerate(step.writes):
            value[b] = hash((origin, j, read))
    return value


def check_rewrite(program: Program, rewrite: Rewrite, recomputable) -> None:
    """What every rewrite must be: SSA (checked by ``Program``), every original step once, in order
    but for the recomputable ones postponed to a later place, with copies of recomputable steps
    between them, original buffers unchanged, copies plain computed values, and every buffer
    holding the value of its origin (so the outputs are the same)."""
    new = rewrite.program
    assert len(rewrite.origin_step) == len(new.steps) and len(rewrite.origin_buffer) == len(new.buffers)
    copies, postponed = set(rewrite.copied_steps), set(rewrite.postponed_steps)
    originals = [s for i, s in enumerate(rewrite.origin_step) if i not in copies]
    assert sorted(originals) == list(range(len(program.steps)))
    in_place = [s for i, s in enumerate(rewrite.origin_step) if i not in copies | postponed]
    assert in_place == sorted(in_place)
    placed_before = set()
    for i, s in enumerate(rewrite.origin_step):
        if i in postponed:  # no earlier than traced: after every original in place traced before it
            assert {t for t in in_place if t < s} <= placed_before
        elif i not in copies:
            placed_before.add(s)
    assert all(recomputable(rewrite.origin_step[i]) for i in copies | postponed)
    assert new.buffers[: len(program.buffers)] == program.buffers
    assert rewrite.origin_buffer[: len(program.buffers)] == tuple(range(len(program.buffers)))
    for copy in new.buffers[len(program.buffers) :]:
        assert copy.kind == "computed" and not copy.is_output and copy.aliased_input is None
        assert copy.label.startswith("recompute of ")
    original, rewritten = values(program), values(new, rewrite.origin_step, rewrite.origin_buffer)
    assert rewritten == [original[o] for o in rewrite.origin_buffer]
    assert rewrite.extra_flops == sum(new.steps[i].flops for i in copies)
    assert set(rewrite.recomputed).isdisjoint(s.buffer for s in rewrite.skipped)


def in_core(program: Program) -> int:
    return simulate(program, keep_all(program)).peak_bytes


def floor(program: Program) -> int:
    return max(required_bytes(program), default=0)


@st.composite
def rewrite_requests(draw):
    """A random program, random targets (any buffers: the rewrite must refuse the wrong ones), and
    a random set of steps that may not be recomputed."""
    program = draw(programs())
    buffer_ids = st.integers(0, len(program.buffers) - 1)
    targets = draw(st.lists(buffer_ids, max_size=8))
    fixed = draw(st.sets(st.integers(0, len(program.steps) - 1), max_size=3))
    across = draw(st.none() | st.integers(0, len(program.steps)))
    return program, targets, (lambda s: s not in fixed), across


@given(rewrite_requests())
def test_every_rewrite_is_a_valid_program_that_computes_the_same_values(request):
    program, targets, recomputable, across = request
    rewrite = recompute_program(program, targets, recomputable=recomputable, across=across)
    check_rewrite(program, rewrite, recomputable)
    assert set(rewrite.recomputed) | {s.buffer for s in rewrite.skipped} == set(targets)


@given(rewrite_requests())
def test_the_same_request_gives_the_same_rewrite(request):
    program, targets, recomputable, across = request
    first = recompute_program(program, targets, recomputable=recomputable, across=across)
    again = recompute_program(program, list(reversed(targets)), recomputable=recomputable, across=across)
    assert first == again


@given(rewrite_requests())
def test_a_recomputed_value_is_dropped_across_its_gap(request):
    # Split at the longest run of steps without a touch: the original is not live inside it.
    program, targets, recomputable, _ = request
    rewrite = recompute_program(program, targets, recomputable=recomputable)
    new = rewrite.program
    copies, postponed = set(rewrite.copied_steps), set(rewrite.postponed_steps)
    position = {rewrite.origin_step[i]: i for i in range(len(new.steps)) if i not in copies}  # original -> new
    for t in rewrite.recomputed:
        if new.uses.defined_at[t] in postponed:
            continue  # made where first needed: it has no early life to end
        touches = (program.uses.defined_at[t], *program.uses.read_at[t])
        gaps = [b - a for a, b in pairwise(touches)]
        i = gaps.index(max(gaps))
        _, end = new.unmoved_spans[t]
        assert end == position[touches[i]]


@given(programs(), st.floats(0.0, 1.0))
def test_the_pressure_bound_never_exceeds_what_the_window_planner_moves(program, position):
    low, high = floor(program), in_core(program)
    budget = max(1, int(low + position * (high - low)))
    schedule = plan_window(program, budget)
    timeline = simulate(program, schedule)
    for profile in ("h100-pcie", "cpu"):
        bound = pressure_bound(program, budget, profile=profile)
        assert bound.moved_bytes <= timeline.h2d_bytes + timeline.d2h_bytes
        assert bound.step_time_s <= simulate_time(program, schedule, profile).step_time_s * (1 + 1e-9)


@given(programs(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_the_pressure_bound_falls_as_the_budget_grows(program, low, high):
    small, large = sorted(max(1, int(f * in_core(program))) for f in (low, high))
    assert pressure_bound(program, large).moved_bytes <= pressure_bound(program, small).moved_bytes
    assert pressure_bound(program, in_core(program)).moved_bytes == 0


@st.composite
def selection_requests(draw):
    program = draw(programs())
    fixed = draw(st.sets(st.integers(0, len(program.steps) - 1), max_size=3))
    low, high = floor(program), in_core(program)
    budget = max(1, int(low + draw(st.floats(0.0, 1.0)) * (high - low)))
    return program, budget, (lambda s: s not in fixed)


@given(selection_requests())
def test_the_selector_returns_a_valid_rewrite_that_holds_no_more_and_keeps_the_budget_feasible(request):
    program, budget, recomputable = request
    rewrite = choose_recompute(program, budget, recomputable=recomputable)
    check_rewrite(program, rewrite, recomputable)
    assert rewrite.peak_bytes == in_core(rewrite.program) <= in_core(program) == rewrite.peak_bytes_before
    assert floor(rewrite.program) <= budget  # the budgets drawn are feasible for the original
    schedule = plan_window(rewrite.program, budget)
    assert validate(rewrite.program, schedule) == ()


@given(selection_requests())
def test_the_selector_decides_the_same_way_every_time(request):
    program, budget, recomputable = request
    assert choose_recompute(program, budget, recomputable=recomputable) == choose_recompute(
        program, budget, recomputable=recomputable
    )


@given(programs())
def test_a_program_that_fits_in_core_is_left_as_it_is(program):
    rewrite = choose_recompute(program, max(1, in_core(program)), recomputable=lambda s: True)
    assert rewrite.program is program and rewrite.recomputed == () and rewrite.extra_flops == 0


# Hand-worked programs.


def test_a_value_dropped_across_a_wide_stretch_is_recomputed_just_before_its_late_read():
    # a is read by g (step 1) and by k (step 4); the longest run without a touch is 1 -> 4, across
    # h and m, which hold the 8-byte c. Before: step 2 holds x, a, b, c = 18. After: a dies after
    # g; f runs again before k, and the peak is k's own operands and results: x, a', d, y = 11.
    sizes = {"x": 1, "a": 8, "b": 1, "c": 8, "d": 1, "y": 1}
    ops = [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("m", ["c"], ["d"]), ("k", ["a", "d"], ["y"])]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"], flops={0: 100})
    rewrite = recompute_program(program, [1], recomputable=lambda s: True)
    assert rewrite.origin_step == (0, 1, 2, 3, 0, 4) and rewrite.copied_steps == (4,)
    assert rewrite.origin_buffer == (0, 1, 2, 3, 4, 5, 1)
    assert rewrite.program.steps[5].reads == (6, 4)  # k reads the copy
    assert rewrite.program.buffers[6].label == "recompute of a"
    assert (rewrite.peak_bytes_before, rewrite.peak_bytes) == (18, 11)
    assert rewrite.recomputed == (1,) and rewrite.extra_flops == 100


def chained() -> Program:
    """a feeds b; b's late read (step 4) comes before a's (step 5)."""
    sizes = {"x": 1, "a": 4, "b": 4, "c": 1, "d": 4, "e": 1, "y": 1}
    ops = [
        ("f", ["x"], ["a"]),
        ("g", ["a"], ["b"]),
        ("h", ["b"], ["c"]),
        ("big", ["c"], ["d"]),
        ("k1", ["b", "d"], ["e"]),
        ("k2", ["a", "e"], ["y"]),
    ]
    return Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"])


def test_a_copy_made_for_another_chain_serves_the_late_reads_of_its_own_target():
    # Recomputing b before k1 needs a, whose original died after g: a is recomputed there, first,
    # and that copy then serves k2 too. f runs twice, not three times.
    program = chained()
    rewrite = recompute_program(program, [1, 2], recomputable=lambda s: True)
    assert rewrite.origin_step == (0, 1, 2, 3, 0, 1, 4, 5)
    assert rewrite.program.steps[7].reads == (7, 5)  # k2 reads the copy of a made before k1
    assert rewrite.recomputed == (1, 2)


def test_an_input_of_a_copy_that_is_not_a_target_stays_and_lives_longer():
    program = chained()
    rewrite = recompute_program(program, [2], recomputable=lambda s: True)
    assert rewrite.origin_step == (0, 1, 2, 3, 1, 4, 5)
    assert rewrite.program.steps[4].reads == (1,)  # g's copy reads the original a


def test_a_target_split_after_its_last_read_is_recomputed_only_where_a_copy_needs_it():
    # With a split after step 1, a is dropped after g and recomputed only for b's copy; c is
    # split after its last read too, but no copy needs it, so it is left as it is.
    program = chained()
    rewrite = recompute_program(program, [1, 2, 3], recomputable=lambda s: True, across={1: 2, 3: 4})
    assert rewrite.recomputed == (1, 2)
    assert rewrite.origin_step == (0, 1, 2, 3, 0, 1, 4, 5)
    assert [(s.buffer, s.reason) for s in rewrite.skipped] == [
        (3, "is not read after the split, and no copy needed it")
    ]


def test_a_copy_of_a_step_with_several_results_writes_fresh_buffers_for_all_of_them():
    sizes = {"x": 1, "a": 4, "z": 2, "b": 1, "c": 4, "y": 1}
    ops = [("f", ["x"], ["a", "z"]), ("g", ["a", "z"], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c"], ["y"])]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"])
    rewrite = recompute_program(program, [1], recomputable=lambda s: True)
    copy = rewrite.program.steps[3]
    assert copy.writes == (6, 7) and rewrite.origin_buffer[6:] == (1, 2)
    assert rewrite.program.uses.read_at[7] == ()  # z's copy is a dead value


def test_values_that_cannot_be_recomputed_are_skipped_with_the_reason():
    sizes = {"x": 1, "a": 4, "b": 1, "c": 4, "y": 1}
    ops = [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c", "b"], ["y"])]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"])
    rewrite = recompute_program(program, [0, 1, 2, 4], recomputable=lambda s: s != 0)
    assert rewrite.program is program and rewrite.recomputed == ()
    assert [(s.buffer, s.reason) for s in rewrite.skipped] == [
        (0, "is an input, not a computed value: there is nothing to recompute it from"),
        (1, "its producer, step 0 (f), may not be recomputed"),
        (2, "is touched at consecutive steps: there is no step to drop it across"),
        (4, "is returned by the step: its device copy is held to the end, so dropping it saves nothing"),
    ]


def test_a_copy_never_reads_a_donated_input_after_its_aliased_output_is_written():
    # w's memory passes to w_new at step 3; a copy of f before step 4 would read w after that.
    sizes = {"x": 1, "w": 4, "a": 4, "b": 1, "c": 1, "w_new": 4, "y": 1}
    ops = [
        ("f", ["x", "w"], ["a"]),
        ("h", ["a"], ["b"]),
        ("m", ["b"], ["c"]),
        ("update", ["w", "c"], ["w_new"]),
        ("k", ["a", "c"], ["y"]),
    ]
    program = Program.from_ops(
        ops, sizes, inputs=["x", "w"], donated=["w"], outputs=["w_new", "y"], aliases={"w_new": "w"}
    )
    rewrite = recompute_program(program, [2], recomputable=lambda s: True)
    assert rewrite.recomputed == () and rewrite.program is program
    assert rewrite.skipped[0].reason == (
        "recomputing it before step 4 would read donated input 1 (w) after step 3 writes the output that "
        "takes over its memory"
    )


def test_a_target_that_is_not_a_buffer_is_an_error():
    with pytest.raises(ValueError, match="target 99 is not a buffer of the program, which has 13"):
        recompute_program(mlp_chain(), [99], recomputable=lambda s: True)


def test_the_mlp_chain_at_18_MiB_fits_in_core_once_a1_is_recomputed():
    # In core the peak is b3 (step 3): the four 1 MiB inputs, a1, a2, a3, g3 (4 MiB each) and dw3:
    # 21 MiB. a1 is the one value live across b3 that b3 does not read: recompute it (f1 again,
    # from x and w1, which are held anyway) before b2. The peak moves to b2: inputs 4, g3, a1', g2
    # (4 each), dw3 and dw2: 18 MiB.
    program = mlp_chain()
    rewrite = choose_recompute(program, 18 * MiB, recomputable=lambda s: True)
    assert [program.buffers[b].label for b in rewrite.recomputed] == ["a1"]
    assert rewrite.origin_step == (0, 1, 2, 3, 0, 4, 5)
    assert (rewrite.peak_bytes_before, rewrite.peak_bytes) == (21 * MiB, 18 * MiB)
    # Swap-only at 18 MiB must have 3 MiB off the device during b3; the cheapest are three of the
    # inputs read later (x, w1, w2): fetched once each, so at least 3 MiB moved.
    bound = pressure_bound(program, 18 * MiB)
    assert (bound.moved_bytes, bound.step, bound.excess_bytes) == (3 * MiB, 3, 3 * MiB)
    assert not plan_window(program, 18 * MiB).moves_nothing
    assert plan_window(rewrite.program, 18 * MiB).moves_nothing


def test_three_layers_at_160_MiB_recompute_the_wide_activations_of_the_first_two_layers():
    # In core the peak is step 15 (the backward's mul reading h[2][1]): 44 MiB of parameters,
    # moments and batch, each layer's saved h[i][0..3] (8 + 32 + 8 + 1/8 MiB) for layers 0 and 1,
    # h[2][0] and h[2][1] (8 + 32), d_h[2][3] (8), d_h[2][2] (32), and the 4-byte loss: 220.25 MiB.
    # The best bytes per recompute-second across it are the 32 MiB tanh outputs h[i][1], recomputed
    # from h[i][0] (live anyway); h[2][1] is read at the peak, so layers 0 and 1 are the class.
    program = layered_training_step(3)
    recomputable = lambda s: program.steps[s].name != "adam"  # noqa: E731
    rewrite = choose_recompute(program, 160 * MiB, recomputable=recomputable)
    assert [program.buffers[b].label for b in rewrite.recomputed] == ["h[0][1]", "h[1][1]"]
    assert rewrite.peak_bytes_before == 220 * MiB + MiB // 4 + 4
    assert rewrite.peak_bytes == rewrite.peak_bytes_before - 64 * MiB
    assert rewrite.extra_flops == 2 * (8 + 32) * MiB * 64  # two tanh, 64 FLOPs per byte touched
    # Swap-only must have 60.25 MiB and 4 bytes off the device at step 15: the cheapest are the
    # 44 MiB of arguments read after it (fetched once each), then 16.25 MiB and 4 bytes of saved
    # activations, out before it and back after it.
    bound = pressure_bound(program, 160 * MiB)
    assert (bound.step, bound.moved_bytes) == (15, 44 * MiB + 2 * (16 * MiB + MiB // 4 + 4))
    assert plan_window(rewrite.program, 160 * MiB).moves_nothing


def test_identical_layers_get_one_decision_even_when_one_would_do():
    # 200 MiB needs 20.25 MiB less at the peak: one h[i][1] would do, but the class is recomputed
    # as a whole so the layers stay alike.
    program = layered_training_step(3)
    rewrite = choose_recompute(program, 200 * MiB, recomputable=lambda s: program.steps[s].name != "adam")
    assert [program.buffers[b].label for b in rewrite.recomputed] == ["h[0][1]", "h[1][1]"]


def test_below_the_in_core_reach_of_recompute_the_planner_moves_far_less():
    program = layered_training_step(3)
    rewrite = choose_recompute(program, 100 * MiB, recomputable=lambda s: program.steps[s].name != "adam")
    swap_only = simulate(program, plan_window(program, 100 * MiB))
    with_recompute = simulate(rewrite.program, plan_window(rewrite.program, 100 * MiB))
    assert with_recompute.h2d_bytes + with_recompute.d2h_bytes < (swap_only.h2d_bytes + swap_only.d2h_bytes) / 2
    assert with_recompute.peak_bytes <= 100 * MiB


@pytest.mark.parametrize("layers, fraction", [(3, 0.3), (6, 0.5), (24, 0.3), (24, 0.5)])
def test_classes_needed_together_are_rewritten_together_and_chosen_as_one_at_a_time_would(layers, fraction):
    program = layered_training_step(layers)
    budget = int(max(program.in_core_bytes) * fraction)
    rewrites = []

    def counted(*args, **kwargs):
        rewrites.append(1)
        return recompute_program(*args, **kwargs)

    def choose(batched: bool) -> tuple[Rewrite, int]:
        rewrites.clear()
        recomputable = lambda s: program.steps[s].name != "adam"  # noqa: E731
        rewrite = choose_recompute(program, budget, recomputable=recomputable, batched=batched, rewrite=counted)
        return rewrite, len(rewrites)

    together, rewrites_together = choose(batched=True)
    alone, rewrites_alone = choose(batched=False)
    assert together.recomputed == alone.recomputed
    assert together.peak_bytes == alone.peak_bytes
    # Where the estimates hold (24 layers at 30%: 3 rewrites instead of 5), fewer; where they
    # mislead (3 layers), one more: the pick that found it out.
    assert rewrites_together <= rewrites_alone + 1
    if layers == 24 and fraction == 0.3:
        assert rewrites_together < rewrites_alone


def test_nothing_recomputable_leaves_the_program_as_it_is():
    program = layered_training_step(3)
    rewrite = choose_recompute(program, 160 * MiB, recomputable=lambda s: False)
    assert rewrite.program is program and rewrite.recomputed == ()


def test_the_time_bound_adds_the_link_time_on_both_sides_of_the_peak_to_its_compute():
    # mlp_chain at 18 MiB: the 3 MiB excess at b3 is cheapest in time as inputs fetched after it.
    program = mlp_chain()
    profile = resolve_profile("cpu")
    bound = pressure_bound(program, 18 * MiB, profile=profile)
    compute = sum(profile.compute_seconds(step) for step in program.steps)
    around_b3 = 3 * MiB / profile.h2d_bytes_per_s + profile.compute_seconds(program.steps[3])
    assert bound.step_time_s == pytest.approx(max(compute, around_b3))


def test_a_value_whose_producer_reads_a_dead_value_is_recomputed_with_its_chain():
    # v (8 MiB) is held across big (step 3, the peak: x, v, c, d = 26 MiB), but its producer g reads
    # u (8 MiB), dead there: recomputing v alone would bring u back to life and save nothing. The
    # chain f, g recomputes both from the argument x before k; the peak falls to 18 MiB (step 3
    # without v, and the copies before k: x, u', v', e).
    sizes = {"x": MiB, "u": 8 * MiB, "v": 8 * MiB, "c": MiB, "d": 16 * MiB, "e": MiB, "y": MiB}
    ops = [
        ("f", ["x"], ["u"]),
        ("g", ["u"], ["v"]),
        ("h", ["v"], ["c"]),
        ("big", ["c"], ["d"]),
        ("m", ["d"], ["e"]),
        ("k", ["v", "e"], ["y"]),
    ]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"])
    rewrite = choose_recompute(program, 20 * MiB, recomputable=lambda s: True)
    check_rewrite(program, rewrite, lambda s: True)
    assert [program.buffers[b].label for b in rewrite.recomputed] == ["u", "v"]
    assert rewrite.origin_step == (0, 1, 2, 3, 4, 0, 1, 5)
    assert (rewrite.peak_bytes_before, rewrite.peak_bytes) == (26 * MiB, 18 * MiB)
    # When f may not run twice, u cannot join the chain: v alone saves nothing.
    alone = choose_recompute(program, 20 * MiB, recomputable=lambda s: s != 0)
    assert alone.recomputed == () and alone.peak_bytes == 26 * MiB


def test_a_class_that_alone_covers_the_excess_is_taken_rather_than_a_crawl_of_small_ones():
    # At step m, x, s1, s2, b, d and e hold 36 MiB, 11 over the budget. s1 and s2 are cheap to
    # recompute but save 2 MiB together, under a quarter of the excess; b is costly and saves 12
    # alone. Taken in rate order the small ones would be picked first, and b after them anyway.
    sizes = {"x": MiB, "s1": MiB, "s2": MiB, "b": 12 * MiB, "d": 20 * MiB, "e": MiB, "g1": MiB, "g2": MiB, "y": MiB}
    ops = [
        ("f1", ["x"], ["s1"]),
        ("f2", ["x"], ["s2"]),
        ("big", ["x"], ["b"]),
        ("turn", ["x"], ["d"]),
        ("m", ["d"], ["e"]),
        ("k1", ["s1", "e"], ["g1"]),
        ("k2", ["s2", "g1"], ["g2"]),
        ("kb", ["b", "g2", "x"], ["y"]),
    ]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["y"], flops={2: 10**12})
    rewrite = choose_recompute(program, 25 * MiB, recomputable=lambda s: True)
    check_rewrite(program, rewrite, lambda s: True)
    assert [program.buffers[b].label for b in rewrite.recomputed] == ["b"]
    assert (rewrite.peak_bytes_before, rewrite.peak_bytes) == (36 * MiB, 24 * MiB)


def test_a_value_the_forward_pass_never_reads_is_made_where_the_backward_needs_it_not_copied():
    # d = f'(h) is made in the forward pass for the backward pass alone; g2 reads it late. It is
    # made just before g2 (not held across the loss), once.
    ops = [("f", ["x"], ["h"]), ("df", ["h"], ["d"]), ("g", ["h"], ["y"]), ("loss", ["y"], ["s"]),
           ("g2", ["s", "d"], ["dx"])]  # fmt: skip
    program = Program.from_ops(ops, dict.fromkeys(["x", "h", "d", "y", "s", "dx"], 8), inputs=["x"], outputs=["dx"])
    d = 2
    rewrite = recompute_program(program, [d], recomputable=lambda s: True, across=3)
    check_rewrite(program, rewrite, lambda s: True)
    assert rewrite.origin_step == (0, 2, 3, 1, 4) and rewrite.postponed_steps == (3,)
    assert rewrite.copied_steps == () and rewrite.extra_flops == 0 and rewrite.recomputed == (d,)
