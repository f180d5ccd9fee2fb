"""Cuts at layers alike: where groups of repeated layers begin and end (``layer_groups``), so that
they run one compiled program; and what two ranges of steps compile to as far as the planner sees
(``segment_signature``).
"""

from __future__ import annotations

from collections.abc import Sequence

from oocjax.schedule.program import Program

MIN_GROUPS = 4


def layer_groups(
    program: Program, layers: Sequence[tuple[int, int, str]], min_flops: int
) -> tuple[tuple[int, int], ...]:
    """The steps ``(start, stop)`` of each group of layers that is alike another, in order.

    In each pass (a kind's first word tells the backward's from the forward's), the runs of layers
    are taken in groups of whole periods of their kinds (``Conv, BatchNorm, Conv, BatchNorm``: 2),
    enough periods for ``min_flops`` of work. A group counts only where another group of the
    pass is alike (``segment_signature``: the same operations on the same sizes, keeping the same values
    for later), so that they run one compiled program; a group like no other is left to the cuts
    the plan needs. A cut that buys no sharing costs a launch, compiles a program more and moves
    where XLA rounds low-precision values. Segments begin and end at these bounds.

    >>> from oocjax.schedule import Program
    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("f", ["y"], ["z"]), ("h", ["z"], ["w"])],
    ...                      {"x": 8, "y": 8, "z": 8, "w": 8}, inputs=["x"], outputs=["w"])
    >>> layer_groups(p, [(0, 1, "Dense"), (1, 2, "Dense")], min_flops=0)  # two layers alike
    ((0, 1), (1, 2))
    >>> layer_groups(p, [(0, 1, "Dense"), (1, 3, "Dense")], min_flops=0)  # the second is not
    ()
    >>> q = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"]), ("f", ["z"], ["w"]), ("h", ["w"], ["v"])],
    ...                      {"x": 8, "y": 8, "z": 8, "w": 8, "v": 8}, inputs=["x"], outputs=["v"])
    >>> layer_groups(q, [(0, 1, "Dense"), (2, 3, "Dense")], min_flops=0)  # alike, g between them
    ((0, 1), (2, 3))
    """
    groups: list[tuple[int, int]] = []
    for runs in _passes(layers):
        kinds = [kind for _, _, kind in runs]
        period = next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[:-p] or p == len(kinds))
        blocks = [runs[i : i + period] for i in range(0, len(runs), period)]
        flops = sorted(sum(s.flops for a, y, _ in block for s in program.steps[a:y]) for block in blocks)
        # Enough work per group for min_flops, but at least MIN_GROUPS groups where there are that
        # many layers: what a group of little work (an optimizer's update) costs is compiling it.
        wanted = -(-min_flops // max(flops[len(flops) // 2], 1))
        if len(blocks) >= MIN_GROUPS:
            wanted = min(wanted, len(blocks) // MIN_GROUPS)
        per_group = period * max(1, wanted)
        # A group ends with its last layer: what runs before the next (copies moved out of it) is not its own.
        ranges = [(runs[i][0], runs[min(i + per_group, len(runs)) - 1][1]) for i in range(0, len(runs), per_group)]
        signatures = [segment_signature(program, a, y) for a, y in ranges]
        groups += [r for r, signature in zip(ranges, signatures) if signatures.count(signature) > 1]
    return tuple(groups)


def segment_signature(program: Program, a: int, y: int) -> tuple:
    """What steps a..y-1 compile to, as far as the planner sees: each step's operation, its operands
    (a value defined in the range by position, else by size), its results' sizes and whether
    steps after the range read them."""
    local: dict[int, int] = {}
    spans, buffers = program.unmoved_spans, program.buffers
    signature = []
    for step in program.steps[a:y]:
        operands = tuple(local.get(b, -buffers[b].nbytes - 1) for b in step.reads)
        results = tuple((buffers[b].nbytes, spans[b][1] >= y) for b in step.writes)
        local.update((b, len(local)) for b in step.writes)
        signature.append((step.name, operands, results, step.flops))
    return tuple(signature)


def _passes(layers: Sequence[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """The layer runs split where the pass changes (forward, backward: the kind's first word)."""
    passes: list[list[tuple[int, int, str]]] = []
    phase = None
    for run in layers:
        kind = run[2]
        this = kind.split(" ")[0] if " " in kind else ""
        if not passes or this != phase:
            passes.append([])
            phase = this
        passes[-1].append(run)
    return passes
