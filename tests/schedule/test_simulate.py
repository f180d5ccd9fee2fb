"""The simulator is the referee: it must find every kind of mistake a schedule can make."""

from hypothesis import given

from oocjax.schedule import Offload, Prefetch, Program, Schedule, keep_all, simulate, validate
from oocjax.schedule.program import BEFORE_FIRST_STEP
from tests.support.programs import MiB, mlp_chain, programs


def chain() -> Program:
    sizes = {"w": MiB, "a": 2 * MiB, "b": 2 * MiB, "c": MiB}
    ops = [("f", ["w"], ["a"]), ("g", ["a"], ["b"]), ("h", ["a", "b", "w"], ["c"])]
    return Program.from_ops(ops, sizes, inputs=["w"], outputs=["c"])


def chain_with_a_gap() -> Program:
    """Like ``chain``, but g does not read a: a waits from f to h."""
    sizes = {"w": MiB, "a": 2 * MiB, "b": 2 * MiB, "c": MiB}
    ops = [("f", ["w"], ["a"]), ("g", ["w"], ["b"]), ("h", ["a", "b", "w"], ["c"])]
    return Program.from_ops(ops, sizes, inputs=["w"], outputs=["c"])


def a_round_trip() -> Schedule:
    """For ``chain_with_a_gap``: a is copied out after f, released before g, fetched back for h."""
    moves = (Offload(buffer=1, after_step=0, done_before_step=1), Prefetch(buffer=1, issue_step=2, use_step=2))
    return Schedule(strategy="hand", budget_bytes=None, moves=moves)


def test_in_core_memory_follows_the_liveness_rules():
    # w is a kept input (whole step); a lives f..h; b lives g..h; c is an output (h..end).
    timeline = simulate(chain(), keep_all(chain()))
    assert [b // MiB for b in timeline.device_bytes] == [3, 5, 6]
    assert (timeline.peak_bytes, timeline.peak_step) == (6 * MiB, 2)
    assert timeline.host_bytes == (0, 0, 0) and timeline.h2d_bytes == timeline.d2h_bytes == 0


def test_a_donated_input_is_freed_after_its_last_read():
    sizes = {"w": MiB, "a": MiB, "b": MiB}
    program = Program.from_ops(
        [("f", ["w"], ["a"]), ("g", ["a"], ["b"])], sizes, inputs=["w"], donated=["w"], outputs=["b"]
    )
    assert [b // MiB for b in simulate(program, keep_all(program)).device_bytes] == [2, 2]


def test_an_offload_frees_the_device_copy_when_it_completes_and_a_prefetch_takes_memory_when_issued():
    program, schedule = chain_with_a_gap(), a_round_trip()
    # a: on device at f, copied out, released before g, fetched again for h.
    timeline = simulate(program, schedule)
    assert [b // MiB for b in timeline.device_bytes] == [3, 3, 6]
    assert timeline.d2h_bytes == timeline.h2d_bytes == 2 * MiB
    assert [b // MiB for b in timeline.host_bytes] == [2, 2, 2]
    assert validate(program, schedule) == ()


def test_a_host_input_costs_the_device_only_its_prefetched_copies():
    program = chain()
    fetches = (Prefetch(buffer=0, issue_step=0, use_step=0), Prefetch(buffer=0, issue_step=2, use_step=2))
    schedule = Schedule(strategy="hand", budget_bytes=None, host_inputs=frozenset({0}), moves=fetches)
    assert [b // MiB for b in simulate(program, schedule).device_bytes] == [3, 4, 6]
    assert validate(program, schedule) == ()


def test_validate_reports_every_violation_at_once():
    program = chain()
    schedule = Schedule(
        strategy="hand",
        budget_bytes=4 * MiB,
        host_inputs=frozenset({0}),  # w on host but never fetched: f and h read it
        moves=(
            Offload(buffer=1, after_step=1, done_before_step=1),  # done before it starts
            Prefetch(buffer=2, issue_step=2, use_step=2),  # b was never offloaded
        ),
    )
    kinds = sorted(v.kind for v in validate(program, schedule))
    assert kinds == ["bad-offload", "over-budget", "prefetch-without-host-copy", "read-not-resident"]
    messages = " ".join(v.message for v in validate(program, schedule))
    assert "step 0 reads buffer 0 (w), which is not on the device" in messages
    assert "buffer 2 (b) is prefetched at step 2 but it was never offloaded" in messages


def test_validate_catches_a_prefetch_before_the_offload_completes_and_a_prefetch_of_a_resident_value():
    program = chain_with_a_gap()
    offload = Offload(buffer=1, after_step=0, done_before_step=2)
    early = Schedule(strategy="hand", budget_bytes=None, moves=(offload, Prefetch(buffer=1, issue_step=1, use_step=2)))
    assert "prefetch-without-host-copy" in {v.kind for v in validate(program, early)}
    resident = Schedule(strategy="hand", budget_bytes=None, moves=(Prefetch(buffer=0, issue_step=1, use_step=2),))
    assert "prefetch-while-resident" in {v.kind for v in validate(program, resident)}


def test_validate_refuses_homes_that_make_no_sense():
    program = chain()
    schedule = Schedule(strategy="hand", budget_bytes=None, host_inputs=frozenset({1}), host_outputs=frozenset({3}))
    assert sorted(v.kind for v in validate(program, schedule)) == ["bad-home", "bad-home"]


def test_a_program_must_be_in_ssa_form():
    import pytest

    with pytest.raises(ValueError, match="redefines"):
        Program.from_ops([("f", [], ["a"]), ("g", [], ["a"])], {"a": 1})
    with pytest.raises(ValueError, match="reads buffer 1 before it is defined"):
        Program.from_ops([("f", ["b"], ["a"]), ("g", [], ["b"])], {"a": 1, "b": 1})


def test_the_mlp_chain_in_core_peak_is_at_the_first_backward_step():
    timeline = simulate(mlp_chain(), keep_all(mlp_chain()))
    assert (timeline.peak_bytes, timeline.peak_step) == (21 * MiB, 3)


@given(programs())
def test_the_written_out_span_of_an_unmoved_buffer_is_the_one_stay_the_liveness_rule_gives(program):
    last_step = len(program.steps) - 1
    for b in range(len(program.buffers)):
        (stay,) = keep_all(program).device_stays(program, b)
        assert not stay.prefetched and not stay.offloaded
        assert stay.served == program.uses.read_at[b]
        start = max(stay.start, 0)
        assert program.unmoved_spans[b] == (start, max(start, min(stay.end, last_step)))


def test_the_stays_of_a_value_sent_out_and_fetched_back_and_of_a_kept_input():
    program, schedule = chain_with_a_gap(), a_round_trip()
    # a: defined at f, held until its offload is done before g, fetched back for h.
    assert [(s.start, s.end, s.served, s.prefetched, s.offloaded) for s in schedule.device_stays(program, 1)] == [
        (0, 0, (), False, True),
        (2, 2, (2,), True, False),
    ]
    # w is an argument there from the start, held past the last step (3 steps: end 3).
    (w,) = schedule.device_stays(program, 0)
    assert (w.start, w.end, w.first_use) == (BEFORE_FIRST_STEP, 3, 0)
    assert w.needed_after(3) and not schedule.device_stays(program, 1)[1].needed_after(3)


def test_the_move_index_groups_each_move_once_by_buffer_and_by_step():
    late_fetch, early_fetch = Prefetch(buffer=1, issue_step=2, use_step=2), Prefetch(buffer=1, issue_step=1, use_step=2)
    offload = Offload(buffer=1, after_step=0, done_before_step=1)
    returned = Offload(buffer=3, after_step=2, done_before_step=None)
    fetch_w = Prefetch(buffer=0, issue_step=2, use_step=2)
    schedule = Schedule(strategy="hand", budget_bytes=None, moves=(offload, late_fetch, early_fetch, fetch_w, returned))
    assert schedule.offload_by_buffer == {1: offload, 3: returned}
    assert schedule.prefetches_by_buffer == {1: (early_fetch, late_fetch), 0: (fetch_w,)}  # issue order
    assert schedule.prefetches_by_issue_step == {2: (late_fetch, fetch_w), 1: (early_fetch,)}
    assert schedule.offloads_by_after_step == {0: (offload,), 2: (returned,)}
    # Step 1 waits for the offload, step 2 for the prefetches it reads; nothing waits for `returned`.
    assert schedule.waits_by_step == {1: (offload,), 2: (late_fetch, early_fetch, fetch_w)}


@given(programs())
def test_a_programs_in_core_bytes_are_the_simulators_with_nothing_moved(program):
    assert program.in_core_bytes == simulate(program, keep_all(program)).device_bytes
