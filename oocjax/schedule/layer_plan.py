"""Plans by layer: one policy for what every layer's backward reads of its forward, for its
parameters and for its optimizer state, with every copy issued where a unit of the layers begins.

Where a step's layers are known (``transforms.layers``: per layer its forward run, its backward run
and, where updates follow the backward pass, its update run), each run is one *unit*, each step
outside the layers its own. A policy (``LayerPolicy``) says every copy of a layer's values on the
program of units (``ranges.coarse_program``, a unit one step):

* **activations** (``ACTIVATIONS``): ``kept``; ``recomputed`` from the layer's input (per-block
  remat: ``schedule.blocks``), or ``by halves``; ``offloaded`` (copied to host after their last
  forward read, fetched back ``ahead`` units before their backward read); or recomputed with the
  input (and midpoint) offloaded. The last ``relaxed`` layers, whose backward comes first, take the
  next cheaper, so that memory the policy leaves is used, not wasted.
* **parameters**: ``kept`` on the device, or ``fetched`` ``ahead`` units before each pass that reads
  them (their host copy is valid: the device copy is dropped after the pass, not copied out).
* **optimizer state**: ``kept``, or ``streamed``: fetched ``ahead`` units before the update and the
  new state copied back as soon as it is made, its memory free ``ahead`` units later.

The window planner (``schedule.window``) plans what lies outside the layers (the embedding, the head,
the loss) on the same units, around the bytes the layers hold there; where a unit does not fit,
every run of its kind is cut alike (``layer_schedule``). The plan is put back on the steps
(``ranges.refined``): its segments are the units. Where copies run beside compute (a GPU's copy
engines), every copy is then given as long as memory allows (``LayerPolicy.widened``).

``plan_layers`` tries the ways of keeping parameters and state from the fewest copies up, each with
the cheapest activations that fit and as many layers relaxed as pay, timed by the simulation
(``cost.simulate_time``, each unit's boundary charged as ``ranges.BOUNDARY_BYTES``), and takes the
one moving the fewest bytes unless another is faster by more than ``MOVE_MARGIN``: the model's times
err by more (``LayerPlan.alternatives`` keeps what else was timed, and why it lost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, groupby, pairwise
from typing import NamedTuple

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.blocks import block_targets
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.moves import Offload, Prefetch, Schedule, move_order
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.schedule.program import Program
from oocjax.schedule.ranges import BOUNDARY_BYTES, Range, coarse_program, refined
from oocjax.schedule.rewrite import Rewrite, identity_rewrite, recompute_program, runs_after
from oocjax.schedule.segments import Segment, cut_segments
from oocjax.schedule.simulate import replay
from oocjax.schedule.units import MiB, format_bytes
from oocjax.schedule.window import plan_window


class _How(NamedTuple):
    """An activation policy: what its relaxed layers take (the next cheaper in time), whether it
    moves what its layers' backward reads, what it recomputes their insides from ("input", or
    "halves": also their narrowest point in the middle, ``blocks.narrowest``; "" for nothing), and
    what a plan says of it."""

    relaxed: str
    offloads: bool
    recomputed_from: str
    said: str


ACTIVATIONS = {
    "kept": _How("kept", False, "", "what its backward reads kept from its forward"),
    "recomputed": _How("kept", False, "input", "recomputed from its input (per-block remat)"),
    "recomputed by halves": _How("kept", False, "halves", "recomputed from its input and its midpoint"),
    "input offloaded": _How("recomputed", True, "input", "recomputed from its input, the input offloaded"),
    "halves offloaded": _How("recomputed by halves", True, "halves", "recomputed by halves, both offloaded"),
    "offloaded": _How("kept", True, "", "what its backward reads offloaded after its forward"),
}
# A run of a layer is cut into at most this many units: more segments a layer cost more than they
# save (each a launch, and alike layers' pieces only alike where their cuts are), and where a layer
# needs more, the step is planned one operation at a time (``schedule.hybrid``).
MOST_PIECES = 4
# A plan that moves more bytes replaces one that moves fewer only when it is faster by more than
# this share: the model's step times err by more (the committed H200 run measured a step 2.7-fold
# under its simulation), and a plan that moves less depends less on the link's rate.
MOVE_MARGIN = 0.15


def steadiest(candidates: Sequence, order: Callable, cost_s: Callable):
    """The first of ``candidates`` by ``order`` (fewest bytes moved first), unless another is
    faster by more than ``MOVE_MARGIN``: then the fastest of those."""
    chosen = min(candidates, key=order)
    return min((c for c in candidates if cost_s(c) * (1 + MOVE_MARGIN) < cost_s(chosen)), key=cost_s, default=chosen)


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer: its kind and its runs of steps, ``(start, stop)`` per phase that has one
    (forward, backward, update), in order."""

    kind: str
    runs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPolicy:
    """How every layer is planned (the module docstring says each choice)."""

    activations: str = "kept"
    relaxed: int = 0
    parameters: str = "kept"
    state: str = "kept"
    ahead: int = 1
    widened: bool = False  # every copy then given as long as memory allows (``_widened``)

    def activation(self, i: int, count: int) -> str:
        """What layer ``i`` of ``count`` (in forward order) does with its activations."""
        return ACTIVATIONS[self.activations].relaxed if i >= count - self.relaxed else self.activations

    def holding_less(self, count: int) -> list[LayerPolicy]:
        """Policies that hold less on the device with the same layers recomputed (the same
        rewrite), fewest copies more first: fewer layers relaxed where relaxed layers only move
        less, or every layer's input offloaded but the top ones'."""
        if ACTIVATIONS[self.activations].offloads:
            return [dataclasses.replace(self, relaxed=r) for r in range(self.relaxed - 1, -1, -1)]
        offloaded = next(
            (a for a, how in ACTIVATIONS.items() if how.offloads and how.relaxed == self.activations), None
        )
        if self.relaxed or offloaded is None:
            return []
        return [dataclasses.replace(self, activations=offloaded, relaxed=r) for r in range(count - 1, -1, -1)]

    def describe(self, kinds: Sequence[str]) -> list[str]:
        """One line per kind of layer and what its activations do (``kinds``: per layer, in forward
        order): ``layers 0-19 (Block): recomputed from its input, the input offloaded; parameters
        fetched for each pass; optimizer state streamed; copies 1 unit ahead``."""
        rest = f"parameters {'fetched for each pass' if self.parameters == 'fetched' else 'kept on the device'}; "
        rest += (
            f"optimizer state {'streamed (fetched once, sent back at once)' if self.state == 'streamed' else 'kept'}"
        )
        if self.parameters == "fetched" or self.state == "streamed" or ACTIVATIONS[self.activations].offloads:
            rest += f"; copies {self.ahead} unit{'s' * (self.ahead > 1)} ahead" if self.ahead else "; copies where read"
            rest += ", earlier where memory allows" * self.widened
        groups: dict[tuple[str, str], list[int]] = {}
        for i, kind in enumerate(kinds):
            groups.setdefault((kind, self.activation(i, len(kinds))), []).append(i)
        return [
            f"{_numbered(numbers)} ({kind}): {ACTIVATIONS[how].said}; {rest}" for (kind, how), numbers in groups.items()
        ]


def _numbered(numbers: Sequence[int]) -> str:
    """``layers 0-4, 6-10`` for those numbers (ascending)."""
    spans = [[i for _, i in run] for _, run in groupby(enumerate(numbers), key=lambda t: t[1] - t[0])]
    said = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in spans)
    return f"layer {said}" if len(numbers) == 1 else f"layers {said}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPlan:
    """The plan ``plan_layers`` chose: its policy, the rewrite it runs (the identity where nothing is
    recomputed), its schedule on ``rewrite.program``, its simulated step time and that with its
    units' boundaries (``cost_s``), and per other policy timed its cost and bytes moved
    (``alternatives``)."""

    policy: LayerPolicy
    rewrite: Rewrite
    schedule: Schedule
    step_time_s: float
    layers: tuple[Layer, ...]
    cost_s: float = 0.0
    alternatives: tuple[tuple[LayerPolicy, float, int], ...] = ()

    def describe(self) -> list[str]:
        """The policy, one line per kind of layer (``LayerPolicy.describe``)."""
        return self.policy.describe([layer.kind for layer in self.layers])

    def why(self) -> list[str]:
        """One line per other policy timed: what it does, its step time and bytes moved, and why it
        was not taken."""
        moved, lines = self.schedule.moved_bytes(self.rewrite.program), []
        for policy, cost_s, their_bytes in self.alternatives:
            reason = "slower" if cost_s >= self.cost_s else f"faster by less than {MOVE_MARGIN:.0%}, moving more"
            lines.append(
                f"{policy.activations} ({policy.relaxed} layers relaxed), parameters {policy.parameters}, state "
                f"{policy.state}: {cost_s * 1e3:.4g} ms against {self.cost_s * 1e3:.4g} ms with the segments' "
                f"boundaries, {format_bytes(their_bytes)} moved against {format_bytes(moved)}: {reason}"
            )
        return lines


def layers_of(program: Program, runs: Sequence[tuple[int, int, str]]) -> tuple[Layer, ...]:
    """The layers of ``runs`` (``transforms.layers``): each forward run with a backward run and an
    update run, where there are any. Where the backward pass has a run of every forward run's kind,
    in the reverse order, they pair in that order; else by what they read: a backward run with the
    latest forward run that read or made what it reads (its parameters, what it saved). An update
    run pairs with the latest backward run that made what it reads (its gradients). Runs left
    unpaired are no layer's."""
    reads = [{b for step in program.steps[a:y] for b in step.reads} for a, y, _ in runs]
    touched = [
        {b for b in reads[j] if program.buffers[b].kind == "input"} | {w for s in program.steps[a:y] for w in s.writes}
        for j, (a, y, _) in enumerate(runs)
    ]
    forward = [j for j, (_, _, kind) in enumerate(runs) if not kind.startswith(("transpose ", "update "))]
    paired: dict[int, list[int]] = {j: [j] for j in forward}
    for phase, prefix in enumerate(("transpose ", "update "), 1):
        later = [j for j, run in enumerate(runs) if run[2].startswith(prefix)]
        if phase == 1 and [prefix + runs[f][2] for f in reversed(forward)] == [runs[j][2] for j in later]:
            for f, j in zip(reversed(forward), later):
                paired[f].append(j)
            continue
        for j in later:
            free = [f for f in forward if len(paired[f]) == phase and touched[paired[f][-1]] & reads[j]]
            if free:
                paired[free[-1]].append(j)
    return tuple(Layer(runs[f][2], tuple(runs[j][:2] for j in paired[f])) for f in forward if len(paired[f]) > 1)


def layer_rewrite(program: Program, layers: Sequence[Layer], policy: LayerPolicy, recomputable: Callable) -> Rewrite:
    """The program with the insides of the layers ``policy`` recomputes recomputed for their
    backward pass (``blocks.block_targets``: per-block remat)."""
    how = _key(policy, len(layers))
    if not any(how):
        return identity_rewrite(program)
    backward_start = min(layer.runs[1][0] for layer in layers)
    targets = []
    for midpoint in (False, True):
        blocks = [layer.runs[0] for layer, h in zip(layers, how) if h == ("halves" if midpoint else "input")]
        targets += block_targets(program, blocks, backward_start, midpoint=midpoint)
    targets = dict.fromkeys(sorted(targets), backward_start)
    return recompute_program(program, targets, recomputable=recomputable, across=targets)


def layers_after(rewrite: Rewrite, layers: Sequence[Layer]) -> tuple[Layer, ...]:
    """``layers`` as they lie in the rewritten program (``rewrite.runs_after``)."""
    runs = runs_after(rewrite, [(a, y, "") for layer in layers for a, y in layer.runs])
    found, i = [], 0
    for layer in layers:
        found.append(Layer(layer.kind, tuple((a, y) for a, y, _ in runs[i : i + len(layer.runs)])))
        i += len(layer.runs)
    return tuple(found)


def layer_schedule(
    program: Program,
    layers: Sequence[Layer],
    policy: LayerPolicy,
    budget_bytes: int,
    *,
    window_bytes: int | None = None,
    min_offload_bytes: int = MiB,
) -> Schedule:
    """The plan of ``program`` (already rewritten for ``policy``) by its ``layers``: the layers'
    copies as ``policy`` says, the rest planned by the window planner around them; its segments
    start where the units do. Each run of a layer is one unit at first; where a unit does not fit
    with what the layers hold there, every run of its kind and phase is cut where that unit holds
    the fewest bytes in its middle half (``_narrowest``), alike layers alike, and the step planned
    again, into ``MOST_PIECES`` at most. Raises ``BudgetInfeasibleError`` where a unit does not fit
    that is outside the layers or cannot be cut further, or what is held across it alone is over
    the budget."""
    window = dict(window_bytes=window_bytes, min_offload_bytes=min_offload_bytes)
    run_of: list[tuple | None] = [None] * len(program.steps)  # per step: its run's kind, phase and start
    for layer in layers:
        for phase, (a, y) in enumerate(layer.runs):
            run_of[a:y] = [(layer.kind, phase, a)] * (y - a)
    edges = {k for k in range(len(program.steps) + 1) if k in (0, len(program.steps)) or None in run_of[k - 1 : k + 1]}
    bounds = edges | {a for layer in layers for run in layer.runs for a in run}
    cuts: dict[tuple[str, int], set[int]] = {}  # per kind and phase of run, where in its runs they are cut

    def cut(unit: Range) -> bool:  # every run alike cut where this unit of it holds the fewest bytes
        kind, phase, start = run_of[unit.start] or (None, None, None)
        if kind is None or len(cuts.get((kind, phase), ())) + 1 >= MOST_PIECES or unit.stop - unit.start == 1:
            return False
        cuts.setdefault((kind, phase), set()).add(_narrowest(program, unit.start, unit.stop) - start)
        return True

    while True:
        runs = (run for layer in layers for run in layer.runs)
        pieces = {a + d for a, y in runs for d in cuts.get(run_of[a][:2], ()) if d < y - a}
        ranges = _whole_units(program, frozenset(bounds | pieces))
        units = _UnitPlan.of(program, ranges, layers, policy, min_offload_bytes)
        try:
            others = plan_window(units.rest, budget_bytes, **window, in_ranges=False, residents=False)
        except BudgetInfeasibleError as error:
            unit, step = ranges[error.step], units.coarse.steps[error.step]
            need = step.transient_bytes + sum(units.coarse.buffers[b].nbytes for b in (*step.reads, *step.writes))
            if error.required_bytes - need >= budget_bytes or not cut(unit):  # what is held across it alone
                raise
            continue
        schedule = units.joined(program, others, ranges, "layers in pieces" if cuts else "layers")
        # A unit that fits as one step of the units may still not as a segment: then cut alike too.
        starts = {r.start for r in ranges}
        segments = cut_segments(program, schedule, budget_bytes=budget_bytes)
        split = next((s for s in segments if s.start not in starts), None)
        if split is None or not cut(next(r for r in ranges if r.start < split.start < r.stop)):
            return _widened(program, schedule, budget_bytes, layers, segments) if policy.widened else schedule


def _widened(
    program: Program, schedule: Schedule, budget_bytes: int, layers: Sequence[Layer], segments: Sequence[Segment]
) -> Schedule:
    """``schedule`` with each copy given as long as memory allows, offloads first, every one of the layers'
    ``segments`` (its ``cut_segments``) within the budget; not across steps outside them: copies keep those apart."""
    peak = [budget_bytes] * len(program.steps)  # per step, its segment's estimate; outside the layers, full
    for s in segments:
        if any(a <= s.start and s.stop <= y for layer in layers for a, y in layer.runs):
            peak[s.start : s.stop] = [s.estimate_bytes] * (s.stop - s.start)
    cuts, moves, done = sorted(schedule.copy_steps | schedule.segment_starts), list(schedule.moves), {}
    fetches = schedule.prefetches_by_buffer

    def widest(at: int, outward: Sequence[int], nbytes: int) -> int:  # the cuts outward, nearest first
        for k in outward:
            span = range(min(at, k), max(at, k))
            if max(peak[j] for j in span) + nbytes > budget_bytes:
                break
            peak[span.start : span.stop] = [peak[j] + nbytes for j in span]
            at = k
        return at

    for i, m in sorted(enumerate(moves), key=lambda t: isinstance(t[1], Prefetch)):
        nbytes, reads = program.buffers[m.buffer].nbytes, program.uses.read_at[m.buffer]
        if isinstance(m, Prefetch):
            first = max([r + 1 for r in reads if r < m.use_step] + [done.get(m.buffer, 0)])
            issue = widest(m.issue_step, [k for k in reversed(cuts) if first <= k < m.issue_step], nbytes)
            moves[i] = dataclasses.replace(m, issue_step=issue)
        elif m.done_before_step is not None:
            back = [p.issue_step for p in fetches.get(m.buffer, ()) if p.issue_step > m.after_step]
            later = [k for k in cuts if m.done_before_step < k <= min(back, default=len(peak) - 1)]
            done[m.buffer] = widest(m.done_before_step, later, nbytes)
            moves[i] = dataclasses.replace(m, done_before_step=done[m.buffer])
    return dataclasses.replace(schedule, moves=tuple(sorted(moves, key=move_order)))


def _narrowest(program: Program, start: int, stop: int) -> int:
    """The step in the middle half of steps ``start .. stop - 1`` (after the first) where the fewest
    bytes are in use with nothing moved, the nearest the middle on a tie: where to cut them."""
    live, middle = program.in_core_bytes, (start + stop) / 2
    lo, hi = max(start + 1, start + (stop - start) // 4), max(start + 1, start + 3 * (stop - start) // 4)
    return min(range(lo, hi + 1), key=lambda k: (live[k], abs(k - middle)))


def _whole_units(program: Program, bounds: frozenset[int]) -> list[Range]:
    """The ranges between consecutive ``bounds``, each with its inner peak (``ranges.Range``): the
    scratch of its steps and the values it makes and frees inside, at their most."""
    starts = sorted(bounds)
    unit = [0] * len(program.steps)
    for i, (a, y) in enumerate(pairwise(starts)):
        unit[a:y] = [i] * (y - a)
    inside = [0] * (len(program.steps) + 1)
    uses = program.uses
    for b, buffer in enumerate(program.buffers):
        if buffer.kind == "computed" and not buffer.is_output:
            made = uses.defined_at[b]
            freed = uses.read_at[b][-1] if uses.read_at[b] else made
            if unit[made] == unit[freed]:
                inside[made] += buffer.nbytes
                inside[freed + 1] -= buffer.nbytes
    live = list(accumulate(inside))
    return [
        Range(a, y, max(live[k] + program.steps[k].transient_bytes for k in range(a, y))) for a, y in pairwise(starts)
    ]


@dataclass(frozen=True, slots=True)
class _UnitPlan:
    """The layers' copies on the program of units (``ranges.coarse_program``, its buffers' ids in
    the program), the buffers they move or keep (the layers' own), and the program the window
    planner plans the rest on: the layers' own of no size, what they hold added to each unit's scratch."""

    coarse: Program
    ids: tuple[int, ...]
    moves: Schedule
    owned: frozenset[int]
    rest: Program

    @classmethod
    def of(cls, program: Program, ranges, layers: Sequence[Layer], policy: LayerPolicy, min_offload_bytes: int):
        coarse, ids = coarse_program(program, ranges)
        starts = {r.start: u for u, r in enumerate(ranges)}
        where = {}  # unit -> (layer, phase)
        for i, layer in enumerate(layers):
            for phase, (a, y) in enumerate(layer.runs):
                where.update((u, (i, phase)) for u in range(starts[a], starts.get(y, len(ranges))))
        moves, owned = _layer_moves(coarse, where, policy, len(layers), min_offload_bytes)
        held = [0] * (len(ranges) + 1)  # what the layers' values hold on the device per unit
        for b in owned:
            for stay in moves.device_stays(coarse, b):
                held[max(stay.start, 0)] += coarse.buffers[b].nbytes
                held[min(stay.end, len(ranges) - 1) + 1] -= coarse.buffers[b].nbytes
        # New state written in the unit that last reads the old, given up to it: in the old one's place.
        uses = coarse.uses
        for old, new in coarse.replaced_by.items():
            made = uses.defined_at[new]
            if new in owned and old in owned and uses.read_at[old] and uses.read_at[old][-1] == made:
                held[made] -= coarse.buffers[new].nbytes
                held[made + 1] += coarse.buffers[new].nbytes
        rest = Program(
            steps=tuple(
                dataclasses.replace(s, transient_bytes=s.transient_bytes + h) if h else s
                for s, h in zip(coarse.steps, accumulate(held))
            ),
            buffers=tuple(dataclasses.replace(x, nbytes=0) if b in owned else x for b, x in enumerate(coarse.buffers)),
        )
        return cls(coarse, ids, moves, frozenset(owned), rest)

    def joined(self, program: Program, others: Schedule, ranges, strategy: str) -> Schedule:
        """The layers' copies and the rest's (``others``, on ``rest``), put back on the program's steps."""
        theirs = lambda bs: frozenset(b for b in bs if b not in self.owned)  # noqa: E731
        moves = [*self.moves.moves, *(m for m in others.moves if m.buffer not in self.owned)]
        both = Schedule(
            strategy=strategy,
            budget_bytes=others.budget_bytes,
            host_inputs=self.moves.host_inputs | theirs(others.host_inputs),
            host_outputs=self.moves.host_outputs | theirs(others.host_outputs),
            moves=tuple(sorted(moves, key=move_order)),
        )
        return dataclasses.replace(refined(program, both, ranges, self.ids), strategy=strategy)


def _layer_moves(
    coarse: Program, where: dict[int, tuple[int, int]], policy: LayerPolicy, count: int, min_offload_bytes: int
) -> tuple[Schedule, set[int]]:
    """The copies of the layers' own values on the program of units (``where``: per unit of a layer,
    the layer and its phase), and those values: each read by one layer's units alone (its
    parameters, its state, what it saves and makes inside), and the new state that replaces them."""
    uses, ahead, units = coarse.uses, policy.ahead, len(coarse.steps)
    owned: dict[int, int] = {}
    for b, buffer in enumerate(coarse.buffers):
        layer = {where.get(u, (None,))[0] for u in uses.read_at[b]}
        if len(layer) == 1 and None not in layer and not (buffer.is_output and buffer.aliased_input is None):
            owned[b] = layer.pop()
    owned |= {b: owned[x.aliased_input] for b, x in enumerate(coarse.buffers) if x.aliased_input in owned}
    moves, host_inputs, host_outputs = [], set(), set()
    for b, i in owned.items():
        buffer, reads = coarse.buffers[b], uses.read_at[b]
        if buffer.never_moves(min_offload_bytes) or not reads:
            continue
        if buffer.kind == "input":
            forward = where[reads[0]][1] == 0
            if (policy.parameters if forward else policy.state) in ("fetched", "streamed"):
                host_inputs.add(b)
                last = -1
                for visit in _visits(reads, where):
                    moves.append(Prefetch(buffer=b, issue_step=max(visit[0] - ahead, last + 1, 0), use_step=visit[0]))
                    last = visit[-1]
        elif ACTIVATIONS[policy.activation(i, count)].offloads:
            touches = (uses.defined_at[b], *reads)
            gaps = [(t, u) for t, u in pairwise(touches) if where[u][1] > where.get(t, (i, 0))[1] and u - t > 1]
            if gaps:
                out, back = gaps[-1]
                issue = max(back - ahead, out + 1)
                moves.append(Offload(buffer=b, after_step=out, done_before_step=min(out + 1 + ahead, issue)))
                moves.append(Prefetch(buffer=b, issue_step=issue, use_step=back))
    for b, x in enumerate(coarse.buffers):
        if x.aliased_input in host_inputs:
            host_outputs.add(b)
            last = max((uses.defined_at[b], *uses.read_at[b]))
            done = last + 1 + ahead
            moves.append(Offload(buffer=b, after_step=last, done_before_step=done if done < units else None))
    schedule = Schedule(
        strategy="layers",
        budget_bytes=None,
        host_inputs=frozenset(host_inputs),
        host_outputs=frozenset(host_outputs),
        moves=tuple(sorted(moves, key=move_order)),
    )
    return schedule, set(owned)


def _visits(reads: Sequence[int], where: dict[int, tuple[int, int]]) -> list[list[int]]:
    """``reads`` (units) grouped by the phase of the layer that reads them: one fetch each."""
    return [list(visit) for _, visit in groupby(reads, key=lambda u: where[u][1])]


def plan_layers(
    program: Program,
    runs: Sequence[tuple[int, int, str]],
    budget_bytes: int,
    *,
    recomputable: Callable[[int], bool],
    profile: DeviceProfile | str,
    recompute: str = "auto",
    window_bytes: int | None = None,
    min_offload_bytes: int = MiB,
) -> LayerPlan | None:
    """The plan of ``program`` by its layers (``runs``: ``transforms.layers``), the policy chosen as
    the module docstring says; None where no policy fits the budget (or the runs pair into no layer).
    ``recompute``: ``"auto"``; ``"off"``: no layer recomputed; ``"always"``: every layer recomputed
    or its activations kept."""
    layers = layers_of(program, runs)
    if not layers:
        return None
    recomputing = ("recomputed", "recomputed by halves", "input offloaded", "halves offloaded")
    activations = {"off": ("offloaded",), "always": recomputing}.get(recompute, (*recomputing, "offloaded"))
    trials = _Trials(
        program, layers, budget_bytes, recomputable, resolve_profile(profile), window_bytes, min_offload_bytes
    )
    # Each way of holding the parameters and the state with the cheapest activations that fit; the
    # next way (which moves more) only where the last relaxed no layer or not all, and what it frees
    # could relax one more: a layer's activations, or nothing fit at all.
    found: list[_Timed] = []
    frees, widened = _bytes_freed(program, layers), trials.profile.copies_overlap_compute
    for parameters, state in (("kept", "kept"), ("kept", "streamed"), ("fetched", "streamed")):
        kept = found and all(found[-1].policy.activation(i, len(layers)) == "kept" for i in range(len(layers)))
        if found and (kept or frees[parameters, state] < frees["activations"]):
            break
        best = None  # the cheapest activations that fit, up to the first that fits each run whole, its copies hidden
        for activation in activations:
            policies = (
                LayerPolicy(activations=activation, parameters=parameters, state=state, ahead=a, widened=widened)
                for a in (1, 0)
            )
            plan = next(filter(None, (_most_relaxed(p, len(layers), trials.planned) for p in policies)), None)
            best = min(filter(None, [best, plan]), key=lambda c: c.cost_s, default=None)
            if plan is not None and plan.schedule.strategy == "layers" and plan.exposed_s <= 1e-9 * plan.time_s:
                break
        found += [best] if best is not None else []
    if not found:
        return None
    chosen = steadiest(found, lambda c: (c.moved_bytes, c.cost_s), lambda c: c.cost_s)
    others = tuple((c.policy, c.cost_s, c.moved_bytes) for c in found if c is not chosen)
    plan = dict(policy=chosen.policy, rewrite=chosen.rewrite, schedule=chosen.schedule, step_time_s=chosen.time_s)
    return LayerPlan(**plan, layers=trials.rewritten(chosen.policy)[1], cost_s=chosen.cost_s, alternatives=others)


@dataclass
class _Trials:
    """Policies planned and timed for one step (``planned``), the rewrites they need made once each."""

    program: Program
    layers: Sequence[Layer]
    budget_bytes: int
    recomputable: Callable[[int], bool]
    profile: DeviceProfile
    window_bytes: int | None
    min_offload_bytes: int
    rewrites: dict = dataclasses.field(default_factory=dict)

    def rewritten(self, policy: LayerPolicy) -> tuple[Rewrite, tuple[Layer, ...]]:
        """The rewrite ``policy`` needs, and the layers as they lie in it."""
        key = _key(policy, len(self.layers))
        if key not in self.rewrites:
            rewrite = layer_rewrite(self.program, self.layers, policy, self.recomputable)
            self.rewrites[key] = rewrite, layers_after(rewrite, self.layers)
        return self.rewrites[key]

    def planned(self, policy: LayerPolicy) -> _Timed | None:
        """``policy``'s plan and its times, or None where it does not fit."""
        rewrite, layers = self.rewritten(policy)
        runs = [run for layer in layers for run in layer.runs]
        window = dict(window_bytes=self.window_bytes, min_offload_bytes=self.min_offload_bytes)
        try:
            schedule = layer_schedule(rewrite.program, layers, policy, self.budget_bytes, **window)
        except (BudgetInfeasibleError, ValueError):  # a unit over the budget or the window
            return None
        if replay(rewrite.program, schedule)[1]:
            return None
        timed = simulate_time(rewrite.program, schedule, self.profile)
        # Where the layers' runs are cut: outside them, small segments are merged (``segments``).
        cuts = [k for k in schedule.copy_steps | schedule.segment_starts if any(a < k < y for a, y in runs)]
        boundaries_s = len(cuts) * BOUNDARY_BYTES / self.profile.h2d_bytes_per_s
        moved = schedule.moved_bytes(rewrite.program)
        return _Timed(policy, rewrite, schedule, timed.step_time_s, moved, boundaries_s, timed.exposed_transfer_s)


class _Timed(NamedTuple):
    """A policy's plan: the rewrite it runs, its schedule, its simulated step time, the bytes it moves."""

    policy: LayerPolicy
    rewrite: Rewrite
    schedule: Schedule
    time_s: float
    moved_bytes: int
    boundaries_s: float  # what cutting its layers' runs costs the executor (``ranges.BOUNDARY_BYTES`` each)
    exposed_s: float  # what of its step time the copies add, by the simulation

    @property
    def cost_s(self) -> float:
        return self.time_s + self.boundaries_s


def _bytes_freed(program: Program, layers: Sequence[Layer]) -> dict:
    """What the device holds less of per layer where its optimizer state streams (``("kept",
    "streamed")``), and where its parameters are fetched too (``("fetched", "streamed")``); and
    what one layer's backward reads of its forward (``"activations"``: what relaxing a layer holds)."""
    uses, buffers, ((fa, fy), (ba, by)) = program.uses, program.buffers, layers[0].runs[:2]
    read = {b for a, y in layers[0].runs for step in program.steps[a:y] for b in step.reads}
    inputs = [b for b in read if buffers[b].kind == "input"]
    state = sum(buffers[b].nbytes for b in inputs if not fa <= uses.read_at[b][0] < fy)
    parameters = sum(buffers[b].nbytes for b in inputs) - state
    made = (b for b in read if buffers[b].kind == "computed" and fa <= uses.defined_at[b] < fy)
    saved = sum(buffers[b].nbytes for b in made if any(ba <= r < by for r in uses.read_at[b]))
    return {("kept", "streamed"): state, ("fetched", "streamed"): state + parameters, "activations": saved}


def _key(policy: LayerPolicy, count: int) -> tuple[str, ...]:
    """Per layer, what ``policy`` recomputes its insides from (``ACTIVATIONS``), or "" for nothing."""
    return tuple(ACTIVATIONS[policy.activation(i, count)].recomputed_from for i in range(count))


def _most_relaxed(policy: LayerPolicy, count: int, planned: Callable) -> tuple | None:
    """``policy`` with as many layers relaxed as fit (a binary search: relaxing a layer only adds to
    what the device holds), or the cheapest of those tried with fewer where holding more made the
    rest move more, and its plan; None where not even none relaxed fits."""
    first = planned(policy)
    if first is None:
        return None
    lo, hi, tried = 0, count, [first]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = planned(dataclasses.replace(policy, relaxed=mid))
        lo, hi = (mid, hi) if plan is not None else (lo, mid - 1)
        tried += [plan] if plan is not None else []
    return min(tried, key=lambda c: (c.cost_s, -c.policy.relaxed))


def replan_layers(
    program: Program,
    plan: LayerPlan,
    budget_bytes: int,
    *,
    window_bytes: int | None = None,
    min_offload_bytes: int = MiB,
) -> LayerPlan:
    """``plan`` made again for ``program`` (its program with the scratch its compiled segments
    measured beyond the estimate): with its policy, or where that no longer fits each run whole, the
    first that does of those holding less with the same layers recomputed (``holding_less``), else
    the first that fits at all. Raises ``BudgetInfeasibleError`` where none fits."""
    window, fitting, refused = dict(window_bytes=window_bytes, min_offload_bytes=min_offload_bytes), [], []
    for policy in (plan.policy, *plan.policy.holding_less(len(plan.layers))):
        try:
            fitting.append((policy, layer_schedule(program, plan.layers, policy, budget_bytes, **window)))
        except BudgetInfeasibleError as error:
            refused.append(error)
            continue
        if fitting[-1][1].strategy == "layers":
            break
    if not fitting:
        raise refused[0]
    policy, schedule = next((f for f in fitting if f[1].strategy == "layers"), fitting[0])
    return dataclasses.replace(plan, policy=policy, schedule=schedule)
