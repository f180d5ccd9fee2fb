"""ooc_jit's contract: caching, the shape of the rewritten and lowered programs, errors, homes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oocjax.api
from oocjax import BudgetInfeasibleError, OocError, UnsupportedPrimitiveError, ooc_jit
from oocjax.schedule import Offload, Prefetch, required_bytes

KiB = 1024


def mlp_step(params, x):
    def loss_fn(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


PARAMS = [jnp.full((128, 128), 0.01 * (i + 1), dtype=jnp.float32) for i in range(4)]
X = jnp.linspace(-1, 1, 256 * 128).reshape(256, 128)


def tight_step(**kw):
    in_core = ooc_jit(mlp_step, budget=2**62).plan(PARAMS, X).baseline_peak_bytes
    return ooc_jit(mlp_step, budget=in_core * 2 // 5, min_offload_bytes=4 * KiB, **kw)


def test_a_second_call_with_the_same_shapes_neither_traces_nor_plans(monkeypatch):
    traces, plans = [], []
    real_plan_window = oocjax.api.plan_window

    def counting_step(params, x):
        traces.append(1)
        return mlp_step(params, x)

    def counting_plan_window(*args, **kwargs):
        plans.append(1)
        return real_plan_window(*args, **kwargs)

    monkeypatch.setattr(oocjax.api, "plan_window", counting_plan_window)
    in_core = ooc_jit(mlp_step, budget=2**62).plan(PARAMS, X).baseline_peak_bytes
    step = ooc_jit(counting_step, budget=in_core // 2, min_offload_bytes=4 * KiB)
    params, _ = step(PARAMS, X)
    assert (len(traces), len(plans)) == (1, 2)  # one plan above for the estimate, one here
    params, _ = step(params, X)
    step.plan(params, X)
    assert (len(traces), len(plans)) == (1, 2)
    step(params, X[:128])  # a new shape is a new signature
    assert (len(traces), len(plans)) == (2, 3)


def test_the_rewritten_jaxpr_has_one_host_transfer_per_offload_and_one_fetch_per_prefetch():
    plan = tight_step().plan(PARAMS, X)
    assert plan.offloads and plan.host_inputs
    puts = [e for e in plan.jaxpr.eqns if e.primitive.name == "device_put"]
    to_host = [e for e in puts if e.params["devices"] == (jax.memory.Space.Host,)]
    to_device = [e for e in puts if e.params["devices"] == (jax.memory.Space.Device,)]
    assert len(to_host) == len(plan.offloads)
    assert len(to_device) == len(plan.schedule.prefetches)
    assert not any(e.primitive.name == "device_put" for e in plan.source_jaxpr.eqns)


def placements(text: str) -> list[str]:
    return re.findall(r'annotate_device_placement\(([^)]*)\).*?_xla_buffer_placement = "(\w+)"', text)


def test_the_cuda_lowering_has_the_planned_transfers_and_barriers_in_plan_order():
    step = tight_step(donate_argnums=(0,))
    plan = step.plan(PARAMS, X)
    text = step.lower(PARAMS, X, lowering_platforms=("cuda",)).as_text()
    # Transfers in program order: each step's prefetches, then its offloads. Then one annotation per
    # result with a memory kind: those returned in host memory, and (jax may elide them) device ones.
    expected = ["device" if isinstance(m, Prefetch) else "pinned_host" for m in plan.schedule.moves]
    found = placements(text)
    assert [kind for _, kind in found[: len(expected)]] == expected
    results = [kind for _, kind in found[len(expected) :]]
    assert results.count("pinned_host") == len(plan.host_outputs)
    assert results.count("device") <= len(jax.tree.leaves(jax.eval_shape(mlp_step, PARAMS, X))) - len(plan.host_outputs)
    # Every prefetch after the first step reads a barrier result: its start is pinned.
    for (operand, _), move in zip(found, plan.schedule.moves):
        if isinstance(move, Prefetch) and move.issue_step > 0:
            assert "#" in operand, f"prefetch {move} is not pinned by a barrier"
    # One barrier per pinned prefetch, per offload issued after its value's definition, and per
    # step that waits for offloads.
    defined_at = {b: k for k, s in enumerate(plan.program.steps) for b in s.writes}
    pinned = sum(1 for m in plan.schedule.prefetches if m.issue_step > 0)
    late = sum(1 for m in plan.schedule.offloads if m.after_step != defined_at[m.buffer])
    waits = len({m.done_before_step for m in plan.schedule.offloads if m.done_before_step is not None})
    assert text.count("stablehlo.optimization_barrier") == pinned + late + waits
    # Arguments kept on host arrive in pinned host memory.
    assert text.count('mhlo.memory_kind = "pinned_host"') >= len(plan.host_inputs)


def test_a_budget_at_the_in_core_estimate_gives_the_plain_program():
    in_core = ooc_jit(mlp_step, budget=2**62).plan(PARAMS, X).baseline_peak_bytes
    step = ooc_jit(mlp_step, budget=in_core)
    plan = step.plan(PARAMS, X)
    assert plan.offloads == () and plan.host_inputs == () and plan.jaxpr is plan.source_jaxpr
    assert "annotate_device_placement" not in step.lower(PARAMS, X, lowering_platforms=("cuda",)).as_text()


def test_plans_label_values_with_their_source_line_and_arguments_with_their_path():
    plan = tight_step().plan(PARAMS, X)
    assert all(re.fullmatch(r"output of \w+ from test_ooc_jit\.py:\d+ \(\w+\)", o.label) for o in plan.offloads)
    assert {h.label for h in plan.host_inputs} <= {f"argument params[{i}]" for i in range(4)} | {"argument x"}
    assert plan.peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert "offloads" in repr(plan) and "in-core" in repr(plan)


def test_an_infeasible_budget_names_the_operation_its_line_and_the_smallest_feasible_budget():
    with pytest.raises(BudgetInfeasibleError) as caught:
        ooc_jit(mlp_step, budget="64KiB").plan(PARAMS, X)
    message = str(caught.value)
    assert re.search(r"step \d+ \(\w+ at test_ooc_jit\.py:\d+ \(\w+\)\) alone needs", message)
    assert "The smallest feasible budget is" in message
    assert isinstance(caught.value, OocError) and caught.value.required_bytes > 64 * KiB
    # and the budget it names works
    ooc_jit(mlp_step, budget=caught.value.required_bytes).plan(PARAMS, X)


@pytest.mark.parametrize(
    ("budget", "error", "words"),
    [
        ("12 parsecs", ValueError, "cannot read '12 parsecs' as a number of bytes"),
        ("80%", ValueError, "does not report its memory size"),
        (0.5, ValueError, "give the budget in bytes instead"),
        (1.5, ValueError, r"fractional budget must be in \(0, 1\]"),
        (-5, ValueError, "budget must be positive"),
        (True, TypeError, "budget must be an int number of bytes"),
        (None, TypeError, "budget must be an int number of bytes"),
    ],
)
def test_a_bad_budget_says_what_is_accepted(budget, error, words):
    with pytest.raises(error, match=words):
        ooc_jit(mlp_step, budget=budget)


def test_budgets_with_units_are_read_as_bytes():
    assert ooc_jit(mlp_step, budget="1.5 GiB").budget_bytes == 3 * 2**29
    assert ooc_jit(mlp_step, budget="512MB").budget_bytes == 512 * 10**6


def test_an_unknown_planner_option_is_refused():
    with pytest.raises(TypeError, match=r"unknown planner options \['windows'\]"):
        ooc_jit(mlp_step, budget="1GiB", windows=3)


def test_an_unknown_higher_order_primitive_is_refused_with_its_name_and_line():
    mesh = jax.make_mesh((1,), ("x",))
    doubled = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
    with pytest.raises(UnsupportedPrimitiveError, match=r"'shard_map' \(at test_ooc_jit\.py:\d+"):
        ooc_jit(lambda a: doubled(a) + 1, budget="1GiB").plan(jnp.ones(4))


def test_state_kept_on_host_comes_back_on_host_and_is_not_moved_again():
    step = tight_step(donate_argnums=(0,))
    params = [p.copy() for p in PARAMS]
    plan = step.plan(params, X)
    host = {h.label for h in plan.host_inputs}
    assert host & {f"argument params[{i}]" for i in range(4)}, "the tight budget should keep parameters on host"
    new_params, _ = step(params, X)
    kinds = [p.sharding.memory_kind for p in new_params]
    assert kinds == ["pinned_host" if f"argument params[{i}]" in host else "device" for i in range(4)]
    # Arguments already where the plan wants them are passed through untouched.
    assert all(oocjax.api._to_memory(p, kind) is p for p, kind in zip(new_params, kinds))
    again, _ = step(new_params, X)
    assert [p.sharding.memory_kind for p in again] == kinds


def test_loops_and_checkpoints_are_planned_as_opaque_steps_and_give_the_same_numbers():
    def scan_step(params, x):
        def loss_fn(params):
            layer = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, params)
            return jnp.mean(h**2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return params - 0.1 * grads, loss

    params = jnp.stack(PARAMS)
    unlimited = ooc_jit(scan_step, budget=2**62).plan(params, X)
    # The backward loop reads every saved residual at once, so the feasible range is narrow.
    smallest = max(required_bytes(unlimited.program, 4 * KiB))
    step = ooc_jit(scan_step, budget=(smallest + unlimited.baseline_peak_bytes) // 2, min_offload_bytes=4 * KiB)
    plan = step.plan(params, X)
    scans = [s for s in plan.program.steps if s.name == "scan"]
    assert len(scans) == 2 and all(s.transient_bytes > 0 for s in scans)  # forward and backward loops
    assert plan.offloads or plan.host_inputs
    expected = jax.jit(scan_step)(params, X)
    actual = step(params, X)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(actual[1], expected[1])


def test_static_and_keyword_arguments_work_as_with_jax_jit():
    def step(params, x, *, scale, steps):
        for _ in range(steps):
            params, loss = mlp_step(params, x * scale)
        return params, loss

    in_core = ooc_jit(step, budget=2**62, static_argnames="steps").plan(PARAMS, X, scale=2.0, steps=2)
    ooc = ooc_jit(step, budget=in_core.baseline_peak_bytes // 2, static_argnames="steps", min_offload_bytes=4 * KiB)
    plan = ooc.plan(PARAMS, X, scale=2.0, steps=2)
    assert "scale" in {b.label.removeprefix("argument ") for b in plan.program.buffers if b.kind == "input"}
    expected = jax.jit(step, static_argnames="steps")(PARAMS, X, scale=2.0, steps=2)
    actual = ooc(PARAMS, X, scale=2.0, steps=2)
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-6)
    assert isinstance(plan.schedule.moves[0], Prefetch | Offload)


def test_the_pretty_jaxpr_marks_every_transfer_with_the_value_it_moves():
    plan = tight_step().plan(PARAMS, X)
    text = plan.pretty_jaxpr()
    assert text.count("<<< OFFLOAD") == len(plan.offloads)
    assert text.count(">>> PREFETCH") == len(plan.schedule.prefetches)
    assert "# transfer" not in text  # every device_put matched a planned move
    for offload in plan.offloads:
        assert f"OFFLOAD after equation {offload.offload_after}: {offload.label}" in text


# -- the closed loop on the budget -------------------------------------------------------------------
# On a CPU, XLA's memory report does not count temporaries, so these tests replace it with a stub:
# a clearly fake "compiled peak" that plays the part of XLA's real report on a GPU.


def test_a_compiled_peak_over_the_budget_is_planned_again_for_a_tighter_budget(monkeypatch):
    budget = tight_step().budget_bytes
    reports = iter([budget * 6 // 5, budget * 9 // 10])  # STUB: 20% over, then under
    monkeypatch.setattr(oocjax.api, "_compiled_peak_bytes", lambda compiled: next(reports))
    step = ooc_jit(mlp_step, budget=budget, min_offload_bytes=4 * KiB, check_compiled_peak=True)
    plan = step.plan(PARAMS, X)
    assert plan.budget_bytes == budget and plan.compiled_peak_bytes == budget * 9 // 10
    assert plan.schedule.budget_bytes == int(budget * budget / (budget * 6 // 5) * 0.98)
    assert plan.peak_bytes <= plan.schedule.budget_bytes < budget
    assert "compiled peak" in plan.summary(profile=None)
    np.testing.assert_allclose(step(PARAMS, X)[1], jax.jit(mlp_step)(PARAMS, X)[1], rtol=1e-6)


def test_a_compiled_peak_that_never_fits_raises_with_every_attempt(monkeypatch):
    budget = tight_step().budget_bytes
    monkeypatch.setattr(oocjax.api, "_compiled_peak_bytes", lambda compiled: 3 * budget)  # STUB
    step = ooc_jit(mlp_step, budget=budget, min_offload_bytes=4 * KiB, check_compiled_peak=True)
    with pytest.raises(OocError, match=r"XLA's compiled step does not fit the budget .* compiled to") as caught:
        step.plan(PARAMS, X)
    assert "check_compiled_peak=False" in str(caught.value)


def test_the_compiled_peak_is_read_from_xla_memory_analysis():
    compiled = jax.jit(lambda x: (x * 2).sum()).lower(X).compile()
    stats = compiled.memory_analysis()
    expected = getattr(stats, "peak_memory_in_bytes", 0) or (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )
    assert oocjax.api._compiled_peak_bytes(compiled) == expected > 0
