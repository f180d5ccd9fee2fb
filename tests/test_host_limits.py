"""Host memory is real: on a GPU every host copy comes from XLA's pinned host pool, which
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB caps (64 GiB by default) whatever the machine has. A plan over the
pool or over the machine's available memory is refused before anything runs, naming both.

The steps are planned from abstract arguments (80 GiB of state, 72 GiB of it kept on host) on a CPU made to read
as "cuda"; a refused plan is refused before its segments are compiled."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from oocjax import OocError, ooc_jit
from oocjax.host_limit import host_limit
from oocjax.options import PlannerOptions
from tests.support.seams import with_seams

GIB = 2**30
POOL = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEPTH, WIDTH, BATCH = 10, 32768, 8  # 4 GiB weights: 40 GiB of parameters and 40 GiB of momentum
OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def loss_fn(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def train_step(state, x):
    params, opt = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt = OPTIMIZER.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def plan_72_gib_of_state_on_host(seams: dict, **options):
    """Plans the step at a 24 GiB budget: of the 80 GiB state, two weights stay on the device (the
    plan would fetch them twice) and the rest on host (72.1 GiB at its peak)."""
    params = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH
    state = (params, jax.eval_shape(OPTIMIZER.init, params))
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    return with_seams(ooc_jit(train_step, budget="24GiB", donate_argnums=0, **options), **seams).plan(state, x)


@pytest.fixture
def machine(monkeypatch):
    """The step's platform, its pinned pool setting (unset: None) and the memory the machine has available."""
    monkeypatch.delenv(POOL, raising=False)

    def set_up(platform: str, pool: str | None = None, available_gib: int = 1000):
        set_up.seams.update(platform=lambda: platform, available_host_bytes=lambda: available_gib * GIB)
        if pool is not None:
            monkeypatch.setenv(POOL, pool)

    set_up.seams = {}
    return set_up


def refused(machine, **options) -> str:
    """The refusal's message; it comes before any segment is compiled."""

    def no_compiling(*args, **kwargs):
        raise AssertionError("a plan over the host memory it may use was compiled")

    with pytest.raises(OocError, match="of host memory at its peak") as caught:
        plan_72_gib_of_state_on_host(machine.seams | {"compile_segments": no_compiling}, **options)
    return str(caught.value)


def test_on_a_gpu_a_plan_over_the_pinned_pool_is_refused_naming_the_pool_and_the_machines_memory(machine, monkeypatch):
    machine("cuda", pool="16")
    message = refused(machine)
    assert "the plan needs 72.1 GiB of host memory at its peak" in message
    assert f"XLA's pool of pinned host memory (16 GiB, {POOL}=16)" in message
    assert "the memory this machine has available less a 10% margin (900 GiB)" in message
    assert "the 16 GiB it may use on this GPU" in message and "the pinned pool binds" in message
    assert f"set {POOL}=73 (GiB) or more" in message
    assert "host_budget=" not in message, "the machine has the memory: no host_budget fix"


def test_on_a_gpu_the_pinned_pool_is_64_gib_when_the_variable_is_unset(machine, monkeypatch):
    machine("cuda")
    message = refused(machine)
    assert f"XLA's pool of pinned host memory (64 GiB, {POOL} unset: 64 GiB by default)" in message


def test_on_a_gpu_the_step_plans_once_the_pool_is_set_to_the_size_the_refusal_names(machine, monkeypatch):
    machine("cuda", pool="16")
    with pytest.raises(OocError, match="of host memory at its peak") as caught:
        plan_72_gib_of_state_on_host(machine.seams)
    needed = re.search(rf"set {POOL}=(\d+) \(GiB\)", str(caught.value)).group(1)
    assert needed == "73"  # whole GiB, as XLA reads them, at least the 72.1 GiB peak
    monkeypatch.setenv(POOL, needed)
    assert 72 * GIB < plan_72_gib_of_state_on_host(machine.seams).host_peak_bytes <= 73 * GIB


def test_on_a_gpu_the_machines_memory_binds_when_it_is_less_than_the_pool(machine, monkeypatch):
    machine("cuda", pool="1000", available_gib=50)
    message = refused(machine)
    assert "the memory this machine has available less a 10% margin (45 GiB)" in message
    assert f"XLA's pool of pinned host memory (1000 GiB, {POOL}=1000)" in message
    assert "the 45 GiB it may use on this GPU" in message and "the machine's memory binds" in message
    assert "free host memory, or pass host_budget='72.1 GiB'" in message
    assert f"set {POOL}=" not in message, "the pool is large enough: no fix for it"


def test_on_a_gpu_a_host_budget_does_not_lift_the_pinned_pool(machine, monkeypatch):
    machine("cuda", pool="16")
    message = refused(machine, host_budget="1TiB")
    assert f"the lesser of host_budget (1 TiB) and XLA's pool of pinned host memory (16 GiB, {POOL}=16)" in message
    assert "the pinned pool binds" in message and "whose cap applies on top of host_budget" in message


def test_on_a_cpu_the_variable_is_ignored_pinned_host_is_ordinary_memory(machine):
    machine("cpu", pool="16")
    assert plan_72_gib_of_state_on_host(machine.seams).host_peak_bytes > 72 * GIB


def test_on_a_cpu_the_machines_memory_still_binds_with_todays_message(machine, monkeypatch):
    machine("cpu", pool="1000", available_gib=50)
    message = refused(machine)
    assert message.startswith(
        "the plan needs 72.1 GiB of host memory at its peak (host-kept state and copies of values moved off the "
        "device), more than the memory this machine has available less a 10% margin (45 GiB).\nFixes:"
    )
    assert POOL not in message


def test_a_setting_xla_cannot_read_as_whole_gib_leaves_the_pool_at_64_gib_as_in_xla(monkeypatch):
    monkeypatch.setenv(POOL, "1.5")
    limit = host_limit(PlannerOptions(), 0, "rocm", None)
    assert limit.pinned_pool_bytes == 64 * GIB
    assert limit.pinned_pool_reading == f"{POOL}='1.5' is not a whole number of GiB: 64 GiB, as XLA reads it"
