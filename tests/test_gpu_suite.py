"""The GPU session's suite (``benchmarks/gpu_suite.py``): its dry run, deadline, verdict, and report."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
GIB = 2**30


def git_head() -> str:
    command = ["git", "rev-parse", "--short", "HEAD"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 and (ROOT / ".git").exists() else "unknown"


@pytest.mark.slow  # 31-69 s on 2 CPU cores shared with other work
def test_the_suite_dry_run_runs_every_part_and_sets_each_step_beside_its_h200_plan(tmp_path):
    from benchmarks import gpu_suite, report

    commit_before, out = git_head(), tmp_path / "suite.json"
    started = time.perf_counter()
    command = [sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "gpu_suite" and record["dry_run"] and record["commit"] in {commit_before, git_head()}
    assert {"jax", "jaxlib", "flax", "optax"} <= set(record["versions"]) and "XLA_FLAGS" in record["env"]
    assert record["summary"] == dict(failures=[], warnings=[], skipped=[])
    assert [p["part"] for p in record["parts"]] == list(gpu_suite.PARTS)
    assert all(p["status"] == "done" and p["exit_code"] == 0 for p in record["parts"])
    assert 0 < record["wall_s"] <= seconds and all(p["status"] == "done" for p in record["planning"])
    parts = {p["part"]: p["record"] for p in record["parts"]}

    activation = parts["activation_gpt"]
    rows = activation["rows"]
    # Run in the order of their peaks: a process's peak only rises.
    order = ["remat", "ooc_jit_at_remat_peak", "ooc_jit", "back_to_back", "jax_jit"]
    assert sorted(rows, key=lambda name: rows[name]["run_order"]) == order
    reference = rows["jax_jit"]["losses"]
    for name in ("remat", "ooc_jit_at_remat_peak", "ooc_jit"):
        assert rows[name]["losses"] == pytest.approx(reference, rel=1e-5) and rows[name]["finite"], name
        assert rows[name]["s_per_step"] > 0 and rows[name]["loss_max_rel_diff"] <= 1e-5
    # On a CPU no allocator reports a peak: ooc_jit runs at remat's compiled one.
    assert activation["remat_peak_bytes"] == dict(bytes=rows["remat"]["compiled_peak_bytes"], source="compiled program")
    assert rows["ooc_jit_at_remat_peak"]["budget_bytes"] == rows["remat"]["compiled_peak_bytes"]
    in_core = rows["ooc_jit"]["in_core_estimate_bytes"]
    assert rows["ooc_jit"]["budget_bytes"] == int(in_core * gpu_suite.DRY_BUDGET_SHARE)
    # At remat's peak a plan may recompute alone (remat does); below it, this one must move values.
    assert rows["ooc_jit"]["moved_bytes"] > 0 and rows["ooc_jit"]["planned_to_device_bytes"] > 0
    for name in ("ooc_jit_at_remat_peak", "ooc_jit"):
        row = rows[name]
        assert 0 < row["planned_peak_bytes"] <= row["budget_bytes"]
        assert row["copied_to_device_bytes"] == row["planned_to_device_bytes"]  # what its plan says, per step
        assert row["copied_back_bytes"] == row["planned_back_bytes"]
        assert row["host_waits_per_step"] >= 0 and 0 < row["first_launch_s"] < row["s_per_step"] * 50
        assert row["peak_bytes_in_use"] is None and row["within_budget"] is None  # no memory statistics on a CPU
    alone = rows["back_to_back"]["segments_alone"]
    assert rows["back_to_back"]["s_per_step"] > 0 and len(alone) == rows["ooc_jit"]["segments"]
    assert [r["steps"][0] for r in alone[1:]] == [r["steps"][1] for r in alone[:-1]]

    state = parts["state_gpt"]
    assert [row["gib"] for row in state["ooc_jit"]] == list(gpu_suite.STATE_BUDGETS_GIB)
    assert [row["remat"] for row in state["jax_jit"]] == [False, True]
    for row in state["ooc_jit"]:
        assert row["copied_to_device_bytes"] == row["planned_to_device_bytes"] > 0
        assert row["copied_back_bytes"] == row["planned_back_bytes"] > 0
        assert row["losses"] == pytest.approx(state["jax_jit"][0]["losses"][: len(row["losses"])], rel=1e-5)
    assert all(state["link"][k] > 0 for k in ("h2d_GB_per_s", "d2h_GB_per_s", "both_GB_per_s"))

    host = parts["host_adamw"]
    assert host["platform"] == "cpu" and host["adamw"]["finite"] and host["adamw"]["s_per_step"] > 0
    assert host["adamw"]["bytes_per_step"] == 28 * host["parameters"] == 28 * gpu_suite.DRY_ADAMW_PARAMETERS
    assert host["bandwidth"]["numpy_copy_GB_per_s"] > 0 and host["bandwidth"]["xla_cpu_GB_per_s"] > 0

    # Beside every measured step, the same step planned for the H200 profile, nothing compiled.
    measured = gpu_suite.measured_rows(record)
    assert len(measured) == 5 + 4
    for where, row in measured:
        plan = row["h200_plan"]
        assert 0 < plan["in_core_time_s"] <= plan["step_time_s"], where
        if "budget_bytes" in row and "in_core_of" not in plan:
            assert plan["budget_bytes"] == row["budget_bytes"] and plan["compiled"] is False, where
    assert rows["jax_jit"]["h200_plan"]["step_time_s"] == rows["jax_jit"]["h200_plan"]["in_core_time_s"]
    assert rows["back_to_back"]["h200_plan"] is not None

    text = "\n".join(report.gpu_suite_lines(out.name, record))
    assert text.count("\n| activation_gpt |") == 5 and text.count("\n| state_gpt |") == 4
    assert len(report.gpu_suite_rows(out.name, record)) == 2


def test_a_part_that_would_end_after_the_deadline_is_skipped_with_a_note_and_the_json_rewritten_after_each():
    from benchmarks.gpu_suite import run_parts

    clock, written = [0.0], []

    def run(name, seconds):
        clock[0] += dict(a=100, b=300)[name]
        return dict(status="done", record={}, seconds_given=seconds)

    def after(results):
        written.append([r["part"] for r in results])

    results = run_parts(["a", "b", "c"], run, lambda: 470 - clock[0], lambda name: 80, after)
    assert [r["status"] for r in results] == ["done", "done", "skipped"]
    assert [r["seconds_given"] for r in results[:2]] == [470, 370]
    assert results[2]["note"] == "skipped: its first item needs ~80 s, 70 s to the deadline"
    assert written == [["a"], ["a", "b"], ["a", "b", "c"]]  # the JSON after every part, run or skipped


def test_the_suite_fails_on_a_peak_over_budget_or_losses_unlike_jax_jits_and_notes_what_it_skipped():
    from benchmarks import gpu_suite, report

    step = dict(finite=True, s_per_step=0.1, losses=[7.0, 6.5])
    rows = dict(
        jax_jit=dict(step, plan_key="activation/in_core"),
        ooc_jit=dict(
            step, losses=[7.0, 6.6], s_per_step=0.15, budget_bytes=8 * GIB, peak_bytes_in_use=9 * GIB,
            peak_is_own=True, within_budget=False, plan_key="activation/ooc_jit",
            copied_to_device_bytes=GIB, copied_back_bytes=0.5 * GIB,
            planned_to_device_bytes=GIB, planned_back_bytes=GIB // 2,
        ),
        remat=dict(error="XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory", plan_key="activation/remat"),
    )  # fmt: skip
    record = dict(
        parts=[
            dict(part="activation_gpt", status="done", exit_code=0, record=dict(rows=rows, skipped=[])),
            dict(part="state_gpt", status="cut short", exit_code=-9, stderr_tail="Killed", record=None),
            dict(part="host_adamw", status="skipped", note="skipped: its first item needs ~10 s, 3 s to the deadline"),
        ],
        plans={"activation/ooc_jit": dict(step_time_s=0.2, in_core_time_s=0.12)},
        date="2026-12-02", commit="abc1234", machine="a host", device="NVIDIA H200", driver="570.1", versions={},
    )  # fmt: skip
    gpu_suite.merge_plans(record)
    assert rows["jax_jit"]["h200_plan"] == dict(
        profile="h200", in_core_of="activation/ooc_jit", step_time_s=0.12, in_core_time_s=0.12
    )
    summary = gpu_suite.summarise(record)
    assert summary["failures"] == [
        "activation_gpt/remat: XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory",
        "activation_gpt/ooc_jit: losses differ from jax.jit's by 0.015 (relative)",
        f"activation_gpt/ooc_jit: peak {9 * GIB} bytes over its budget {8 * GIB}",
    ]
    assert summary["skipped"] == [
        "state_gpt: cut short at the deadline; its items measured by then are kept",
        "host_adamw: skipped: its first item needs ~10 s, 3 s to the deadline",
    ]
    assert summary["warnings"] == ["activation_gpt/remat: no h200 plan beside it"]
    assert rows["ooc_jit"]["vs_jax_jit"] == pytest.approx(1.5)

    record["summary"] = summary
    text = "\n".join(report.gpu_suite_lines("gpu_suite-nvidia-h200-2026-12-02.json", record))
    assert "| activation_gpt | `jax.jit` | 0.1000 | - | - | - | - | 120.0 ms / 120.0 ms |" in text
    expected = "| activation_gpt | `ooc_jit` at 7.72 GiB | 0.1500 | 1.50x | 9.00 GiB | 8.00 GiB |"
    assert expected + " 1.00 / 0.50 GiB (1.00 / 0.50) | 200.0 ms / 120.0 ms |" in text
    assert "| activation_gpt | per-block `nn.remat`, `nothing_saveable` | **failed**: XlaRuntimeError" in text
    assert "driver 570.1" in text and "Skipped: state_gpt: cut short" in text and "**Failures**" in text
    (row,) = report.gpu_suite_rows("gpu_suite-nvidia-h200-2026-12-02.json", record)
    remat = "- at 7.72 GiB; - at remat's peak (`nothing_saveable`)"  # remat failed: no ratio against it
    assert f"| 1.50x at 7.72 GiB; - at remat's peak | {remat} |" in row and "before recompute" not in row


def test_the_suite_never_asks_for_unified_memory():
    from benchmarks.gpu_suite import refuse_managed_memory

    refuse_managed_memory({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", "TF_FORCE_UNIFIED_MEMORY": "0"})
    for environ in ({"TF_FORCE_UNIFIED_MEMORY": "1"}, {"XLA_CLIENT_MEM_FRACTION": "4"}):
        with pytest.raises(SystemExit, match=r"unified memory|more memory than the card"):
            refuse_managed_memory(environ)
