"""The traced step's optimizer updates reordered (``schedule.reorder``): applied to the flat
program before it is analysed, so that everything after (the plan, the segments, the view) sees
the new order, whatever the budget. Each parameter's update goes right after its gradient
(``updates_after_gradients``), so that a layer's backward pass and its update run as one
segment and its state can stream through the device (a 4x512 GPT planned for an H200 at 0.95 of
its state's size: 3.0x the floor to the device and 1.3x back in the traced order, 1.6x and 1.05x
with the updates early; the four-way decoder at 4 layers: 11-12 segments where the updates after
the backward pass made 15-16, moving as much). Only with the state donated (scalars aside): with
state the caller keeps, an early update would hold the new parameters and moments beside the old
ones through the backward pass; there the updates stay after it, grouped by layer
(``updates_by_layer``). Equations with effects (callbacks, prints) keep the traced order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from oocjax.schedule.reorder import updates_by_layer, updates_early
from oocjax.transforms.flat import FlatProgram, dataflow
from oocjax.transforms.layers import equation_phases, layer_runs


def reorder_tail(flat: FlatProgram, donated: Sequence[bool]) -> FlatProgram:
    """``flat`` with its updates after their gradients (``updates_after_gradients``) where that
    applies, else grouped by layer after the backward pass (``updates_by_layer``)."""
    backward = _backward(flat)
    early = updates_after_gradients(flat, donated, backward)
    return early if early is not flat else updates_by_layer_of(flat, backward)


def _backward(flat: FlatProgram) -> list[int]:
    """The positions of the backward pass's equations."""
    return [k for k, phase in enumerate(equation_phases(flat)) if phase == "transpose"]


def updates_by_layer_of(flat: FlatProgram, backward: list[int] | None = None) -> FlatProgram:
    """``flat`` with the equations after its backward pass grouped by the backward layer whose
    gradients they read (``schedule.reorder.updates_by_layer``): each layer's update one run of
    equations, alike from layer to layer (``layers.layer_runs`` finds them), so that one compiled
    program serves every layer's update; ``flat`` itself where it has no layers or its tail has
    effects. On ``examples/decoders``' 12-layer Linen decoder the tail was one segment of 2,892
    equations that took 1.8 s to compile on this project's 2-core CPU, longer than any other.
    ``backward``: the backward pass's positions, where the caller has them."""
    backward = _backward(flat) if backward is None else backward
    if not backward or any(fe.eqn.effects for fe in flat.equations[backward[-1] + 1 :]):
        return flat
    layers = [(a, y) for a, y, kind in layer_runs(flat) if kind.startswith("transpose")]
    if len(layers) < 2:
        return flat
    reads, writes = dataflow(flat)
    return _in_order(flat, updates_by_layer(reads, writes, backward[-1] + 1, backward[0], layers))


def _in_order(flat: FlatProgram, order: list[int]) -> FlatProgram:
    if order == sorted(order):
        return flat
    return dataclasses.replace(flat, equations=tuple(flat.equations[k] for k in order))


def updates_after_gradients(
    flat: FlatProgram, donated: Sequence[bool], backward: list[int] | None = None
) -> FlatProgram:
    """``flat`` with its tail (after the backward pass) interleaved with the backward pass, where
    the state the tail reads is donated; else ``flat`` itself."""
    backward = _backward(flat) if backward is None else backward
    if not backward:
        return flat
    backward_start, tail_start = backward[0], backward[-1] + 1
    tail = flat.equations[tail_start:]
    arguments = {r for fe in tail for r in fe.inputs if isinstance(r, int) and r < flat.num_inputs}
    state = [b for b in arguments if math.prod(flat.avals[b].shape) > 1]  # not a learning rate passed in
    if not state or not all(donated[b] for b in state) or any(fe.eqn.effects for fe in tail):
        return flat
    reads, writes = dataflow(flat)
    return _in_order(flat, updates_early(reads, writes, tail_start, backward_start))
