"""Where a step's repeated layers run, read from its equations' name stacks.

Flax names every module call in the name stack (``jvp(Transformer)/Block_2/Dense_0``); the backward
pass keeps the names under ``transpose(...)``. A *layer* is a module whose kind repeats under one
parent (``Block_0`` .. ``Block_23``). Cutting segments where layers begin lets layers alike run the
same compiled programs (``schedule.segments.cut_segments``), so that the programs to compile grow
with the kinds of layers, not with depth.
"""

from __future__ import annotations

import re
from collections import defaultdict

from oocjax.transforms import _compat as jc
from oocjax.transforms.analyse import FlatProgram

_NUMBERED = re.compile(r"^(?P<kind>.+)_(?P<index>\d+)$")
# Operands that name a random stream rather than carry data: Flax folds each module's path into its
# key as a literal, which is all that tells one layer's program from the next. Passed as arguments
# (``transforms.segment``), they let layers alike share one program.
LIFTED_LITERALS = frozenset({"random_fold_in"})


def layer_runs(flat: FlatProgram) -> tuple[tuple[int, int, str], ...]:
    """``(start, stop, kind)`` per run of one layer's equations, in order, forward and backward
    apart (``kind`` is e.g. ``"Block"``; the backward's is ``"transpose Block"``). A run ends after
    its layer's last equation before the next run; equations without a layer inside it (a
    residual add, a recomputed copy) are part of it, those after a pass's last layer (the loss,
    the optimizer) are not."""
    paths = [_path(fe.eqn) for fe in flat.equations]
    repeated = _repeated_kinds(paths)
    runs: list[list] = []
    for k, (fe, (phase, path)) in enumerate(zip(flat.equations, paths, strict=True)):
        layer = _layer(path, repeated)
        if layer is None or fe.recompute_of is not None:
            continue
        if runs and runs[-1][3] == (phase, layer):
            runs[-1][1] = k + 1
        else:
            kind = _NUMBERED.match(layer[-1])["kind"]
            runs.append([k, k + 1, f"{phase} {kind}".strip(), (phase, layer)])
    return tuple((start, stop, kind) for start, stop, kind, _ in runs)


def _path(eqn: jc.JaxprEqn) -> tuple[str, tuple[str, ...]]:
    """(phase, module path): the phase is ``"transpose"`` in the backward pass, else empty."""
    parts = str(eqn.source_info.name_stack).split("/")
    phase = "transpose" if parts[0].startswith("transpose(") else ""
    return phase, tuple(parts[1:])


def _repeated_kinds(paths: list[tuple[str, tuple[str, ...]]]) -> set[tuple[tuple[str, ...], str]]:
    """(parent path, kind) of the modules numbered at least twice under one parent."""
    indices: dict[tuple[tuple[str, ...], str], set[str]] = defaultdict(set)
    for _, path in set(paths):
        for depth, part in enumerate(path):
            match = _NUMBERED.match(part)
            if match:
                indices[path[:depth], match["kind"]].add(match["index"])
    return {key for key, seen in indices.items() if len(seen) > 1}


def _layer(path: tuple[str, ...], repeated: set) -> tuple[str, ...] | None:
    """The shortest prefix of ``path`` that names a layer (a repeated module), or None."""
    for depth, part in enumerate(path):
        match = _NUMBERED.match(part)
        if match and (path[:depth], match["kind"]) in repeated:
            return path[: depth + 1]
    return None
