"""Where a step's repeated layers run: read from the equations' name stacks where they name layers,
found from the program's structure where they do not.

A *layer* is a run of equations that repeats: the same operations on the same shapes, wired alike,
once per layer in the forward pass and once per layer (in reverse order) in the backward pass.
Cutting segments where layers begin lets alike layers run the same compiled programs
(``schedule.segments.cut_segments``), so that the programs to compile grow with the kinds of layers,
not with depth.

* **By name.** Flax puts every module call in the name stack (``jvp(GPT)/transformer/h/3/attn``),
  and the backward pass keeps it under ``transpose(...)``. A path component that differs from its
  siblings only by a number names a layer: ``Block_3``, ``layer_3``, ``layers.3``, or ``3`` under a
  parent ``h``.
* **By structure**, in a pass (forward or backward) where no name does: NNX modules and plain
  functions over lists of weights leave no names. Each equation gets a token (its primitive,
  parameters, operand and result types, and where within one layer its operands come from); the
  longest run of tokens that repeats with one period is a run of layers of that length; layers are
  cut where the fewest bytes pass from one layer to the next (the residual stream).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import accumulate, groupby, pairwise

import numpy as np

from oocjax.schedule.reorder import anchors, layer_of_updates
from oocjax.transforms import compat as jc
from oocjax.transforms.compile import params_key
from oocjax.transforms.flat import FlatProgram, dataflow

# A path component numbered among its siblings: ``Block_3``, ``layer.3``, ``h/3`` (kind empty).
_NUMBERED = re.compile(r"^(?P<kind>.*?)[_.\-]?(?P<index>\d+)$")
# Fewer repeats than this, or a layer of fewer equations, is not worth cutting by.
MIN_LAYERS = 2
MIN_LAYER_EQUATIONS = 8
# Candidate periods tried per pass, the most frequent distances between equal tokens first.
_CANDIDATE_PERIODS = 24


def layer_runs(flat: FlatProgram) -> tuple[tuple[int, int, str], ...]:
    """``(start, stop, kind)`` per run of one layer's equations, in order, forward and backward
    apart (``kind`` is e.g. ``"Block"``; the backward's is ``"transpose Block"``). A run ends after
    its layer's last equation before the next run; equations without a layer inside it (a
    residual add, a recomputed copy) are part of it, those after a pass's last layer (the loss,
    the optimizer) are not. Passes where no name stack names layers are searched by structure
    (their kind is ``"layer"``)."""
    phases = equation_phases(flat)
    named = _alike_only(flat, _named_runs(flat, phases))
    runs = list(named)
    for start, stop, phase in _phase_ranges(phases):
        if phase and not any(start <= a < stop for a, _, _ in named):
            owners = _owners(flat, runs) if phase == "transpose" else None
            runs += _structural_runs(flat, start, stop, phase, owners)
    return tuple(sorted([*runs, *_update_runs(flat, phases, runs)]))


def _update_runs(
    flat: FlatProgram, phases: Sequence[str], runs: Sequence[tuple[int, int, str]]
) -> list[tuple[int, int, str]]:
    """Per backward layer, the run of equations after the backward pass that follow its gradients
    (``schedule.reorder.layer_of_updates``): its optimizer update, kind ``"update Block"``, where each
    layer's is one run (``transforms.reorder`` groups them so); else none."""
    backward = [(a, y, kind) for a, y, kind in runs if kind.startswith("transpose")]
    transposed = [k for k, phase in enumerate(phases) if phase == "transpose"]
    if len(backward) < MIN_LAYERS:
        return []
    reads, writes = dataflow(flat)
    tail_start, n = transposed[-1] + 1, len(flat.equations)
    anchor = anchors(reads, writes, tail_start, transposed[0], unused=transposed[0] - 1)  # as the grouping
    group = layer_of_updates(anchor, tail_start, n, [(a, y) for a, y, _ in backward])
    kinds = {a: "update " + kind.removeprefix("transpose ") for a, _, kind in backward}
    runs_of = [(g, list(ks)) for g, ks in groupby(range(tail_start, n), key=group.__getitem__)]
    found = [(ks[0], ks[-1] + 1, kinds[g], g) for g, ks in runs_of if g in kinds]
    if len({g for *_, g in found}) < len(found):  # a layer's update in pieces: not grouped
        return []
    return [(a, y, kind) for a, y, kind, _ in found]


def _owners(flat: FlatProgram, runs: Sequence[tuple[int, int, str]]) -> dict[int, int]:
    """Buffer -> the forward layer that made it or alone read it (its parameters), so that a
    backward layer can be told by what it reads: its own forward layer's values."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for j, (a, y, _) in enumerate(r for r in runs if not r[2].startswith("transpose")):
        for fe in flat.equations[a:y]:
            owner.update((b, j) for b in fe.outputs)
            for ref in fe.inputs:
                if type(ref) is int and ref < flat.num_inputs and owner.setdefault(ref, j) != j:
                    shared.add(ref)
    return {b: j for b, j in owner.items() if b not in shared}


# -- Passes ---------------------------------------------------------------------------------------


def equation_phases(flat: FlatProgram) -> list[str]:
    """Per equation: ``"forward"`` under ``jvp(...)``, ``"transpose"`` under ``transpose(...)``, else
    ``""``. A recomputed copy belongs to the pass it runs in (the equation before it), and so does
    an equation of no pass between two of the backward's (an optimizer update moved next to its
    gradient, ``transforms.reorder``)."""
    phases: list[str] = []
    for fe in flat.equations:
        if fe.recompute_of is not None and phases:
            phases.append(phases[-1])
            continue
        head = str(fe.eqn.source_info.name_stack).split("/", 1)[0]
        phases.append("transpose" if head.startswith("transpose(") else "forward" if head.startswith("jvp(") else "")
    backward = [k for k, phase in enumerate(phases) if phase == "transpose"]
    if backward:
        phases[backward[0] : backward[-1]] = [phase or "transpose" for phase in phases[backward[0] : backward[-1]]]
    return phases


def _phase_ranges(phases: Sequence[str]) -> list[tuple[int, int, str]]:
    """Maximal ranges of equations in one phase."""
    bounds = [0, *accumulate(len(list(run)) for _, run in groupby(phases))]
    return [(a, y, phases[a]) for a, y in pairwise(bounds)]


def _kind(phase: str, kind: str) -> str:
    return f"transpose {kind}" if phase == "transpose" else kind


# -- By name --------------------------------------------------------------------------------------


def _named_runs(flat: FlatProgram, phases: Sequence[str]) -> list[tuple[int, int, str]]:
    paths = [_path(fe.eqn) for fe in flat.equations]
    repeated = _repeated_kinds(paths)
    runs: list[list] = []
    for k, (fe, path) in enumerate(zip(flat.equations, paths, strict=True)):
        layer = _layer(path, repeated)
        if layer is None or fe.recompute_of is not None or not phases[k]:
            continue
        if runs and runs[-1][3] == (phases[k], layer):
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1, _kind(phases[k], _label(layer)), (phases[k], layer)])
    return [(start, stop, kind) for start, stop, kind, _ in runs]


def _alike_only(flat: FlatProgram, runs: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The runs of the kinds of which at least two runs do the same operations on the same shapes: a
    numbered name alone (``Dense_0`` .. ``Dense_3`` of four widths) is no layer to share programs."""

    def shape(a: int, y: int) -> tuple:
        return tuple((fe.eqn.primitive, tuple(flat.avals[b] for b in fe.outputs)) for fe in flat.equations[a:y])

    by_kind: dict[str, Counter] = defaultdict(Counter)
    shapes = [shape(a, y) for a, y, _ in runs]
    for (_, _, kind), s in zip(runs, shapes):
        by_kind[kind][s] += 1
    alike = {kind for kind, counts in by_kind.items() if max(counts.values()) >= MIN_LAYERS}
    return [run for run in runs if run[2] in alike]


def _path(eqn: jc.JaxprEqn) -> tuple[str, ...]:
    """The module path an equation was traced in, without the transformation around it."""
    return tuple(str(eqn.source_info.name_stack).split("/")[1:])


def _repeated_kinds(paths: list[tuple[str, ...]]) -> set[tuple[tuple[str, ...], str]]:
    """(parent path, kind) of the components numbered at least twice under one parent."""
    indices: dict[tuple[tuple[str, ...], str], set[str]] = defaultdict(set)
    for path in set(paths):
        for depth, part in enumerate(path):
            match = _NUMBERED.match(part)
            if match:
                indices[path[:depth], match["kind"]].add(match["index"])
    return {key for key, seen in indices.items() if len(seen) >= MIN_LAYERS}


def _layer(path: tuple[str, ...], repeated: set) -> tuple[str, ...] | None:
    """The shortest prefix of ``path`` that names a layer (a repeated component), or None."""
    for depth, part in enumerate(path):
        match = _NUMBERED.match(part)
        if match and (path[:depth], match["kind"]) in repeated:
            return path[: depth + 1]
    return None


def _label(layer: tuple[str, ...]) -> str:
    """``Block`` for ``.../Block_3``; the parent's name for ``.../h/3``."""
    kind = _NUMBERED.match(layer[-1])["kind"]
    return kind or (layer[-2] if len(layer) > 1 else "layer")


# -- By structure ---------------------------------------------------------------------------------


def _structural_runs(
    flat: FlatProgram, start: int, stop: int, phase: str, owners: dict[int, int] | None = None
) -> list[tuple[int, int, str]]:
    """The layers of equations ``start .. stop - 1`` (one pass): the longest periodic run of tokens,
    then the runs on either side of it (two stacks), else a layer like its beside it (``_alike_beside``).
    ``owners`` (backward passes): which forward layer each buffer belongs to (``_owners``)."""
    if stop - start < MIN_LAYERS * MIN_LAYER_EQUATIONS:
        return []
    tokens = _tokens(flat, start, stop)
    found = _longest_periodic(tokens)
    if found is None:
        return []
    first, end, period = (start + found[0], start + found[1], found[2])
    first, count = _aligned(flat, (start, stop), (first, end), period, owners or {})
    if count < MIN_LAYERS:
        return []
    runs = [(first + i * period, first + (i + 1) * period, _kind(phase, "layer")) for i in range(count)]
    before = _structural_runs(flat, start, first, phase, owners) or _alike_beside(tokens, start, runs[0], start)
    after = _structural_runs(flat, runs[-1][1], stop, phase, owners) or _alike_beside(tokens, start, runs[-1], stop)
    return [*before, *runs, *after]


def _alike_beside(tokens: np.ndarray, origin: int, layer: tuple[int, int, str], limit: int) -> list:
    """The run beside ``layer``, towards ``limit``, that is a layer like it but not the same (a global
    attention layer by local ones): within ``_INSIDE`` of its length, the most alike by the tokens
    (``tokens[0]`` is equation ``origin``'s) the two share, by Jaccard's index, and at least ``_INSIDE``."""
    (a, y, kind), after, n = layer, limit >= layer[1], layer[1] - layer[0]
    template, best, found = Counter(tokens[a - origin : y - origin].tolist()), _INSIDE, []
    for length in range(math.ceil(_INSIDE * n), min(int(n / _INSIDE), abs(limit - (y if after else a))) + 1):
        lo, hi = (y, y + length) if after else (a - length, a)
        common = (Counter(tokens[lo - origin : hi - origin].tolist()) & template).total()
        if (alike := common / (length + n - common)) > best:
            best, found = alike, [(lo, hi, kind)]
    return found


def _tokens(flat: FlatProgram, start: int, stop: int) -> np.ndarray:
    """One integer per equation, equal for equations alike: primitive, parameters, operand and result
    types, and each operand's source: a literal, an argument, or the equation so many steps back
    (``"far"`` beyond ``_NEAR`` steps, as the backward's reads of the forward's values are)."""
    producer = {b: k for k, fe in enumerate(flat.equations[start:stop], start) for b in fe.outputs}
    ids: dict = {}
    tokens = np.empty(stop - start, np.int64)
    for k, fe in enumerate(flat.equations[start:stop], start):
        sources = []
        for ref in fe.inputs:
            if type(ref) is not int:
                sources.append(("literal", ref.aval))
            elif ref < flat.num_inputs or ref not in producer:
                sources.append(("outside", flat.avals[ref]))
            else:
                back = k - producer[ref]
                sources.append(("near", back, flat.avals[ref]) if back <= _NEAR else ("far", flat.avals[ref]))
        outs = tuple(flat.avals[b] for b in fe.outputs)
        key = (fe.eqn.primitive, params_key(fe.eqn), tuple(sources), outs, fe.recompute_of is None)
        tokens[k - start] = ids.setdefault(key, len(ids))
    return tokens


# Operands made at most this many equations earlier count as made inside the layer (by distance);
# from further back, by type only (a backward layer reads its forward layer's values from afar).
_NEAR = 64


def _longest_periodic(tokens: np.ndarray) -> tuple[int, int, int] | None:
    """``(first, end, period)`` of the longest run ``tokens[first:end]`` with ``tokens[i] ==
    tokens[i + period]`` throughout and at least ``MIN_LAYERS`` periods; the shortest period among
    runs as long. Candidate periods are the most common distances between equal tokens."""
    order = np.lexsort((np.arange(len(tokens)), tokens))
    same = tokens[order][1:] == tokens[order][:-1]
    gaps = (order[1:] - order[:-1])[same]
    best = None
    for period, _ in Counter(gaps[gaps >= MIN_LAYER_EQUATIONS].tolist()).most_common(_CANDIDATE_PERIODS):
        match = np.concatenate([[False], tokens[period:] == tokens[:-period], [False]])
        edges = np.flatnonzero(match[1:] != match[:-1])  # run starts and ends, alternating
        if len(edges) == 0:
            continue
        lengths = edges[1::2] - edges[::2]
        i = int(np.argmax(lengths))
        first, end = int(edges[2 * i]), int(edges[2 * i + 1]) + period
        if end - first < MIN_LAYERS * period:
            continue
        if best is None or (end - first, -period) > (best[1] - best[0], -best[2]):
            best = (first, end, period)
    return best


def _aligned(
    flat: FlatProgram, within: tuple[int, int], run: tuple[int, int], period: int, owners: dict[int, int]
) -> tuple[int, int]:
    """Where the layers of the periodic run ``first .. end - 1`` (``run``) begin, and how many there
    are, all inside the pass's equations ``within``.

    Layers are ``period`` equations long, each at least ``_INSIDE`` of it inside the run (the
    first layer's first operations may read its input from elsewhere than the later layers do).
    Of the boundaries that give the most layers: in a backward pass, those where the fewest
    equations read another forward layer's values (``owners``) than most of their layer does;
    then where the fewest bytes made before a boundary are read after it within a period (the
    residual stream, not a layer's insides); then the nearest to where the repetition begins."""
    (first, end), (lo, hi) = run, within
    lo, hi = max(first - period, lo), min(end + period, hi)
    crossing = _crossing_bytes(flat, lo, hi, period)
    owner = np.array([_owner(fe, owners) for fe in flat.equations[lo:hi]], np.int64)

    def inside(a: int) -> bool:  # a layer from a: in the pass, and mostly inside the run
        return lo <= a and a + period <= hi and min(a + period, end) - max(a, first) >= _INSIDE * period

    def layers(start: int) -> range:  # the whole periods from start that lie mostly inside the run
        count = 0
        while inside(start + count * period):
            count += 1
        return range(start, start + count * period + 1, period)

    def strays(bounds: range) -> int:  # equations reading another forward layer than their own
        if not owners or len(bounds) < 2:
            return 0
        rows = owner[bounds[0] - lo : bounds[-1] - lo].reshape(len(bounds) - 1, period)
        return sum(int((row >= 0).sum() - np.bincount(row[row >= 0]).max(initial=0)) for row in rows)

    def cost(start: int) -> tuple:
        bounds = layers(start)
        return (-len(bounds), strays(bounds), sum(crossing[b - lo] for b in bounds), abs(start - first))

    best = min(range(max(first - period // 2, lo), first + period // 2 + 1), key=cost)
    return best, len(layers(best)) - 1


# A layer's share that must lie inside the periodic run.
_INSIDE = 0.75


def _owner(fe, owners: dict[int, int]) -> int:
    """The forward layer an equation reads from (the first it finds), or -1."""
    for ref in fe.inputs:
        if type(ref) is int and ref in owners:
            return owners[ref]
    return -1


def _crossing_bytes(flat: FlatProgram, lo: int, hi: int, period: int) -> np.ndarray:
    """Per position ``k`` in ``lo .. hi`` (index ``k - lo``): the bytes of values made before
    equation ``k`` and read at or after it, within ``period`` equations of being made."""
    made = {b: k for k in range(lo, hi) for b in flat.equations[k].outputs}
    last_read = {}
    for k in range(lo, hi):
        for ref in flat.equations[k].inputs:
            if type(ref) is int and ref in made and made[ref] < k <= made[ref] + period:
                last_read[ref] = k
    crossing = np.zeros(hi - lo + 2)
    for ref, k in last_read.items():
        aval = flat.avals[ref]
        size = int(np.prod(aval.shape)) * aval.dtype.itemsize
        crossing[made[ref] + 1 - lo] += size
        crossing[k + 1 - lo] -= size
    return np.cumsum(crossing)
