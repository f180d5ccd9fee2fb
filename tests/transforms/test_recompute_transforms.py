"""Recomputation on real steps: dead code is gone before planning, only effect-free equations may run
twice, a planner rewrite becomes equations that compute what jax.jit computes, and a copy stays a
copy when it shares a compiled segment with its original."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oocjax import ooc_jit, to_device
from oocjax.schedule import chain_of, keep_all
from oocjax.schedule.rewrite import recompute_program
from oocjax.schedule.segments import cut_segments
from oocjax.transforms import analyse
from oocjax.transforms.analyse import to_program
from oocjax.transforms.functions import chain_function, segment_functions
from oocjax.transforms.recompute import apply_rewrite, recomputable_steps, why_not_recomputable
from oocjax.transforms.trace import trace_step

W1 = jnp.linspace(-1, 1, 64 * 32).reshape(64, 32)
W2 = jnp.linspace(1, -1, 32 * 16).reshape(32, 16)
X = jnp.linspace(-2, 2, 128 * 64).reshape(128, 64)


def mlp_loss(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return (jnp.tanh(h @ w2) ** 2).mean()


MLP_STEP = jax.value_and_grad(mlp_loss, argnums=(0, 1))


def names(traced):
    return [step.name for step in traced.program.steps]


# -- dead code ---------------------------------------------------------------------------------------


def with_dead_values(mask, a, b):
    unused = jnp.where(mask, jnp.exp(a), b)  # computed, never read
    del unused
    return jnp.sin(a) * b


def test_a_value_nobody_reads_has_no_step_and_the_chain_that_built_it_dies_with_it():
    mask, a, b = jnp.arange(8) % 2 == 0, jnp.linspace(0, 1, 8), jnp.linspace(1, 2, 8)
    traced = trace_step(with_dead_values, mask, a, b)
    assert names(traced) == ["sin", "mul"]
    assert traced.flat.dead_equations == 2  # exp, then the select_n that was its only reader
    np.testing.assert_array_equal(
        np.asarray(to_device(ooc_jit(with_dead_values, budget=2**62)(mask, a, b))),
        jax.jit(with_dead_values)(mask, a, b),
    )


def masked_softmax_loss(x):
    """A causal mask applied with ``where``: its backward builds the cotangent of the constant branch,
    which nobody reads."""
    mask = jnp.tril(jnp.ones((x.shape[-1], x.shape[-1]), bool))
    return jax.nn.softmax(jnp.where(mask, x, -1e9), axis=-1).sum()


def test_every_computed_value_of_a_masked_softmax_gradient_is_read_or_returned():
    x = jnp.linspace(-1, 1, 4 * 16 * 16).reshape(4, 16, 16)
    program = trace_step(jax.grad(masked_softmax_loss), x).program
    unread = [
        f"{b}: {buffer.label}"
        for b, buffer in enumerate(program.buffers)
        if buffer.kind == "computed" and not buffer.is_output and not program.uses.read_at[b]
    ]
    assert unread == []
    np.testing.assert_allclose(
        np.asarray(to_device(ooc_jit(jax.grad(masked_softmax_loss), budget=2**62)(x))),
        jax.jit(jax.grad(masked_softmax_loss))(x),
        rtol=1e-6,
        atol=1e-7,
    )


def test_dead_code_elimination_keeps_arguments_constants_and_buffer_ids_coherent():
    def step(a, b):
        dead = jnp.cos(a) + jnp.asarray([1.0, 2.0, 3.0])  # a constant only dead code reads
        del dead
        return a * jnp.asarray([4.0, 5.0, 6.0]), b

    flat = analyse.flatten(jax.make_jaxpr(step)(jnp.ones(3), jnp.ones(3)))
    assert flat.num_inputs == 2 and flat.outputs[1] == 1  # arguments keep their ids
    assert len(flat.constants) == 1 and len(flat.avals) == 4  # a, b, the live constant, the product
    assert flat.equations[0].inputs == (0, flat.constants[0][0]) and flat.equations[0].outputs == (3,)


def test_an_equation_with_effects_stays_though_nobody_reads_its_result():
    def step(x):
        jax.debug.print("x = {}", x)
        jax.experimental.io_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x)
        return x * 2

    assert names(trace_step(step, 1.0)) == ["debug_print", "io_callback", "mul"]


# -- which equations may run twice -------------------------------------------------------------------


def verdicts(fun, *args):
    flat = analyse.flatten(jax.make_jaxpr(fun)(*args), unroll=False)
    return [(fe.eqn.primitive.name, ok) for fe, ok in zip(flat.equations, recomputable_steps(flat))]


def test_random_numbers_from_an_explicit_key_may_be_recomputed():
    assert all(ok for _, ok in verdicts(lambda k: jax.random.bernoulli(k, 0.5, (4,)), jax.random.key(0)))


def test_transfers_stateful_draws_and_effects_may_not_run_twice():
    def step(x):
        jax.debug.print("x = {}", x)
        host = jax.device_put(x, jax.memory.Space.Host)
        return host, jax.lax.rng_uniform(0.0, 1.0, (3,)), jnp.sin(x)

    assert verdicts(step, jnp.ones(3)) == [
        ("debug_print", False),
        ("device_put", False),
        ("rng_uniform", False),
        ("sin", True),
    ]


def test_an_opaque_loop_may_run_twice_unless_its_body_may_not():
    pure = verdicts(
        lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c) @ W2 @ W2.T, None), x, None, length=3)[0], X[:, :32]
    )
    assert pure == [("scan", True)]

    def printing(x):
        def body(c, _):
            jax.debug.print("c = {}", c)
            return jnp.sin(c), None

        return jax.lax.scan(body, x, None, length=3)[0]

    assert verdicts(printing, 1.0) == [("scan", False)]
    eqn = jax.make_jaxpr(printing)(1.0).eqns[0]
    assert re.match(
        r"it has effects \(.*Debug.*\): running it twice would perform them twice", why_not_recomputable(eqn)
    )


def test_a_body_holding_a_transfer_is_refused_with_the_reason():
    def staged(x):
        return jax.lax.cond(x.sum() > 0, lambda v: jax.device_put(v, jax.memory.Space.Device), jnp.cos, x)

    eqn = next(e for e in jax.make_jaxpr(staged)(jnp.ones(3)).eqns if e.primitive.name == "cond")
    assert why_not_recomputable(eqn) == (
        "its cond body holds an equation that may not run twice: it is a transfer (device_put): "
        "a copy would move its bytes again"
    )


# -- the rewrite as equations ------------------------------------------------------------------------


def rewritten_mlp():
    """The MLP step with the first layer's matmul (``a``) and ``tanh`` (``h``) dropped after the
    forward and recomputed before the backward reads ``h``."""
    traced = trace_step(MLP_STEP, W1, W2, X)
    flat = traced.flat
    [dot] = [fe for fe in flat.equations if fe.eqn.primitive.name == "dot_general" and fe.inputs == (2, 0)]
    [tanh] = [fe for fe in flat.equations if fe.inputs == dot.outputs]
    reads_of_h = traced.program.uses.read_at[tanh.outputs[0]]
    turn = reads_of_h[1] + 1  # after the forward's last read of h, before the backward's first
    assert turn < reads_of_h[2]
    ok = recomputable_steps(flat)
    rewrite = recompute_program(traced.program, [*dot.outputs, *tanh.outputs], recomputable=ok.__getitem__, across=turn)
    assert rewrite.recomputed == (*dot.outputs, *tanh.outputs) and len(rewrite.copied_steps) == 2
    return traced, rewrite, apply_rewrite(flat, rewrite)


def test_the_rewritten_flat_program_is_the_rewritten_program_step_for_step():
    _, rewrite, flat = rewritten_mlp()
    program = to_program(flat, input_labels=["w1", "w2", "x"], donated=[False] * 3)
    assert [(s.reads, s.writes, s.name) for s in program.steps] == [
        (s.reads, s.writes, s.name) for s in rewrite.program.steps
    ]
    copies = [i for i, fe in enumerate(flat.equations) if fe.recompute_of is not None]
    assert copies == list(rewrite.copied_steps)
    for i in copies:
        original = flat.equations[flat.equations[i].recompute_of]
        assert original.eqn is flat.equations[i].eqn and original.recompute_of is None
        assert original.outputs != flat.equations[i].outputs  # fresh buffers


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # inputs XLA cannot reuse
@pytest.mark.parametrize("segments", [1, 3])
def test_the_rewritten_step_computes_what_jax_jit_computes(segments):
    _, rewrite, flat = rewritten_mlp()
    schedule = keep_all(rewrite.program)
    cut = cut_segments(rewrite.program, schedule, budget_bytes=2**62, min_segments=segments)
    assert len(cut) == segments
    chain = chain_function(
        flat, chain_of(rewrite.program, schedule, cut, flat.result_buffers), segment_functions(flat, cut)
    )
    loss, (g1, g2) = jax.jit(MLP_STEP)(W1, W2, X)
    for actual, expected in zip(chain(W1, W2, X), (loss, g1, g2)):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-6, atol=1e-7)


def test_a_rewrite_of_another_program_is_refused():
    _, rewrite, _ = rewritten_mlp()
    other = trace_step(lambda x: jnp.sin(x) * 2, jnp.ones(3)).flat
    with pytest.raises(ValueError, match="the rewrite was not made from this flat program"):
        apply_rewrite(other, rewrite)


# -- XLA must not merge a copy with its original -----------------------------------------------------


def one_segment(flat, rewrite):
    (segment,) = cut_segments(rewrite.program, keep_all(rewrite.program), budget_bytes=2**62)
    (function,) = segment_functions(flat, (segment,))
    return function.lower(*({0: W1, 1: W2, 2: X}[b] for b in segment.inputs))


def copies_in(text):
    """The operations of copies (their name stack says ``oocjax.recompute``), by primitive."""
    return sorted(re.findall(r'(?:op_name=|loc\()"[^"]*oocjax\.recompute[^"]*/(dot_general|tanh)"', text))


def test_a_copy_in_the_segment_of_its_original_reads_its_operands_through_a_barrier():
    _, rewrite, flat = rewritten_mlp()
    lowered = one_segment(flat, rewrite)
    [barrier] = [line for line in lowered.as_text().splitlines() if "optimization_barrier" in line]
    # One per group of consecutive copies: x and w1 (the dot's operands), and the result of the
    # step before the group (f32[128,16]), which keeps XLA from running the copies earlier.
    assert barrier.endswith(": tensor<128x64xf32>, tensor<64x32xf32>, tensor<128x16xf32>")
    assert lowered.as_text().count("stablehlo.tanh") == 3  # two layers' forward, and the copy
    assert copies_in(lowered.as_text(debug_info=True)) == ["dot_general", "tanh"]
    unguarded = dataclasses.replace(
        flat, equations=tuple(dataclasses.replace(fe, recompute_of=None) for fe in flat.equations)
    )
    assert "optimization_barrier" not in one_segment(unguarded, rewrite).as_text()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA:CPU drops barriers before its last CSE pass")
def test_the_copies_survive_xla_common_subexpression_elimination_on_a_gpu():
    # XLA:GPU expands optimization barriers only after scheduling, so what it compiles is what the
    # rewrite says. (XLA:CPU expands them before a later CSE pass, which merges the copies again.)
    _, rewrite, flat = rewritten_mlp()
    compiled = one_segment(flat, rewrite).compile().as_text()
    assert set(copies_in(compiled)) == {"dot_general", "tanh"}


def test_a_copy_is_named_for_the_value_it_computes_again_in_the_compiled_metadata():
    _, rewrite, flat = rewritten_mlp()
    (segment,) = cut_segments(rewrite.program, keep_all(rewrite.program), budget_bytes=2**62)
    labels = [buffer.label for buffer in rewrite.program.buffers]
    (function,) = segment_functions(flat, (segment,), labels)
    text = function.lower(*({0: W1, 1: W2, 2: X}[b] for b in segment.inputs)).as_text(debug_info=True)
    recomputed = {labels[b].removeprefix("recompute of ") for b in rewrite.recomputed}
    assert recomputed and all(f"oocjax.recompute({label}" in text for label in recomputed), recomputed
