"""Keep, move or recompute: the plan a step runs, chosen by simulated step time.

Two candidates are planned for one budget:

* **swap only**: the adaptive window planner (``plan_window``) on the program as traced;
* **hybrid**: ``choose_recompute`` rewrites the program so that less is live at its peak (values
  dropped after their forward use and recomputed before their backward use), and the window
  planner moves what still does not fit.

Both are timed with the same device profile (``simulate_time``); the hybrid is taken only when it
is faster, or as fast and moving less (PoocH's rule: recompute where recomputing costs less than
moving), so the answer is never slower than swap-only by the model. A hybrid that moves nothing is what recomputation
is for: it wins as soon as the FLOPs it adds cost less than the exposed transfers they replace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.cost import DeviceProfile, simulate_time
from oocjax.schedule.moves import Schedule
from oocjax.schedule.program import Program
from oocjax.schedule.recompute import Rewrite, choose_recompute, identity_rewrite
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
      swap_only: the adaptive window plan of the original program (None where it is infeasible).
      swap_only_time_s: its simulated step time (None where infeasible).
    """

    rewrite: Rewrite
    schedule: Schedule
    step_time_s: float
    swap_only: Schedule | None
    swap_only_time_s: float | None

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
) -> HybridPlan:
    """Plans ``program`` within ``budget_bytes``: swap only, or recompute and swap, whichever the
    simulation says is faster (``recompute="auto"``); ``"off"`` is the window planner alone,
    ``"always"`` takes the recomputing plan whenever the selector finds values to recompute (for
    tests and experiments), and a ``RecomputePolicy`` forces or forbids values by their producer's
    name and their label, then chooses as ``"always"`` does. ``planner`` makes the moves of either
    program (the window planner).

    Raises ``BudgetInfeasibleError`` when neither plan fits.

    >>> from oocjax.schedule.synthetic import layered_training_step
    >>> p = layered_training_step(3)
    >>> plan = plan_hybrid(p, 160 * MiB, recomputable=lambda s: p.steps[s].name != "adam", profile="h100-pcie")
    >>> plan.schedule.moves_nothing, plan.step_time_s <= plan.swap_only_time_s
    (True, True)
    """
    forced, recomputable = _apply_policy(program, recompute, recomputable)
    window = dict(window_bytes=window_bytes, min_offload_bytes=min_offload_bytes)
    swap, infeasible = None, None
    try:
        swap = planner(program, budget_bytes, **window)
    except BudgetInfeasibleError as error:
        infeasible = error
    swap_time = None if swap is None else simulate_time(program, swap, profile).step_time_s
    if recompute != "off" and not (swap is not None and swap.moves_nothing):
        rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=min_offload_bytes, forced=forced)
        rewrite = choose_recompute(program, budget_bytes, **rules)
        hybrid = _plan_or_none(planner, rewrite, budget_bytes, window) if rewrite.recomputed else None
        if hybrid is not None:
            hybrid_time = simulate_time(rewrite.program, hybrid, profile).step_time_s
            faster = swap is None or (hybrid_time, _moved(hybrid)) < (swap_time, _moved(swap))
            if recompute == "always" or callable(recompute) or faster:
                return HybridPlan(
                    rewrite=rewrite,
                    schedule=hybrid,
                    step_time_s=hybrid_time,
                    swap_only=swap,
                    swap_only_time_s=swap_time,
                )
    if swap is None:
        raise infeasible
    same = identity_rewrite(program)
    return HybridPlan(rewrite=same, schedule=swap, step_time_s=swap_time, swap_only=swap, swap_only_time_s=swap_time)


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


def _plan_or_none(planner: Callable, rewrite: Rewrite, budget_bytes: int, window: dict) -> Schedule | None:
    try:
        return planner(rewrite.program, budget_bytes, **window)
    except BudgetInfeasibleError:
        return None  # the rewrite lengthened some value's life past what a step can hold
