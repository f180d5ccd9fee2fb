"""The executor's allocator gate: where the device reports its allocator's bytes in use, a launch
also waits until the allocator, not only the executor's own account, has room for it; where it
reports nothing (a CPU) nothing changes. And the GPU check's synced diagnostic, on numbers worked
out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from oocjax import ooc_jit
from oocjax.transforms.account import COMPUTE_SYNCHRONIZED, DeviceAccess, DeviceMemory, allocator_reader, wait
from oocjax.transforms.execute import observe_segments
from tests.support.seams import with_seams

HOST = jax.memory.Space.Host


class Probe:
    """Stands in for an array that is ready once its work is done; counts the waits on it."""

    def __init__(self):
        self.waits, self.deleted = 0, False

    def is_ready(self) -> bool:
        return self.waits > 0

    def is_deleted(self) -> bool:
        return self.deleted

    def block_until_ready(self):
        assert not self.deleted, "waiting on a deleted array crashes the process"
        self.waits += 1
        return self


class Allocator:
    """A fake ``bytes_in_use``: ``base``, plus bytes that go back only once their probe is waited on,
    plus ``growth`` more at every read (never room, whatever is taken as foreign)."""

    def __init__(self, base: int, late: dict[Probe, int] | None = None, growth: int = 0):
        self.base, self.late, self.growth, self.reads = base, late or {}, growth, 0

    def __call__(self) -> int:
        self.reads += 1
        return self.base + self.growth * self.reads + sum(n for probe, n in self.late.items() if not probe.waits)


def memory_with_two_pending(allocator: Allocator, **access) -> tuple[DeviceMemory, Probe, Probe]:
    """A budget of 100 bytes; 30 + 30 bytes let go of, in use until ``first`` and ``second`` are ready."""
    memory = DeviceMemory(100, allocator, access=DeviceAccess(**access))
    memory.count_foreign()  # nothing is held or pending yet: all the allocator reports is foreign
    first, second = Probe(), Probe()
    memory.release([], first, extra_bytes=30)
    memory.release([], second, extra_bytes=30)
    return memory, first, second


def test_a_launch_waits_while_the_allocator_has_more_in_use_than_the_account():
    allocator = Allocator(0)
    memory, first, second = memory_with_two_pending(allocator)
    # The account says 60 + 30 = 90 fit in 100; the allocator has 35 more in use until `first` is done.
    allocator.base, allocator.late = 60, {first: 35}
    memory.make_room(30)
    assert (first.waits, second.waits) == (1, 0)
    assert memory.pending_bytes == 30 and memory.allocator_bytes == 60


def test_the_switch_turns_the_gate_off():
    allocator = Allocator(0)
    memory, first, second = memory_with_two_pending(allocator, allocator_gate=False)
    allocator.base, allocator.late = 60, {first: 35}
    memory.make_room(30)
    assert (first.waits, second.waits) == (0, 0) and allocator.reads == 0
    assert memory.pending_bytes == 60 and memory.allocator_bytes is None


def test_a_launch_does_not_wait_when_the_allocator_agrees_with_the_account():
    allocator = Allocator(0)
    memory, first, second = memory_with_two_pending(allocator)
    allocator.base = 60
    memory.make_room(40)  # 60 + 40: exactly the budget
    assert (first.waits, second.waits) == (0, 0)
    assert memory.pending_bytes == 60 and memory.allocator_bytes == 60


def test_memory_in_use_when_a_call_starts_that_the_executor_does_not_hold_is_not_counted_against_it():
    allocator = Allocator(40)  # the caller's other arrays
    memory = DeviceMemory(100, allocator)
    memory.count_foreign()
    probe = Probe()
    memory.release([], probe, extra_bytes=30)
    allocator.base = 70
    memory.make_room(50)  # 70 - 40 + 50 = 80 fit; counting the caller's 40 they would not
    assert memory.foreign_bytes == 40 and probe.waits == 0


def test_with_nothing_pending_the_gate_waits_for_the_latest_launch_then_gives_up():
    allocator = Allocator(0)
    memory, first, second = memory_with_two_pending(allocator)
    allocator.base = 1000  # over the budget whatever the executor waits for
    launch = Probe()
    memory.launched(launch)
    memory.make_room(10)
    assert (first.waits, second.waits, launch.waits) == (1, 1, 1)
    assert memory.pending_bytes == 0 and memory.allocator_bytes == 1000
    memory.make_room(10)  # nothing left to wait on: it returns
    assert launch.waits == 1


def test_a_probe_deleted_since_is_neither_polled_nor_waited_on():
    allocator = Allocator(0)
    memory, first, second = memory_with_two_pending(allocator)
    allocator.base = 1000
    launch = Probe()
    memory.launched(launch)
    first.deleted = launch.deleted = True  # e.g. returned arrays the caller donated to the next call
    memory.make_room(10)
    assert (first.waits, second.waits, launch.waits) == (0, 1, 0) and memory.pending_bytes == 0


def test_arrays_donated_to_a_launch_hand_the_wait_on_the_latest_launch_to_that_launch():
    memory = DeviceMemory(100, Allocator(1000))
    earlier, later = Probe(), Probe()
    memory.launched(earlier)
    memory.consumed([earlier], later)
    memory.make_room(10)
    assert (earlier.waits, later.waits) == (0, 1)


# -- a real step -------------------------------------------------------------------------------------


def mlp_step():
    """A 6-layer MLP trained with Adam: small, and with enough to move at 40% of its in-core peak."""
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (128, 128)) / 12 for k in keys]
    optimizer = optax.adam(1e-3)

    def loss_fn(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def step(state, x):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, optimizer.init(params)), jax.random.normal(jax.random.key(1), (512, 128))


def run_two_steps(step, state, x, budget: int, **access) -> tuple[list, list, int]:
    """Two steps under ``ooc_jit`` (the state donated and passed on), the executor reading and
    waiting on the device as ``access`` says (``DeviceAccess``): their results, every launch they
    made, and how many times they made room (at each launch and prefetch, and each call)."""
    ooc = ooc_jit(step, budget=budget, donate_argnums=(0,), min_offload_bytes=4096)
    ooc = with_seams(ooc, device_access=DeviceAccess(**access))
    plan = ooc.plan(state, x)
    assert plan.segments, "the budget must cut the step into segments"
    to_device = [e for e in plan.jaxpr.eqns if e.primitive.name == "device_put" and e.params["devices"] != (HOST,)]
    assert to_device, "the budget must make the step prefetch"
    launches, results = [], []
    state = jax.tree.map(lambda a: a.copy(), state)
    with observe_segments(launches.append):
        for _ in range(2):
            state, loss = ooc(state, x)
            results.append(loss)
    return [*results, *jax.tree.leaves(state)], launches, 2 * (len(plan.segments) + len(to_device) + 1)


@pytest.fixture(scope="module")
def real_step():
    step, state, x = mlp_step()
    budget = int(ooc_jit(step, budget=2**62).plan(state, x).baseline_peak_bytes * 0.4)
    return step, state, x, budget


@pytest.fixture(scope="module")
def as_it_runs(real_step):
    """``run_two_steps`` with nothing patched (on a CPU: no allocator to read), once for the tests
    that compare a patched run with it."""
    return run_two_steps(*real_step)


def test_a_cpu_reports_no_allocator_so_a_real_step_runs_as_without_the_gate(real_step, as_it_runs):
    assert allocator_reader(jax.devices()[0]) is None
    gated, gated_launches, _ = as_it_runs
    plain, plain_launches, _ = run_two_steps(*real_step, allocator_gate=False)
    # The same segments with the same bytes held, launch by launch (what is in flight depends on timing).
    assert [(x.segment, x.cost, x.held_bytes) for x in gated_launches] == [
        (x.segment, x.cost, x.held_bytes) for x in plain_launches
    ]
    assert all(launch.allocator_bytes is None and launch.foreign_bytes == 0 for launch in gated_launches)
    for a, b in zip(gated, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_real_step_under_an_allocator_never_with_room_waits_at_every_launch_and_computes_the_same(
    real_step, as_it_runs
):
    plain, plain_launches, _ = as_it_runs
    allocator = Allocator(0, growth=real_step[-1])
    gated, gated_launches, rooms_made = run_two_steps(*real_step, allocator_reader=lambda device: allocator)
    assert [launch.segment for launch in gated_launches] == [launch.segment for launch in plain_launches]
    readings = [launch.allocator_bytes for launch in gated_launches]
    assert None not in readings and readings == sorted(readings)
    # Every launch waited for everything in flight (a read that finds no room is followed by a wait
    # and another read, until nothing is left to wait on).
    assert all(launch.in_flight_bytes == 0 for launch in gated_launches)
    assert allocator.reads > rooms_made
    for a, b in zip(gated, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_real_step_takes_what_the_allocator_has_in_use_beyond_its_account_when_a_call_starts_as_foreign(
    real_step, as_it_runs
):
    plain, _, _ = as_it_runs
    budget = real_step[-1]
    allocator = Allocator(4 * budget)  # the caller's other arrays: 4 budgets, before and throughout
    gated, launches, _ = run_two_steps(*real_step, allocator_reader=lambda device: allocator)
    # Foreign: the 4 budgets less what the executor holds when a call starts (its arguments, within
    # the budget) and what it let go of that is still in flight from the call before (within the
    # budget too; more of it on a loaded machine).
    assert all(2 * budget <= launch.foreign_bytes <= 4 * budget for launch in launches)
    assert launches[0].foreign_bytes >= 3 * budget  # the first call: nothing in flight yet
    for a, b in zip(gated, plain, strict=True):
        np.testing.assert_array_equal(a, b)


# -- the GPU check's synced diagnostic ------------------------------------------------------------------


def synced_rows() -> list[dict]:
    """Before a step, two launches, after it: bytes as ``gpu_check._synced_row`` records them."""
    launch = dict(foreign=0, gate_reading=None, temp=0, output=0, alias=0)
    return [
        dict(segment=None, unsynced_in_use=100, in_use=100, peak=500, live_device=90),
        dict(launch, segment=0, unsynced_in_use=400, in_use=300, peak=500, live_device=250, held=240, in_flight=50)
        | dict(launch_bytes=200, temp=150),
        dict(launch, segment=1, unsynced_in_use=350, in_use=330, peak=700, live_device=300, held=280, in_flight=20)
        | dict(launch_bytes=100, temp=60),
        dict(segment=None, unsynced_in_use=320, in_use=320, peak=900, live_device=310),
    ]


def test_the_synced_diagnostic_finds_late_frees_the_persistent_gap_and_scratch_beyond_the_launch_bytes():
    from benchmarks import gpu_check

    summary = gpu_check.summarise_synced(synced_rows())
    assert summary["launches"] == 2 and summary["peak_after_bytes"] == 900
    assert summary["max_late_freed"] == dict(bytes=100, segment=0)  # 400 before the sync, 300 after
    assert summary["max_unsynced_over_account"] == dict(bytes=110, segment=0)  # 400 - 240 - 50
    assert summary["max_in_use_over_held"] == dict(bytes=60, segment=0)  # 300 - 240
    assert summary["max_in_use_over_account"] == dict(bytes=30, segment=1)  # 330 - 280 - 20
    assert summary["max_in_use_over_live"] == dict(bytes=50, segment=0)  # 300 - 250
    assert summary["max_live_over_held"] == dict(bytes=20, segment=1)  # 300 - 280
    # The peak did not rise before the first launch; it rose by 700 - 300 across segment 0 (launch
    # bytes 200) and by 900 - 330 across segment 1 (launch bytes 100): largest excess first.
    assert summary["peak_rises"] == 2
    assert [(t["segment"], t["transient_bytes"], t["excess_bytes"]) for t in summary["transients"]] == [
        (1, 570, 470),
        (0, 400, 200),
    ]
    assert summary["transients"][1]["held_rise_bytes"] == 40 and summary["transients"][0]["held_rise_bytes"] is None
    assert [r["segment"] for r in gpu_check.summarise_synced(synced_rows(), kept=1)["rows"]] == [0]

    record = dict(configuration="ooc_jit_capped", strategy="ooc_jit", allocator_gate=True, budget_bytes=800)
    record |= dict(runtime_peak_bytes=850, synced_first_step=summary, synced_last_step=summary)
    digest = gpu_check._memory_digest(record)
    assert digest["over_budget_bytes"] == 50 and digest["late_freed_bytes"] == 100
    assert digest["persistent_gap_bytes"] == 60 and digest["not_in_live_arrays_bytes"] == 50
    assert (digest["worst_transient_excess_bytes"], digest["worst_transient_segment"]) == (470, 1)


def test_the_synced_diagnostic_records_nothing_where_the_device_reports_no_statistics():
    from benchmarks import gpu_check

    rows = [{**row, "unsynced_in_use": None, "in_use": None, "peak": None} for row in synced_rows()]
    summary = gpu_check.summarise_synced(rows)
    assert summary["launches"] == 2 and summary["peak_rises"] == 0 and summary["rows"] == []
    assert summary["max_late_freed"] is None and summary["max_in_use_over_held"] is None


# -- a compute-synchronized device (a GPU's client) ------------------------------------------------


class Held:
    """Stands in for a device array the executor holds."""

    def is_deleted(self) -> bool:
        return False


def test_on_a_compute_synchronized_device_memory_a_launch_let_go_of_is_reused_at_once():
    memory = DeviceMemory(100, stream_ordered=True)
    launch = Probe()
    memory.launched(launch)
    memory.release([], launch, extra_bytes=60)  # scratch and dead inputs of the launch
    memory.make_room(90)
    assert launch.waits == 0 and memory.pending_bytes == 0


def test_on_a_compute_synchronized_device_an_offloads_source_is_in_use_until_its_copy_ends():
    memory = DeviceMemory(100, stream_ordered=True)
    source, copy = Held(), Probe()
    memory.hold(source, 60, owned=False)
    memory.release([source], copy, copied=True)
    assert memory.pending_bytes == 60
    memory.make_room(50)
    assert copy.waits == 1 and memory.pending_bytes == 0


def test_on_a_compute_synchronized_device_an_allocator_over_the_budget_is_not_a_reason_to_drain():
    memory = DeviceMemory(100, Allocator(1000), stream_ordered=True)
    launch = Probe()
    memory.launched(launch)
    memory.make_room(10)
    assert launch.waits == 0


def waited_memory_kinds(real_step, *, compute_synchronized: bool) -> tuple[list[str], list]:
    """Two real steps in which nothing finishes unless waited for: the memory kind of every array
    the executor waited on, and the steps' results."""
    kinds = []

    def recorded(probe):
        kinds.append(probe.sharding.memory_kind)
        wait(probe)

    synchronized = frozenset({"cpu"}) if compute_synchronized else COMPUTE_SYNCHRONIZED
    access = dict(compute_synchronized=synchronized, finished=lambda probe: probe is None, wait=recorded)
    results, _, _ = run_two_steps(*real_step, **access)
    return kinds, results


def test_a_real_step_on_a_compute_synchronized_device_waits_only_for_copies_to_host(real_step, as_it_runs):
    kinds, results = waited_memory_kinds(real_step, compute_synchronized=True)
    assert kinds and set(kinds) == {"pinned_host"}, kinds
    plain, _, _ = as_it_runs
    for a, b in zip(results, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_same_step_on_a_cpu_also_waits_for_launches(real_step):
    kinds, _ = waited_memory_kinds(real_step, compute_synchronized=False)
    assert "device" in kinds
