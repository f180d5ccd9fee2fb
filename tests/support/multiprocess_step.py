"""One process of a two-process data-parallel run, for ``tests/test_multiprocess.py``.

    python -m tests.support.multiprocess_step <process id> <number of processes> <coordinator port>

Each process has 4 virtual CPU devices (``XLA_FLAGS``, set by the parent) and joins the others
through ``jax.distributed`` with gloo collectives. The step is data parallel over all 8 devices,
its arguments global arrays made from each process's own shards. The process prints one JSON
object: a digest of its plan, its losses under ``ooc_jit`` and ``jax.jit``, and its result shardings.
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from oocjax import ooc_jit


def join(process: int, processes: int, port: int) -> None:
    """Joins the other processes (before anything touches a device)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=processes, process_id=process)


WIDTH, BATCH, DEPTH = 256, 64, 4
optimizer = optax.adam(1e-2)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def loss(params, batch):
    h = batch["x"]
    for i in range(DEPTH):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def step(state, batch):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value


def global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The same global value in every process, each process placing only its own shards."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def main(process: int) -> None:
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)  # the same values in every process
    params = {f"w{i}": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / WIDTH**0.5 for i in range(DEPTH)}
    params |= {f"b{i}": np.zeros(WIDTH, np.float32) for i in range(DEPTH)}
    batches = [{k: rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for k in ("x", "y")} for _ in range(3)]
    params = {k: global_array(v, replicated) for k, v in params.items()}
    batches = [{k: global_array(v, split) for k, v in b.items()} for b in batches]

    def fresh_state():  # every leaf a global array, as on several hosts (no leaf on one device)
        return jax.jit(lambda p: (p, optimizer.init(p)), out_shardings=replicated)(params)

    in_core = ooc_jit(step, budget=2**62).plan(fresh_state(), batches[0]).baseline_peak_bytes
    budget = int(in_core * 0.4)
    # Process 1 asks for a little more (as a share of a device's memory may come out on another
    # host): every process plans with the least.
    stepped = ooc_jit(step, budget=budget + 4096 * process, donate_argnums=0, min_offload_bytes=4096)
    plan = stepped.plan(fresh_state(), batches[0])
    shape = (plan.segments, plan.schedule, tuple(r.label for r in plan.recomputed), plan.executed_peak_bytes)
    state, expected_state, losses, expected = fresh_state(), fresh_state(), [], []
    compiles = []  # programs compiled while the planned step runs: transfers must compile none
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if event == COMPILE_EVENT else None
    )
    compiles_while_running = 0
    for batch in batches:
        before = len(compiles)
        state, value = stepped(state, batch)
        jax.block_until_ready(state)
        compiles_while_running += len(compiles) - before
        expected_state, reference = jax.jit(step)(expected_state, batch)
        losses.append(float(value))
        expected.append(float(reference))
    leaves = jax.tree.leaves(state)
    print(
        json.dumps(
            dict(
                process=process,
                devices=len(jax.devices()),
                local_devices=len(jax.local_devices()),
                budget=budget,
                agreed_budget=stepped.budget_bytes,
                plan_digest=hashlib.sha256(repr(shape).encode()).hexdigest(),
                segments=len(plan.segments),
                moved_bytes=plan.moved_bytes,
                recomputed=len(plan.recomputed),
                compiles_while_running=compiles_while_running,
                losses=losses,
                jit_losses=expected,
                result_devices=sorted({len(x.sharding.device_set) for x in leaves}),
                result_memory_kinds=sorted({x.sharding.memory_kind for x in leaves}),
            )
        )
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    process, processes, port = (int(a) for a in sys.argv[1:4])
    join(process, processes, port)
    main(process)
