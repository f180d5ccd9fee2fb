"""Swap or recompute: choosing the values to drop after their early reads and compute again for their late ones.

Swapping alone cannot be fast when a program holds far more than the budget at one instant (the
turn from forward to backward): every byte over the budget there leaves the device before that
step and comes back after it, so the two link directions cannot overlap (``bounds.pressure_bound``).
Recomputation removes those bytes instead, at the price of running some equations twice. This is
the choice PoocH (Ito et al. 2019, arXiv 1907.05013) makes per layer and Capuchin (Peng et al.,
ASPLOS'20) makes per tensor, ranking candidates by bytes saved per second of recomputation.

Each choice is made real by the recompute rewrite (``rewrite.recompute_program``, whose docstring
has its rules); this module chooses.

**The selector** (``choose_recompute``): the pressure phase of a swap-or-recompute choice,
greedy as in Capuchin. At the in-core peak step of the program rewritten so far, the candidates are
the original computed values live across it (not read there), not yet chosen, whose producer may be
recomputed. They are grouped into classes of identical layers (same operation, source label, FLOPs
and operand sizes, the same result of it), so repeated layers get one decision and keep sharing
compiled programs. A candidate whose producer reads values dead at the peak comes with its *chain*
(``_chain``): those inputs that may be recomputed join the targets too (dropped after their last
read, so they stay as they were early and are recomputed only by the candidate's copy), walked
back up to 8 values; without them the copy would hold them again across the peak (the attention
probabilities of a GPT: exp reads the 512 MiB shifted scores, dead at the turn, and is only worth
recomputing with them). A candidate's estimated saving is its size less the inputs that the
chain brings back to life across the peak (those that cannot join it); the class with the most
bytes saved per recompute-second (``DeviceProfile.compute_seconds`` of the chains' producers)
joins the targets, split across the peak, and
the *original* program is rewritten with all targets (so the closure rule sees every choice). The
pick is kept if it lowers the in-core peak, or keeps it and lowers the bytes over the budget summed
over the steps, and if it does not raise the smallest feasible budget (``required_bytes``) above
the budget when the original's was within it; a class that fails is not tried again. Each pick is
one rewrite and a few linear passes. The next best classes at the same peak join a pick while their
estimated savings together stay within the bytes over the budget there (each would be picked next
anyway); such a pick is kept only if the peak falls by 3/4 of its estimate, else its best class is
tried alone, and one class at a time from then on. Where the classes a pick would take are
estimated to save under a quarter of the excess, the best class that alone covers it goes first
(``_leap``). (Where the step's layers are known, it is planned by layer instead, ``schedule.layer_plan``:
every layer recomputed alike, or kept alike.)
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from oocjax.schedule.feasibility import required_bytes
from oocjax.schedule.gc_paused import gc_paused
from oocjax.schedule.profiles import DEFAULT_PROFILE, DeviceProfile, resolve_profile
from oocjax.schedule.program import Program, Step
from oocjax.schedule.rewrite import Recomputable, Rewrite, Skipped, identity_rewrite, recompute_program
from oocjax.schedule.units import MiB


def choose_recompute(
    program: Program,
    budget_bytes: int,
    *,
    recomputable: Recomputable,
    profile: DeviceProfile | str | None = None,
    min_offload_bytes: int = MiB,
    max_picks: int = 1000,
    forced: Iterable[int] | Mapping[int, int] = (),
    batched: bool = True,
    rewrite: Callable[..., Rewrite] = recompute_program,
) -> Rewrite:
    """Chooses values to recompute so that the program holds less at its in-core peak.

    Greedy, per class of identical layers, by estimated bytes saved per recompute-second at the
    in-core peak (the module docstring has the rule), until the rewritten program fits the budget
    in core (then nothing has to move) or no class helps. A pick never raises the smallest feasible
    budget (``required_bytes``) above the budget when the original's was within it.

    Args:
      program: the step program.
      budget_bytes: the device budget.
      recomputable: whether a step of ``program`` may be copied (effect-free equations only).
      profile: device rates for the recompute time (a ``DeviceProfile`` or a name);
        default ``DEFAULT_PROFILE``.
      min_offload_bytes: the planner's threshold, for the ``required_bytes`` check.
      max_picks: a bound on the classes tried.
      forced: buffers to recompute whatever the costs say (split at their longest gap, or where a
        mapping says: buffer -> a step to split across), before
        the selector adds its own.
      batched: try the classes the bytes over the budget need anyway in one rewrite (False: one
        class a pick, from the first).
      rewrite: the rewrite each trial is made with (``recompute_program``; a test counts them).

    Returns:
      The rewrite of ``program`` (the identity if it already fits, or nothing helps); ``skipped``
      lists the candidates of classes that were tried and not kept.

    >>> from oocjax.schedule.synthetic import layered_training_step
    >>> p = layered_training_step(3)
    >>> r = choose_recompute(p, 160 * MiB, recomputable=lambda step: p.steps[step].name != "adam")
    >>> r.peak_bytes_before // MiB, r.peak_bytes <= 160 * MiB
    (220, True)
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    profile = resolve_profile(DEFAULT_PROFILE if profile is None else profile)
    rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=min_offload_bytes)
    tries = dict(max_picks=max_picks, forced=forced, batched=batched, rewrite=rewrite)
    with gc_paused():
        return _greedy(program, budget_bytes, **tries, **rules)


def _greedy(
    program: Program,
    budget_bytes: int,
    *,
    recomputable: Recomputable,
    profile: DeviceProfile,
    min_offload_bytes: int,
    max_picks: int,
    forced: Iterable[int] | Mapping[int, int],
    batched: bool,
    rewrite: Callable[..., Rewrite],
) -> Rewrite:
    """``choose_recompute``'s loop: a class of candidates or more a pick, until the step fits in core."""
    floor_fits = max(required_bytes(program, min_offload_bytes), default=0) <= budget_bytes
    targets: dict[int, int | None] = dict(forced) if isinstance(forced, Mapping) else dict.fromkeys(forced)
    chosen = (
        rewrite(program, targets, recomputable=recomputable, across=targets) if targets else identity_rewrite(program)
    )
    rejected, skipped = set(), []
    device = chosen.program.in_core_bytes  # recomputed only when a pick is kept
    tried, batching = 0, batched

    def attempt(batch: list[_Class]) -> tuple[str | None, tuple[int, ...], Rewrite, dict, list[int]]:
        members = list(dict.fromkeys(b for pick in batch for b in pick.members))
        widened = {**targets, **{b: pick.across for pick in batch for b in pick.members}}
        trial = rewrite(program, widened, recomputable=recomputable, across=widened)
        why_not, after = _why_not_kept(trial, members, device, budget_bytes, floor_fits, min_offload_bytes)
        return why_not, after, trial, widened, members

    while tried < max_picks and max(device, default=0) > budget_bytes:
        ranked, p = [], 0
        for p in _pressure_points(device, budget_bytes):
            if ranked := _ranked_classes(program, chosen, targets, p, recomputable, profile, rejected):
                break
        if not ranked:
            break
        # The classes that the bytes over the budget at p need anyway, by their estimates, are
        # tried together: one rewrite instead of one each (20 rewrites became 3 for a 24-layer
        # GPT). Where that is not kept, or saves much less than estimated (a class in it that
        # alone would raise the peak), the best class alone is tried, and from then on one
        # class at a time.
        batch = _needed(ranked, device[p] - budget_bytes) if batching else ranked[:1]
        batch = _leap(ranked, batch, device[p] - budget_bytes) or batch
        why_not, after, trial, widened, members = attempt(batch)
        if len(batch) > 1 and (why_not is not None or not _estimates_held(batch, device, after)):
            batch, batching = ranked[:1], False
            why_not, after, trial, widened, members = attempt(batch)
        tried += len(batch)
        if why_not is None:
            chosen, targets, device = trial, widened, after
        else:
            rejected.add(batch[0].key)
            skipped += [Skipped(buffer=b, reason=why_not) for b in members]
    kept = set(chosen.recomputed)  # a chain member of a rejected class may join a later one
    return replace(chosen, skipped=(*chosen.skipped, *(s for s in skipped if s.buffer not in kept)))


def _pressure_points(device: Sequence[int], budget: int, most: int = 8) -> list[int]:
    """Steps to relieve, most loaded first: the peak, then the most loaded steps over the budget
    elsewhere (the peak may sit where nothing can be recomputed, such as the optimizer's update,
    while the forward/backward turn is over the budget too). One step per stretch of the program."""
    apart = max(1, len(device) // (4 * most))
    points: list[int] = []
    for k in sorted(range(len(device)), key=lambda k: -device[k]):
        if device[k] <= budget or len(points) == most:
            break
        if all(abs(k - p) >= apart for p in points):
            points.append(k)
    return points


def _why_not_kept(
    trial: Rewrite, members: list[int], device: tuple[int, ...], budget: int, floor_fits: bool, min_offload_bytes: int
) -> tuple[str | None, tuple[int, ...]]:
    """Why a trial rewrite does not help (None: keep it), and its bytes in core per step."""
    if not set(members) & set(trial.recomputed):
        return "no value of its class could be recomputed across the peak", ()
    after = trial.program.in_core_bytes
    if _excess(after, budget) >= _excess(device, budget):
        return "recomputing its class across the peak did not lower the in-core bytes over the budget", after
    if floor_fits and max(required_bytes(trial.program, min_offload_bytes), default=0) > budget:
        return "recomputing its class would make some step alone need more than the budget", after
    return None, after


ClassKey = tuple  # (name, flops, transient, read sizes, write sizes, label, which write)


class _Class(NamedTuple):
    """A class of candidates: its members (buffers of the original program), the original step
    to split them across, and the bytes recomputing them is estimated to save there."""

    key: ClassKey
    members: list[int]
    across: int
    saved_bytes: int


def _ranked_classes(
    program: Program,
    chosen: Rewrite,
    targets: Mapping[int, int],
    p: int,
    recomputable: Recomputable,
    profile: DeviceProfile,
    rejected: set[ClassKey],
) -> list[_Class]:
    """The classes of candidates live across step ``p`` of the rewritten program, the most
    estimated bytes saved per recompute-second first: per class its key, its members (buffers of
    ``program``), the original step to split them across and its estimated saving."""
    q = _next_original(chosen, p)
    rewritten = chosen.program
    uses = rewritten.uses
    classes: dict[ClassKey, tuple[list[int], list[float]]] = {}
    for b, buffer in enumerate(program.buffers):  # originals only: a copy serves a late group already
        reads, defined = uses.read_at[b], uses.defined_at[b]
        if b in targets or buffer.kind != "computed" or buffer.is_output or not reads or not defined < p:
            continue
        if reads[-1] <= q or reads[bisect_left(reads, p)] <= q or not recomputable(chosen.origin_step[defined]):
            continue  # dead at p, or read from p to the next original step: not droppable there
        step = rewritten.steps[defined]
        key = _class_key(rewritten, step, b)
        if key in rejected:
            continue
        chain, revived, seconds = _chain(program, chosen, targets, defined, p, recomputable, profile)
        if buffer.nbytes <= revived:
            continue
        members, totals = classes.setdefault(key, ([], [0.0, 0.0]))
        members += [b, *chain]
        totals[0] += buffer.nbytes - revived
        totals[1] += seconds

    def rank(item: tuple[ClassKey, tuple[list[int], list[float]]]) -> tuple[float, int]:
        members, (saved, seconds) = item[1]
        return (saved / seconds if seconds > 0 else math.inf, -members[0])

    across = chosen.origin_step[q]
    ranked = sorted(classes.items(), key=rank, reverse=True)
    return [_Class(key, list(dict.fromkeys(members)), across, int(saved)) for key, (members, (saved, _)) in ranked]


def _excess(device: Sequence[int], budget: int) -> tuple[int, int]:
    """The in-core peak and the bytes over the budget summed over the steps: what a pick lowers."""
    return max(device, default=0), sum(max(0, live - budget) for live in device)


def _estimates_held(batch: list[_Class], device: Sequence[int], after: Sequence[int]) -> bool:
    """Whether the peak fell by at least 3/4 of what the classes were estimated to save."""
    estimated = sum(pick.saved_bytes for pick in batch)
    return 4 * (max(device) - max(after)) >= 3 * estimated


def _needed(ranked: list[_Class], over: int) -> list[_Class]:
    """The best classes whose estimated savings together do not exceed ``over`` (at least one):
    were they taken one at a time, each would still leave the step over the budget."""
    needed, saved = ranked[:1], ranked[0].saved_bytes
    for pick in ranked[1:]:
        if saved + pick.saved_bytes > over:
            break
        needed.append(pick)
        saved += pick.saved_bytes
    return needed


# Crawling one small class at a time took a 24-layer decoder 45 rewrites (6.5 s of its first call)
# and ended over the budget; the class that alone covered the excess fitted it in one.
LEAP = 4


def _leap(ranked: list[_Class], batch: list[_Class], over: int) -> list[_Class] | None:
    """The best-ranked class estimated to save ``over`` alone, where ``batch`` saves far less."""
    if LEAP * sum(pick.saved_bytes for pick in batch) >= over:
        return None
    return next(([pick] for pick in ranked if pick.saved_bytes >= over), None)


def _chain(
    program: Program,
    chosen: Rewrite,
    targets: Mapping[int, int],
    producer: int,
    p: int,
    recomputable: Recomputable,
    profile: DeviceProfile,
    most: int = 8,
) -> tuple[list[int], int, float]:
    """What recomputing the value that step ``producer`` (of the rewritten program) writes across
    step ``p`` takes: the inputs dead at ``p`` that the copy's chain recomputes too (values of
    ``program`` that may be recomputed, at most ``most``, walked back from the producer), the bytes
    of the other dead inputs (brought back to life across ``p``) and the chain's recompute-seconds.
    Inputs that are targets already are recomputed by their own copies."""
    rewritten = chosen.program
    spans, defined_at, steps = rewritten.unmoved_spans, rewritten.uses.defined_at, rewritten.steps
    chain: list[int] = []
    revived, seconds, todo = 0, profile.compute_seconds(steps[producer]), list(steps[producer].reads)
    while todo:
        i = todo.pop()
        if spans[i][0] <= p <= spans[i][1] or i in targets or i in chain:
            continue
        d = defined_at[i]
        joins = (
            len(chain) < most
            and i < len(program.buffers)
            and program.buffers[i].kind == "computed"
            and not program.buffers[i].is_output
            and d is not None
            and recomputable(chosen.origin_step[d])
        )
        if joins:
            chain.append(i)
            seconds += profile.compute_seconds(steps[d])
            todo += steps[d].reads
        else:
            revived += rewritten.buffers[i].nbytes
    return chain, revived, seconds


def _next_original(chosen: Rewrite, p: int) -> int:
    """The first step at or after ``p`` of the rewritten program that is an original in its place
    (copies and postponed steps are placed just before one): the original step that a value dropped
    across ``p`` must skip."""
    while _holds(chosen.copied_steps, p) or _holds(chosen.postponed_steps, p):
        p += 1
    return p


def _holds(ascending: tuple[int, ...], k: int) -> bool:
    i = bisect_left(ascending, k)
    return i < len(ascending) and ascending[i] == k


def _class_key(program: Program, step: Step, b: int) -> ClassKey:
    """What identical layers share: the producer's operation, work, sizes and source, and which of
    its results the value is. Buffer labels are left out: they name the layer."""
    sizes = tuple(program.buffers[i].nbytes for i in step.reads), tuple(program.buffers[w].nbytes for w in step.writes)
    return step.name, step.flops, step.transient_bytes, *sizes, step.label, step.writes.index(b)
