"""With JAX's persistent cache directory set, a plan and its compiled segments made in one process
are read back by the next instead of being made again (``oocjax.plan_cache``); on a CPU the plan
alone, its segments compiled again through JAX's cache."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest

from oocjax import ooc_jit
from tests.support.seams import capture_stages, logged_stages, plans_made, with_seams
from tests.support.zoo import mlp_adam


@functools.cache
def case():
    return mlp_adam()


@functools.cache
def in_core() -> int:
    return ooc_jit(case().step, budget=2**62).plan(case().state, case().batches[0]).baseline_peak_bytes


@pytest.fixture
def cache_dir(tmp_path):
    in_core()  # planned before any cache is set: that plan is no entry of the tests' caches
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", previous)


def fresh(state):
    return jax.tree.map(lambda x: x.copy(), state)


def make_step(fraction: float = 0.35, **options):
    options = dict(recompute="off", min_offload_bytes=4096) | options
    return ooc_jit(case().step, budget=int(in_core() * fraction), donate_argnums=(0,), **options)


def entries(cache_dir) -> list:
    return sorted((cache_dir / "oocjax").glob("*.pkl"))


@pytest.mark.parametrize("keeps_programs", [True, False], ids=["with its programs", "plan alone (a CPU)"])
def test_a_new_wrapper_reads_the_plan_and_programs_instead_of_planning_and_compiling(cache_dir, caplog, keeps_programs):
    # On a CPU an entry keeps the plan alone (``plan_cache.KEEPS_PROGRAMS``): its segments compile
    # again, through JAX's cache. Elsewhere it keeps the compiled programs too (tried here on a CPU).
    first = with_seams(make_step(), keeps_programs=keeps_programs)
    expected = first(fresh(case().state), case().batches[0])
    plan = first.plan(case().state, case().batches[0])
    assert plan.segments and plan.schedule.moves and len(entries(cache_dir)) == 1

    capture_stages(caplog)
    second = make_step()
    actual = second(fresh(case().state), case().batches[0])
    jax.tree.map(np.testing.assert_array_equal, actual, expected)
    stages = logged_stages(caplog)
    assert "read the plan from the plan cache" in stages and plans_made(caplog) == 0, stages
    compiled = [stage for stage in stages if stage.startswith("compile")]
    assert len(compiled) == (0 if keeps_programs else 1), stages  # the plan alone: its segments compile once
    again = second.plan(case().state, case().batches[0])
    assert again.segments == plan.segments and again.segment_costs == plan.segment_costs
    assert again.schedule == plan.schedule and again.executed_peak_bytes == plan.executed_peak_bytes


def test_another_budget_or_options_plans_again(cache_dir):
    make_step(0.35)(fresh(case().state), case().batches[0])
    make_step(0.5)(fresh(case().state), case().batches[0])
    make_step(0.35, min_offload_bytes=8192)(fresh(case().state), case().batches[0])
    assert len(entries(cache_dir)) == 3


def test_a_recompute_policy_function_is_never_cached(cache_dir):
    make_step(recompute=lambda name, label: None)(fresh(case().state), case().batches[0])
    assert entries(cache_dir) == []


def test_an_unreadable_entry_is_ignored_with_a_warning_and_replaced(cache_dir):
    expected = make_step()(fresh(case().state), case().batches[0])
    (entry,) = entries(cache_dir)
    entry.write_bytes(b"not a plan")
    with pytest.warns(UserWarning, match="unreadable plan cache entry"):
        actual = make_step()(fresh(case().state), case().batches[0])
    jax.tree.map(np.testing.assert_array_equal, actual, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_step().plan(case().state, case().batches[0])  # the entry was written again


@pytest.mark.slow
def test_a_second_process_runs_the_cached_plan_with_the_same_results(tmp_path):
    script = textwrap.dedent(
        """
        import sys, jax, numpy as np
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
        from oocjax import ooc_jit
        from tests.support.seams import with_seams
        from tests.support.zoo import mlp_adam
        case = mlp_adam()
        in_core = ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes
        step = ooc_jit(case.step, budget=int(in_core * 0.35), donate_argnums=(0,), recompute="off",
                       min_offload_bytes=4096)
        if sys.argv[2] == "second":  # planning again would fail (on a CPU its segments compile again)
            step = with_seams(step, plan_window=None)
        state, metrics = step(case.state, case.batches[0])
        np.save(sys.argv[3], np.asarray(metrics["loss"]))
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for run in ("first", "second"):
        subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "cache"), run, str(tmp_path / f"{run}.npy")],
            check=True,
            cwd=root,
            env=os.environ | {"PYTHONPATH": root},
        )
    np.testing.assert_array_equal(np.load(tmp_path / "second.npy"), np.load(tmp_path / "first.npy"))
