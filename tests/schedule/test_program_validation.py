"""A Program checks itself on construction: each malformed one is refused with a message that says
what is wrong, with the step and buffer to look at."""

import re
from dataclasses import replace

import pytest

from oocjax.schedule import Buffer, Program, Step


def computed(nbytes: int = 8, **kw) -> Buffer:
    return Buffer(nbytes=nbytes, kind="computed", **kw)


def argument(nbytes: int = 8, **kw) -> Buffer:
    return Buffer(nbytes=nbytes, kind="input", **kw)


def refused(steps, buffers, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Program(steps=tuple(steps), buffers=tuple(buffers))


def test_a_well_formed_program_is_accepted():
    program = Program(
        steps=(Step(reads=(0,), writes=(1,), name="f"), Step(reads=(0, 1), writes=(2,), name="g")),
        buffers=(
            argument(donated=True),
            computed(),
            computed(is_output=True, aliased_input=0),
        ),
    )
    assert program.uses.defined_at == (None, 0, 1)
    assert program.uses.read_at == ((0, 1), (1,), ())


def test_a_step_naming_a_buffer_that_does_not_exist_is_refused():
    message = "step 0 names buffer {}, but there are 2 buffers"
    refused([Step(reads=(3,), writes=(1,), name="f")], [argument(), computed()], message.format(3))
    refused([Step(reads=(0,), writes=(2,), name="f")], [argument(), computed()], message.format(2))


def test_a_negative_buffer_id_is_refused_rather_than_read_from_the_end():
    # Python would happily index buffers[-1]: the check must not.
    refused([Step(reads=(-1,), writes=(1,), name="f")], [argument(), computed()], "step 0 names buffer -1")


def test_a_read_before_the_definition_names_the_step_its_source_line_and_the_buffer():
    steps = [
        Step(reads=(0,), writes=(1,), name="f"),
        Step(reads=(2,), writes=(3,), name="dot_general", label="model.py:42"),
        Step(reads=(1,), writes=(2,), name="g"),
    ]
    buffers = [argument(), computed(), computed(), computed()]
    refused(steps, buffers, "step 1 (dot_general at model.py:42) reads buffer 2 before it is defined")


def test_a_step_reading_its_own_result_is_a_read_before_the_definition():
    refused([Step(reads=(0,), writes=(0,), name="f")], [computed()], "step 0 (f) reads buffer 0 before it is defined")


def test_a_read_listed_twice_is_refused():
    refused(
        [Step(reads=(0, 0), writes=(1,), name="add")],
        [argument(), computed()],
        "step 0 (add) lists a read twice: (0, 0)",
    )


def test_a_second_definition_of_a_computed_value_is_refused():
    steps = [Step(reads=(), writes=(0,), name="f"), Step(reads=(), writes=(0,), name="g")]
    refused(steps, [computed()], "step 1 (g) redefines computed buffer 0")


def test_writing_an_input_or_a_constant_is_refused():
    refused([Step(reads=(), writes=(0,))], [argument()], "step 0 (step) redefines input buffer 0")
    refused([Step(reads=(), writes=(0,), name="f")], [Buffer(nbytes=4, kind="constant")], "redefines constant buffer 0")


def test_a_computed_value_no_step_defines_is_refused_with_its_label():
    refused([Step(reads=(), writes=(0,), name="f")], [computed(), computed(label="h[3]")], "computed buffer 1 (h[3])")
    refused([], [computed()], "computed buffer 0 (unlabelled) is never defined")


def test_a_negative_size_is_refused():
    refused([Step(reads=(), writes=(0,))], [computed(nbytes=-4)], "buffer 0 has a negative size -4")


def test_only_an_input_may_be_donated():
    refused(
        [Step(reads=(), writes=(0,))],
        [computed(donated=True)],
        "buffer 0 is donated or held by the caller but is not an input",
    )
    refused(
        [],
        [Buffer(nbytes=4, kind="constant", donated=True)],
        "buffer 0 is donated or held by the caller but is not an input",
    )


@pytest.mark.parametrize(
    ("buffers", "why"),
    [
        ([argument(), computed(is_output=True, aliased_input=0)], "the input is not donated"),
        ([argument(donated=True), computed(aliased_input=0)], "the aliasing buffer is not an output"),
        ([argument(donated=True), computed(is_output=True, aliased_input=5)], "there is no buffer 5"),
        ([argument(donated=True), computed(is_output=True, aliased_input=-1)], "a negative id"),
    ],
    ids=["not-donated", "not-an-output", "out-of-range", "negative"],
)
def test_an_alias_must_pair_an_output_with_a_donated_input(buffers, why):
    alias = buffers[1].aliased_input
    refused(
        [Step(reads=(0,), writes=(1,), name="f")],
        buffers,
        f"buffer 1 aliases {alias}, which is not a donated input of an output",
    )


def test_from_ops_builds_the_same_checked_program():
    with pytest.raises(ValueError, match=r"step 0 \(f\) reads buffer 1 before it is defined"):
        Program.from_ops([("f", ["b"], ["a"]), ("g", [], ["b"])], {"a": 1, "b": 1})


def test_only_an_input_may_be_held_by_the_caller_and_never_also_donated():
    refused([], [Buffer(nbytes=4, kind="constant", held_by_caller=True)], "is donated or held by the caller but is not")
    both = Buffer(nbytes=4, kind="input", donated=True, held_by_caller=True)
    refused([], [both], "buffer 0 is both donated and held by the caller")


def test_an_input_the_caller_holds_never_moves_whatever_its_size():
    held = Buffer(nbytes=2**30, kind="input", held_by_caller=True)
    assert held.never_moves(min_offload_bytes=1) and not replace(held, held_by_caller=False).never_moves(1)
