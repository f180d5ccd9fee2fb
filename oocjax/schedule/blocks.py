"""Recompute by block: what per-block remat recomputes (``block_targets``), for the layer planner's
``recomputed`` policies (``schedule.layer_plan``). ``nn.remat`` around each block keeps the block's
input and recomputes everything else the block's backward needs: the members of a block (its steps
``start .. stop - 1`` in the forward pass) are the computed values it makes, less those the forward
pass reads after the block (its output, the next block's input). Those only the block reads are
members too: a member's copy reads them, and were they not members, the copy would keep them alive
from the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from oocjax.schedule.program import Program


def block_targets(
    program: Program, blocks: Sequence[tuple[int, int]], backward_start: int, *, midpoint: bool = False
) -> list[int]:
    """The values per-block remat recomputes: per block ``(start, stop)`` (steps of the forward
    pass, in order), the computed values made in it that no forward step after the block reads
    (before ``backward_start``). With ``midpoint``, also kept: the values that cross the block's
    narrowest point in its middle half (``narrowest``: a transformer block's residual stream
    between its attention and its MLP), so that each half is recomputed only for its own
    backward pass, the second half's without the first's.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["h"]), ("f", ["h"], ["b"]), ("g", ["b"], ["y"]), ("loss", ["y"], ["s"]),
    ...      ("dloss", ["s", "y"], ["dy"]), ("dg", ["dy", "b"], ["db"]), ("df", ["db", "h"], ["dh"]),
    ...      ("dg", ["dh", "a"], ["da"])],
    ...     dict.fromkeys(["x", "a", "h", "b", "y", "s", "dy", "db", "dh", "da"], 8), inputs=["x"], outputs=["da"])
    >>> [p.buffers[b].label for b in block_targets(p, [(0, 2), (2, 4)], backward_start=5)]
    ['a', 'b']
    """
    uses = program.uses
    last_forward = blocks[-1][1] if blocks else 0
    targets = []
    for start, stop in blocks:
        kept = narrowest(program, start, stop) if midpoint else set()
        for step in program.steps[start:stop]:
            for b in step.writes:
                reads = uses.read_at[b]
                buffer = program.buffers[b]
                if buffer.kind != "computed" or buffer.is_output or b in kept:
                    continue
                if not any(stop <= r < max(backward_start, last_forward) for r in reads):
                    targets.append(b)
    return targets


def narrowest(program: Program, start: int, stop: int) -> set[int]:
    """The values made in steps ``start .. stop - 1`` before a point in their middle half and read
    after it within them, at the point where they are fewest in bytes (the nearest the middle on a
    tie): a block's checkpoint, if it keeps one.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["c"], ["d"]), ("m", ["d"], ["e"]),
    ...      ("n", ["e", "c"], ["y"])],
    ...     {"x": 8, "a": 64, "b": 64, "c": 8, "d": 64, "e": 64, "y": 8}, inputs=["x"], outputs=["y"])
    >>> [p.buffers[b].label for b in narrowest(p, 0, 6)]  # before k, only c crosses
    ['c']
    """
    made = {b: k for k in range(start, stop) for b in program.steps[k].writes}
    crossing: dict[int, list[int]] = {
        c: [] for c in range(start + (stop - start) // 4, start + 3 * (stop - start) // 4 + 1)
    }
    for b, k in made.items():
        inside = [r for r in program.uses.read_at[b] if r < stop]
        for c in crossing:
            if k < c <= (inside[-1] if inside else k):
                crossing[c].append(b)
    middle = (start + stop) / 2
    best = min(
        crossing, key=lambda c: (sum(program.buffers[b].nbytes for b in crossing[c]), abs(c - middle)), default=None
    )
    return set() if best is None else set(crossing[best])
