"""The benchmark harnesses work, and docs/measurements.md and the README state only what the results files say."""

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.background import Processes

ROOT = Path(__file__).parent.parent


def git_head(root: Path) -> str:
    command = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def checkout_commit() -> str:
    """The commit a benchmark run from this source tree records: git's HEAD in a clone; "unknown" in an
    unpacked sdist or ``git archive``, which have no .git."""
    return git_head(ROOT) if (ROOT / ".git").exists() else "unknown"


@dataclass(frozen=True)
class DryRun:
    processes: Processes
    out: Path  # the JSON the run writes
    commit_before: str  # the source tree's commit when it started


@pytest.fixture(scope="module", autouse=True)
def gpu_check_dry_run(request, tmp_path_factory):
    """``benchmarks/gpu_check.py --dry-run``, started with this module's first test where its test is
    selected: its processes run while the tests before it run in this one (the segment profile's
    test plans with fixed rates, and checks its timings for sign and order only)."""
    processes, out = Processes(), tmp_path_factory.mktemp("gpu_check") / "gpu-dry.json"
    commit_before = checkout_commit()
    if any(
        getattr(item, "function", None) is test_the_gpu_check_dry_run_runs_every_configuration_with_equal_losses
        for item in request.session.items
    ):
        command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", out]
        processes.queue("gpu_check", command, cwd=ROOT)
    yield DryRun(processes, out, commit_before)
    processes.close()


def test_the_generated_measurements_and_the_readme_table_match_the_results_files():
    result = subprocess.run(
        [sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# A results file's name, and the commit a `git show` takes it from where the docs cite an earlier run.
RESULTS_NAME = re.compile(
    r"(?:git show ([0-9a-f]{7,40}):benchmarks/results/)?\b([\w.-]+-20\d\d-\d\d-\d\d[\w-]*\.(?:json|png))"
)


def test_results_keep_one_file_per_cited_claim_and_every_file_the_docs_name_exists():
    """Issue 52: at most 25 results files, each one cited by the README, the docs or a benchmark; every
    results file they name is there, but for earlier runs, which they cite with a ``git show``."""
    results = ROOT / "benchmarks" / "results"
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    sources += [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "oocjax").rglob("*.py")]
    text = {path: path.read_text() for path in sources}
    kept = sorted(path.name for path in results.iterdir())
    assert 0 < len(kept) <= 25, kept
    cited = "\n".join(text.values())
    assert [name for name in kept if name not in cited] == []
    missing = [
        f"{path.relative_to(ROOT)}: {found.group(2)}"
        for path, words in text.items()
        for found in RESULTS_NAME.finditer(words)
        if not found.group(1) and found.group(2) not in kept
    ]
    assert missing == []
    # Earlier runs are cited from history: each names a commit that has the file (where there is git to ask).
    earlier = {(found.group(1), found.group(2)) for words in text.values() for found in RESULTS_NAME.finditer(words)}
    earlier = sorted(pair for pair in earlier if pair[0])
    assert earlier, "the measurements cite no earlier run"
    if shutil.which("git") and (ROOT / ".git").exists():
        absent = [
            f"{commit}:{name}"
            for commit, name in earlier
            if subprocess.run(
                ["git", "cat-file", "-e", f"{commit}:benchmarks/results/{name}"], cwd=ROOT, capture_output=True
            ).returncode
        ]
        assert absent == []


def test_the_simulated_benchmark_fills_every_cell_for_a_model():
    from benchmarks import models, simulated

    result = simulated.run_model(models.mlp(width=2048, depth=6, batch=2048))
    budgets = sorted({c["fraction"] for c in result["cells"]}, reverse=True)
    # From the in-core peak down to one budget no schedule can meet, which shows where the limit is.
    assert budgets[0] == 1
    assert min(c["budget_bytes"] for c in result["cells"]) < result["smallest_feasible_bytes"]
    assert len(result["cells"]) == len(budgets) * len(simulated.STRATEGIES) * len(simulated.PROFILES)
    for cell in result["cells"]:
        feasible = cell["budget_bytes"] >= result["smallest_feasible_bytes"]
        if cell["strategy"] == "window":
            assert cell["fits"] == feasible
        if cell["fits"]:
            assert cell["peak_bytes"] <= cell["budget_bytes"]
            assert cell["vs_lower_bound"] >= 1 - 1e-9 and cell["vs_in_core"] >= 1 - 1e-9
    assert all(c["fits"] == (c["fraction"] == 1) for c in result["cells"] if c["strategy"] == "keep_all")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_benchmark_records_the_commit_of_its_checkout_and_unknown_outside_one(tmp_path):
    from benchmarks._machine import machine, source_commit

    assert machine()["commit"] == checkout_commit()
    assert source_commit(tmp_path) == "unknown"  # a directory outside any repository, as an unpacked sdist
    repository = tmp_path / "clone"
    (repository / "unpacked").mkdir(parents=True)
    identity = ["-c", "user.name=oocjax tests", "-c", "user.email=tests@oocjax.invalid", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], [*identity, "commit", "-q", "--allow-empty", "-m", "A commit"]):
        subprocess.run(["git", *command], cwd=repository, capture_output=True, check=True)
    assert source_commit(repository) == git_head(repository)
    # A tarball unpacked inside some other checkout is still not a checkout: that repository's HEAD is not its commit.
    assert source_commit(repository / "unpacked") == "unknown"


def test_the_gpu_check_fails_when_ooc_jit_goes_over_budget_and_the_measurements_say_so():
    from benchmarks import gpu_check, report

    gib = 2**30
    step = dict(losses=[7.0, 6.5], s_per_step=0.1, finite=True, final_loss=6.0, bytes_limit=105 * gib)
    record = dict(
        dry_run=False,
        date="2026-11-27",
        commit="abc1234",
        device="NVIDIA H200",
        model=dict(layers=16, width=1024, batch=8, seq=1024),
        settings=dict(mem_fraction=0.0714),
        link=dict(configuration="link", jitted=dict(bytes=gib, d2h_GB_per_s=53.5, h2d_GB_per_s=53.0), eager={}),
        results=[
            dict(step, configuration="jax_jit", runtime_peak_bytes=30 * gib),
            dict(
                step,
                configuration="ooc_jit_capped",
                bytes_limit=10 * gib,
                budget_bytes=8 * gib,
                runtime_peak_bytes=9 * gib,
                losses=[7.0, 6.5001],
                s_per_step=0.2,
            ),
            dict(
                configuration="jax_jit_capped",
                expect_oom=True,
                oom=True,
                bytes_limit=10 * gib,
                error="XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.",
            ),
        ],
    )
    assert gpu_check.cap_fraction(record["results"][0], None, 1 / 3, environ={}) == pytest.approx(0.0714, abs=1e-4)
    summary = gpu_check.summarise(record)
    assert summary["failures"] == ["ooc_jit_capped: runtime peak 9.00 GiB exceeds its budget 8.00 GiB"]
    assert summary["capped_jax_jit_oom"] and summary["ooc_vs_jax_jit"] == pytest.approx(2.0)
    assert summary["ooc_loss_max_abs_diff"] == pytest.approx(1e-4, rel=1e-3)

    table = "\n".join(report.gpu_check_lines("gpu-nvidia-h200-2026-11-27.json", record))
    assert "| `jax.jit` | none | - | 30.00 GiB | 0.100 | 1.00x | reference, 2 steps |" in table
    assert "| `jax.jit` | 10.00 GiB | - | out of memory (RESOURCE_EXHAUSTED) | - | - | - |" in table
    over = "| `ooc_jit` | 10.00 GiB | 8.00 GiB | 9.00 GiB (**over budget**) | 0.200 | 2.00x | max difference 0.0001 |"
    assert over in table
    assert "jitted 1 GiB copies 53.5 / 53.0" in table


def test_the_readme_table_gives_ooc_jits_time_over_jax_jits_and_over_per_block_remats():
    from benchmarks import report

    step = dict(losses=[7.0], finite=True)
    record = dict(
        date="2026-12-03",
        commit="abc1234",
        device="NVIDIA H200",
        model=dict(layers=16, width=1024),
        results=[
            dict(step, configuration="jax_jit", s_per_step=0.1, vs_jax_jit=1.0, runtime_peak_bytes=30 * 2**30),
            dict(step, configuration="ooc_jit_capped", s_per_step=0.2, vs_jax_jit=2.0, bytes_limit=10 * 2**30),
            dict(step, configuration="remat_nothing_saveable_capped", s_per_step=0.16, vs_jax_jit=1.6),
            dict(configuration="remat_dots_saveable_capped", oom=True, error="RESOURCE_EXHAUSTED"),
        ],
    )
    row = report._gpu_row("gpu-nvidia-h200-2026-12-03.json", record)
    assert (
        "| 2.00x | `nothing_saveable` 1.25x; `dots_saveable` out of memory | `gpu-nvidia-h200-2026-12-03.json` |" in row
    )
    jit = [dict(remat=False, s_per_step=0.4, peak_bytes_in_use=70 * 2**30), dict(remat=True, s_per_step=0.5)]
    ooc = [
        dict(gib=gib, s_per_step=s, state_bytes=15 * 2**30, peak_bytes_in_use=gib * 2**30, budget_bytes=gib * 2**30)
        for gib, s in ((4, 1.0), (14, 0.6))
    ]
    state = dict(record, parameters=1.34e9, jax_jit=jit, ooc_jit=ooc)
    row = report._state_offload_gpu_row("state_offload_gpu-nvidia-h200-2026-12-03.json", state)
    assert "| 2.50x / 1.50x (peak 4.00 GiB / 14.00 GiB) | 2.00x / 1.20x (`nothing_saveable`) |" in row


def test_a_first_call_run_renders_whatever_parts_it_measured_in_the_measurements_and_the_readme_table():
    """``first_call.py`` with ``--ways`` and without ``--second-process``, or with the decoder's ways alone."""
    from benchmarks import report

    def row(model, layers, ratio):
        timings = dict(ooc_s=ratio * 2.0, jit_s=2.0, segments=2 * layers, segments_per_layer=2.0)
        return dict(timings, model=model, layers=layers, ratio=ratio, distinct_programs=6, plans=1)

    machine = dict(machine="a CPU", commit="abc1234", date="2026-11-27")
    zoo = [row("zoo", 4, 1.5), row("zoo", 24, 0.75)]
    ways = [row(way, layers, 1.25) for way in ("linen_auto", "plain") for layers in (4, 24)]
    record = dict(machine, rows=zoo + ways, second_process=[])
    text = "\n".join(report._first_call_lines("first_call-cpu-2026-11-27c.json", record))
    assert "4 layers at 30%: 1.50x" in text and "24 layers at 30%: 0.75x" in text and "second process" not in text
    assert (
        "| linen_auto | 24 | 30% | 1.25x (2.5 s / 2.0 s) | 2.0 | 6 | 1 | - | - |" in text
    )  # peak and results: unrecorded
    measured = dict(
        row("plain", 4, 1.0), fraction=0.6, executed_peak_bytes=90, budget_bytes=100, results_as_jax_jit=True
    )
    assert "| plain | 4 | 60% | 1.00x (2.0 s / 2.0 s) | 2.0 | 6 | 1 | yes | yes |" in "\n".join(
        report._ways_lines(dict(machine, rows=[measured]))
    )
    assert report._first_call_rows("first_call-cpu-2026-11-27c.json", dict(machine, rows=[measured])) == []
    rows = report._first_call_rows("first_call-cpu-2026-11-27c.json", record)
    assert len(rows) == 2 and "| 1.50x / 0.75x | - | `first_call-cpu-2026-11-27c.json` |" in rows[0]
    assert "4 / 24 layers" in rows[1] and "linen_auto 1.25x / 1.25x; plain 1.25x / 1.25x" in rows[1]

    alone = dict(machine, rows=ways)  # the zoo's depths not measured, no second process recorded
    assert "| plain | 4 |" in "\n".join(report._first_call_lines("first_call-cpu-2026-11-27c.json", alone))
    assert len(report._first_call_rows("first_call-cpu-2026-11-27c.json", alone)) == 1


@pytest.mark.slow  # 76 s on 2 loaded CPU cores
def test_the_segment_profile_dry_run_times_every_segment_of_the_plan(tmp_path):
    """The script a GPU session runs to split ``ooc_jit``'s step time (``segment_profile.py``); its
    dry run plans with the H200's rates (the CPU's published rates chose a plan whose segments share
    no program, 19 of 19; which plan the rates pick is not what this test is about)."""
    from benchmarks.gpu_check import DRY_MODEL
    from benchmarks.segment_profile import DRY_REMAT_FRACTIONS, profile

    record = profile(DRY_MODEL, None, steps=2, dry_run=True)
    rows = record["segments"]
    assert len(rows) == record["plan_segments"]
    assert [r["steps"][0] for r in rows[1:]] == [r["steps"][1] for r in rows[:-1]]  # consecutive, none missing
    assert all(r["solo_s"] > 0 and r["flops_per_s"] >= 0 for r in rows)
    # Its two layers may share no program: alike layers share one where they are cut alike.
    assert 0 < record["distinct_programs"] <= len(rows)
    assert all(record[k] > 0 for k in ("jit_s", "ooc_s", "ooc_gate_off_s", "ooc_no_waits_s", "back_to_back_s"))
    # Issue 30's figures: the executor's host waits, the time to its first launch, per-block remat
    # and ooc_jit at remat's own peak and below it.
    assert record["host_waits_per_step"] >= 0 and record["blocked_s_per_step"] >= 0
    assert 0 < record["first_launch_s"] < record["ooc_s"] and record["argument_leaves"] > 10
    assert record["remat_s"] > 0 and record["remat_peak_bytes"] > 0
    assert [row["fraction"] for row in record["at_remat_peak"]] == list(DRY_REMAT_FRACTIONS) == [1.0, 0.8]
    assert all(row.get("s_per_step", 0) > 0 or "infeasible" in row for row in record["at_remat_peak"])


# Here: after the segment profile's test, which runs while this one's processes do; before the first-call
# test, which measures this process's rates and times with nothing running beside it.
@pytest.mark.slow  # every configuration in its own process, two at a time: 27-45 s on 2 CPU cores
def test_the_gpu_check_dry_run_runs_every_configuration_with_equal_losses(gpu_check_dry_run):
    from benchmarks import gpu_check, report

    out, commit_before = gpu_check_dry_run.out, gpu_check_dry_run.commit_before
    result = gpu_check_dry_run.processes.result("gpu_check", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(out.read_text())
    assert record["benchmark"] == "gpu_check" and record["dry_run"] and record["summary"]["failures"] == []
    # The source tree's commit ("unknown" outside a git checkout), taken once the run started: HEAD may move meanwhile.
    assert record["commit"] in {commit_before, checkout_commit()}
    assert record["date"] and {"jax", "jaxlib", "flax", "optax"} <= set(record["versions"])
    assert record["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"

    link = record["link"]
    assert "error" not in link
    assert link["jitted"]["d2h_GB_per_s"] > 0 and link["jitted"]["h2d_GB_per_s"] > 0
    assert len(link["eager"]) == 2
    assert all(e["d2h_GB_per_s"] > 0 and e["h2d_GB_per_s"] > 0 for e in link["eager"].values())

    by = {r["configuration"]: r for r in record["results"]}
    assert list(by) == list(gpu_check.CONFIGURATIONS)  # every configuration ran, in its own process
    reference = by["jax_jit"]["losses"]
    for r in by.values():
        assert "error" not in r, r
        assert r["device"] and r["process_s"] > 0 and r["s_per_step"] > 0 and all(t > 0 for t in r["step_s"])
        assert len(r["losses"]) == record["settings"]["loss_steps"] and r["finite"]
        assert r["losses"] == pytest.approx(reference, rel=1e-5)  # every strategy computes the same steps
        if r["platform"] == "cpu":  # a CPU has no memory_stats(): no cap, no runtime peak
            assert r["bytes_limit"] is None and r["runtime_peak_bytes"] is None
        else:
            assert r["runtime_peak_bytes"] > 0 and r["bytes_limit"] > 0

    ooc = by["ooc_jit_capped"]
    assert ooc["budget_bytes"] == int(0.5 * ooc["in_core_estimate_bytes"])
    assert 0 < ooc["planned_peak_bytes"] <= ooc["budget_bytes"] and ooc["offloads"] > 0
    assert ooc["executed_peak_bytes"] is None or ooc["executed_peak_bytes"] <= ooc["budget_bytes"]
    # What a reader without the device needs to see why the plan is what it is.
    assert ooc["planned_for_bytes"] <= ooc["budget_bytes"] and len(ooc["attempts"]) >= 1
    assert ooc["profile"]["flops_per_s"] > 0 and ooc["summary"].startswith("oocjax plan")
    assert all(by[name]["compiled"]["argument_size_in_bytes"] > 0 for name in by if name != "ooc_jit_capped")

    table = report.gpu_check_lines(out.name, record)
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| configuration")]
    assert len(rows) == len(gpu_check.CONFIGURATIONS)


@pytest.mark.slow  # 36 s on 2 loaded CPU cores
def test_the_first_call_benchmark_counts_each_wrappers_compiles_and_cpu_time():
    from benchmarks.first_call import first_call, in_core_bytes

    budget = int(in_core_bytes(2) * 0.3)
    jit, ooc = first_call(2, "jit", budget), first_call(2, "ooc", budget)
    (planner,) = ooc.step._planners.values()
    assert jit.compiles == 1  # jax.jit's one program: the step's state and batch were made before the call
    # Every distinct segment program is one compile (a renamed JAX event would count none).
    assert ooc.compiles >= len({id(p) for p in planner.built.programs}) > 1
    assert 0 < jit.compile_seconds < jit.seconds and ooc.compile_seconds > 0
    assert jit.cpu_seconds > 0 and ooc.cpu_seconds > 0


def test_a_gpu_state_offload_step_is_measured_against_the_slower_of_its_link_floor_and_jax_jits_step():
    from benchmarks.state_offload_gpu import floors, model_flops

    gb = 1e9
    record = dict(
        link=dict(h2d_GB_per_s=50.0, d2h_GB_per_s=40.0, both_GB_per_s=60.0),
        model_flops=model_flops(dict(batch=2, seq=4, layers=3, width=8), parameters=100),
        jax_jit=[dict(remat=True, s_per_step=0.5), dict(remat=False, s_per_step=0.4)],
        ooc_jit=[
            dict(host_kept_bytes=10 * gb, returned_to_host_bytes=10 * gb, s_per_step=0.6),  # both at once: 1/3 s
            dict(host_kept_bytes=30 * gb, returned_to_host_bytes=0, s_per_step=0.9),  # to the device: 0.6 s
        ],
    )
    floors(record)
    assert record["model_flops"] == 6 * 100 * 8 + 12 * 3 * 8 * 4 * 8
    first, second = record["ooc_jit"]
    assert first["transfer_floor_s"] == pytest.approx(1 / 3) and first["vs_floor"] == pytest.approx(0.6 / 0.4)
    assert second["transfer_floor_s"] == pytest.approx(0.6) and second["vs_floor"] == pytest.approx(0.9 / 0.6)
    assert record["jax_jit"][0]["model_TFLOP_per_s"] == pytest.approx(record["model_flops"] / 0.5 / 1e12)
