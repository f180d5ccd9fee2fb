"""A plan's plot reads as a person needs it: the step's phases and layers named where they are, the
largest moves in a table, and no text drawn over other text or off the figure."""

import pytest

from oocjax.plan import Plan
from oocjax.plotting import Span, StepRegions, plan_regions, step_regions
from tests.support.plans import transformer_plan, wide_plan

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")
Text = matplotlib.text.Text


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def drawn_texts(figure) -> list[tuple[str, object]]:
    """(text, window extent) of every non-empty text the figure draws: recorded while drawing, so a
    text that exists but is not drawn (an axis turned off, a hidden label) does not count."""
    drawn = []
    real_draw = Text.draw

    def recording_draw(text, renderer):
        real_draw(text, renderer)
        if text.get_visible() and text.get_text().strip():
            drawn.append((text.get_text(), text.get_window_extent(renderer)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Text, "draw", recording_draw)
        figure.canvas.draw()
    return drawn


def overlapping(texts) -> list[tuple[str, str]]:
    return [(a, b) for i, (a, box) in enumerate(texts) for b, other in texts[i + 1 :] if box.overlaps(other)]


def outside(figure, texts) -> list[str]:
    width, height = figure.bbox.width, figure.bbox.height
    return [t for t, box in texts if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5]


def test_the_text_checks_catch_text_drawn_over_text_and_text_off_the_figure():
    figure, ax = plt.subplots()
    ax.text(0.5, 0.5, "first label")
    ax.text(0.5, 0.5, "second label")
    ax.text(1.5, 0.5, "off to the right")
    texts = drawn_texts(figure)
    assert overlapping(texts) == [("first label", "second label")]
    assert outside(figure, texts) == ["off to the right"]


# -- phases and layers from name stacks ------------------------------------------------------------


def spans(found: tuple[Span, ...]) -> list[tuple[str, int, int]]:
    return [(s.name, s.start, s.stop) for s in found]


def test_a_gradient_step_is_forward_up_to_its_first_transposed_equation_then_backward_then_optimizer():
    stacks = [
        "",  # the step's own code before the loss (splitting a key): counted in the forward
        "jvp(Net)/Dense_0",
        "jvp(Net)/Dense_1",
        "jvp()",  # the loss, outside the model
        "transpose(jvp())",
        "transpose(jvp(Net))/Dense_1",
        "",  # a gradient sum outside any scope, between transposed equations: still the backward
        "transpose(jvp(Net))/Dense_0",
        "",
        "",
    ]
    regions = step_regions(stacks)
    assert spans(regions.phases) == [("forward", 0, 4), ("backward", 4, 8), ("optimizer", 8, 10)]
    assert spans(regions.layers) == [("Dense_0", 1, 2), ("Dense_1", 2, 3), ("Dense_1", 5, 6), ("Dense_0", 7, 8)]
    assert regions.where(5) == "backward, Dense_1" and regions.where(9) == "optimizer"


def test_a_layers_run_goes_on_through_equations_of_no_layer_but_stops_at_another_layer_and_at_a_phase():
    stacks = [
        "jvp(M)/Block_0/Dense_0",
        "jvp(M)",  # the residual add of the root module, between Block_0's modules
        "jvp(M)/Block_0/LayerNorm_0",
        "jvp(M)/Block_1/Dense_0",
        "jvp(M)/Block_0",  # Block_0 again after Block_1 began: a run of its own
        "transpose(jvp(M))/Block_0",  # same layer, but across the turn: the backward's own run
    ]
    regions = step_regions(stacks)
    assert spans(regions.layers) == [("Block_0", 0, 3), ("Block_1", 3, 4), ("Block_0", 4, 5), ("Block_0", 5, 6)]


def test_transforms_are_peeled_off_to_find_the_layer_and_scopes_of_plain_jax_code_are_layers_too():
    stacks = ["jvp(M)/remat(Block_0)/Dense_0", "jvp()/encoder", "transpose(jvp(M))/Head", "transpose(jvp())"]
    assert spans(step_regions(stacks).layers) == [("Block_0", 0, 1), ("encoder", 1, 2), ("Head", 2, 3)]


def test_a_step_that_takes_no_gradient_has_no_phases_or_layers():
    assert step_regions(["", "M/Block_0", "M/Block_1"]) == StepRegions()
    assert step_regions(["jvp(M)/Block_0", "jvp(M)/Block_1"]) == StepRegions()  # forward mode alone
    assert step_regions([]) == StepRegions()


@pytest.mark.slow
def test_the_transformers_plan_has_its_phases_and_each_blocks_forward_and_backward_in_order():
    regions = plan_regions(transformer_plan())
    assert [p.name for p in regions.phases] == ["forward", "backward", "optimizer"]
    forward, backward, optimizer = regions.phases
    assert forward.start == 0 and forward.stop == backward.start and backward.stop == optimizer.start
    assert optimizer.stop == len(transformer_plan().program.steps)
    blocks = [f"Block_{i}" for i in range(4)]
    # Dropout is one jitted function called in every block: each call's equations are its block's.
    assert [s.name for s in regions.layers if s.stop <= forward.stop] == ["Embed_0", *blocks, "Dense_0"]
    assert [s.name for s in regions.layers if s.start >= backward.start] == ["Dense_0", *blocks[::-1], "Embed_0"]


@pytest.mark.slow
def test_in_a_recomputing_plan_every_copy_runs_in_the_backward_of_the_block_it_was_dropped_from():
    plan = transformer_plan("always")
    regions = plan_regions(plan)
    assert plan.recomputed
    for r in plan.recomputed:
        dropped, again = regions.where(r.dropped_after), regions.where(r.recomputed_at)
        assert again.startswith("backward, Block_") and again.split(", ")[1] == dropped.split(", ")[1], r


def test_a_plan_loaded_without_its_traced_step_has_no_regions():
    plan = wide_plan()  # a plain jax gradient step: phases, but no modules, so no layers
    assert [p.name for p in plan_regions(plan).phases] == ["forward", "backward", "optimizer"]
    assert plan_regions(plan).layers == ()
    assert plan_regions(Plan.from_json(plan.to_json(full=True))) == StepRegions()


# -- the figure ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["off", "always"])
@pytest.mark.parametrize("profile", [None, "h100"])
def test_the_transformers_plot_names_its_phases_and_no_text_overlaps_or_leaves_the_figure(recompute, profile, tmp_path):
    plan = transformer_plan(recompute)
    drawn = plan.plot(profile=profile)
    figure = (drawn if profile is None else drawn[0]).figure
    figure.savefig(tmp_path / "plan.png")  # no bbox_inches="tight": the figure as it is
    texts = drawn_texts(figure)
    assert overlapping(texts) == []
    assert outside(figure, texts) == []
    shown = [text.strip() for text, _ in texts]
    # Each update follows its gradient inside the backward: what runs after it (the embedding's
    # update) is too narrow a span to name, as the head's Dense_0 is.
    assert {"forward", "backward"} <= set(shown)
    assert {"Block_0", "Block_1", "Block_2", "Block_3"} <= set(shown)
    # The narrow spans (the head's Dense_0, the embedding) go unnamed rather than overlap: their
    # names exist but are not drawn.
    assert "Dense_0" not in shown


@pytest.mark.slow
def test_the_largest_moves_are_in_a_table_with_each_equations_phase_and_layer():
    plan = transformer_plan("off")
    figure = plan.plot().figure
    (table,) = [text for text, _ in drawn_texts(figure) if text.startswith("Largest moves")]
    largest = max(plan.offloads, key=lambda o: o.nbytes)
    region = plan_regions(plan).where(largest.offload_after)
    assert region.startswith("forward, Block_")
    assert any(
        f" {largest.offload_after} ({region}) " in line and line.endswith(largest.label) for line in table.splitlines()
    )
    assert table.splitlines()[0] == f"Largest moves (5 of {len(plan.offloads) + len(plan.host_inputs)})"
