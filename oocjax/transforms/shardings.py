"""Where a step's values live on a mesh, and what each of them costs one device.

A step is *sharded* when an argument spans several devices, when its avals carry explicit mesh
axes (``jax.make_mesh(..., axis_types=(Explicit, ...))`` + ``jax.set_mesh``), or when it calls
``shard_map`` on several devices. Then every flat buffer gets one device sharding (a ``Layout``),
which the plan sizes it by and the segments are compiled with:

* under an explicit-axes mesh, from the buffer's aval;
* otherwise from one probe compile of the whole step, which returns every buffer of at least
  ``PROBED_BYTES`` as an extra output: its sharding is the one XLA chose for it
  (``compiled.output_shardings``); smaller buffers are sized as, and pinned to, replicated;
* the outputs of a ``shard_map`` call from its ``out_specs``.

A buffer costs a device its shard: the whole array's bytes divided, per dimension and rounding up, by
the product of the sizes of the mesh axes the spec names there. Segments compiled with these
shardings on every input and output need no resharding between them, and the step's results come
out with the shardings ``jax.jit`` gives them. Nothing here ever gathers onto one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from oocjax.errors import OocError
from oocjax.schedule import Program, Step
from oocjax.schedule.segments import GatheringStep
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatProgram

PROBED_BYTES = 64 * 1024  # intermediates at least this large get the sharding XLA chose for them


@dataclass(frozen=True, slots=True)
class Layout:
    """Per flat buffer, the device sharding it lives in (memory kind ``"device"``).

    Attributes:
      shardings: per buffer of the flat program, arguments first.
      replicated: every device of the mesh holding the whole value (constants, lifted literals).
      mesh: the mesh as a plan names it: ``"8 devices, mesh data=8"``.
    """

    shardings: tuple[Any, ...]
    replicated: Any
    mesh: str

    def for_rewrite(self, origin_buffer: Sequence[int]) -> Layout:
        """The layout of a rewritten flat program (``recompute.apply_rewrite``): a copy lives as its original."""
        return Layout(tuple(self.shardings[b] for b in origin_buffer), self.replicated, self.mesh)


def shard_bytes(aval: Any, sharding: Any) -> int:
    """What a value of type ``aval`` costs each device it is on under ``sharding`` (the largest
    shard: uneven dimensions round up). 0 for tokens.

    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> shard_bytes(jax.ShapeDtypeStruct((7, 4), "float32"), NamedSharding(mesh, PartitionSpec("data")))
    112
    """
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return prod(shard_shape(tuple(shape), sharding)) * int(dtype.itemsize)


def shard_shape(shape: tuple[int, ...], sharding: Any) -> tuple[int, ...]:
    """The shape of the largest shard of a ``shape`` array under ``sharding``."""
    if sharding is None:
        return shape
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
        parts = []
        for dim, entry in zip(shape, (*sharding.spec, *(None,) * len(shape))):
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            ways = prod(sizes[name] for name in names)
            parts.append(-(-dim // ways))
        return tuple(parts)
    try:
        return tuple(sharding.shard_shape(shape))
    except Exception:  # an uneven sharding of another kind: count the whole value (an upper bound)
        return shape


def array_shard_bytes(x: Any) -> int:
    """What an array costs each device it is on (its ``nbytes`` on one device)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return int(getattr(x, "nbytes", 0))
    return shard_bytes(x, sharding)


def _spans_devices(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def _explicit_mesh(aval: Any) -> Any:
    """The abstract mesh of an aval typed with explicit mesh axes, else None."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    explicit = jax.sharding.AxisType.Explicit
    return mesh if any(t == explicit for t in mesh.axis_types) else None


def _shard_maps(flat: FlatProgram) -> list[jc.JaxprEqn]:
    return [fe.eqn for fe in flat.equations if fe.eqn.primitive.name == "shard_map"]


def is_sharded(leaves: Sequence[Any], flat: FlatProgram) -> bool:
    """Whether the step runs on a mesh: an argument spans several devices, an aval carries
    explicit mesh axes, or it calls ``shard_map`` over several devices."""
    return (
        any(_spans_devices(x) for x in leaves)
        or any(_explicit_mesh(aval) is not None for aval in flat.avals)
        or any(eqn.params["mesh"].size > 1 for eqn in _shard_maps(flat))
    )


def check_one_mesh(leaves: Sequence[Any], labels: Sequence[str]) -> None:
    """Refuses arguments on two meshes: one plan holds one device budget on one set of devices."""
    meshes: dict[Any, str] = {}
    for x, label in zip(leaves, labels):
        if not _spans_devices(x):
            continue
        sharding = x.sharding
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else frozenset(d.id for d in sharding.device_set)
        meshes.setdefault(mesh, label)
    if len(meshes) > 1:
        (first, a), (second, b) = list(meshes.items())[:2]
        raise OocError(
            f"ooc_jit: the arguments live on {len(meshes)} different meshes: {a} on {_describe(first)}, "
            f"{b} on {_describe(second)}. One plan holds one per-device budget on one set of devices, and "
            "oocjax never gathers values onto one device behind your back.\n"
            "Fixes:\n  1. put every argument on the same mesh first: jax.device_put(x, NamedSharding(mesh, spec));\n"
            "  2. or call the step separately per mesh."
        )


def _describe(mesh: Any) -> str:
    if isinstance(mesh, frozenset):
        return f"devices {sorted(mesh)}"
    return "mesh " + " ".join(f"{name}={size}" for name, size in mesh.shape.items())


def _concrete_mesh(leaves: Sequence[Any], flat: FlatProgram) -> Any:
    """The step's mesh: from its arguments, its ``shard_map`` calls, or the mesh set with ``jax.set_mesh``."""
    for x in leaves:
        if _spans_devices(x) and isinstance(x.sharding, NamedSharding):
            return x.sharding.mesh
    for eqn in _shard_maps(flat):
        if isinstance(eqn.params["mesh"], jax.sharding.Mesh):
            return eqn.params["mesh"]
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    raise OocError(
        "ooc_jit: the step runs on several devices, but oocjax found no mesh to place its values on "
        "(no argument is a NamedSharding array, and no mesh is set).\n"
        "Fix: pass the arguments as arrays placed on a mesh, jax.device_put(x, NamedSharding(mesh, spec)), "
        "or set the mesh with jax.set_mesh(mesh)."
    )


def step_layout(flat: FlatProgram, leaves: Sequence[Any]) -> Layout:
    """Every flat buffer's device sharding (see the module docstring). ``leaves`` are the step's
    flat arguments: arrays (in any memory) or ``jax.ShapeDtypeStruct``s."""
    mesh = _concrete_mesh(leaves, flat)
    replicated = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    shardings: list[Any] = [None] * len(flat.avals)
    for b, aval in enumerate(flat.avals):
        if _explicit_mesh(aval) is not None:
            shardings[b] = NamedSharding(mesh, aval.sharding.spec, memory_kind="device")
    for b, x in flat.constants:
        # A constant the step closed over on the mesh keeps its layout (replicating it would gather
        # it onto every device); numpy and one-device constants are replicated, as jax.jit does.
        shardings[b] = x.sharding.with_memory_kind("device") if _spans_devices(x) else replicated
    for fe in flat.equations:
        eqn = fe.eqn
        if eqn.primitive.name == "shard_map" and isinstance(eqn.params["mesh"], jax.sharding.Mesh):
            for b, out_spec in zip(fe.outputs, eqn.params["out_specs"]):
                shardings[b] = NamedSharding(eqn.params["mesh"], out_spec, memory_kind="device")
    unknown = [b for b in range(len(flat.avals)) if shardings[b] is None]
    if unknown:
        _probe(flat, leaves, shardings)
    for b, sharding in enumerate(shardings):
        shardings[b] = replicated if sharding is None else sharding.with_memory_kind("device")
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return Layout(tuple(shardings), replicated, f"{mesh.size} devices, mesh {axes}")


def _probe(flat: FlatProgram, leaves: Sequence[Any], shardings: list[Any]) -> None:
    """Fills ``shardings`` from one compile of the whole step that also returns every
    intermediate of at least ``PROBED_BYTES``: the arguments' as the compiled program takes them
    (committed arrays as they are, the others as ``jax.jit`` places them), the results' and the
    large intermediates' as XLA chose them."""
    returned = [r for r in dict.fromkeys(flat.outputs) if isinstance(r, int)]
    constants = {b for b, _ in flat.constants}
    large = [
        b
        for b in range(flat.num_inputs, len(flat.avals))
        if b not in constants and b not in returned and jc.nbytes(flat.avals[b]) >= PROBED_BYTES
    ]
    probed = returned + large

    def run(*arguments: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(flat.constants)
        env.update(enumerate(arguments))
        for fe in flat.equations:
            invals = [r.val if isinstance(r, jc.Literal) else env[r] for r in fe.inputs]
            with jc.equation_context(fe.eqn):
                env.update(zip(fe.outputs, jc.bind_equation(fe.eqn, invals), strict=True))
        return tuple(env[b] for b in probed)

    compiled = jax.jit(run).lower(*(_probe_argument(x) for x in leaves)).compile()
    in_shardings, _ = compiled.input_shardings
    for b, sharding in enumerate(in_shardings):
        shardings[b] = shardings[b] or sharding
    for b, sharding in zip(probed, compiled.output_shardings):
        shardings[b] = shardings[b] or sharding


def _probe_argument(x: Any) -> Any:
    """An argument as the probe compiles it: a host-kept array as its device twin (the step computes
    on the device), an uncommitted one as ``jax.jit`` would place it."""
    if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host":
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device"))
    return x


def per_device_sizes(program: Program, flat: FlatProgram, layout: Layout) -> Program:
    """``program`` with every buffer sized as what it costs one device under ``layout``, and the
    collectives' scratch (``collective_scratch``) added to their steps', which become
    ``GatheringStep``s: a segment holds the scratch of all of them at once."""
    buffers = tuple(
        dataclasses.replace(buffer, nbytes=shard_bytes(flat.avals[b], layout.shardings[b]))
        for b, buffer in enumerate(program.buffers)
    )
    steps = tuple(
        _gathering(step, extra) if (extra := collective_scratch(fe, flat, layout)) else step
        for step, fe in zip(program.steps, flat.equations, strict=True)
    )
    return Program(steps=steps, buffers=buffers)


def _gathering(step: Step, scratch: int) -> GatheringStep:
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    return GatheringStep(**fields | dict(transient_bytes=step.transient_bytes + scratch))


def collective_scratch(fe: Any, flat: FlatProgram, layout: Layout) -> int:
    """What a contraction over sharded dimensions may hold beyond its shards on each device.

    When a ``dot_general`` contracts a dimension that is sharded, XLA gathers an operand whole
    (FSDP's weights, sharded on their first dimension) or computes the whole result as partial sums
    before it reduces and scatters it. Neither value is in the jaxpr, so the plan reserves, as the
    step's scratch, the whole operands and result less the shards it already counts (an upper bound).
    Inside one compiled program XLA gathers early, so a segment counts the scratch of all such
    steps it runs together (``schedule.segments.GatheringStep``).
    """
    eqn = fe.eqn
    if eqn.primitive.name != "dot_general":
        return 0
    contracting, _ = eqn.params["dimension_numbers"]  # (lhs, rhs) contracting dimensions, then batch
    operands = [r for r in fe.inputs[:2] if isinstance(r, int)]
    sharded = False
    for r, dims in zip(fe.inputs[:2], contracting):
        sharding = layout.shardings[r] if isinstance(r, int) else None
        if isinstance(sharding, NamedSharding):
            spec = (*sharding.spec, *(None,) * len(flat.avals[r].shape))
            sharded |= any(spec[d] is not None for d in dims)
    if not sharded:
        return 0
    values = [*operands, *fe.outputs]
    return sum(jc.nbytes(flat.avals[b]) - shard_bytes(flat.avals[b], layout.shardings[b]) for b in values)
