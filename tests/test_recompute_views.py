"""Every view of a plan says what is recomputed, where, at what extra work and what it saves; and the
summary says when JAX's softmax flag would keep less for the backward."""

import functools
import html
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.decoders import decoder_case
from oocjax import ooc_jit
from oocjax.plan import Plan
from oocjax.render import svg_timeline
from oocjax.schedule import format_bytes
from tests.support.plans import WIDE_PARAMS, WIDE_X, wide_mlp_step
from tests.support.zoo import transformer_dropout_adamw


@functools.cache
def wide_plan(recompute: str) -> Plan:
    """The 20-layer MLP at 50% of its in-core estimate (at 60% it fits with each tanh's derivative
    made in the backward pass, not the forward: nothing recomputed). "always": the recomputing plan
    whatever the timing says; "auto" picks by times simulated with this machine's measured rates, which vary
    from run to run, so it cannot be relied on to recompute."""
    in_core = ooc_jit(wide_mlp_step, budget=2**62).plan(WIDE_PARAMS, WIDE_X).baseline_peak_bytes
    step = ooc_jit(wide_mlp_step, budget=int(in_core * 0.5), min_offload_bytes=1024, recompute=recompute)
    return step.plan(WIDE_PARAMS, WIDE_X)


@functools.cache
def transformer_plan() -> Plan:
    """A Flax transformer with AdamW, traced with the softmax flag off (jax 0.10's default), planned
    with the published CPU rates, as every plan is: under some rates measured on this machine the
    selector recomputed every softmax's exp as well (67 values, where 47 to 51 keep them)."""
    case = transformer_dropout_adamw()
    with jax.softmax_custom_jvp(False):
        in_core = ooc_jit(case.step, budget=2**62, donate_argnums=(0,)).plan(case.state, case.batches[0])
        budget = int(in_core.baseline_peak_bytes * 0.6)
        step = ooc_jit(case.step, budget=budget, donate_argnums=(0,), min_offload_bytes=4096, recompute="always")
        return step.plan(case.state, case.batches[0])


@pytest.fixture
def plan() -> Plan:
    plan = wide_plan("always")
    assert len(plan.recomputed) >= 5 and plan.extra_flops > 0
    return plan


def segment_blocks(pretty: str) -> dict[tuple[int, int], list[str]]:
    """Per segment line shown, (first, last equation) -> that line and the lines after it up to
    the next segment."""
    blocks, current = {}, None
    for line in pretty.splitlines():
        match = re.match(r"segment \d+: equations (\d+)\.\.(\d+)", line)
        if match:
            current = blocks.setdefault((int(match[1]), int(match[2])), [])
        if current is not None:
            current.append(line)
    return blocks


def test_the_repr_counts_the_recomputed_values(plan):
    assert f", {len(plan.recomputed)} values recomputed, " in repr(plan)


def test_the_summary_says_how_many_values_are_recomputed_what_they_cost_and_what_they_save(plan):
    text = plan.summary()
    held = format_bytes(sum(r.nbytes for r in plan.recomputed))
    assert f"Recomputed: {len(plan.recomputed)} values, {held} not held on the device" in text
    step_flops = sum(s.flops for s in plan.program.steps) - plan.extra_flops  # the program holds the copies
    assert re.search(rf"extra work +\S+ [kMG]?FLOP, {100 * plan.extra_flops / step_flops:.3g}% of the step's", text)
    assert "swap only would take" in text and "a model, not a measurement" in text
    largest = max(plan.recomputed, key=lambda r: r.nbytes)
    row = re.compile(rf"{format_bytes(largest.nbytes)} +{largest.dropped_after} +{largest.recomputed_at} +")
    assert any(row.search(line) and line.endswith(largest.label) for line in text.splitlines())
    assert all(r.dropped_after < r.recomputed_at for r in plan.recomputed)


def test_the_pretty_view_names_each_recomputed_value_in_the_segment_that_computes_it_again(plan):
    pretty = plan.pretty_jaxpr()
    blocks = segment_blocks(pretty)
    shown = 0
    for r in plan.recomputed:
        block = [lines for (first, last), lines in blocks.items() if first <= r.recomputed_at <= last]
        if not block:
            continue  # its segment is one of a run of segments alike, shown once
        shown += 1
        assert re.search(r", recomputes \d+ values?", block[0][0])
        said = f"recomputes {r.label} ({format_bytes(r.nbytes)}): dropped after equation {r.dropped_after}"
        assert any(said in line for line in block[0][1:])
    assert shown and pretty.count("+++   recomputes ") == shown
    assert shown + sum(hidden_recomputes(pretty)) == len(plan.recomputed)


def hidden_recomputes(pretty: str) -> list[int]:
    """Per run of segments shown once, how many values it says its hidden segments recompute."""
    runs = (re.search(r"^\.\.\. segments .*, recomputing (\d+) values?$", line) for line in pretty.splitlines())
    return [int(m[1]) for m in runs if m]


def test_a_run_of_segments_shown_once_says_how_many_values_it_recomputes():
    # A plain function over a list of weights: its layers recompute alike values, labelled alike.
    step_fn, state, batch = decoder_case("plain", 6)
    in_core = ooc_jit(step_fn, budget=2**62).plan(state, batch).baseline_peak_bytes
    plan = ooc_jit(step_fn, budget=int(in_core * 0.3), donate_argnums=0, min_offload_bytes=4096).plan(state, batch)
    pretty = plan.pretty_jaxpr()
    hidden = hidden_recomputes(pretty)
    assert hidden, "a run of layers alike that recompute is still shown once"
    assert pretty.count("+++   recomputes ") + sum(hidden) == len(plan.recomputed)


def test_a_saved_plan_lists_what_it_recomputes_and_a_full_one_brings_it_back(plan):
    saved = json.loads(plan.to_json())
    assert [r["recomputed_at"] for r in saved["recomputed"]] == [r.recomputed_at for r in plan.recomputed]
    assert {r["label"] for r in saved["recomputed"]} == {r.label for r in plan.recomputed}
    assert saved["extra_flops"] == plan.extra_flops and saved["step_time_s"] == plan.step_time_s
    loaded = Plan.from_json(plan.to_json(full=True))
    assert (loaded.recomputed, loaded.extra_flops) == (plan.recomputed, plan.extra_flops)
    assert (loaded.step_time_s, loaded.swap_only_time_s) == (plan.step_time_s, plan.swap_only_time_s)
    # The in-core peak is the step's as traced, not that of the program with its copies.
    assert loaded.baseline_peak_bytes == plan.baseline_peak_bytes
    assert f"Recomputed: {len(plan.recomputed)} values" in loaded.summary()


def test_the_html_view_marks_where_values_are_recomputed_counting_them_and_naming_the_largest(plan):
    page = plan._repr_html_()
    assert "Recomputed:" in page
    marks = re.findall(r'<circle class="recompute"[^>]*><title>([^<]*)</title>', page)
    counts = [int(re.match(r"(\d+) values? recomputed at equations? \d+", mark)[1]) for mark in marks]
    assert marks and sum(counts) == len(plan.recomputed)
    largest = max(plan.recomputed, key=lambda r: r.nbytes)
    assert any(html.escape(largest.label, quote=False) in mark for mark in marks)
    assert "recomputed (purple)" in svg_timeline(plan)


def test_the_plot_marks_recomputed_values_with_their_own_legend_entry(plan):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plan.plot()
    try:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["recomputed"].get_xdata()) == [r.recomputed_at for r in plan.recomputed]
        # The in-core curve is of the step as traced: its steps line up with the originals of the
        # program as it runs, skipping the copies.
        in_core = next(line for label, line in lines.items() if label.startswith("in-core"))
        copies = {r.recomputed_at for r in plan.recomputed}
        assert len(in_core.get_xdata()) == len(plan.baseline_timeline.device_bytes)
        assert set(in_core.get_xdata()) == set(range(len(plan.program.steps))) - copies
        assert "recomputed" in [text.get_text() for text in ax.get_legend().get_texts()]
        assert ax.get_title().endswith(f"{len(plan.recomputed)} values recomputed")
    finally:
        plt.close(ax.figure)


def test_with_recompute_off_no_view_mentions_recomputation():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = wide_plan("off")
    assert plan.recomputed == () and plan.extra_flops == 0
    assert "recomputed" not in repr(plan) and "Recomputed" not in plan.summary()
    assert "recomputes" not in plan.pretty_jaxpr()
    assert 'class="recompute"' not in plan._repr_html_() and "recomputed (purple)" not in plan._repr_html_()
    assert json.loads(plan.to_json())["recomputed"] == []
    ax = plan.plot()
    assert "recomputed" not in [line.get_label() for line in ax.get_lines()]
    plt.close(ax.figure)


# -- the softmax flag ------------------------------------------------------------------------------


def attention_step(w, x):
    def loss(w):
        q, k, v = x @ w[0], x @ w[1], x @ w[2]
        return ((jax.nn.softmax(q @ k.T / 8.0, axis=-1) @ v) ** 2).mean()

    return jax.grad(loss)(w)


W, X = jnp.ones((3, 64, 64)) / 64, jnp.ones((256, 64))  # one 256 x 256 float32 exp: 256 KiB


def test_with_the_softmax_flag_off_the_summary_says_what_turning_it_on_would_save():
    with jax.softmax_custom_jvp(False):
        text = ooc_jit(attention_step, budget=2**62).plan(W, X).summary()
    assert "Softmax: 1 softmax keeps its exp (256 KiB) for the backward" in text
    assert 'jax.config.update("jax_softmax_custom_jvp", True)' in text and "about 256 KiB less" in text
    assert not jax.config.jax_softmax_custom_jvp, "the summary only says it; it sets nothing"


def test_with_the_softmax_flag_on_the_summary_says_nothing_of_it():
    with jax.softmax_custom_jvp(True):
        text = ooc_jit(attention_step, budget=2**62).plan(W, X).summary()
    assert "Softmax" not in text and "jax_softmax_custom_jvp" not in text
    with jax.softmax_custom_jvp(False):
        traced_off = ooc_jit(attention_step, budget=2**62).plan(W, X)
    with jax.softmax_custom_jvp(True):  # turned on since: the advice is taken
        assert "jax_softmax_custom_jvp" not in traced_off.summary()


# -- a real model -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_transformers_plan_says_what_it_recomputes_and_what_its_four_softmaxes_keep():
    plan = transformer_plan()
    assert len(plan.recomputed) >= 10
    with jax.softmax_custom_jvp(False):
        text = plan.summary()
    assert f"Recomputed: {len(plan.recomputed)} values" in text
    largest = max(plan.recomputed, key=lambda r: r.nbytes)
    assert any(line.endswith(largest.label) and format_bytes(largest.nbytes) in line for line in text.splitlines())
    # Four attention layers, each a 16 x 4 x 32 x 32 float32 exp: 256 KiB.
    assert "Softmax: 4 softmaxes keep their exp (1 MiB) for the backward" in text
    assert pretty_names_every_recomputed_value(plan)
    copies = {r.recomputed_at for r in plan.recomputed}
    assert len(plan.baseline_timeline.device_bytes) + len(copies) == len(plan.program.steps)
    loaded = Plan.from_json(plan.to_json(full=True))
    assert loaded.recomputed == plan.recomputed and loaded.extra_flops == plan.extra_flops


def pretty_names_every_recomputed_value(plan: Plan) -> bool:
    """Each recomputed value is named in its segment's block, or counted on the line of a run of
    segments shown once."""
    pretty = plan.pretty_jaxpr()
    blocks, named = segment_blocks(pretty), 0
    for r in plan.recomputed:
        block = [lines for (first, last), lines in blocks.items() if first <= r.recomputed_at <= last]
        if block:
            named += 1
            if not any(f"recomputes {r.label} ({format_bytes(r.nbytes)})" in line for line in block[0]):
                return False
    return named > 0 and named + sum(hidden_recomputes(pretty)) == len(plan.recomputed)


def test_a_tanh_mlp_at_60_percent_makes_each_derivative_where_the_backward_pass_reads_it_and_says_so():
    """Each layer's 1 - tanh(h)**2 is made in the forward pass for the backward pass alone: the plan
    runs those equations in the backward pass instead, so nothing is copied or moved."""
    in_core = ooc_jit(wide_mlp_step, budget=2**62).plan(WIDE_PARAMS, WIDE_X).baseline_peak_bytes
    step = ooc_jit(wide_mlp_step, budget=int(in_core * 0.6), min_offload_bytes=1024)
    plan = step.plan(WIDE_PARAMS, WIDE_X)
    assert plan.postponed >= 20 and not plan.recomputed and plan.extra_flops == 0 and plan.moved_bytes == 0
    assert f"postponed     {plan.postponed} equations run where the backward pass" in plan.summary()
    assert Plan.from_json(plan.to_json(full=True)).postponed == plan.postponed
    (params, loss), (expected_params, expected_loss) = (
        step(WIDE_PARAMS, WIDE_X),
        jax.jit(wide_mlp_step)(WIDE_PARAMS, WIDE_X),
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(expected_params), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)
    assert plan.executed_peak_bytes <= plan.budget_bytes
