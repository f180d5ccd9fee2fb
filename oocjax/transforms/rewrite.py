"""From a schedule back to a JAX function: re-evaluate the flattened step, with transfers at the
planned points and data dependencies that pin them there.

Inside one XLA program a transfer is ``jax.device_put(x, jax.memory.Space.Host)`` (or ``.Device``).
XLA's scheduler may move the resulting copies; ``jax.lax.optimization_barrier`` ties them down
(JAX_XLA_NOTES.md, "How XLA places the copies"):

* a prefetch issued at step ``k`` may not start before step ``k - 1`` has produced its result: the
  host value and that result pass through one barrier before the ``device_put``;
* an offload issued after a later step than its value's definition is tied to that step's result;
* an offload whose device copy must be released before step ``w`` (``done_before_step``) passes its
  host value through one barrier with step ``w``'s operands, so step ``w`` cannot start earlier.

Barriers also block fusion across them, so they appear at plan points only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oocjax.schedule import Offload, Prefetch, Schedule
from oocjax.transforms import _compat as jc
from oocjax.transforms.analyse import FlatProgram

Host = jax.memory.Space.Host
Device = jax.memory.Space.Device


def rewritten_step(flat: FlatProgram, schedule: Schedule) -> Callable[..., tuple[Any, ...]]:
    """A function of the step's flat arguments that runs ``schedule``; trace it under ``jax.jit``.

    Arguments in ``schedule.host_inputs`` must arrive in host memory, and outputs in
    ``schedule.host_outputs`` are returned there (set the jit's shardings accordingly).
    """
    prefetch_at: dict[int, list[Prefetch]] = defaultdict(list)
    offload_after: dict[int, list[Offload]] = defaultdict(list)
    done_before: dict[int, list[Offload]] = defaultdict(list)
    for move in schedule.moves:
        if isinstance(move, Prefetch):
            prefetch_at[move.issue_step].append(move)
        else:
            offload_after[move.after_step].append(move)
            if move.done_before_step is not None:
                done_before[move.done_before_step].append(move)
    defined_at = {b: k for k, fe in enumerate(flat.equations) for b in fe.outputs}

    def run(*arguments: Any) -> tuple[Any, ...]:
        device: dict[int, Any] = dict(flat.constants)
        host: dict[int, Any] = {}
        for b, value in enumerate(arguments):
            (host if b in schedule.host_inputs else device)[b] = value
        anchor = None  # a value of the last step: what a prefetch issued now must wait for

        for k, fe in enumerate(flat.equations):
            for p in prefetch_at[k]:
                source = host[p.buffer]
                if anchor is not None:
                    source, _ = jax.lax.optimization_barrier((source, anchor))
                device[p.buffer] = jax.device_put(source, Device)
            operands = [device[r] for r in fe.inputs if isinstance(r, int)]
            waits = done_before[k]
            if waits and operands:  # step k cannot start before these copies are complete
                copies, operands = jax.lax.optimization_barrier(([host[o.buffer] for o in waits], operands))
                host.update((o.buffer, c) for o, c in zip(waits, copies, strict=True))
            invals = _merge_literals(fe.inputs, operands)
            with jc.equation_context(fe.eqn):
                outvals = jc.bind_equation(fe.eqn, invals)
            if waits and not operands:  # no operand to hold the step back: hold back its results
                copies, outvals = jax.lax.optimization_barrier(([host[o.buffer] for o in waits], outvals))
                host.update((o.buffer, c) for o, c in zip(waits, copies, strict=True))
            device.update(zip(fe.outputs, outvals, strict=True))
            anchor = _anchor(outvals, anchor)
            for o in offload_after[k]:
                value = device[o.buffer]
                if defined_at.get(o.buffer) != k:  # not before step k has run
                    value, _ = jax.lax.optimization_barrier((value, anchor))
                host[o.buffer] = jax.device_put(value, Host)

        return tuple(
            r.val if isinstance(r, jc.Literal) else host[r] if r in schedule.host_outputs else device[r]
            for r in flat.outputs
        )

    return run


def _merge_literals(refs: Sequence[Any], operands: list[Any]) -> list[Any]:
    values = iter(operands)
    return [r.val if isinstance(r, jc.Literal) else next(values) for r in refs]


def _anchor(values: Sequence[Any], previous: Any) -> Any:
    """A value fit to pass through a barrier: an array of a plain dtype (not a token or a key)."""
    for value in values:
        dtype = getattr(value, "dtype", None)
        if dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return value
    return previous
