"""The costs analyse.py gives higher-order primitives: bodies' flops and scratch, per primitive's rule;
and the labels it gives values, as their users name them.

Flops are worked out by hand from the rules: ``dot_general`` of two 8x8 matrices is 2·8·8·8 = 1024,
every other primitive one per output element (``sin`` of an 8x8 matrix 64, a scalar counter's ``add``
or ``lt`` 1).
"""

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import oocjax
from oocjax import UnsupportedPrimitiveError, ooc_jit
from oocjax.transforms import analyse, rules
from oocjax.transforms.trace import trace_step
from tests.support.zoo import mlp_adam

W = jnp.linspace(-1, 1, 64).reshape(8, 8)
X = jnp.ones((8, 8))
DOT, SIN, SCALAR = 1024, 64, 1


def steps_of(fun, *args):
    # Scans stay whole here (a scan doing a layer's work is otherwise run per iteration): these
    # are the rules for loops that run as one operation.
    flat = analyse.flatten(jax.make_jaxpr(fun)(*args), unroll=False)
    labels = [str(i) for i in range(flat.num_inputs)]
    return analyse.to_program(flat, input_labels=labels, donated=[False] * flat.num_inputs).steps


def the_step(name, fun, *args):
    [step] = [s for s in steps_of(fun, *args) if s.name == name]
    return step


def layer(c):
    return jnp.sin(c @ W)


@pytest.mark.parametrize("length", [1, 4, 7])
def test_the_flops_of_a_scan_scale_with_its_length(length):
    step = the_step("scan", lambda x: jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=length)[0], X)
    assert step.flops == length * (DOT + SIN)


def test_a_cond_counts_its_largest_branch():
    step = the_step("cond", lambda p, x: jax.lax.cond(p, lambda c: c @ W, jnp.sin, x), True, X)
    assert step.flops == DOT


def counted_while(lower, upper, step=1):
    """A counted loop written by hand: bounds and step as literals."""
    return lambda x: jax.lax.while_loop(lambda c: c[0] < upper, lambda c: (c[0] + step, layer(c[1])), (lower, x))[1]


def fori_loop_given_bounds_through_a_jit_call(x):
    """Inside the jit the bound is a traced value (so a ``while``); the caller passes it as a literal."""
    loop = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: layer(c), x))
    return loop(x, 5)


WHILE_TRIP = SCALAR + DOT + SIN + SCALAR  # the counter's add, the layer, and the condition's lt


@pytest.mark.parametrize(
    ("name", "fun", "flops"),
    [
        # jax turns a fori_loop with Python int bounds into a scan of that length (no condition).
        ("scan", lambda x: jax.lax.fori_loop(0, 5, lambda i, c: layer(c), x), 5 * (SCALAR + DOT + SIN)),
        ("while", counted_while(2, 7), 5 * WHILE_TRIP),
        ("while", counted_while(0, 9, step=2), 5 * WHILE_TRIP),  # 0, 2, 4, 6, 8
        ("while", counted_while(7, 2), 0),
        ("while", fori_loop_given_bounds_through_a_jit_call, 5 * WHILE_TRIP),
    ],
    ids=[
        "fori_loop as a scan",
        "while from 2 to 7",
        "while from 0 to 9 by 2",
        "while from 7 to 2",
        "fori_loop in a jit",
    ],
)
def test_a_loop_with_static_bounds_counts_its_trip_count_times_its_body_flops(name, fun, flops):
    assert the_step(name, fun, X).flops == flops


def moving_bound(x):
    """Counts up while the bound counts down: a literal start, but the bound is not the literal's."""
    return jax.lax.while_loop(lambda c: c[0] < c[1], lambda c: (c[0] + 1, c[1] - 1, layer(c[2])), (0, 10, x))[2]


@pytest.mark.parametrize(
    ("fun", "args", "flops"),
    [
        # The condition is a sum (one scalar) and a lt (one scalar).
        (lambda x: jax.lax.while_loop(lambda c: c.sum() < 10, layer, x), (X,), DOT + SIN + 2 * SCALAR),
        (lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: layer(c), x), (X, 5), WHILE_TRIP),
        (moving_bound, (X,), WHILE_TRIP + SCALAR),  # and the bound's subtraction
    ],
    ids=["condition on data", "fori_loop bound by an argument", "bound changed by the body"],
)
def test_a_while_whose_trip_count_is_not_known_statically_counts_its_body_and_condition_once(fun, args, flops):
    assert the_step("while", fun, *args).flops == flops


def outer_product_rows(c):
    return jnp.outer(c, c).sum(0)


# The body's peak is at the multiply: its argument (256 B), the two broadcasts of it (256 B each) and
# their 64x64 product (16 KiB). Its scratch is that peak beyond its argument and its result (256 B each).
OUTER_PRODUCT_SCRATCH = 256 + 2 * 256 + 64 * 64 * 4 - 2 * 256


@pytest.mark.parametrize("length", [1, 3])
def test_the_scratch_of_a_scan_body_is_counted_once_whatever_its_length(length):
    def rows(x):
        return jax.lax.scan(lambda c, _: (outer_product_rows(c), None), x, None, length=length)[0]

    assert the_step("scan", rows, jnp.ones(64)).transient_bytes == OUTER_PRODUCT_SCRATCH


def test_a_cond_needs_the_scratch_of_its_largest_branch_only():
    def fewer_rows(c):  # a 64x8 product: some scratch, less than outer_product_rows's
        return jnp.outer(c, c[:8]).sum(1)

    def scratch(*branches):
        return the_step("cond", lambda p, x: jax.lax.cond(p, *branches, x), True, jnp.ones(64)).transient_bytes

    assert 0 < scratch(fewer_rows, fewer_rows) < OUTER_PRODUCT_SCRATCH
    assert scratch(outer_product_rows, fewer_rows) == scratch(fewer_rows, outer_product_rows) == OUTER_PRODUCT_SCRATCH


def test_a_primitive_without_a_rule_gets_one_flop_per_output_element():
    assert the_step("sin", jnp.sin, X).flops == SIN
    assert the_step("cumsum", jnp.cumsum, X).flops == SIN


def test_primitives_whose_jaxpr_params_only_combine_elements_are_not_refused():
    assert the_step("scatter-add", lambda x: x.at[jnp.array([1, 2])].add(1.0), X).transient_bytes == 0
    assert (
        the_step("reduce", lambda x: jax.lax.reduce(x, 0.0, lambda a, b: a + b, (0,)), X).flops == 8
    )  # one row of sums


def halved_by_a_custom_solve(b):
    return jax.lax.custom_linear_solve(lambda x: 2 * x, b, lambda matvec, v: v / 2)


def test_an_unknown_higher_order_primitive_gets_the_default_rule_which_refuses_it():
    with pytest.raises(UnsupportedPrimitiveError, match=r"'custom_linear_solve' \(at test_analyse\.py:\d+ "):
        steps_of(halved_by_a_custom_solve, jnp.ones(4))


def test_the_rule_the_refusal_suggests_lets_the_primitive_be_analysed():
    with pytest.raises(UnsupportedPrimitiveError) as refused:
        steps_of(halved_by_a_custom_solve, jnp.ones(4))
    suggested = str(refused.value).splitlines()[-1].strip()
    assert suggested.startswith("oocjax.transforms.rules.register_primitive('custom_linear_solve', ")
    exec(suggested, {"oocjax": oocjax})
    try:
        assert the_step("custom_linear_solve", halved_by_a_custom_solve, jnp.ones(4)).flops > 0
    finally:
        rules.unregister_primitive("custom_linear_solve")


# Labels: a value is named by the scope it was made in (a Flax module path), what made it as its user
# calls it, and the user's line; a result by where the step returns it.


def labels_of(fun, *args, **options):
    return [buffer.label for buffer in trace_step(fun, *args, **options).program.buffers]


def line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment), as labels cite it."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith(marker))


def thresholded(x):
    with jax.named_scope("block"):
        h = jnp.where(x > 0.5, x * x, 0.0)  # where-line
    return jax.nn.relu(h).sum() + jax.nn.silu(h).sum()  # activations-line


def test_a_value_is_named_by_its_scope_by_what_its_user_called_and_by_the_users_line():
    labels = labels_of(jax.value_and_grad(thresholded), X)
    where, activations = line_of("# where-line"), line_of("# activations-line")
    expected = {
        f"block: output of > from test_analyse.py:{where} (thresholded)",
        # jnp.where is a jitted function: its body is inlined, its result named as the user called it,
        # inside the caller's scope and at the caller's line.
        f"block: output of where from test_analyse.py:{where} (thresholded)",
        f"output of relu from test_analyse.py:{activations} (thresholded)",  # custom_jvp_call
        f"output of silu from test_analyse.py:{activations} (thresholded)",  # an inlined jit
    }
    assert expected <= set(labels), sorted(set(labels))
    words = " ".join(labels)
    for internal in ("add_any", "custom_jvp_call", "select_n", " gt ", "logistic", "_where"):
        assert internal not in words, internal
    assert all(label.startswith(("argument ", "result", "block: ", "output of ")) for label in labels), labels


def test_every_equation_of_a_jitted_library_function_names_the_line_that_called_it():
    steps = trace_step(jax.value_and_grad(thresholded), X).program.steps
    assert steps and all(re.fullmatch(r"test_analyse\.py:\d+ \(thresholded\)", s.label) for s in steps), [
        (s.name, s.label) for s in steps if not s.label.startswith("test_analyse.py:")
    ]


def test_results_are_named_by_where_the_step_returns_them_as_arguments_are_by_where_they_are_given():
    def sgd(state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sin(x @ p["w"]).sum())(state)
        return {"w": state["w"] - 0.1 * grads["w"], "frozen": state["frozen"]}, loss

    labels = labels_of(sgd, {"w": W, "frozen": X}, X, donate_argnums=0)
    assert labels[:3] == ["argument state['frozen']", "argument state['w']", "argument x"]
    assert "result[0]['w']" in labels and "result[1]" in labels
    assert "result[0]['frozen']" not in labels, "returned as it is: still the argument"


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(8)(x))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(Layer)()(x)
        for _ in range(2):
            x = Layer()(x)
        return (nn.Dense(1)(x) ** 2).sum()


def flax_grad_labels() -> list[str]:
    model = Model()
    params = model.init(jax.random.key(0), X)
    return labels_of(jax.grad(model.apply), params, X)


def test_a_flax_value_is_named_by_its_module_path_without_the_models_own_root():
    labels = flax_grad_labels()
    scopes = {label.split(": ")[0] for label in labels if ": output of " in label}
    # The remat block's backward equations are named once, as the forward's are, not Model/Model/...
    assert scopes == {"CheckpointLayer_0", "CheckpointLayer_0/Dense_0", "Layer_0", "Layer_0/Dense_0"} | {
        "Layer_1",
        "Layer_1/Dense_0",
        "Dense_0",
    }, sorted(scopes)
    assert any(label.startswith("Layer_1/Dense_0: output of dot_general from test_analyse.py:") for label in labels)
    assert "result['params']['Layer_1']['Dense_0']['kernel']" in labels


def test_two_models_in_one_step_keep_their_roots():
    first, second = Layer(), Layer()
    a, b = first.init(jax.random.key(0), X), second.init(jax.random.key(1), X)

    def two(a, b, x):
        with jax.named_scope("student"):
            s = first.apply(a, x)
        with jax.named_scope("teacher"):
            t = second.apply(b, x)
        return ((s - t) ** 2).sum()

    scopes = {label.split(": ")[0] for label in labels_of(jax.grad(two), a, b, X) if ": output of " in label}
    assert {"student/Layer/Dense_0", "teacher/Layer/Dense_0"} <= scopes, sorted(scopes)


def test_a_users_own_scope_around_everything_stays_in_the_labels_and_so_does_one_around_a_vmap():
    def scoped(x):
        with jax.named_scope("inner"):
            return jnp.sin(x)

    def outer(x):
        with jax.named_scope("outer"):
            return jax.vmap(scoped)(x).sum()

    assert any(label.startswith("outer/inner: output of sin") for label in labels_of(outer, X))


def test_results_a_plan_keeps_on_host_are_named_as_the_state_arguments_they_replace():
    case = mlp_adam()
    in_core = ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes
    step = ooc_jit(case.step, budget=int(in_core * 0.35), donate_argnums=0, recompute="off", min_offload_bytes=4096)
    plan = step.plan(case.state, case.batches[0])
    arguments = {h.label.removeprefix("argument state") for h in plan.host_inputs}
    results = {label.removeprefix("result[0]") for label in plan.host_outputs}  # the step returns (state, metrics)
    assert plan.host_outputs and all(label.startswith("result[0][") for label in plan.host_outputs)
    assert results <= arguments, sorted(results - arguments)
    assert any(label.startswith("[0]['params']['Dense_") and label.endswith("['kernel']") for label in arguments)
