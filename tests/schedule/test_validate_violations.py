"""validate finds each kind of fault a schedule can commit: one small hand-made schedule per fault,
each checked for exactly the violations it should raise, where, and in words.

The program (sizes in MiB): w is an input, k a constant, d the output.

    step 0  f: w       -> a (2)
    step 1  g: w       -> b (2)
    step 2  h: a,b,w,k -> c (1)
    step 3  j: c       -> d (1)
"""

import pytest

from oocjax.schedule import Offload, Prefetch, Program, Schedule, Violation, keep_all, simulate, validate

MiB = 2**20
W, K, A, B, C, D = range(6)


def program() -> Program:
    sizes = {"w": MiB, "k": MiB, "a": 2 * MiB, "b": 2 * MiB, "c": MiB, "d": MiB}
    ops = [("f", ["w"], ["a"]), ("g", ["w"], ["b"]), ("h", ["a", "b", "w", "k"], ["c"]), ("j", ["c"], ["d"])]
    return Program.from_ops(ops, sizes, inputs=["w"], constants=["k"], outputs=["d"])


def schedule(*moves, host_inputs=(), host_outputs=(), budget_bytes=None) -> Schedule:
    return Schedule(
        strategy="hand",
        budget_bytes=budget_bytes,
        host_inputs=frozenset(host_inputs),
        host_outputs=frozenset(host_outputs),
        moves=moves,
    )


def found(*moves, **homes) -> list[tuple[str, int | None, int | None]]:
    """(kind, step, buffer) of every violation, in the order validate reports them."""
    return [(v.kind, v.step, v.buffer) for v in validate(program(), schedule(*moves, **homes))]


def messages(*moves, **homes) -> str:
    return "\n".join(v.message for v in validate(program(), schedule(*moves, **homes)))


A_ROUND_TRIP = (Offload(buffer=A, after_step=0, done_before_step=1), Prefetch(buffer=A, issue_step=2, use_step=2))


def test_the_baseline_schedules_of_the_program_are_valid():
    assert validate(program(), keep_all(program())) == ()
    assert found(*A_ROUND_TRIP) == []
    assert found(Prefetch(buffer=W, issue_step=0, use_step=0), host_inputs={W}) == []


# -- unknown-buffer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [Prefetch(buffer=9, issue_step=0, use_step=0), Offload(buffer=9, after_step=0, done_before_step=None)],
    ids=["prefetch", "offload"],
)
def test_a_move_naming_a_buffer_the_program_lacks_is_reported(move):
    assert found(move) == [("unknown-buffer", None, 9)]
    assert "a move names buffer 9, but the program has 6" in messages(move)


# -- bad-offload -------------------------------------------------------------------------------------


def test_copying_out_an_input_is_refused_in_favour_of_placing_it_on_host():
    move = Offload(buffer=W, after_step=0, done_before_step=1)
    assert found(move) == [("bad-offload", 0, W)]
    assert "buffer 0 (w) is an input: place it on host instead of copying it out" in messages(move)


def test_copying_out_a_constant_is_a_bad_offload():
    assert found(Offload(buffer=K, after_step=0, done_before_step=1)) == [("bad-offload", 0, K)]


def test_copying_out_a_constant_says_constants_stay_on_the_device():
    text = messages(Offload(buffer=K, after_step=0, done_before_step=1))
    assert "(k) is a constant" in text and "place it on host" not in text


def test_a_second_offload_of_the_same_value_is_refused():
    twice = (A_ROUND_TRIP[0], *A_ROUND_TRIP)
    assert found(*twice) == [("bad-offload", 0, A)]
    assert "buffer 2 (a) is offloaded twice" in messages(*twice)


@pytest.mark.parametrize(
    ("after_step", "where"),
    [(4, "outside steps 0..3"), (-1, "outside steps 0..3")],
    ids=["past-the-end", "before-the-start"],
)
def test_an_offload_outside_the_steps_where_the_value_exists_is_refused(after_step, where):
    move = Offload(buffer=A, after_step=after_step, done_before_step=None)
    assert found(move) == [("bad-offload", after_step, A)]
    assert f"buffer 2 (a) is offloaded after step {after_step}, {where} where it exists" in messages(move)


def test_an_offload_before_the_value_is_defined_is_refused():
    move = Offload(buffer=D, after_step=1, done_before_step=None)
    assert found(move) == [("bad-offload", 1, D)]
    assert "outside steps 3..3 where it exists" in messages(move)


@pytest.mark.parametrize("done_before_step", [1, 0, 4], ids=["at-its-start", "before-its-start", "past-the-end"])
def test_an_offload_must_complete_after_it_starts_and_within_the_program(done_before_step):
    move = Offload(buffer=A, after_step=1, done_before_step=done_before_step)
    assert found(move) == [("bad-offload", 1, A)]
    assert f"has its offload done before step {done_before_step}, not after it starts (step 1)" in messages(move)


# -- bad-prefetch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("issue_step", "use_step"), [(2, 1), (0, 4), (-1, 0)], ids=["issued-after-its-use", "use-past-the-end", "negative"]
)
def test_a_prefetch_issued_after_its_use_or_outside_the_program_is_refused(issue_step, use_step):
    move = Prefetch(buffer=W, issue_step=issue_step, use_step=use_step)
    assert found(move) == [("bad-prefetch", issue_step, W)]
    assert f"buffer 0 (w) is prefetched at step {issue_step} for step {use_step}" in messages(move)


def test_a_prefetch_must_name_the_first_read_it_serves():
    # w lives on host; fetched at step 0, the copy serves step 0's read first, not step 1's.
    move = Prefetch(buffer=W, issue_step=0, use_step=1)
    assert found(move, host_inputs={W}) == [("bad-prefetch", 0, W)]
    assert "prefetched for step 1, but the first read it serves is at step 0" in messages(move, host_inputs={W})


# -- prefetch-without-host-copy ----------------------------------------------------------------------


def test_fetching_a_value_never_copied_out_is_refused():
    move = Prefetch(buffer=A, issue_step=2, use_step=2)
    assert found(move) == [("prefetch-without-host-copy", 2, A)]
    assert "buffer 2 (a) is prefetched at step 2 but it was never offloaded" in messages(move)


def test_fetching_a_value_before_its_offload_completes_is_refused():
    moves = (Offload(buffer=A, after_step=0, done_before_step=2), Prefetch(buffer=A, issue_step=1, use_step=2))
    # Its device copy is held until the offload completes: the early fetch would also be a second copy.
    assert found(*moves) == [("prefetch-without-host-copy", 1, A), ("prefetch-while-resident", 1, A)]
    assert "buffer 2 (a) is prefetched at step 1 before its offload completes (step 2)" in messages(*moves)


def test_fetching_a_value_no_later_than_its_definition_is_refused():
    moves = (A_ROUND_TRIP[0], Prefetch(buffer=A, issue_step=0, use_step=2))
    assert ("prefetch-without-host-copy", 0, A) in found(*moves)
    assert "buffer 2 (a) is prefetched at step 0 before it is defined at step 0" in messages(*moves)


def test_fetching_a_constant_is_refused():
    move = Prefetch(buffer=K, issue_step=2, use_step=2)
    assert found(move) == [("prefetch-without-host-copy", 2, K), ("prefetch-while-resident", 2, K)]
    assert "buffer 1 (k) is prefetched at step 2 but constants stay on the device" in messages(move)


# -- prefetch-while-resident -------------------------------------------------------------------------


def test_fetching_an_input_kept_on_the_device_is_a_second_copy_of_a_resident_value():
    # A kept input is on the device for the whole step; a fetch of it has no host copy either.
    move = Prefetch(buffer=W, issue_step=1, use_step=1)
    assert found(move) == [("prefetch-without-host-copy", 1, W), ("prefetch-while-resident", 1, W)]
    assert "buffer 0 (w) is prefetched at step 1 while its device copy is still held (until step 3)" in messages(move)


# -- unused-prefetch ---------------------------------------------------------------------------------


def test_a_prefetch_no_read_uses_is_reported():
    # a's last read is step 2: a copy fetched at step 3 serves nothing.
    moves = (*A_ROUND_TRIP, Prefetch(buffer=A, issue_step=3, use_step=3))
    assert found(*moves) == [("unused-prefetch", 3, A)]
    assert "buffer 2 (a) is prefetched at step 3 but no read uses that copy" in messages(*moves)


# -- read-not-resident -------------------------------------------------------------------------------


def test_a_read_of_a_value_not_on_the_device_is_reported_at_its_first_read():
    # w lives on host and is fetched only for step 1: step 0's read finds nothing.
    move = Prefetch(buffer=W, issue_step=1, use_step=1)
    assert found(move, host_inputs={W}) == [("read-not-resident", 0, W)]
    assert "step 0 reads buffer 0 (w), which is not on the device" in messages(move, host_inputs={W})


# -- bad-home ----------------------------------------------------------------------------------------


def test_only_an_input_may_live_on_host():
    assert found(host_inputs={A}) == [("bad-home", None, A)]
    assert "buffer 2 (a) is placed on host but is a computed, not an input" in messages(host_inputs={A})


def test_only_an_output_with_a_host_copy_may_be_returned_on_host():
    # d is an output but never copied out; a is copied out but is not an output.
    assert found(host_outputs={D}) == [("bad-home", None, D)]
    assert found(*A_ROUND_TRIP, host_outputs={A}) == [("bad-home", None, A)]
    assert "buffer 5 (d) is returned on host but is not an output with a host copy" in messages(host_outputs={D})


# -- over-budget -------------------------------------------------------------------------------------


def test_each_run_of_steps_over_the_budget_is_one_violation_at_its_worst_step():
    device = [b // MiB for b in simulate(program(), keep_all(program())).device_bytes]
    assert device == [4, 6, 7, 4]  # w, k held throughout; a, b until h; c, d from h and j
    one_step = validate(program(), schedule(budget_bytes=6 * MiB))
    assert one_step == (
        Violation(
            kind="over-budget",
            step=2,
            message="device bytes exceed the budget of 6 MiB at step 2 (peak 7 MiB at step 2)",
        ),
    )
    run = validate(program(), schedule(budget_bytes=5 * MiB))
    assert [(v.kind, v.step) for v in run] == [("over-budget", 2)]
    assert "at steps 1..2 (peak 7 MiB at step 2)" in run[0].message
    assert validate(program(), schedule(budget_bytes=7 * MiB)) == ()


def test_runs_over_the_budget_separated_by_a_step_within_it_are_reported_apart():
    # Scratch of 3 MiB on f and j: at a 6 MiB budget f is over, g is not, h and j are.
    sizes = {"w": MiB, "k": MiB, "a": 2 * MiB, "b": 2 * MiB, "c": MiB, "d": MiB}
    ops = [("f", ["w"], ["a"]), ("g", ["w"], ["b"]), ("h", ["a", "b", "w", "k"], ["c"]), ("j", ["c"], ["d"])]
    spiky = Program.from_ops(
        ops, sizes, inputs=["w"], constants=["k"], outputs=["d"], transient={0: 3 * MiB, 3: 3 * MiB}
    )
    assert [b // MiB for b in simulate(spiky, keep_all(spiky)).device_bytes] == [7, 6, 7, 7]
    violations = validate(spiky, schedule(budget_bytes=6 * MiB))
    assert [(v.kind, v.step) for v in violations] == [("over-budget", 0), ("over-budget", 2)]
    assert "at step 0 (peak 7 MiB at step 0)" in violations[0].message
    assert "at steps 2..3 (peak 7 MiB at step 2)" in violations[1].message
