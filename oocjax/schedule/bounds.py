"""Lower bounds on swapping: what any swap-only plan within a budget must move, and how long its step takes.

At a step where a program holds more than the budget in core (the turn from forward to backward),
every byte over the budget leaves the device before that step and comes back after it, so the two
link directions cannot overlap there (``pressure_bound``). The cost model reports the bound's step
time as a floor under a schedule's (``cost.simulate_time``); it is why swapping alone cannot be fast
for such a program, and recomputation (``schedule.recompute``) is worth its FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import accumulate

from oocjax.schedule.gc_paused import gc_paused
from oocjax.schedule.profiles import DeviceProfile, resolve_profile
from oocjax.schedule.program import Program
from oocjax.schedule.units import MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class PressureBound:
    """What any swap-only plan within a budget must at least move.

    Attributes:
      moved_bytes: a lower bound on host-to-device plus device-to-host bytes.
      step: the step that sets ``moved_bytes`` (None when nothing has to move).
      excess_bytes: in-core bytes over the budget at that step.
      step_time_s: with a device profile, a lower bound on the step's time; else None.
    """

    moved_bytes: int
    step: int | None
    excess_bytes: int
    step_time_s: float | None = None


# The pools a byte over the budget at step p can be taken from, with the least it costs to move
# (bytes; and seconds before or after step p, where the two directions cannot overlap).
_FREE = 0  # an argument nothing reads: left on host, never fetched
_FETCHED_BEFORE = 1  # an argument held to the end but last read before p: one fetch, before p
_FETCH_AFTER = 2  # an argument read after p: one fetch, after p
_COPY_OUT = 3  # a computed output last read before p: one offload, done before p (returned on host)
_ROUND_TRIP = 4  # a computed value read after p: an offload done before p and a fetch after it
_POOLS = 5


def pressure_bound(
    program: Program,
    budget_bytes: int,
    *,
    profile: DeviceProfile | str | None = None,
    min_offload_bytes: int = MiB,
) -> PressureBound:
    """The least any swap-only plan within ``budget_bytes`` must move.

    At each step p, the in-core bytes over the budget must be off the device. A value off the
    device at p that it reads later left before p (an offload, unless it is an argument, which has
    a host copy) and comes back after p (a prefetch); an argument read earlier was fetched once;
    an output read earlier was copied out once; an argument nothing reads costs nothing. Filling
    the excess with the cheapest of those bytes first bounds the bytes moved; the time bound adds
    the link time that must finish before p and start after it to step p's own compute (the two
    directions cannot overlap there), and is at least the whole compute time. Values that never
    move (``Buffer.never_moves``) and step p's own operands are not available. The bound holds
    for every valid plan: for ``simulate``'s h2d + d2h bytes and ``simulate_time``'s step time.

    >>> p = Program.from_ops(
    ...     [("f", ["x"], ["a"]), ("g", ["a"], ["b"]), ("h", ["b"], ["c"]), ("k", ["a", "c"], ["y"])],
    ...     {"x": MiB, "a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB, "y": MiB}, inputs=["x"], outputs=["y"])
    >>> [pressure_bound(p, budget * MiB).moved_bytes / MiB for budget in (13, 12, 9)]  # peak: 13 MiB
    [0.0, 1.0, 7.0]

    At 12 MiB, the argument ``x`` (read at step 0 only) can stay on host, fetched once; at 9 MiB,
    3 MiB more must come from ``a``, which step 3 reads: out and back, twice its bytes.
    """
    with gc_paused():
        device = program.in_core_bytes
        pools = _removable_pools(program, min_offload_bytes)
        bound = PressureBound(moved_bytes=0, step=None, excess_bytes=0)
        for p, live in enumerate(device):
            excess = live - budget_bytes
            if excess <= 0:
                continue
            free, before, after, out, round_trip = (pool[p] for pool in pools)
            moved = _cheapest_cover(excess, [(free, 0), (before + after + out, 1), (round_trip, 2)])
            if moved > bound.moved_bytes:
                bound = PressureBound(moved_bytes=int(moved), step=p, excess_bytes=excess)
        if profile is None:
            return bound
        return replace(bound, step_time_s=_time_bound(program, device, pools, budget_bytes, resolve_profile(profile)))


def _time_bound(
    program: Program, device: tuple[int, ...], pools: list[list[int]], budget: int, profile: DeviceProfile
) -> float:
    """Seconds no valid plan can beat: the whole compute, and at each step over the budget, the
    offloads that must finish before it, its compute, and the prefetches that start after it."""
    to_host, to_device = 1 / profile.d2h_bytes_per_s, 1 / profile.h2d_bytes_per_s
    best = sum(profile.compute_seconds(step) for step in program.steps)
    for p, live in enumerate(device):
        if live <= budget:
            continue
        free, before, after, out, round_trip = (pool[p] for pool in pools)
        pools_by_rate = [(free + before, 0.0), (after, to_device), (out, to_host), (round_trip, to_host + to_device)]
        link = _cheapest_cover(live - budget, pools_by_rate)
        best = max(best, link + profile.compute_seconds(program.steps[p]))
    return best


def _cheapest_cover(excess: int, pools: list[tuple[int, float]]) -> float:
    """The least cost of taking ``excess`` bytes from pools of (bytes, cost per byte), cheapest
    first: a fractional relaxation, so never above what any whole-buffer choice costs."""
    cost: float = 0
    for size, rate in sorted(pools, key=lambda pool: pool[1]):
        take = min(excess, size)
        cost += take * rate
        excess -= take
    return cost


def _removable_pools(program: Program, min_offload_bytes: int) -> list[list[int]]:
    """Per pool (``_FREE`` ...), the bytes per step that a plan could have off the device there:
    values in core at that step (``Program.unmoved_spans``) that may move and that the step does
    not touch. One difference array per pool: linear in steps plus reads."""
    n, uses = len(program.steps), program.uses
    diffs = [[0] * (n + 1) for _ in range(_POOLS)]

    def add(pool: int, first: int, last: int, nbytes: int, holes: Iterable[int] = ()) -> None:
        if first > last:
            return
        diff = diffs[pool]
        diff[first] += nbytes
        diff[last + 1] -= nbytes
        for r in holes:  # steps that read the value need it on the device
            diff[r] -= nbytes
            diff[r + 1] += nbytes

    for b, buffer in enumerate(program.buffers):
        if buffer.never_moves(min_offload_bytes) or not n:
            continue
        start, end = program.unmoved_spans[b]
        reads, size = uses.read_at[b], buffer.nbytes
        if buffer.kind == "input" and not reads:
            add(_FREE, start, end, size)
        elif buffer.kind == "input":
            add(_FETCH_AFTER, 0, reads[-1] - 1, size, reads[:-1])
            add(_FETCHED_BEFORE, reads[-1] + 1, end, size)
        else:
            last = reads[-1] if reads else start
            add(_ROUND_TRIP, start + 1, last - 1, size, reads[:-1])
            add(_COPY_OUT, last + 1, end, size)  # non-empty only for outputs (held to the end)
    return [list(accumulate(diff))[:n] for diff in diffs]
