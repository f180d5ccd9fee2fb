"""Plans explain themselves: repr, summary, HTML with an SVG timeline, plots, JSON, the notebook."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oocjax.plan import Plan
from oocjax.schedule import plan_window
from tests.programs import MiB, mlp_chain

EXAMPLES = Path(__file__).parent.parent / "examples"


def chain_plan() -> Plan:
    program = mlp_chain()
    return Plan.build(program=program, schedule=plan_window(program, 16 * MiB), jaxpr=None, source_jaxpr=None)


def test_the_repr_is_one_line_with_peak_budget_in_core_offloads_and_traffic():
    assert (
        repr(chain_plan()) == "Plan(peak=16 MiB / budget 16 MiB, in-core 21 MiB, 0 segments, 2 offloads, 16 MiB moved)"
    )


def test_the_summary_of_the_hand_worked_chain_reads_as_expected():
    # The schedule is the hand-worked one of test_window_golden; the times follow from the h100-pcie
    # profile: 6 small steps of 5 us launch overhead plus the copies on a 35/50 GB/s link.
    assert chain_plan().summary() == "\n".join(
        [
            "oocjax plan (window, 6 equations)",
            "  budget        16 MiB",
            "  in-core peak  21 MiB",
            "  planned peak  16 MiB at equation 4 (b2)",
            "  to host       5 MiB in 2 offloads",
            "  to device     11 MiB in 8 prefetches",
            "  host peak     9 MiB",
            "  kept on host  4 arguments (4 MiB), 1 result",
            "",
            "Largest moves (6 of 6):",
            "   size  out after  back before       distance  value",
            "  4 MiB          1            4              3  a1",
            "  1 MiB          3            -  stays on host  dw3",
            "  1 MiB       host         0, 4              -  x",
            "  1 MiB       host         0, 4              -  w1",
            "  1 MiB       host         0, 4              -  w2",
            "  1 MiB       host            0              -  w3",
            "",
            "Timed simulation on h100-pcie (378 TFLOP/s sustained, host link 35 GB/s in, 50 GB/s out):",
            "  step time     478 us = compute 30 us + exposed transfers 448 us",
            "  lower bound   330 us (max of compute and each link's traffic)",
        ]
    )


def test_the_summary_can_leave_out_the_timed_simulation():
    assert "Timed simulation" not in chain_plan().summary(profile=None)


def test_the_html_view_has_an_svg_with_the_budget_line_and_one_mark_per_move():
    plan = chain_plan()
    page = plan._repr_html_()
    assert page.count("<svg") == 1 and "planned peak" in page
    assert len(re.findall(r'<line class="budget"', page)) == 1
    assert len(re.findall(r'<polygon class="move (offload|prefetch)"', page)) == len(plan.schedule.moves) == 10
    assert page.count('class="move offload"') == 2


def test_a_plan_survives_a_json_round_trip():
    plan = chain_plan()
    loaded = Plan.from_json(plan.to_json())
    assert loaded.program == plan.program and loaded.schedule == plan.schedule
    assert (loaded.peak_bytes, loaded.offloads, loaded.host_inputs) == (
        plan.peak_bytes,
        plan.offloads,
        plan.host_inputs,
    )
    assert loaded.jaxpr is None
    with pytest.raises(ValueError, match="not an oocjax plan"):
        Plan.from_json(json.dumps({"format": "something else"}))


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
    import jupytext
    import nbformat

    script = jupytext.read(EXAMPLES / "inspect_plan.py")
    notebook = nbformat.read(EXAMPLES / "inspect_plan.ipynb", as_version=4)
    assert [c.source for c in script.cells] == [c.source for c in notebook.cells]


@pytest.mark.slow
def test_the_notebook_executes_end_to_end_and_writes_its_figures(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("OOCJAX_FIGURES", str(tmp_path))
    notebook = nbformat.read(EXAMPLES / "inspect_plan.ipynb", as_version=4)
    NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()  # the kernel inherits OOCJAX_FIGURES from this process
    for name in ("plan-60.png", "plan-40.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    outputs = "".join(
        str(o.get("text", "")) + str(o.get("data", "")) for c in notebook.cells for o in c.get("outputs", [])
    )
    assert "Largest moves" in outputs and "<svg" in outputs and "<<<   offload" in outputs
