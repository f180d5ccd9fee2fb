"""Keep, move or recompute: the plan a step runs, chosen by simulated step time.

Up to three candidates are planned for one budget:

* **swap only**: the adaptive window planner (``plan_window``) on the program as traced;
* **hybrid**: ``choose_recompute`` rewrites the program so that less is live at its peak (values
  dropped after their forward use and recomputed before their backward use), and the window
  planner moves what still does not fit;
* **by block**, where the step's layers are known: every block's insides recomputed for its
  backward pass, its input kept (``schedule.blocks``: per-block remat), the selector's picks on
  top of that, and the window planner moves what still does not fit;
* **by half-block**: the same with each block's narrowest point in its middle kept too, so that
  the second half is recomputed for its own backward pass without the first (a transformer
  block's attention is then recomputed only when its backward comes, not held through the MLP's).

The window planner plans each step by step and, where the layers are known or the state is larger
than the budget, in ranges of steps (``schedule.ranges``) that never cross a layer's bounds, so
that a plan's copies and segments follow the layers.

All are timed with the same device profile (``simulate_time``); a recomputing plan is taken only
when it is faster, or as fast and moving less (PoocH's rule: recompute where recomputing costs less than
moving), so the answer is never slower than swap-only by the model. A hybrid that moves nothing is what recomputation
is for: it wins as soon as the FLOPs it adds cost less than the exposed transfers they replace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.blocks import block_targets
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.moves import Schedule, keep_all
from oocjax.schedule.profiles import DeviceProfile
from oocjax.schedule.program import Program
from oocjax.schedule.recompute import choices_alike, choose_recompute
from oocjax.schedule.rewrite import Rewrite, hoisted, identity_rewrite, recompute_program, runs_after
from oocjax.schedule.units import MiB
from oocjax.schedule.window import plan_window

RecomputeMode = Literal["auto", "off", "always"]
RECOMPUTE_MODES = ("auto", "off", "always")
# An expert's choice per value: given the producing operation's name and the value's label, True
# recomputes it whatever the costs say, False never recomputes it, None leaves it to the selector.
RecomputePolicy = Callable[[str, str], "bool | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridPlan:
    """The plan chosen for one budget, and the swap-only plan it was compared with.

    Attributes:
      rewrite: the program as it runs (the identity rewrite when nothing is recomputed).
      schedule: the moves, on ``rewrite.program``.
      step_time_s: simulated step time of that plan.
      in_core_time_s: simulated step time of the program as traced with nothing moved or recomputed,
        on the same profile: the step in core, were the device large enough.
      swap_only: the adaptive window plan of the original program (None where it is infeasible).
      swap_only_time_s: its simulated step time (None where infeasible).
      by_block: whether ``rewrite`` recomputes by block (``schedule.blocks``) rather than by the
        per-value selector.
    """

    rewrite: Rewrite
    schedule: Schedule
    step_time_s: float
    in_core_time_s: float
    swap_only: Schedule | None
    swap_only_time_s: float | None
    by_block: bool = False

    @property
    def program(self) -> Program:
        return self.rewrite.program


def plan_hybrid(
    program: Program,
    budget_bytes: int,
    *,
    recomputable: Callable[[int], bool],
    profile: DeviceProfile | str,
    recompute: RecomputeMode | RecomputePolicy = "auto",
    window_bytes: int | None = None,
    min_offload_bytes: int = MiB,
    planner: Callable[..., Schedule] = plan_window,
    blocks: Sequence[tuple[int, int]] = (),
    backward_start: int = 0,
    layers: Sequence[tuple[int, int]] = (),
) -> HybridPlan:
    """Plans ``program`` within ``budget_bytes``: swap only, or recompute and swap, whichever the
    simulation says is faster (``recompute="auto"``); ``"off"``: the window planner alone;
    ``"always"``: the recomputing plan whenever the selector finds values to recompute (tests,
    experiments); a ``RecomputePolicy`` forces or forbids values by producer name and label, then
    chooses as ``"always"``. ``planner`` makes the moves (the window planner). ``blocks``: each
    layer's forward steps, ``backward_start`` the backward's first, for the by-block candidate;
    ``layers``: every layer's steps, forward, backward and update (default ``blocks``), where the
    selector makes its choices alike. Raises ``BudgetInfeasibleError`` when neither plan fits.

    >>> from oocjax.schedule.synthetic import layered_training_step
    >>> p = layered_training_step(3)
    >>> plan = plan_hybrid(p, 160 * MiB, recomputable=lambda s: p.steps[s].name != "adam", profile="h100-pcie")
    >>> plan.schedule.moves_nothing, plan.step_time_s <= plan.swap_only_time_s
    (True, True)
    """
    forced, recomputable = _apply_policy(program, recompute, recomputable)
    window = dict(window_bytes=window_bytes, min_offload_bytes=min_offload_bytes)
    swap, infeasible = None, None  # swap only: the window planner on the program as traced
    try:
        swap = planner(program, budget_bytes, **window, layers=tuple(layers or blocks))
    except BudgetInfeasibleError as error:
        infeasible = error
    swap_time = None if swap is None else simulate_time(program, swap, profile).step_time_s
    candidates = [] if swap is None else [_Candidate(identity_rewrite(program), swap, swap_time, False)]
    if recompute != "off" and not (swap is not None and swap.moves_nothing):
        rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=min_offload_bytes, forced=forced)
        rules["layers"] = runs = layers or blocks
        alike = functools.partial(choices_alike, program, rules["layers"])
        rewrites = [(choose_recompute(program, budget_bytes, **rules), False)]
        candidates += _planned(rewrites, planner, budget_bytes, window, profile, alike, runs)
        # Per-block remat (which recomputes more), then the selector's picks, where those alone move
        # or are not alike in alike layers.
        if blocks and recompute == "auto" and not any(c.schedule.moves_nothing and c.alike for c in candidates):
            by_block = dict.fromkeys(block_targets(program, blocks, backward_start), backward_start)
            halves = dict.fromkeys(block_targets(program, blocks, backward_start, midpoint=True), backward_start)
            rewrites = [
                (choose_recompute(program, budget_bytes, **rules | dict(forced=by_block)), True),
                (recompute_program(program, halves, recomputable=recomputable, across=halves), True),
            ]
            candidates += _planned(rewrites, planner, budget_bytes, window, profile, alike, runs)
    if not candidates:
        raise infeasible
    chosen = _chosen(candidates, recompute, swap, budget_bytes)
    plan = dict(rewrite=chosen.rewrite, schedule=chosen.schedule, step_time_s=chosen.time_s, by_block=chosen.by_block)
    in_core = simulate_time(program, keep_all(program), profile).step_time_s
    return HybridPlan(**plan, in_core_time_s=in_core, swap_only=swap, swap_only_time_s=swap_time)


# A plan that moves more bytes replaces one that moves fewer only when the model says it is faster
# by more than this: the model's step times err by more (the committed H200 run measured the step
# 2.7-fold under its simulation), and a plan that moves less is the steadier: its layers stay alike,
# and alike layers share compiled programs.
MOVE_MARGIN = 0.15
# Moving fewer bytes makes a plan no steadier where the difference is this share of the budget or
# less: a 24-layer decoder's selector plan, 362 KB moved (0.8%) and 9% faster by the model, lost to
# recomputing every block, and a 4-layer one's, 16 KB more, to the same; their backward programs
# then compile the forward's kernels too (a first call 1.8x jax.jit's where it was 1.2x).
NEGLIGIBLE_MOVES = 0.01


@dataclass(frozen=True, slots=True)
class _Candidate:
    rewrite: Rewrite
    schedule: Schedule
    time_s: float
    by_block: bool
    alike: bool = True  # its choices are alike in alike layers (``recompute.choices_alike``)

    @property
    def moved_bytes(self) -> int:
        return self.schedule.moved_bytes(self.rewrite.program)


def _planned(
    rewrites: list, planner: Callable, budget_bytes: int, window: dict, profile, alike: Callable, runs: Sequence
) -> list[_Candidate]:
    """The rewrites (each with whether it is by block) that the planner fits, planned and timed;
    ``runs``: the original program's layers (``rewrite.hoisted``)."""
    candidates = []
    for chosen, by_block in rewrites:
        if not chosen.recomputed:
            continue
        rewrite, schedule = _hoisted_plan(planner, chosen, budget_bytes, window, runs)
        if schedule is not None:
            time = simulate_time(rewrite.program, schedule, profile).step_time_s
            candidates.append(_Candidate(rewrite, schedule, time, by_block, alike(rewrite.recomputed)))
    return candidates


def _chosen(
    candidates: list[_Candidate], recompute: RecomputeMode | RecomputePolicy, swap: Schedule | None, budget_bytes: int
) -> _Candidate:
    """The candidate ``plan_hybrid`` takes: under ``"always"`` or a policy, the first recomputing plan
    (right after swap only, or first where swap only is infeasible); else ``_steadiest``'s pick."""
    forcing = recompute == "always" or callable(recompute)
    chosen = (
        candidates[1] if forcing and len(candidates) > 1 and swap is not None else _steadiest(candidates, budget_bytes)
    )
    if forcing and swap is None:
        chosen = candidates[0]
    return chosen


def _steadiest(candidates: list[_Candidate], budget_bytes: int) -> _Candidate:
    """The candidate moving the fewest bytes (the fastest of those), unless one moving more is
    faster by more than ``MOVE_MARGIN``, or faster at all while moving about as much (at most
    ``MOVE_MARGIN`` more, or more by under ``NEGLIGIBLE_MOVES`` of the budget) with its choices
    alike in alike layers: a selector plan whose layers differ compiles more programs than the
    by-block plan it would replace (a 4-layer plain decoder's: 24 against 8). For the same reason a
    plan alike in alike layers replaces one that is not where it moves no more and is at most
    ``MOVE_MARGIN`` slower (the 4-layer zoo transformer's selector plan, 1.05x faster by the model,
    compiled 20 programs and measured over its budget where the half-block plan compiles 5). Ties
    in time go to fewer copies."""
    ordered = sorted(candidates, key=lambda c: (c.moved_bytes, c.time_s, _moved(c.schedule)))
    chosen = ordered[0]
    for candidate in ordered[1:]:
        extra = candidate.moved_bytes - chosen.moved_bytes
        close = candidate.alike and (
            extra <= MOVE_MARGIN * chosen.moved_bytes or extra < NEGLIGIBLE_MOVES * budget_bytes
        )
        steadier = candidate.alike and not chosen.alike and extra <= 0
        faster = candidate.time_s * (1 + MOVE_MARGIN) < chosen.time_s or (close and candidate.time_s < chosen.time_s)
        if faster or (steadier and candidate.time_s <= chosen.time_s * (1 + MOVE_MARGIN)):
            chosen = candidate
    return chosen


def _apply_policy(
    program: Program, recompute: RecomputeMode | RecomputePolicy, recomputable: Callable[[int], bool]
) -> tuple[list[int], Callable[[int], bool]]:
    """The buffers a policy forces, and ``recomputable`` less the producers of values it forbids."""
    if not callable(recompute) and recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES} or a function; got {recompute!r}")
    if not callable(recompute):
        return [], recomputable
    forced, forbidden = [], set()
    for k, step in enumerate(program.steps):
        for b in step.writes:
            verdict = recompute(step.name, program.buffers[b].label)
            if verdict is True:
                forced.append(b)
            elif verdict is False:
                forbidden.add(k)
    return forced, (lambda k: k not in forbidden and recomputable(k))


def _moved(schedule: Schedule) -> int:
    """How much a schedule moves, to break ties in time: fewer copies, less to go wrong."""
    return len(schedule.moves) + len(schedule.host_inputs)


def _hoisted_plan(
    planner: Callable, rewrite: Rewrite, budget_bytes: int, window: dict, runs: Sequence
) -> tuple[Rewrite, Schedule | None]:
    """``rewrite`` with the copies of no layer's work run before the layer they serve
    (``rewrite.hoisted``, ``runs``: the original program's layers) and its plan; as it is where
    that does not fit; None for the plan where neither does."""
    moved = hoisted(rewrite, runs)
    schedule = _plan_or_none(planner, moved, budget_bytes, window, runs)
    if schedule is None and moved is not rewrite:
        return rewrite, _plan_or_none(planner, rewrite, budget_bytes, window, runs)
    return moved, schedule


def _plan_or_none(
    planner: Callable, rewrite: Rewrite, budget_bytes: int, window: dict, runs: Sequence
) -> Schedule | None:
    """The plan of ``rewrite``'s program, with its layers (``runs``, of the original program, as
    they lie in the rewritten one), or None where it does not fit."""
    layers = tuple((a, y) for a, y, _ in runs_after(rewrite, [(a, y, "") for a, y, *_ in runs]))
    try:
        return planner(rewrite.program, budget_bytes, **window, layers=layers)
    except BudgetInfeasibleError:
        return None  # the rewrite lengthened some value's life past what a step can hold
