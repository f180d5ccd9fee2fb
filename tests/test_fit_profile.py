"""The H200 profile's fit (``benchmarks/fit_profile.py``): it recovers known rates, and the committed fit
predicts the committed runs it was not fitted to within issue 53's 25%."""

import json
from pathlib import Path

import pytest

from oocjax.schedule.program import Step

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def step(flops: float, nbytes: float) -> Step:
    return Step(
        reads=(), writes=(), transient_bytes=0, flops=int(flops), bytes_accessed=int(nbytes), name="x", label=""
    )


def test_the_compute_fit_recovers_the_rates_the_launch_times_were_made_with():
    from benchmarks.fit_profile import fit_compute

    rates = dict(flops_per_s=3e14, hbm_bytes_per_s=1e13, op_overhead_s=2e-6, launch_s=3e-4)

    def seconds(steps):
        per_step = [max(s.flops / rates["flops_per_s"], s.bytes_accessed / rates["hbm_bytes_per_s"]) for s in steps]
        return rates["launch_s"] + sum(per_step) + rates["op_overhead_s"] * len(steps)

    gemm, elementwise, tiny = step(1e12, 1e9), step(1e6, 4e9), step(1e3, 1e3)
    mixes = [(4, 10, 50), (1, 30, 5), (8, 2, 400), (0, 50, 10), (2, 0, 1000), (6, 6, 6)]
    groups = [([gemm] * g + [elementwise] * e + [tiny] * t, 0.0) for g, e, t in mixes]
    groups = [(steps, seconds(steps)) for steps, _ in groups]
    fit = fit_compute(groups)
    for name, value in rates.items():
        assert fit[name] == pytest.approx(value, rel=1e-6), name
    assert fit["relative_rms"] < 1e-9 and fit["ratios"] == pytest.approx([1.0] * len(groups))


def test_the_link_fit_recovers_a_latency_and_a_bandwidth():
    from benchmarks.fit_profile import fit_link

    points = [(b, 2e-4 + b / 53e9, "run") for b in (2**22, 2**28, 2**30)]
    bandwidth, latency = fit_link(points)
    assert bandwidth == pytest.approx(53e9, rel=1e-9) and latency == pytest.approx(2e-4, rel=1e-9)


def test_the_committed_fit_predicts_every_held_out_run_it_rebuilt_within_a_quarter():
    files = sorted(RESULTS.glob("fit_profile-h200-*.json"))
    assert files, "no committed fit"
    record = json.loads(files[-1].read_text())
    assert record["kind"] == "model" and "fitted" in record["proposed_profile"]["source"]
    rows = [r for r in record["predictions"] if "predicted_s" in r]
    for r in rows:  # each ratio is what its row says
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"]) and r["within"] == (
            abs(r["ratio"] - 1) <= 0.25
        )
    held = [r for r in rows if r["held_out"]]
    rebuilt = [r for r in held if r["rebuilt"]]
    assert record["held_out"]["runs"] == len(held) and record["held_out"]["rebuilt_runs"] == len(rebuilt) > 0
    assert all(r["within"] for r in rebuilt), [(r["file"], r["configuration"], r["ratio"]) for r in rebuilt]
    assert all(r.get("why_not_rebuilt") for r in record["predictions"] if not r.get("rebuilt"))
