"""Each parameter's update right after its last gradient: the order of a step's tail.

A training step traced from ``optax`` updates every parameter after the whole backward pass: the
gradients of the first layers are made last, so the optimizer's equations wait for them all, and
every gradient, parameter and moment is alive together at the end. Any order that keeps each
equation after the equations it reads computes the same values, so the tail (the equations after
the backward pass) can be interleaved with it: each tail equation placed right after the last
equation it depends on. A layer's update then follows that layer's gradient, and the updated
parameter and moments can leave the device at once.

A tail equation also follows every earlier use of what it reads: an update then comes after the
backward's last read of the parameter it replaces, so that the new one can take its memory.

A tail equation that depends on nothing the backward pass makes (the step count, a learning-rate
schedule, weight decay's ``decay * param``) goes right before its first user, not to the start:
there it would hold a parameter-sized value through the whole backward pass. Where an update needs
every gradient (clipping by the norm of all of them), it depends on the last one, and stays at the end.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def updates_early(
    reads: Sequence[Sequence[int]], writes: Sequence[Sequence[int]], tail_start: int, backward_start: int
) -> list[int]:
    """The positions of the equations in their new order: equations ``tail_start ..`` each placed
    right after the last equation before ``tail_start`` it depends on (directly or through other
    tail equations) or that uses what it reads, and not before ``backward_start``; the rest keep
    their order.

    >>> # f, g; b1 (its input's gradient 3, its weight's 4), b0 (its weight's 5); the updates of 4 and 5
    >>> reads = [[0], [1], [2], [3], [4, 9], [5, 9]]
    >>> writes = [[1], [2], [3, 4], [5], [6], [7]]
    >>> updates_early(reads, writes, tail_start=4, backward_start=2)
    [0, 1, 2, 4, 3, 5]
    """
    anchor = anchors(reads, writes, tail_start, backward_start)
    # Stable: equations with one anchor keep their order, and each follows what it reads.
    return sorted(range(len(reads)), key=lambda k: (anchor.get(k, k), k >= tail_start, k))


def updates_by_layer(
    reads: Sequence[Sequence[int]],
    writes: Sequence[Sequence[int]],
    tail_start: int,
    backward_start: int,
    layers: Sequence[tuple[int, int]],
) -> list[int]:
    """The positions of the equations in their new order: the tail kept after the backward pass,
    but grouped by the backward layer (``(start, stop)`` runs of equations) each equation's
    anchor lies in, groups in the backward's order. ``optax`` traces one operation over every
    parameter, then the next: grouped, each layer's update is one run, alike from layer to layer,
    so that the tail compiles as one layer's program run once per layer, not as one program as
    large as every update together.

    >>> # backward layers (0, 2) and (2, 4); the tail: two operations over each layer's gradient
    >>> reads = [[0], [1], [2], [3], [1], [3], [5], [6]]
    >>> writes = [[1], [2], [3], [4], [5], [6], [7], [8]]
    >>> updates_by_layer(reads, writes, tail_start=4, backward_start=0, layers=[(0, 2), (2, 4)])
    [0, 1, 2, 3, 4, 6, 5, 7]
    """
    # A metric of the old parameters goes first, not after every update: they may then be written over.
    anchor = anchors(reads, writes, tail_start, backward_start, unused=backward_start - 1)
    group = layer_of_updates(anchor, tail_start, len(reads), layers)
    return [*range(tail_start), *sorted(range(tail_start, len(reads)), key=lambda k: (group[k], k))]


def layer_of_updates(
    anchor: dict[int, int], tail_start: int, n: int, layers: Sequence[tuple[int, int]]
) -> dict[int, int]:
    """Per tail equation: the start of the backward layer its anchor lies in, else the anchor."""
    starts = [a for a, _ in layers]
    group = {}
    for k in range(tail_start, n):
        i = bisect.bisect_right(starts, anchor[k]) - 1
        group[k] = layers[i][0] if i >= 0 and anchor[k] < layers[i][1] else anchor[k]
    return group


def anchors(
    reads: Sequence[Sequence[int]],
    writes: Sequence[Sequence[int]],
    tail_start: int,
    backward_start: int,
    *,
    unused: int | None = None,
) -> dict[int, int]:
    """Per equation from ``tail_start``: the equation before the tail it is to follow (see
    ``updates_early``). One that reads nothing the backward pass makes and that no tail equation
    reads (a metric of the old parameters) follows ``unused``, by default the backward pass's end."""
    n = len(reads)
    defined_at = {b: k for k in range(tail_start) for b in writes[k]}
    # The last use before the tail of each buffer: a tail equation goes after it too, so that an
    # update that writes a new parameter over the old one comes after every other read of the old.
    last_use = {b: k for k in range(tail_start) for b in (*reads[k], *writes[k])}
    anchor: dict[int, int] = {}  # tail equation -> the equation before the tail it goes after
    made: dict[int, int] = {}  # tail equation -> the last equation before the tail it depends on
    independent: list[int] = []
    for k in range(tail_start, n):
        producers = [defined_at.get(b, -1) for b in reads[k]]
        needs = max((made.get(d, d) for d in producers), default=-1)
        made[k] = needs
        if needs < backward_start:  # depends on nothing the backward pass makes: placed before its first user
            independent.append(k)
        follows = max((anchor.get(d, d) for d in producers), default=-1)
        anchor[k] = max([follows, *(last_use.get(b, -1) for b in reads[k])])
        defined_at.update((b, k) for b in writes[k])
    users: dict[int, list[int]] = {}
    for k in range(tail_start, n):
        for b in reads[k]:
            d = defined_at.get(b, -1)
            if d >= tail_start:
                users.setdefault(d, []).append(k)
    for k in reversed(independent):
        placed = [anchor[u] for u in users.get(k, ()) if anchor[u] >= backward_start]
        anchor[k] = min(placed, default=tail_start - 1 if unused is None else unused)
    for k in independent:  # and after what it reads, where that went later (to a user's place)
        anchor[k] = max([anchor[k], *(anchor[d] for b in reads[k] if (d := defined_at.get(b, -1)) >= tail_start)])
    return anchor
