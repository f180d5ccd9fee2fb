"""The chain of segments replayed on a fake device (``check_segments``): every plan's chain runs,
and each way a chain can break is caught, named and placed.

The hand-made chains use this program (sizes in MiB); w is a kept input, d the output:

    step 0  f: w       -> a (2)
    step 1  g: a       -> b (1)
    step 2  h: w       -> c (1)
    step 3  k: a, b, c -> d (1)

and this plan: a is offloaded after g (its next read, k, is two steps away), the copy is done
before h, and a is fetched back for k. Its segments: [f] [g, offloads a] [waits for a, h]
[prefetches a, k].
"""

from dataclasses import replace

from hypothesis import example, given
from hypothesis import strategies as st

from oocjax.schedule import (
    Buffer,
    Offload,
    Prefetch,
    Program,
    Schedule,
    Step,
    keep_all,
    plan_window,
    required_bytes,
    simulate,
    validate,
)
from oocjax.schedule.chain import check_segments
from oocjax.schedule.segments import Segment, cut_segments
from oocjax.schedule.synthetic import layered_training_step
from tests.support.programs import MiB, an_offloaded_output_of_a_host_input, programs

W, A, B, C, D = range(5)


def program() -> Program:
    sizes = {"w": MiB, "a": 2 * MiB, "b": MiB, "c": MiB, "d": MiB}
    ops = [("f", ["w"], ["a"]), ("g", ["a"], ["b"]), ("h", ["w"], ["c"]), ("k", ["a", "b", "c"], ["d"])]
    return Program.from_ops(ops, sizes, inputs=["w"], outputs=["d"])


def schedule(*, host_w: bool = False) -> Schedule:
    """The plan above; with ``host_w``, w lives on host and is fetched for f, and again for h."""
    offload_a, fetch_a = (
        Offload(buffer=A, after_step=1, done_before_step=2),
        Prefetch(buffer=A, issue_step=3, use_step=3),
    )
    if not host_w:
        return Schedule(strategy="hand", budget_bytes=None, moves=(offload_a, fetch_a))
    fetch_w = [Prefetch(buffer=W, issue_step=k, use_step=k) for k in (0, 2)]
    moves = (fetch_w[0], offload_a, fetch_w[1], fetch_a)
    return Schedule(strategy="hand", budget_bytes=None, host_inputs=frozenset({W}), moves=moves)


def segments(*, host_w: bool = False) -> list[Segment]:
    """One segment per step."""
    return list(cut_segments(program(), schedule(host_w=host_w), budget_bytes=10 * MiB, min_segments=4))


def found(chain: list[Segment], *, host_w: bool = False) -> list[tuple[str, int | None, int | None]]:
    """(kind, step, buffer) of every violation, in the order the replay meets them."""
    return [(v.kind, v.step, v.buffer) for v in check_segments(program(), schedule(host_w=host_w), chain)]


def messages(chain: list[Segment], *, host_w: bool = False) -> list[str]:
    return [v.message for v in check_segments(program(), schedule(host_w=host_w), chain)]


def test_the_hand_made_plans_are_valid_and_their_chains_run():
    for host_w in (False, True):
        assert validate(program(), schedule(host_w=host_w)) == ()
        assert check_segments(program(), schedule(host_w=host_w), segments(host_w=host_w)) == ()
    chain = segments()
    assert [(s.start, s.stop) for s in chain] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [(s.inputs, s.outputs, s.donated) for s in chain] == [
        ((W,), (A,), ()),
        ((A,), (B,), ()),  # a is offloaded after g: not donated to it
        ((W,), (C,), ()),  # the caller keeps w: not donated to h
        ((A, B, C), (D,), (A, B, C)),
    ]
    assert (chain[1].offloads, chain[2].waits, chain[3].prefetches) == ((A,), (A,), (A,))


def test_a_segment_that_donates_a_buffer_offloaded_after_it_is_a_use_after_delete():
    chain = segments()
    chain[1] = replace(chain[1], donated=(A,))  # g reads a last before k, but a is offloaded after g
    assert found(chain) == [("use-after-donation", 1, A)]
    assert messages(chain) == [
        "buffer 1 (a) is offloaded after segment 1 (step 1), but segment 1 (step 1) consumed its device copy "
        "(it was donated there)"
    ]


def test_a_buffer_donated_and_read_again_is_a_use_after_delete():
    chain = segments()
    # a stays on the device from f to k (no offload, no wait, no prefetch), but g consumes it.
    chain[1] = replace(chain[1], donated=(A,), offloads=())
    chain[2] = replace(chain[2], waits=())
    chain[3] = replace(chain[3], prefetches=())
    assert found(chain) == [("use-after-donation", 3, A)]
    assert messages(chain) == [
        "buffer 1 (a) is read by segment 3 (step 3), but segment 1 (step 1) consumed its device copy "
        "(it was donated there)"
    ]


def test_an_output_donated_to_the_segment_that_reads_it_last_is_gone_when_the_step_returns_it():
    sizes = {"x": MiB, "y": MiB, "z": MiB}
    two = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"])], sizes, inputs=["x"], outputs=["y", "z"])
    chain = list(cut_segments(two, keep_all(two), budget_bytes=10 * MiB, min_segments=2))
    assert check_segments(two, keep_all(two), chain) == () and chain[1].donated == ()
    chain[1] = replace(chain[1], donated=(1,))
    assert [v.message for v in check_segments(two, keep_all(two), chain)] == [
        "buffer 1 (y) is returned on the device, but segment 1 (step 1) consumed its device copy (it was donated there)"
    ]


def test_a_prefetch_without_a_host_copy_is_caught_with_the_wait_that_has_nothing_to_wait_for():
    chain = segments()
    chain[1] = replace(chain[1], offloads=())  # a is never copied out
    assert found(chain) == [("missing-host-copy", 2, A), ("missing-host-copy", 3, A)]
    assert messages(chain) == [
        "buffer 1 (a) is waited for before segment 2 (step 2), but it has no host copy: no earlier segment offloads it",
        "buffer 1 (a) is prefetched before segment 3 (step 3), but it has no host copy: it is not a host input "
        "and no earlier segment offloads it",
    ]


def test_a_prefetch_issued_before_the_offload_that_makes_its_host_copy_is_caught():
    chain = segments()
    chain[1] = replace(chain[1], prefetches=(A,))  # before g runs, so before a's offload after g
    assert found(chain) == [("missing-host-copy", 1, A)]


def test_a_read_of_a_host_input_that_was_never_prefetched_is_caught():
    chain = segments(host_w=True)
    assert chain[0].prefetches == (W,) and chain[2].prefetches == (W,)
    chain[2] = replace(chain[2], prefetches=())  # h reads w, whose device copy f consumed
    assert found(chain, host_w=True) == [("use-after-donation", 2, W)]
    chain[0] = replace(chain[0], prefetches=())  # and f reads w, which is only on host
    assert found(chain, host_w=True)[0] == ("missing-device-copy", 0, W)
    assert messages(chain, host_w=True)[0] == (
        "buffer 0 (w) is read by segment 0 (step 0), but it is not on the device: it lives in host memory and no "
        "prefetch brings it in"
    )


def test_a_value_no_segment_hands_on_is_not_on_the_device_for_the_next():
    chain = segments()
    chain[2] = replace(chain[2], outputs=())  # h's c is read by k
    assert found(chain) == [("missing-device-copy", 3, C)]


def test_a_segment_that_donates_the_callers_kept_argument_is_caught():
    chain = segments()
    chain[2] = replace(chain[2], donated=(W,))  # h reads w last, but the caller keeps w
    assert found(chain) == [("donates-caller-buffer", 2, W)]
    assert messages(chain) == [
        "buffer 0 (w) is donated to segment 2 (step 2), but its device copy is the caller's (an argument the "
        "caller keeps)"
    ]


def test_segments_that_skip_steps_or_read_what_they_do_not_take_are_caught():
    chain = segments()
    del chain[2]  # h never runs: c is never made
    assert found(chain)[0] == ("bad-segment", 3, None)
    assert messages(chain)[0] == "segment 2 (step 3) should start at step 2, where the one before ends, and run a step"
    assert ("missing-device-copy", 3, C) in found(chain)
    undeclared = segments()
    undeclared[3] = replace(undeclared[3], inputs=(A, B))  # k reads c without taking it
    assert found(undeclared) == [("bad-segment", 3, C)]


def test_the_chain_of_a_plan_that_offloads_an_output_twice_consumes_it_before_the_second_offload():
    # The plan plan_window made for this program before its fix: y was offloaded after make_y and
    # again after use_y, to be returned on host. The segment of use_y read y last and consumed it.
    program = an_offloaded_output_of_a_host_input()
    x, y = 0, 1
    twice = Schedule(
        strategy="window",
        budget_bytes=MiB,
        host_inputs=frozenset({x}),
        host_outputs=frozenset({y}),
        moves=(
            Offload(buffer=y, after_step=0, done_before_step=10),
            Prefetch(buffer=y, issue_step=11, use_step=11),
            Offload(buffer=y, after_step=11, done_before_step=None),
        ),
    )
    chain = cut_segments(program, twice, budget_bytes=MiB)
    assert [(v.kind, v.step, v.buffer) for v in check_segments(program, twice, chain)] == [
        ("use-after-donation", 11, y)
    ]
    fixed = plan_window(program, MiB)
    assert check_segments(program, fixed, cut_segments(program, fixed, budget_bytes=MiB)) == ()


@st.composite
def training_states(draw) -> Program:
    """A random program (``tests.support.programs``) whose donated inputs are all replaced by outputs, as a
    training step replaces its parameters and optimizer state: a step after the others reads each
    one and a value of the program, and writes its new version. Half of them donate every input."""
    program = draw(programs())
    buffers, steps = list(program.buffers), list(program.steps)
    if draw(st.booleans()):
        buffers = [replace(b, donated=True) if b.kind == "input" else b for b in buffers]
    aliased = {b.aliased_input for b in buffers}
    computed = [b for b, buffer in enumerate(buffers) if buffer.kind == "computed"]
    for d, buffer in enumerate(list(buffers)):
        if not buffer.donated or d in aliased:
            continue
        reads = (d, draw(st.sampled_from(computed))) if computed else (d,)
        buffers.append(Buffer(nbytes=buffer.nbytes, is_output=True, aliased_input=d, label=f"new_{buffer.label}"))
        steps.append(Step(reads=reads, writes=(len(buffers) - 1,), flops=10**9, name=f"update_{buffer.label}"))
    return Program(steps=tuple(steps), buffers=tuple(buffers))


@st.composite
def training_steps(draw) -> Program:
    return layered_training_step(
        draw(st.integers(1, 3)),
        draw(st.integers(1, 4)),
        activation_bytes=draw(st.sampled_from([MiB, 4 * MiB])),
        param_bytes=draw(st.sampled_from([MiB // 2, MiB, 4 * MiB])),
    )


@given(
    st.one_of(programs(), training_states(), training_steps()),
    st.floats(0.0, 1.25),
    st.sampled_from([0, 10**9, 3 * 10**9, 10**15]),
    st.sampled_from([1, 1, 2, 3, 7]),
)
@example(an_offloaded_output_of_a_host_input(), 0.0, 0, 1)
def test_every_plan_cut_into_segments_gives_a_chain_that_runs(program, position, min_segment_flops, min_segments):
    low = max(required_bytes(program), default=0)
    high = simulate(program, keep_all(program)).peak_bytes
    budget = max(1, int(low + position * (high - low)))  # above the in-core peak too: nothing moves
    schedule = plan_window(program, budget)
    chain = cut_segments(
        program, schedule, budget_bytes=budget, min_segment_flops=min_segment_flops, min_segments=min_segments
    )
    assert validate(program, schedule) == ()
    assert check_segments(program, schedule, chain) == ()
