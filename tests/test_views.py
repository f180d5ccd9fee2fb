"""Plans explain themselves: repr, summary, HTML with an SVG timeline, plots, JSON, the notebook."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from oocjax import BudgetInfeasibleError, ooc_jit
from oocjax.plan import Plan
from oocjax.schedule import keep_all, plan_window, simulate
from oocjax.timeline_svg import svg_timeline
from tests.support.plans import WIDE_PARAMS, WIDE_X, transformer_plan, wide_mlp_step, wide_plan
from tests.support.programs import MiB, mlp_chain

EXAMPLES = Path(__file__).parent.parent / "examples"


def chain_plan() -> Plan:
    program = mlp_chain()
    schedule = plan_window(program, 16 * MiB)
    timelines = dict(timeline=simulate(program, schedule), baseline_timeline=simulate(program, keep_all(program)))
    return Plan.build(program=program, schedule=schedule, jaxpr=None, source_jaxpr=None, **timelines)


def test_the_repr_is_one_line_with_peak_budget_in_core_offloads_host_kept_arguments_and_traffic():
    assert repr(chain_plan()) == (
        "Plan(peak=16 MiB / budget 16 MiB, in-core 21 MiB, 0 segments, 2 offloads, 2 arguments kept on host, "
        "12 MiB moved)"
    )


def test_the_summary_of_the_hand_worked_chain_reads_as_expected():
    # The schedule is the hand-worked one of test_window_golden; the times follow from the h100-pcie
    # profile: 6 small steps of 5 us launch overhead plus the copies on a 35/50 GB/s link.
    assert chain_plan().summary(profile="h100-pcie") == "\n".join(
        [
            "oocjax plan (window, 6 equations)",
            "  budget        16 MiB",
            "  in-core peak  21 MiB",
            "  planned peak  16 MiB at equation 3 (b3)",
            "  to host       5 MiB in 2 offloads",
            "  to device     7 MiB in 4 prefetches",
            "  host peak     7 MiB",
            "  kept on host  2 arguments (2 MiB), 1 result",
            "",
            "Largest moves (4 of 4):",
            "   size  out after  back before       distance  value",
            "  4 MiB          1            4              3  a1",
            "  1 MiB          3            -  stays on host  dw3",
            "  1 MiB       host         0, 4              -  w2",
            "  1 MiB       host            0              -  w3",
            "",
            "State kept on host cannot go to plain jax.jit: evaluate it with an ooc_jit step under the same budget "
            "(ooc_jit(eval_step, budget=...)(state, batch), without donating it), or move it back with "
            "oocjax.to_device(state) where the device has room for it.",
            "",
            "Timed simulation on a model of h100-pcie, not a measurement:",
            "  device model  h100-pcie: 378 TFLOP/s sustained, host link 35 GB/s in, 50 GB/s out",
            "  step time     324 us = compute 30 us + exposed transfers 294 us",
            "  lower bound   210 us (max of compute and each link's traffic)",
        ]
    )


def test_the_summary_simulates_a_device_only_when_asked_and_then_says_it_is_a_model():
    assert "Timed simulation" not in chain_plan().summary()
    assert "Timed simulation on a model of h100-pcie, not a measurement:" in chain_plan().summary(profile="h100-pcie")


def test_a_plan_for_the_cpu_timed_on_a_gpus_model_says_the_figures_are_the_gpus_not_the_cpus():
    timed = dataclasses.replace(chain_plan(), device="cpu").summary(profile="h100").split("Timed simulation")[1]
    lines = timed.splitlines()
    assert lines[0] == " on a model of h100-pcie, not a measurement:"
    assert lines[1] == "  device model  h100-pcie: 378 TFLOP/s sustained, host link 35 GB/s in, 50 GB/s out"
    assert lines[2] == "  planned for   cpu (the times below are the h100-pcie model's, not cpu's)"
    assert not re.search(r"cpu\W+\d+ TFLOP/s", timed), "the rates never follow the CPU's name"
    # A plan made for the modelled device itself needs no such line.
    same = dataclasses.replace(chain_plan(), device="h100-pcie").summary(profile="h100-pcie")
    assert "planned for" not in same


def test_the_html_view_has_an_svg_with_the_budget_line_and_marks_that_account_for_every_move():
    plan = chain_plan()
    page = plan._repr_html_()
    assert page.count("<svg") == 1 and "planned peak" in page
    assert len(re.findall(r'<line class="budget"', page)) == 1
    # Moves of one kind at one place share a mark, whose title counts them: w2 and w3 are both
    # fetched at equation 0, a mark's width apart at most.
    titles = re.findall(r'<polygon class="move (offload|prefetch)"[^>]*><title>([^<]*)</title>', page)
    counted = {"offload": 0, "prefetch": 0}
    for kind, title in titles:
        many = re.match(r"(\d+) (offload|prefetche)s ", title)
        counted[kind] += int(many[1]) if many else 1
    assert counted == {"offload": 2, "prefetch": 4} and len(plan.schedule.moves) == 6
    assert len(titles) < 6
    assert "offload after equation 1: a1 (4 MiB)" in page
    assert re.search(r"\d prefetches at equation 0 \(\d MiB\): ", page)


@pytest.mark.slow
def test_the_html_view_of_the_zoo_transformers_plan_stays_under_40_kb():
    for recompute in ("off", "always"):
        plan = transformer_plan(recompute)
        assert plan.schedule.moves if recompute == "off" else plan.recomputed
        page = plan._repr_html_()
        assert len(page.encode()) < 40 * 1024, (recompute, len(page.encode()))
        # Drawn at the picture's resolution, the curves still reach the peaks.
        planned = re.search(r'<path class="planned" fill="none" d="([^"]*)"', page)[1]
        heights = [int(v) for v in re.findall(r"V(\d+)", planned)]
        assert min(heights) == round(_y(plan, plan.peak_bytes))


def _y(plan: Plan, nbytes: int) -> float:
    """Where the SVG draws ``nbytes`` (timeline_svg.svg_timeline's scale)."""
    from oocjax.timeline_svg import _HEIGHT, _PAD

    top = max([plan.budget_bytes, *plan.timeline.device_bytes, *plan.baseline_timeline.device_bytes, 1]) * 1.05
    return _PAD + (_HEIGHT - 2 * _PAD) * (1 - nbytes / top)


def test_a_saved_plan_is_small_and_says_what_moves():
    saved = json.loads(chain_plan().to_json())
    assert "program" not in saved and "schedule" not in saved
    assert (saved["peak_bytes"], len(saved["offloads"]), len(saved["host_inputs"])) == (16 * MiB, 2, 2)
    assert {o["label"] for o in saved["offloads"]} == {"a1", "dw3"}
    with pytest.raises(ValueError, match=r"save it with plan.to_json\(full=True\)"):
        Plan.from_json(chain_plan().to_json())


def test_a_plan_saved_in_full_survives_a_json_round_trip():
    plan = chain_plan()
    loaded = Plan.from_json(plan.to_json(full=True))
    assert loaded.program == plan.program and loaded.schedule == plan.schedule
    assert (loaded.peak_bytes, loaded.offloads, loaded.host_inputs) == (
        plan.peak_bytes,
        plan.offloads,
        plan.host_inputs,
    )
    assert loaded.jaxpr is None
    with pytest.raises(ValueError, match="not an oocjax plan"):
        Plan.from_json(json.dumps({"format": "something else"}))


def test_a_plan_saved_in_full_keeps_its_segments_and_what_they_measured():
    plan = wide_plan()
    assert len(plan.segments) > 1 and plan.executed_peak_bytes is not None
    loaded = Plan.from_json(plan.to_json(full=True))
    assert (loaded.segments, loaded.segment_costs) == (plan.segments, plan.segment_costs)
    assert (loaded.input_kinds, loaded.headroom_bytes) == (plan.input_kinds, plan.headroom_bytes)
    assert f"{len(plan.segments)} segments" in repr(loaded) and repr(loaded) == repr(plan)
    executed = next(line for line in plan.summary().splitlines() if "executed peak" in line)
    assert executed in loaded.summary().splitlines()
    # A plan saved before segments were (format /3) still loads, without them.
    saved = json.loads(plan.to_json(full=True)) | {"format": "oocjax.plan/3"}
    del saved["chain"], saved["segment_costs"]
    assert Plan.from_json(json.dumps(saved)).segments == ()


def test_plot_draws_both_curves_the_budget_and_the_streams(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    memory_ax, stream_ax = chain_plan().plot(profile="h100-pcie")
    labels = [line.get_label() for line in memory_ax.get_lines()]
    assert any(label.startswith("in-core") for label in labels) and any(label.startswith("planned") for label in labels)
    assert "budget" in labels
    assert len(stream_ax.collections) == 3  # compute, host-to-device, device-to-host
    memory_ax.figure.savefig(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_importing_oocjax_imports_no_rendering_library():
    code = "import sys, oocjax; print(sorted(m for m in ('matplotlib', 'IPython', 'jax') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_plotting_error_says_how_to_install_matplotlib(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'oocjax\[plot\]'"):
        chain_plan().plot()


def test_the_notebook_is_in_sync_with_its_jupytext_script():
    jupytext = pytest.importorskip("jupytext", reason="the notebook extra: pip install -e '.[notebook]'")
    import nbformat

    script = jupytext.read(EXAMPLES / "inspect_plan.py")
    notebook = nbformat.read(EXAMPLES / "inspect_plan.ipynb", as_version=4)
    assert [c.source for c in script.cells] == [c.source for c in notebook.cells]


def test_the_notebook_says_the_budgets_its_code_plans_at():
    jupytext = pytest.importorskip("jupytext", reason="the notebook extra: pip install -e '.[notebook]'")

    cells = jupytext.read(EXAMPLES / "inspect_plan.py").cells
    said = {int(p) for c in cells if c.cell_type == "markdown" for p in re.findall(r"(\d+)% ", c.source)}
    fractions = [f for c in cells if c.cell_type == "code" for f in re.findall(r"\b0\.\d+\b", c.source)]
    assert said == {round(float(f) * 100) for f in fractions} == {60, 40, 35}


def notebook_outputs(notebook) -> tuple[str, int]:
    """All text and HTML outputs joined, and the number of embedded PNG images."""
    outputs = [o for c in notebook.cells for o in c.get("outputs", [])]
    # A figure's text/plain ("<Figure size ...>") goes with its image: only text standing alone counts.
    alone = [o for o in outputs if "image/png" not in o.get("data", {})]
    text = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in alone)
    text += "".join(str(o.get("data", {}).get("text/html", "")) for o in outputs)
    return text, sum("image/png" in o.get("data", {}) for o in outputs)


def test_the_committed_notebook_reads_without_running_it():
    nbformat = pytest.importorskip("nbformat", reason="the notebook extra: pip install -e '.[notebook]'")

    notebook = nbformat.read(EXAMPLES / "inspect_plan.ipynb", as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    text, images = notebook_outputs(notebook)
    assert images >= 2  # one memory plot per budget, embedded
    assert "Largest moves" in text and "<svg" in text and "<<<   offload" in text
    assert "\x1b[" not in text and "<Figure size" not in text
    assert re.search(r"from In\[\d+\]:\d+", text), "labels name notebook cells, not hashed cell files"


@pytest.mark.slow
def test_the_notebook_executes_end_to_end_with_its_figures_inline():
    nbformat = pytest.importorskip("nbformat", reason="the notebook extra: pip install -e '.[notebook]'")
    NotebookClient = pytest.importorskip("nbclient", reason="the notebook extra").NotebookClient

    notebook = nbformat.read(EXAMPLES / "inspect_plan.ipynb", as_version=4)

    def files():
        return sorted(p for p in EXAMPLES.iterdir() if p.name != "__pycache__")  # Python's own bytecode cache

    before = files()
    # Run where it lives, as a reader would: it imports the model zoo next to it.
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    text, images = notebook_outputs(notebook)
    assert images >= 2 and "Largest moves" in text and "<svg" in text and "<<<   offload" in text
    assert "scans run one iteration at a time" in text
    assert files() == before  # writes no files


# -- views of a real ooc_jit plan -------------------------------------------------------------------


def test_the_pretty_view_of_a_step_with_40_parameter_arrays_shows_a_transfer_within_six_lines():
    lines = wide_plan().pretty_jaxpr().splitlines()
    assert any(marker in line for line in lines[:6] for marker in (">>>   prefetch", "<<<   offload", "wait  "))
    assert any("not needed again until equation" in line or "stays on host" in line for line in lines)


def test_the_full_pretty_view_has_no_terminal_colour_codes():
    assert "\x1b[" not in wide_plan().pretty_jaxpr(full=True)


def test_every_transfer_in_the_chain_is_named_for_the_value_it_moves_and_a_users_own_is_not():
    def step_with_its_own_transfer(params, x):
        x = jax.device_put(x, jax.memory.Space.Host)  # the user's own: stays inside a segment
        return wide_mlp_step(params, jax.device_put(x, jax.memory.Space.Device))

    in_core = ooc_jit(step_with_its_own_transfer, budget=2**62).plan(WIDE_PARAMS, WIDE_X).baseline_peak_bytes
    plan = ooc_jit(step_with_its_own_transfer, budget=int(in_core * 0.4), min_offload_bytes=1024).plan(
        WIDE_PARAMS, WIDE_X
    )
    puts = [e for e in plan.jaxpr.jaxpr.eqns if e.primitive.name == "device_put"]
    assert len(puts) == len(plan.schedule.moves)
    names = [str(e.source_info.name_stack) for e in puts]
    assert all(re.fullmatch(r"oocjax\.(offload|prefetch)\(.+\)", n) for n in names), names
    offloaded = {o.label.replace("/", "|") for o in plan.offloads}
    assert {n[len("oocjax.offload(") : -1] for n in names if n.startswith("oocjax.offload")} == offloaded


def test_a_plan_says_which_device_it_was_made_for():
    assert wide_plan().device == jax.devices()[0].device_kind
    assert wide_plan().summary().splitlines()[0].startswith(f"oocjax plan for {jax.devices()[0].device_kind} ")
    assert json.loads(wide_plan().to_json())["device"] == jax.devices()[0].device_kind


def test_the_svg_timeline_numbers_both_axes():
    svg = svg_timeline(wide_plan())
    ticks = re.findall(r'<text class="tick"[^>]*>([^<]*)</text>', svg)
    assert len(ticks) == 10
    assert "0 B" in ticks and "0" in ticks and str(len(wide_plan().program.steps)) in ticks


def test_a_plot_without_a_profile_keeps_its_x_label_inside_a_plain_savefig_and_tables_the_largest_moves(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    plan = wide_plan()
    ax = plan.plot()
    ax.figure.savefig(tmp_path / "plan.png")  # no bbox_inches="tight"
    label = ax.xaxis.label.get_window_extent(ax.figure.canvas.get_renderer())
    assert label.y0 >= 0  # drawn inside the figure, not cut off below it
    assert not ax.texts or all(not t.get_text().startswith("output of") for t in ax.texts), "no labels by the marks"
    largest = max(plan.offloads, key=lambda o: o.nbytes)
    tables = [t.get_text() for other in ax.figure.axes if other is not ax for t in other.texts]
    assert any(line.endswith(largest.label) for table in tables for line in table.splitlines())


def test_an_infeasible_budget_gives_each_figure_on_a_line_of_its_own_and_the_smallest_budget():
    from oocjax.schedule import format_bytes

    program = mlp_chain()  # held on the device, the 1 MiB inputs and gradients add to what b2 needs
    with pytest.raises(BudgetInfeasibleError) as caught:
        plan_window(program, 16 * MiB, min_offload_bytes=2 * MiB)
    error, lines = caught.value, str(caught.value).splitlines()
    assert lines[0] == f"a budget of 16 MiB is too small: step {error.step} (b2) alone needs 18 MiB on the device."
    assert lines[1:4] == [
        "That is:",
        "  - 14 MiB for its own operands, results and scratch;",
        "  - 4 MiB for other values alive across it that no plan moves (constants, arguments kept on the device, "
        "values under min_offload_bytes, now 2 MiB).",
    ]
    assert lines[4] == f"The smallest feasible budget is {format_bytes(error.required_bytes)}, set by that operation."
    assert error.required_bytes == 18 * MiB
    # Where the operation's own figure is all it needs, the message says so in one line.
    with pytest.raises(BudgetInfeasibleError) as alone:
        plan_window(program, 13 * MiB)
    assert str(alone.value).splitlines()[1] == "All of it is the operation's own operands, results and scratch."


def test_a_loop_that_sets_the_floor_is_named_by_the_users_line_and_the_error_says_it_is_a_scan():
    def scanned_step(w, x):
        def loss(w):
            def layer(h, w_i):
                return jnp.tanh(h * w_i), None  # element-wise: the scan stays one operation

            return jax.lax.scan(layer, x, w)[0].sum()  # this line is the scan's label

        return jax.grad(loss)(w)

    w, x = jnp.ones((8, 64)) / 64, jnp.ones((256, 64))
    plan = ooc_jit(scanned_step, budget=2**62).plan(w, x)
    scans = [s for s in plan.program.steps if s.name == "scan"]
    assert scans and all(re.fullmatch(r"test_views\.py:\d+ \(loss\)", s.label) for s in scans)
    with pytest.raises(BudgetInfeasibleError, match="is a scan: oocjax runs it whole"):
        ooc_jit(scanned_step, budget=plan.baseline_peak_bytes // 4, min_offload_bytes=1024)(w, x)


def test_a_flax_scan_is_labelled_with_the_users_line_not_flaxs_own_file():
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(32)(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, h):
            layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
            return layers()(h, None)[0].sum()

    model, x = Stack(), jnp.ones((16, 32))
    params = model.init(jax.random.key(0), x)
    plan = ooc_jit(jax.grad(model.apply), budget=2**62).plan(params, x)
    assert plan.loops and all(loop.label.startswith("test_views.py:") for loop in plan.loops), plan.loops
    # Every step, the scan's bookkeeping included, names a line of the modules above, none a frame
    # of Flax's own axes_scan.py (where nn.scan's body is traced) and none is left unlabelled.
    labels = {s.label for s in plan.program.steps}
    assert labels and all(re.fullmatch(r"test_views\.py:\d+ \(__call__\)", label) for label in labels), labels


def test_a_profiler_trace_names_each_transfer_for_the_value_it_moves(tmp_path):
    plan = wide_plan()
    step = ooc_jit(wide_mlp_step, budget=plan.budget_bytes, min_offload_bytes=1024, recompute="off")
    step(WIDE_PARAMS, WIDE_X)  # compiled outside the trace
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(step(WIDE_PARAMS, WIDE_X))
    traces = list(tmp_path.rglob("*.xplane.pb"))
    assert traces
    recorded = b"".join(t.read_bytes() for t in traces)
    offloaded = plan.offloads[0].label.replace("/", "|")
    assert f"oocjax.offload({offloaded})".encode() in recorded
    assert b"oocjax.prefetch(" in recorded
