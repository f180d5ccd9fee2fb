"""``benchmarks/hybrid_gpu_model.py`` in its smoke mode (a tiny GPT, < 30 s): both rows, planned
through ``ooc_jit(...).plan(..., profile=...)``, labelled a model, and the hybrid never simulates
slower than swap-only."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SMOKE = ["--layers", "2", "--width", "128", "--seq", "128", "--budget-of-in-core", "0.5", "--min-offload", "16384"]


@pytest.mark.slow  # 13 s on 2 loaded CPU cores
def test_the_smoke_model_has_both_rows_and_auto_is_never_slower_than_off(tmp_path):
    out = tmp_path / "hybrid_gpu_model-smoke.json"
    # Calibrated to 10 ms for this tiny step: copies then cost more than recomputing (the tiny step's
    # default, the 16-layer GPT's 0.092 s, makes everything compute-bound and nothing worth recomputing).
    command = [sys.executable, "benchmarks/hybrid_gpu_model.py", *SMOKE, "--jit-s", "0.01", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(out.read_text())

    assert record["benchmark"] == "hybrid_gpu_model" and record["kind"] == "model"
    assert "NOT A MEASUREMENT" in record["label"]
    assert record["computed_on"]["machine"] and record["computed_on"]["jax"] and record["date"]
    assert not record["model"]["same_as_gpu_check"] and record["cross_check"] is None
    assert record["failures"] == []

    rows = {r["recompute"]: r for r in record["rows"]}
    assert list(rows) == ["off", "auto"]
    off, auto = rows["off"], rows["auto"]
    assert auto["simulated_s"] <= off["simulated_s"] * (1 + 1e-9)
    assert off["recomputed_values"] == 0 and off["extra_flops"] == 0 and off["chosen"] == "swap-only"
    assert auto["chosen"] == "hybrid" and auto["recomputed_values"] > 0 and auto["extra_flops_pct"] > 0
    assert auto["moved_bytes"] < off["moved_bytes"]
    for r in (off, auto):
        assert r["planned_peak_bytes"] <= record["budget"]["planned_bytes"]
        assert r["pressure_bound"]["moved_bytes"] <= r["moved_bytes"]  # a bound on any swap-only plan of it
        assert r["vs_jax_jit"] == r["simulated_s"] / record["calibration"]["in_core_target_s"]
        assert r["segments"] > 0 and r["plan_s"] > 0  # something moves: the plan is cut into segments
        assert r["swap_only_simulated_s"] in (None, off["plan_step_time_s"])  # by layer: no swap-only plan to time
        assert r["in_core_simulated_s"] == record["calibration"]["in_core_simulated_s"]
    assert auto["copied_equations"] >= auto["recomputed_values"]  # a copied equation per value at least
    assert sum(auto["selector"]["recomputed_by_operation"].values()) == auto["recomputed_values"]

    budget = record["budget"]
    assert budget["headroom_bytes"] == int(budget["user_bytes"] * 0.08)  # the GPU profile's default, not the CPU's 0
    assert budget["planned_bytes"] == budget["user_bytes"] - budget["headroom_bytes"]
    calibration = record["calibration"]
    assert not calibration["target_is_measured"] and record["remat_nothing_saveable"] is None
    assert abs(calibration["in_core_simulated_s"] - 0.01) < 1e-9  # the in-core step matches what it was fitted to
    profile = calibration["profile"]
    for direction in ("d2h", "h2d"):
        fit = calibration["eager_link_fits"][direction]
        assert 1e-4 < fit["latency_s"] < 3e-4  # about 0.2 ms per eager copy, as measured on the H200
        assert profile[f"{direction}_latency_s"] == fit["latency_s"]
    assert profile["d2h_bytes_per_s"] == record["measured_reference"]["link"]["d2h_bytes_per_s"]
    assert {row["variant"] for row in record["sensitivity"]} and all("auto" in row for row in record["sensitivity"])


@pytest.mark.slow  # 4 s on 2 loaded CPU cores
def test_a_state_homes_row_is_the_plan_ooc_jit_makes_for_the_profile_or_why_it_refuses():
    import jax.numpy as jnp

    from benchmarks import models
    from benchmarks.hybrid_gpu_model import traced
    from benchmarks.state_homes_model import row
    from oocjax.schedule import PROFILES

    work = models.gpt2(layers=2, width=512, heads=8, batch=2, seq=256, vocab=1024, dtype=jnp.float32)
    in_core = traced(work.step, work.state, work.batch).baseline_peak_bytes
    budget = int(in_core * 0.6)
    r = row(work, budget, PROFILES["h200"], jit_s=0.01)
    assert r["planned_bytes"] == budget - int(budget * 0.08)  # the GPU profile's headroom
    assert r["planned_peak_bytes"] <= r["planned_bytes"] and r["segments"] > 0
    assert 0 < r["arguments_on_host"] <= r["arguments"] and r["argument_bytes_on_host"] <= r["argument_bytes"]
    assert r["moved_bytes"] >= r["argument_bytes_on_host"]  # a host-kept argument comes to the device to be read
    assert r["vs_jax_jit"] == r["simulated_s"] / 0.01

    refused = row(work, int(in_core * 0.02), PROFILES["h200"], jit_s=0.01)
    assert "too small" in refused["refused"] and "moved_bytes" not in refused
