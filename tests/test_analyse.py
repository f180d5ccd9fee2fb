"""The costs analyse.py gives higher-order primitives: bodies' flops and scratch, per primitive's rule.

Flops are worked out by hand from the rules: ``dot_general`` of two 8x8 matrices is 2·8·8·8 = 1024,
every other primitive one per output element (``sin`` of an 8x8 matrix 64, a scalar counter's ``add``
or ``lt`` 1).
"""

import jax
import jax.numpy as jnp
import pytest

import oocjax
from oocjax import UnsupportedPrimitiveError
from oocjax.transforms import analyse

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


def doubled_in_a_shard_map(a):
    mesh = jax.make_mesh((1,), ("x",))
    return jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(a)


def test_an_unknown_higher_order_primitive_gets_the_default_rule_which_refuses_it():
    with pytest.raises(UnsupportedPrimitiveError, match=r"'shard_map' \(at test_analyse\.py:\d+ "):
        steps_of(doubled_in_a_shard_map, jnp.ones(4))


def test_the_rule_the_refusal_suggests_lets_the_primitive_be_analysed(monkeypatch):
    monkeypatch.setattr(analyse, "primitive_rules", dict(analyse.primitive_rules))  # undone after the test
    with pytest.raises(UnsupportedPrimitiveError) as refused:
        steps_of(doubled_in_a_shard_map, jnp.ones(4))
    suggested = str(refused.value).splitlines()[-1].strip()
    assert suggested.startswith("oocjax.transforms.analyse.primitive_rules['shard_map'] = ")
    exec(suggested, {"oocjax": oocjax})
    assert the_step("shard_map", doubled_in_a_shard_map, jnp.ones(4)).flops == 4  # its body's multiply
