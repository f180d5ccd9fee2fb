"""A plan is one value from the loop to the user: the chain it shows is the one the simulator
checked and the executor runs, and a first call says what it spent its time on."""

import logging
import time

import jax

from oocjax import ooc_jit
from tests.support.seams import REAL, capture_stages, logged_stages, with_seams
from tests.support.zoo import mlp_adam


def tight_step(**seams):
    case = mlp_adam()
    in_core = ooc_jit(case.step, budget=2**62).plan(case.state, case.batches[0]).baseline_peak_bytes
    step = ooc_jit(case.step, budget=int(in_core * 0.35), donate_argnums=(0,), min_offload_bytes=4096)
    return with_seams(step, **seams), case


def test_the_chain_the_executor_runs_is_the_plans_and_the_one_the_checker_replayed():
    checked = []

    def checking(program, chain):
        checked.append(chain)
        return REAL.check_chain(program, chain)

    step, case = tight_step(check_chain=checking)
    plan = step.plan(case.state, case.batches[0])
    (planner,) = step._planners.values()
    assert plan.segments and plan.chain is not None
    assert planner.built.executor.chain is plan.chain
    assert checked[-1] is plan.chain  # the last chain checked is the one settled on
    assert plan.chain.segments == plan.segments


def test_a_first_call_logs_each_stage_with_its_time_and_the_plan_keeps_them(caplog):
    capture_stages(caplog)
    step, case = tight_step()
    caplog.clear()
    start = time.perf_counter()
    plan = step.plan(case.state, case.batches[0])
    elapsed = time.perf_counter() - start
    stages = [name for name, _ in plan.timings]
    assert stages[0] == "trace" and stages[-1] == "build"
    assert {"layers", "plan", "cut", "measure"} <= set(stages)
    assert any(name.startswith("compile") and name.endswith("programs") for name in stages)
    assert logged_stages(caplog) == stages
    assert all(r.levelno == logging.INFO and r.getMessage().endswith(" s") for r in caplog.records)
    assert abs(sum(seconds for _, seconds in plan.timings) - elapsed) <= 0.1 * elapsed
    # A second call plans nothing and logs nothing.
    caplog.clear()
    step(jax.tree.map(lambda x: x.copy(), case.state), case.batches[0])
    assert logged_stages(caplog) == []
