"""Edges of steps on a mesh: a segment's measured scratch counted once whatever its gathers,
``jax_debug_nans`` in each segment's layout, and the mesh set with ``jax.set_mesh`` in the signature."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import oocjax
from oocjax import ooc_jit
from oocjax.arguments import layouts_key
from oocjax.schedule import Program, keep_all
from oocjax.schedule.measured import with_measured_scratch
from oocjax.schedule.segments import GatheringStep, SegmentCost, cut_segments
from oocjax.transforms import memories
from tests.support.background import cpu_devices_env

ROOT = Path(__file__).resolve().parent.parent

# -- measured scratch in a segment of gathering steps -------------------------------------------

GATHER, EXCESS = 100, 40


def gathering_program() -> Program:
    """x -> a -> b -> c -> out, the middle three steps each gathering 100 bytes (an FSDP product)."""
    sizes = {"x": 8, "a": 8, "b": 8, "c": 8, "out": 8}
    ops = [("f", ["x"], ["a"]), ("dot", ["a"], ["b"]), ("dot", ["b"], ["c"]), ("dot", ["c"], ["out"])]
    program = Program.from_ops(ops, sizes, inputs=["x"], outputs=["out"])
    steps = tuple(
        GatheringStep(**{f.name: getattr(step, f.name) for f in dataclasses.fields(step)} | {"transient_bytes": GATHER})
        if step.name == "dot"
        else step
        for step in program.steps
    )
    return Program(steps=steps, buffers=program.buffers)


def test_a_segments_measured_excess_counts_once_whatever_its_gathering_steps():
    program = gathering_program()
    schedule = keep_all(program)
    (segment,) = cut_segments(program, schedule, budget_bytes=10**6)
    # Every gather, two live values and the result.
    assert segment.estimate_bytes - segment.held_bytes == 3 * GATHER + 3 * 8
    # The compiled segment came out EXCESS bytes larger than its estimate.
    launched = segment.estimate_bytes - segment.held_bytes + EXCESS
    cost = SegmentCost(temp_bytes=launched, output_bytes=0, alias_bytes=0)
    learnt = with_measured_scratch(program, (segment,), (cost,), budget_bytes=10**6)
    assert [s.transient_bytes for s in learnt.steps] == [EXCESS, *(3 * [GATHER + EXCESS])]  # per step, as planned
    (again,) = cut_segments(learnt, keep_all(learnt), budget_bytes=10**6)
    # Planned again, the segment's estimate is what it measured: the excess once, not once per gather.
    assert again.estimate_bytes - again.held_bytes == launched
    # So the budget it measured at fits it, uncut.
    assert len(cut_segments(learnt, keep_all(learnt), budget_bytes=again.held_bytes + launched)) == 1
    # The gathers stay apart from the excess, each step's own.
    assert all(s.gathered_bytes == GATHER for s in learnt.steps if isinstance(s, GatheringStep))


def test_a_one_step_gathering_segment_is_still_the_per_step_model():
    program = gathering_program()
    cost = SegmentCost(temp_bytes=0, output_bytes=0, alias_bytes=0)
    segments = cut_segments(program, keep_all(program), budget_bytes=10**6, min_segments=4)
    learnt = program
    for segment in segments:
        measured = dataclasses.replace(cost, temp_bytes=segment.estimate_bytes - segment.held_bytes + EXCESS)
        learnt = with_measured_scratch(learnt, (segment,), (measured,), budget_bytes=10**6)
    for segment in cut_segments(learnt, keep_all(learnt), budget_bytes=10**6, min_segments=4):
        (step,) = learnt.steps[segment.start : segment.stop]
        written = sum(learnt.buffers[b].nbytes for b in step.writes)
        assert segment.estimate_bytes == segment.held_bytes + written + step.transient_bytes


# -- the mesh set with jax.set_mesh ---------------------------------------------------------------


def one_device_mesh(axis: str) -> jax.sharding.Mesh:
    return jax.make_mesh((1,), (axis,), axis_types=(AxisType.Explicit,))


def test_each_mesh_set_with_jax_set_mesh_gets_its_own_plan():
    traced_under = []

    def step(x):
        traced_under.append(jax.sharding.get_abstract_mesh().axis_names)
        return x * 2

    ooc, x = ooc_jit(step, budget="1GiB"), jnp.ones(8)
    with jax.set_mesh(one_device_mesh("a")):
        first = ooc.plan(x)
        assert ooc.plan(x) is first  # the same mesh: the same plan
        assert (ooc(x) == 2).all()
    with jax.set_mesh(one_device_mesh("b")):
        second = ooc.plan(x)
        assert (ooc(x) == 2).all()
    assert second is not first  # another mesh, another plan, traced under it
    assert ("a",) in traced_under and ("b",) in traced_under
    assert ooc.plan(x) is not first and ooc.plan(x) is not second  # and none set: one more
    with jax.set_mesh(one_device_mesh("a")):
        assert ooc.plan(x) is first


def test_without_a_mesh_the_signature_holds_no_layout():
    assert layouts_key([None, None]) is None
    with jax.set_mesh(one_device_mesh("a")):
        assert layouts_key([None, None]) == (one_device_mesh("a"),)


# -- jax_debug_nans on a mesh -----------------------------------------------------------------------

DEBUG_NANS_ON_A_MESH = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import oocjax
from oocjax import ooc_jit

mesh = jax.make_mesh((2,), ("data",))
rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

def nan_step(params, x):
    h = jnp.log(x @ params["w"] - 1e3)  # the log of a negative number: NaN
    return jnp.sum(h @ params["v"]) + 0.0 * jnp.sum(jnp.exp(1.5) * x)

params = jax.device_put({"w": jnp.ones((256, 256)), "v": jnp.ones((256, 256))}, replicated)
x = jax.device_put(jnp.ones((256, 256)), rows)
step = ooc_jit(nan_step, budget=5 * 256 * 256 * 4, min_offload_bytes=1024, min_segments=2)
plan = step.plan(oocjax.to_host(params), x)
report = dict(devices=len(jax.devices()), mesh=plan.mesh, segments=len(plan.segments))
with jax.debug_nans(True):
    try:
        step(oocjax.to_host(params), x)
        report["raised"] = None
    except FloatingPointError as error:
        report["raised"] = "FloatingPointError"
        report["text"] = str(error) + "\\n".join(getattr(error, "__notes__", []))
    except Exception as error:
        report["raised"] = type(error).__name__
        report["text"] = str(error)[:2000]
# Without NaNs, the checked segments compute what the chain does, in the chain's layouts.
finite = {"w": params["w"] * 10.0, "v": params["v"]}  # log(2560 - 1000)
expected = step(oocjax.to_host(finite), x)
with jax.debug_nans(True):
    checked = step(oocjax.to_host(finite), x)
report["same"] = bool(jnp.allclose(checked, expected))
print(json.dumps(report))
"""


def test_jax_debug_nans_on_a_mesh_runs_each_segment_in_its_layout_and_names_the_operation():
    env = cpu_devices_env(2)
    done = subprocess.run(
        [sys.executable, "-c", DEBUG_NANS_ON_A_MESH], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2 and report["mesh"].startswith("2 devices") and report["segments"] >= 2
    assert report["raised"] == "FloatingPointError", report.get("text")
    assert "log" in report["text"], report["text"]
    assert report["same"]


def test_on_one_device_transfers_skip_the_per_array_checks_of_a_mesh(monkeypatch):
    batches, device_put = [], jax.device_put

    def batched(values, targets, *args, **kwargs):  # in one process, put is one jax.device_put per batch
        batches.append(values)
        return device_put(values, targets, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", batched)
    assert memories.put([jnp.ones(3), jnp.zeros(2)], memories.sharding("pinned_host"))[1].shape == (2,)
    assert len(batches) == 1 and len(batches[0]) == 2
    monkeypatch.undo()
    params = {"w": jnp.ones((256, 256)) * 1e-3, "v": jnp.ones((256, 256))}
    step = ooc_jit(lambda p, x: jnp.sum((x @ p["w"]) @ p["v"]), budget=4 * 256 * 256 * 4, min_offload_bytes=1024)
    plan = step.plan(oocjax.to_host(params), jnp.ones((256, 256)))
    assert plan.segments and any(s.prefetches for s in plan.segments)
    assert jnp.allclose(step(oocjax.to_host(params), jnp.ones((256, 256))), 256 * 256 * 256 * 0.256)
