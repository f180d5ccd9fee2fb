"""Keep, move or recompute: the plan a step runs, chosen by simulated step time.

Where the step's layers are known, the plan is made by layer (``schedule.layer_plan``): one policy
for every layer's activations, parameters and optimizer state, its copies where the layers' units
begin, and the window planner for what lies outside the layers. Elsewhere, and where no layer
policy fits the budget, two candidates are planned for one budget:

* **swap only**: the adaptive window planner (``plan_window``) on the program as traced;
* **hybrid**: ``choose_recompute`` rewrites the program so that less is live at its peak (values
  dropped after their forward use and recomputed before their backward use), and the window
  planner moves what still does not fit.

Both are timed with the same device profile (``simulate_time``); the recomputing plan is taken when
it moves fewer bytes, unless swap only is faster by more than ``MOVE_MARGIN``, or when it is faster
by more than that (PoocH's rule: recompute where recomputing costs less than moving). A hybrid
that moves nothing is what recomputation is for: it wins as soon as the FLOPs it adds cost less
than the exposed transfers they replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from oocjax.errors import BudgetInfeasibleError
from oocjax.schedule.cost import simulate_time
from oocjax.schedule.layer_plan import LayerPlan, plan_layers, steadiest
from oocjax.schedule.moves import Schedule, keep_all
from oocjax.schedule.profiles import DeviceProfile
from oocjax.schedule.program import Program
from oocjax.schedule.recompute import choose_recompute
from oocjax.schedule.rewrite import Rewrite, identity_rewrite
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
      swap_only: the adaptive window plan of the original program (None where it is infeasible, or
        not made: a plan by layer).
      swap_only_time_s: its simulated step time (None where not made).
      layer_plan: the plan by layer (``schedule.layer_plan``) where this is one: its policy and the
        policies it was chosen over.
    """

    rewrite: Rewrite
    schedule: Schedule
    step_time_s: float
    in_core_time_s: float
    swap_only: Schedule | None
    swap_only_time_s: float | None
    layer_plan: LayerPlan | None = None

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
    runs: Sequence[tuple[int, int, str]] = (),
) -> HybridPlan:
    """Plans ``program`` within ``budget_bytes``. Given its layers (``runs``: ``(start, stop, kind)``
    per run of a layer, ``transforms.layers``), by layer (``schedule.layer_plan``), with ``recompute``
    saying which layer policies may recompute; elsewhere, or where no layer policy fits: swap only,
    or recompute and swap, whichever the simulation says (``recompute="auto"``); ``"off"``: the
    window planner alone; ``"always"``: the recomputing plan whenever the selector finds values to
    recompute (tests, experiments); a ``RecomputePolicy`` forces or forbids values by producer name
    and label, then chooses as ``"always"``, operation by operation. ``planner`` makes the moves (the
    window planner). Raises ``BudgetInfeasibleError`` when no plan fits.

    >>> from oocjax.schedule.synthetic import layered_training_step
    >>> p = layered_training_step(3)
    >>> plan = plan_hybrid(p, 160 * MiB, recomputable=lambda s: p.steps[s].name != "adam", profile="h100-pcie")
    >>> plan.schedule.moves_nothing, plan.step_time_s <= plan.swap_only_time_s
    (True, True)
    """
    forced, recomputable = _apply_policy(program, recompute, recomputable)
    window = dict(window_bytes=window_bytes, min_offload_bytes=min_offload_bytes)
    in_core = simulate_time(program, keep_all(program), profile).step_time_s
    if runs and not callable(recompute) and max(program.in_core_bytes, default=0) > budget_bytes:
        layered = plan_layers(
            program, runs, budget_bytes, recomputable=recomputable, profile=profile, recompute=recompute, **window
        )
        if layered is not None:
            plan = dict(rewrite=layered.rewrite, schedule=layered.schedule, step_time_s=layered.step_time_s)
            return HybridPlan(**plan, in_core_time_s=in_core, swap_only=None, swap_only_time_s=None, layer_plan=layered)
    swap, infeasible = None, None  # swap only: the window planner on the program as traced
    try:
        swap = planner(program, budget_bytes, **window)
    except BudgetInfeasibleError as error:
        infeasible = error
    swap_time = None if swap is None else simulate_time(program, swap, profile).step_time_s
    candidates = [] if swap is None else [_Candidate(identity_rewrite(program), swap, swap_time)]
    if recompute != "off" and not (swap is not None and swap.moves_nothing):
        rules = dict(recomputable=recomputable, profile=profile, min_offload_bytes=min_offload_bytes, forced=forced)
        chosen = choose_recompute(program, budget_bytes, **rules)
        try:
            schedule = planner(chosen.program, budget_bytes, **window) if chosen.recomputed else None
        except BudgetInfeasibleError:  # the rewrite lengthened some value's life past what a step can hold
            schedule = None
        if schedule is not None:
            candidates.append(
                _Candidate(chosen, schedule, simulate_time(chosen.program, schedule, profile).step_time_s)
            )
    if not candidates:
        raise infeasible
    chosen = _chosen(candidates, recompute)
    plan = dict(rewrite=chosen.rewrite, schedule=chosen.schedule, step_time_s=chosen.time_s)
    return HybridPlan(**plan, in_core_time_s=in_core, swap_only=swap, swap_only_time_s=swap_time)


@dataclass(frozen=True, slots=True)
class _Candidate:
    rewrite: Rewrite
    schedule: Schedule
    time_s: float


def _chosen(candidates: list[_Candidate], recompute: RecomputeMode | RecomputePolicy) -> _Candidate:
    """The candidate ``plan_hybrid`` takes: under ``"always"`` or a policy, the recomputing plan
    where there is one; else the one moving the fewest bytes, unless the other is faster by more
    than ``MOVE_MARGIN`` (ties in time go to fewer copies)."""
    if recompute == "always" or callable(recompute):
        return candidates[-1]
    order = lambda c: (c.schedule.moved_bytes(c.rewrite.program), c.time_s, len(c.schedule.moves))  # noqa: E731
    return steadiest(candidates, order, lambda c: c.time_s)


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
