"""Nothing lost: a donated training state survives every plan, a failed call, two threads, and the
caller's own arrays count against the budget."""

import functools
import threading
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import oocjax
from oocjax import BudgetInfeasibleError, OocError, ooc_jit
from oocjax.schedule.simulate import frees_host_state_early
from oocjax.transforms.execute import observe_segments
from tests.support.seams import REAL, with_seams

DEPTH, WIDTH, BATCH = 6, 128, 64
OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def mlp_state(seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), DEPTH)
    params = [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5, "b": jnp.zeros(WIDTH)} for k in keys]
    return {"params": params, "opt": OPTIMIZER.init(params)}


def loss_fn(params, x, y):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x - y) ** 2)


def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], *batch)
    updates, opt = OPTIMIZER.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


@functools.cache
def batches(n: int = 3) -> list:
    """``n`` batches, made once, on first use."""
    keys = jax.random.split(jax.random.key(1), 2 * n)
    return [
        (jax.random.normal(keys[2 * i], (BATCH, WIDTH)), jax.random.normal(keys[2 * i + 1], (BATCH, WIDTH)))
        for i in range(n)
    ]


@functools.cache
def in_core() -> int:
    return ooc_jit(train_step, budget=2**62).plan(mlp_state(), batches()[0]).baseline_peak_bytes


def reference(state, steps: int = 3) -> list:
    results = []
    for batch in batches()[:steps]:
        state, loss = jax.jit(train_step)(state, batch)
        results.append((state, loss))
    return results


def assert_close(actual, expected) -> None:
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5), actual, expected
    )


def live_leaves(tree) -> int:
    return sum(not x.is_deleted() for x in jax.tree.leaves(tree))


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60])
def test_a_donated_sgd_momentum_state_trains_like_jax_jit_at_every_budget_and_no_leaf_is_lost(fraction):
    step = ooc_jit(train_step, budget=int(in_core() * fraction), donate_argnums=(0,), min_offload_bytes="16KiB")
    state = mlp_state()
    for batch, (expected_state, expected_loss) in zip(batches(), reference(mlp_state())):
        state, loss = step(state, batch)
        assert live_leaves(state) == 24, "every leaf of the returned state is alive"
        assert_close((state, loss), (expected_state, expected_loss))


def host_state_step(fraction: float = 0.35):
    """The MLP step at ``fraction`` of in-core, and a state as the step returns it after one call:
    the part the plan keeps on host comes back in host memory."""
    step = ooc_jit(train_step, budget=int(in_core() * fraction), donate_argnums=(0,), min_offload_bytes="16KiB")
    state, _ = step(mlp_state(), batches()[0])
    assert any(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state)), "some state lives on host"
    return step, state


def interrupt_at(segment: int):
    def observer(launch):
        if launch.segment == segment:
            raise KeyboardInterrupt

    return observer


def test_an_interrupt_before_the_first_launch_leaves_the_donated_state_whole_and_reusable():
    step, state = host_state_step()
    with observe_segments(interrupt_at(0)), pytest.raises(KeyboardInterrupt):
        step(state, batches()[1])
    assert live_leaves(state) == 24
    expected = reference(mlp_state(), steps=3)[2]
    state, loss = step(state, batches()[1])
    state, loss = step(state, batches()[2])
    assert_close((state, loss), expected)


@pytest.mark.parametrize("fraction", [0.35, 0.6])
def test_an_interrupt_between_segments_keeps_host_kept_state_and_names_the_consumed_leaves(fraction):
    step, state = host_state_step(fraction)
    plan = step.plan(state, batches()[1])
    labels = {x: label for x, label in zip(map(id, jax.tree.leaves(state)), _leaf_paths(state))}
    host_kept = [x for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host"]
    with observe_segments(interrupt_at(len(plan.segments) - 1)), pytest.raises(KeyboardInterrupt) as caught:
        step(state, batches()[1])
    if frees_host_state_early(plan.program, plan.schedule):  # state on host larger than the budget
        assert any(x.is_deleted() for x in host_kept), "old state on host goes at its last prefetch"
    else:
        assert not any(x.is_deleted() for x in host_kept), "state kept in host memory survives a failed call"
    gone = [labels[id(x)] for x in jax.tree.leaves(state) if x.is_deleted()]
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    if gone:
        assert "consumed" in notes and all(name in notes for name in gone), (gone, notes)
    else:
        assert "consumed" not in notes


def _leaf_paths(tree) -> list[str]:
    return [f"state{jax.tree_util.keystr(path)}" for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_a_failed_call_keeps_none_of_its_intermediate_arrays_alive_through_the_exception():
    step, state = host_state_step()
    plan = step.plan(state, batches()[1])
    before = {id(x) for x in jax.live_arrays()}
    with observe_segments(interrupt_at(len(plan.segments) // 2)):
        try:
            step(state, batches()[1])
        except KeyboardInterrupt as error:
            kept = error  # the caller holds on to the exception
    made = [x for x in jax.live_arrays() if id(x) not in before and not x.is_deleted()]
    assert kept is not None and made == [], [x.shape for x in made]


def test_two_threads_calling_one_step_get_the_serial_results_and_each_call_holds_the_budget():
    budget = int(in_core() * 0.4)
    params = oocjax.to_host(mlp_state()["params"])  # not donated: the step streams them from host
    grad_step = ooc_jit(jax.value_and_grad(loss_fn), budget=budget, min_offload_bytes="16KiB")
    plan = grad_step.plan(params, *batches()[0])
    assert plan.segments and plan.moved_bytes > 0, "the step runs as a chain that moves values"
    serial = [grad_step(params, *batches()[i % 3]) for i in range(3)]
    results, errors, launches = {}, [], []

    def worker(thread: int) -> None:
        try:
            for i in range(20):
                results[thread, i] = grad_step(params, *batches()[i % 3])
        except Exception as error:
            errors.append(error)

    with observe_segments(launches.append):
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert len(results) == 40
    for (_, i), result in results.items():
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), result, serial[i % 3])
    assert launches and all(launch.held_bytes + launch.cost.launch_bytes <= budget for launch in launches)


def device_bytes_during(step, *args) -> int:
    """The most device bytes of arrays made since the call started, plus the caller's arguments in
    device memory, at any segment boundary."""
    before = {id(x) for x in jax.live_arrays()}
    arguments = sum(x.nbytes for x in jax.tree.leaves(args) if x.sharding.memory_kind == "device")
    samples = []

    def sample(launch):
        made = [x for x in jax.live_arrays() if id(x) not in before and x.sharding.memory_kind == "device"]
        samples.append(arguments + sum(x.nbytes for x in made) + launch.cost.launch_bytes)

    with observe_segments(sample):
        jax.block_until_ready(step(*args))
    return max(samples)


def test_a_state_the_caller_keeps_on_the_device_is_counted_there_and_not_copied_to_host():
    state = mlp_state()  # on the device, not donated: the caller still holds every byte of it
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    budget = int(in_core() * 0.75)
    assert state_bytes < budget
    step = ooc_jit(train_step, budget=budget, min_offload_bytes="16KiB")
    plan = step.plan(state, batches()[0])
    assert plan.offloads, "the budget still makes the step move activations"
    assert set(plan.input_kinds) == {"device"} and not plan.host_inputs
    assert device_bytes_during(step, state, batches()[0]) <= budget
    assert_close(step(state, batches()[0]), reference(mlp_state(), steps=1)[0])


def test_a_budget_only_the_kept_arguments_break_names_them_with_the_fixes():
    state = mlp_state()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    step = ooc_jit(train_step, budget=int(state_bytes * 0.9), min_offload_bytes="16KiB")
    with pytest.raises(BudgetInfeasibleError, match=r"keep on the device") as caught:
        step(state, batches()[0])
    message = str(caught.value)
    assert "state['params'][0]['w']" in message and "donate" in message and "oocjax.to_host" in message
    assert live_leaves(state) == 24
    # The fixes it names work: the same state passed in host memory, or donated.
    assert_close(step(oocjax.to_host(state), batches()[0]), reference(mlp_state(), steps=1)[0])


def test_a_host_budget_below_the_host_peak_is_refused_before_anything_runs():
    state = mlp_state()
    step = ooc_jit(
        train_step, budget=int(in_core() * 0.35), donate_argnums=(0,), min_offload_bytes="16KiB", host_budget="64KiB"
    )
    with pytest.raises(OocError, match=r"of host memory at its peak.*host_budget \(64 KiB\)"):
        step(state, batches()[0])
    assert live_leaves(state) == 24, "nothing ran: the donated state is untouched"


def test_donated_state_kept_on_host_is_deleted_when_the_call_succeeds_as_jax_jit_deletes_donated_arrays():
    step, state = host_state_step()
    host_kept = [x for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host"]
    new_state, _ = step(state, batches()[1])
    assert all(x.is_deleted() for x in host_kept)
    assert live_leaves(new_state) == 24


def nan_step(params, x):
    h = jnp.log(x @ params["w"] - 1e3)  # the log of a negative number: NaN
    return jnp.sum(h @ params["v"])


def test_jax_debug_nans_raises_a_floating_point_error_naming_the_operation_and_the_line():
    params = {"w": jnp.ones((256, 256)), "v": jnp.ones((256, 256))}
    x = jnp.ones((256, 256))
    step = ooc_jit(nan_step, budget=5 * 256 * 256 * 4, min_offload_bytes=1024, min_segments=2)
    assert step.plan(oocjax.to_host(params), x).segments
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as caught:
        step(oocjax.to_host(params), x)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "log" in str(caught.value) + notes and "test_reliability.py:" in notes, (str(caught.value), notes)


def test_a_plan_the_simulator_rejects_never_runs_and_the_error_says_why():
    def offloading_twice(program, budget_bytes, **options):
        schedule = REAL.plan_window(program, budget_bytes, **options)
        first = schedule.offloads[0]
        again = replace(first, after_step=first.after_step, done_before_step=None)
        return replace(schedule, moves=(*schedule.moves, again))

    state = mlp_state()
    step = ooc_jit(train_step, budget=int(in_core() * 0.4), donate_argnums=(0,), min_offload_bytes="16KiB")
    with pytest.raises(OocError, match=r"its own simulator rejects .*\n  - buffer \d+ .* is offloaded twice"):
        with_seams(step, plan_window=offloading_twice)(state, batches()[0])
    assert live_leaves(state) == 24, "nothing ran: the donated state is untouched"
