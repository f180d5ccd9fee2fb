"""In-core bytes: what a program holds on the device at each step when nothing moves.

The recompute rewrite (its peaks), the selector (each pick's check) and the pressure bound all ask
it, often of the same program: the last few answers are kept.
"""

from __future__ import annotations

from oocjax.schedule.moves import keep_all
from oocjax.schedule.program import Program
from oocjax.schedule.simulate import simulate


def in_core_bytes(program: Program) -> tuple[int, ...]:
    """Device bytes per step with nothing moved: ``Program``'s liveness rule, through the simulator.
    The selector asks it at every pick of the same original program and of each trial, twice (the
    rewrite's peak, then the pick's check): the last few answers are kept, by identity."""
    for kept, device in _RECENT_IN_CORE:
        if kept is program:
            return device
    device = simulate(program, keep_all(program)).device_bytes
    _RECENT_IN_CORE[:] = [*_RECENT_IN_CORE[-(_KEPT_IN_CORE - 1) :], (program, device)]
    return device


_KEPT_IN_CORE = 3  # the original, the rewrite kept, the trial: a few programs held at most
_RECENT_IN_CORE: list[tuple[Program, tuple[int, ...]]] = []
