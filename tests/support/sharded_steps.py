"""Sharded training steps run with ``ooc_jit`` on 8 virtual CPU devices, for ``tests/test_sharded.py``.

Run as ``python -m tests.support.sharded_steps <layout>`` in a process whose ``XLA_FLAGS`` holds
``--xla_force_host_platform_device_count=8`` (set before jax starts): it prints one JSON object
of what it measured, and the parent test asserts on it. Layouts: ``LAYOUTS``.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from collections import defaultdict
from math import prod
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from oocjax import Plan, ooc_jit
from oocjax.schedule.segments import GatheringStep
from oocjax.testing import with_seams
from oocjax.transforms.account import DeviceAccess, DeviceMemory
from oocjax.transforms.execute import observe_segments

LAYOUTS = ("data", "model", "fsdp", "explicit", "shard_map")
FRACTIONS = (1.0, 0.6, 0.4)
WIDTH, BATCH = 256, 64
# FSDP gathers a whole weight for each product (and sums a whole weight gradient before scattering
# it): per device, the sharded state must outweigh one layer's gathered weights for 40% of the
# in-core estimate to be a budget the step can hold at all.
DEPTHS = {"fsdp": 12}
FLOAT32_TOLERANCE = dict(atol=2e-5, rtol=1e-5)  # as tests/test_ooc_jit_reference.py
LEARNING_RATE, B1, EPS = 1e-2, 0.9, 1e-8
optimizer = optax.adam(LEARNING_RATE, b1=B1, eps=EPS)


def init(key, depth):
    keys = jax.random.split(key, depth + 1)
    params = {f"w{i}": jax.random.normal(keys[i], (WIDTH, WIDTH)) / WIDTH**0.5 for i in range(depth)}
    params |= {f"b{i}": jnp.zeros((WIDTH,)) for i in range(depth)}
    batch = {"x": jax.random.normal(keys[-1], (BATCH, WIDTH)), "y": jax.random.normal(keys[0], (BATCH, WIDTH))}
    return params, batch


def loss(params, batch):
    h = batch["x"]
    for i in range(len(params) // 2):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def adam_step(state, grads):
    params, opt_state = state
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def step(state, batch):
    value, grads = jax.value_and_grad(loss)(state[0], batch)
    return adam_step(state, grads), value


def shard_map_step(mesh):
    """Each layer a ``shard_map`` call on the device's rows of the batch (as a hand-written kernel
    would be), differentiated through: the planner sees one call per layer and its transpose."""
    layer = jax.shard_map(
        lambda h, w, b: jnp.tanh(h @ w + b), mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P("data")
    )

    def sharded_loss(params, batch):
        h = batch["x"]
        for i in range(len(params) // 2):
            h = layer(h, params[f"w{i}"], params[f"b{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch):
        value, grads = jax.value_and_grad(sharded_loss)(state[0], batch)
        return adam_step(state, grads), value

    return step


def placed(layout: str):
    """The step, its state and batch placed for ``layout``, and the mesh (set for ``explicit``)."""
    auto = layout != "explicit"
    types = AxisType.Auto if auto else AxisType.Explicit
    shape, names = ((2, 4), ("data", "model")) if layout == "model" else ((8,), ("data",))
    mesh = jax.make_mesh(shape, names, axis_types=(types,) * len(shape))
    params, batch = init(jax.random.key(0), DEPTHS.get(layout, 4))

    def param_spec(name, x):
        if layout == "model":
            return P(None, "model") if name.startswith("w") else P("model")
        if layout == "fsdp":
            return P("data")
        return P()

    params = {k: jax.device_put(v, NamedSharding(mesh, param_spec(k, v))) for k, v in params.items()}
    batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch.items()}
    if not auto:
        jax.set_mesh(mesh)
    state = (params, optimizer.init(params))
    return (shard_map_step(mesh) if layout == "shard_map" else step), state, batch


def copied(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def shard_bytes(x) -> int:
    return prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def per_device_at_each_launch(fn, state, batch):
    """Calls ``fn(state, batch)``; at each segment launch, per device, the device bytes of live
    arrays other than the caller's (counted from each sharding's devices and shard shape, never
    from ``addressable_shards``, which makes arrays), and the launch's own bytes."""
    arguments = {id(x) for x in jax.tree.leaves((state, batch))}
    callers = {id(x) for x in jax.live_arrays()} - arguments
    samples = []

    def sample(launch):
        held = defaultdict(int)
        for x in jax.live_arrays():
            if x.sharding.memory_kind == "device" and id(x) not in callers:
                for device in x.sharding.device_set:
                    held[device.id] += shard_bytes(x)
        samples.append((max(held.values(), default=0), launch.cost.launch_bytes))

    with observe_segments(sample):
        result = fn(state, batch)
    return result, samples


def adam_comparison(result, expected) -> dict:
    """``result`` of one Adam step against ``expected``, part by part.

    After Adam's first step from zero moments, ``mu = (1 - B1) * g``: the gradients are compared
    through it, with the loss and ``nu``. A parameter moves by ``lr * g / (|g| + eps)`` (bias
    corrected), whose derivative in ``g`` is ``lr * eps / (|g| + eps)**2``: up to ``lr / eps = 1e6``
    at ``g = 0``, so a gradient near 0 that two reduction orders round differently by 1e-9 moves
    its parameter by up to 1e-3. ``params_within_adam_bound``: every parameter within the float32
    tolerance plus that bound, taken over the gradients' measured difference at that element (the
    mean value theorem, ``|g|`` at its smallest between the two gradients, 0 if their signs differ).
    """
    ((params, (adam, *_)), value), ((want_params, (want_adam, *_)), want_value) = result, expected

    def f64(tree):
        return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]

    grads, want_grads = [m / (1 - B1) for m in f64(adam.mu)], [m / (1 - B1) for m in f64(want_adam.mu)]
    within, params_difference = True, 0.0
    for p, q, g, h in zip(f64(params), f64(want_params), grads, want_grads):
        nearest = np.where(np.sign(g) == np.sign(h), np.minimum(np.abs(g), np.abs(h)), 0.0)
        bound = LEARNING_RATE * np.abs(g - h) * EPS / (nearest + EPS) ** 2
        tolerance = FLOAT32_TOLERANCE["atol"] + FLOAT32_TOLERANCE["rtol"] * np.abs(q)
        within &= bool(np.all(np.abs(p - q) <= bound + tolerance))
        params_difference = max(params_difference, float(np.max(np.abs(p - q))))
    moments = [(adam.mu, want_adam.mu), (adam.nu, want_adam.nu), (adam.count, want_adam.count), (value, want_value)]
    return dict(
        loss_difference=abs(float(value) - float(want_value)),
        gradient_difference=max(float(np.max(np.abs(g - h))) for g, h in zip(grads, want_grads)),
        largest_gradient=max(float(np.max(np.abs(h))) for h in want_grads),
        moments_and_loss_close=all(
            np.allclose(a, b, **FLOAT32_TOLERANCE) for x, y in moments for a, b in zip(f64(x), f64(y))
        ),
        params_difference=params_difference,
        params_within_adam_bound=within,
    )


def planned_bytes_checked() -> tuple[list[tuple[int, int]], DeviceAccess]:
    """A device access whose account checks every array the executor holds on the device
    (arguments, segment outputs, prefetched copies) against the bytes its plan counts for it, and
    the mismatches it finds, as (planned, real shard bytes)."""
    mismatches: list[tuple[int, int]] = []

    class Checked(DeviceMemory):
        def hold(self, x, nbytes, *, owned):
            if nbytes and isinstance(x, jax.Array) and nbytes != shard_bytes(x):
                mismatches.append((nbytes, shard_bytes(x)))
            super().hold(x, nbytes, owned=owned)

    return mismatches, DeviceAccess(memory=Checked)


def run(layout: str) -> dict:
    fn, state, batch = placed(layout)
    expected = jax.jit(fn)(copied(state), batch)
    report: dict = {"layout": layout, "devices": len(jax.devices()), "fractions": {}}
    in_core = ooc_jit(fn, budget=2**62, donate_argnums=0).plan(state, batch).baseline_peak_bytes
    global_bytes = sum(x.nbytes for x in jax.tree.leaves((state, batch)))
    report |= dict(in_core_bytes=in_core, argument_global_bytes=global_bytes)
    wrappers, planned = {}, {}  # by fraction: the checks below reuse them rather than plan the same again
    for fraction in FRACTIONS:
        budget = int(in_core * fraction)
        mismatches, access = planned_bytes_checked()
        jitted = ooc_jit(fn, budget=budget, donate_argnums=0, min_offload_bytes=4096)
        jitted = wrappers[fraction] = with_seams(jitted, device_access=access)
        try:
            plan = planned[fraction] = jitted.plan(state, batch)
        except Exception as error:
            report["fractions"][str(fraction)] = dict(budget=budget, error=f"{type(error).__name__}: {error}")
            continue
        (result, samples) = per_device_at_each_launch(jitted, copied(state), batch)
        leaves, wanted = jax.tree.leaves(result), jax.tree.leaves(expected)
        copies = [buffer.label.startswith("recompute of") for buffer in plan.program.buffers]
        exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves, wanted))
        close = all(np.allclose(np.asarray(a), np.asarray(b), **FLOAT32_TOLERANCE) for a, b in zip(leaves, wanted))
        worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(leaves, wanted))
        same_shardings = all(
            a.sharding.with_memory_kind("device").is_equivalent_to(b.sharding.with_memory_kind("device"), a.ndim)
            for a, b in zip(leaves, wanted)
        )
        # Planned per-device sizes against the real arrays: the arguments (as placed for the call)
        # and every result the step computes.
        traced = next(iter(jitted._traces.values()))
        buffers = traced.program.buffers
        arguments = jax.tree.leaves((state, batch))
        sizes_ok = all(buffers[b].nbytes == shard_bytes(x) for b, x in enumerate(arguments))
        outputs = traced.flat.outputs
        sizes_ok &= all(
            buffers[r].nbytes == shard_bytes(x)
            for r, x in zip(outputs, leaves)
            if isinstance(r, int) and r >= traced.flat.num_inputs
        )
        # A second call neither traces nor plans: fed the state the first returned, as a training
        # loop does (its single-device leaves, such as Adam's count, come back replicated).
        traces, planners = dict(jitted._traces), dict(jitted._planners)
        jitted(copied(result[0]), batch)
        again = jitted._traces == traces and jitted._planners == planners
        report["fractions"][str(fraction)] = dict(
            budget=budget,
            segments=len(plan.segments),
            moved_bytes=plan.moved_bytes,
            recomputed=len(plan.recomputed),
            peak_bytes=plan.peak_bytes,
            executed_peak_bytes=plan.executed_peak_bytes,
            mesh=plan.mesh,
            summary_first_line=plan.summary().splitlines()[0],
            repr=repr(plan),
            launches=len(samples),
            worst_launch=max((h + c for h, c in samples), default=0),
            exact=exact,
            close=close,
            max_abs_difference=worst,
            same_shardings=same_shardings,
            single_device_results=sum(len(x.sharding.device_set) == 1 for x in leaves),
            result_kinds=sorted({x.sharding.memory_kind for x in leaves}),
            sizes_match_shards=bool(sizes_ok),
            second_call_reuses_plan=again,
            gathering_steps=sum(isinstance(step, GatheringStep) for step in plan.program.steps),
            json_keeps_the_program=Plan.from_json(plan.to_json(full=True)).program == plan.program,
            lowered_on_the_mesh=lowered_on_the_mesh(jitted, state, batch, len(plan.segments)),
            held_arrays_off_their_planned_bytes=mismatches,
            # The traced calls, not the copies a recomputing plan adds (whether it recomputes one
            # depends on the rates this process measured, and so on the machine's load).
            shard_map_steps=sum(
                step.name == "shard_map" and not all(copies[w] for w in step.writes) for step in plan.program.steps
            ),
            layers=DEPTHS.get(layout, 4),
            adam=adam_comparison(result, expected),
        )
    if layout == "fsdp":  # jax.jit itself, the same step on replicated parameters (data-parallel)
        everywhere = NamedSharding(batch["x"].sharding.mesh, P())
        replicated = jax.tree.map(lambda x: jax.device_put(x, everywhere), state)
        report["jit_data_parallel"] = adam_comparison(jax.jit(fn)(replicated, batch), expected)
    if layout == "data":  # another layout of the same step: another signature, another plan
        jitted = wrappers[0.6]  # called above with this batch
        replicated = jax.tree.map(lambda x: jax.device_put(x, x.sharding.update(spec=P())), batch)
        jitted(copied(state), replicated)
        plans = [p.built.plan for p in jitted._planners.values()]
        report["layouts"] = dict(traces=len(jitted._traces), plans=len(plans), distinct=plans[0] is not plans[1])
        # Leaves on two meshes: refused, never gathered.
        other = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
        elsewhere = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(other, P())), batch)
        try:
            jitted(copied(state), elsewhere)
            report["two_meshes"] = "no error"
        except Exception as error:
            report["two_meshes"] = f"{type(error).__name__}: {error}"
        report["closed_over"] = closed_over_sharded_constant(fn, state, batch, int(in_core * 0.6))
        report["host_budget"] = host_budget_per_process(fn, state, batch, planned[0.4])
        report["plan_cache"] = stored_and_read_back(fn, state, batch, int(in_core * 0.4))
    return report


def stored_and_read_back(fn, state, batch, budget: int) -> dict:
    """With JAX's persistent cache directory set, a sharded step's plan and programs are stored,
    and a fresh wrapper reads them back (it plans and compiles nothing) and gives the same result."""
    made = []  # the plans made, as the oocjax logger records them

    class Plans(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("plan:"):
                made.append(1)

    handler, logger = Plans(), logging.getLogger("oocjax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory() as cache:
            jax.config.update("jax_compilation_cache_dir", cache)
            results = [
                ooc_jit(fn, budget=budget, donate_argnums=0, min_offload_bytes=4096)(copied(state), batch)
                for _ in range(2)
            ]
            stored = len(list((Path(cache) / "oocjax").glob("*.pkl")))
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        logger.removeHandler(handler)
    first, second = (jax.tree.leaves(r) for r in results)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, second))
    shardings = all(a.sharding == b.sharding for a, b in zip(first, second))
    return dict(made=len(made), stored=stored, same_results=same, same_shardings=shardings)


def lowered_on_the_mesh(jitted, state, batch, segments: int) -> bool:
    """``step.lower`` gives one program per segment (or jax.jit's one), taking its arguments in their layouts."""
    lowered = jitted.lower(state, batch)
    programs = lowered if isinstance(lowered, tuple) else (lowered,)  # jax.jit's one program at 100%
    first = jax.tree.leaves(programs[0].compile().input_shardings[0])
    return len(programs) == max(segments, 1) and all(len(s.device_set) == len(jax.devices()) for s in first)


def host_budget_per_process(fn, state, batch, plan: Plan) -> dict:
    """A plan's host peak is per device, and this process keeps host copies for each of its 8
    devices: a host_budget below 8 times it is refused, 8 times it is enough. ``plan``: the step's
    plan at its budget without a host_budget (the same options)."""
    per_device, budget = plan.host_peak_bytes, plan.budget_bytes
    outcome = {}
    for name, host_budget in (("just_enough", 8 * per_device), ("one_byte_short", 8 * per_device - 1)):
        try:
            ooc_jit(fn, budget=budget, donate_argnums=0, min_offload_bytes=4096, host_budget=host_budget).plan(
                state, batch
            )
            outcome[name] = "planned"
        except Exception as error:
            outcome[name] = f"{type(error).__name__}: {error}"
    return dict(per_device=per_device, **outcome)


def closed_over_sharded_constant(fn, state, batch, budget: int) -> dict:
    """A step that closes over an array split over the mesh: the constant keeps its layout (it
    is never gathered onto every device), and the step matches jax.jit."""
    targets = batch["y"]

    def closed(state, x):
        return fn(state, {"x": x, "y": targets})

    expected = jax.jit(closed)(copied(state), batch["x"])
    jitted = ooc_jit(closed, budget=budget, donate_argnums=0, min_offload_bytes=4096)
    result = jitted(copied(state), batch["x"])
    traced = next(iter(jitted._traces.values()))
    specs = [str(traced.layout.shardings[b].spec) for b, x in traced.flat.constants if x is targets]
    close = all(
        np.allclose(np.asarray(a), np.asarray(b), **FLOAT32_TOLERANCE)
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(expected))
    )
    return dict(specs=specs, close=close, segments=len(jitted.plan(copied(state), batch["x"]).segments))


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
