"""Adaptive window-based swap scheduling (Hayakawa & Narihira 2020, arXiv 2010.14109).

This is the algorithm of nnabla's ``SwapInOutScheduler``, planned statically over a whole step.
The program is flattened into an *access list*: for each step, its reads, then its writes; each
output gets one more access after the last step (being returned). Two pointers walk that list:

* ``head`` runs ahead of the current step and admits accesses into the *window* while the distinct
  buffers in it fit ``window_bytes`` (default 1.5x the budget). The first admission of a buffer
  prefetches it (if it lives on host), cancels its pending offload (if the copy is still on the
  device, it comes back for free), or notes that the step ahead will create it.
* pending offloads are waited for oldest first, and only when memory is needed.

For each step: advance ``head``; reserve the step's outputs and scratch, waiting for offloads if
memory is short; if nothing is left to wait for, *backtrack*: forbid the furthest prefetches before
the next step and plan again from the start (in effect: from a snapshot before those prefetches).
After the step, each buffer whose next access is not in the window is freed (no further use),
dropped (it has a valid host copy), kept (too small to move, or a constant), or offloaded.

Because the window is in bytes, the prefetch distance adapts along the program: many steps ahead
where tensors are small, few where they are large. There is no timing model.

Beyond nnabla: buffers under ``min_offload_bytes`` never move; an infeasible budget is detected
before planning and reported with the smallest feasible budget (``schedule.feasibility``); inputs
whose plan is "fetch at the start and keep" stay on the device instead, and outputs follow the
memory of the input they alias (``schedule.homes``). Where the donated state is larger than the
budget, inputs fetched again and again are kept on the device from the start where that moves
fewer bytes (``homes.resident_candidates``). Where the state is (``Program.state_bytes``: an init's
results count too), the step is also planned in ranges of steps (``schedule.ranges``), taken where
its fewer stops of the executor cost less than its copies. (Where a step's layers are known, it is
planned by layer instead: ``schedule.layer_plan``, which plans what lies outside them with this.)
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

from oocjax.schedule.feasibility import check_feasible, check_window
from oocjax.schedule.gc_paused import gc_paused
from oocjax.schedule.homes import resident_candidates, settle_homes
from oocjax.schedule.moves import Move, Offload, Prefetch, Schedule, keep_all
from oocjax.schedule.program import Program, held_for_whole_step
from oocjax.schedule.ranges import cheapest_in_ranges
from oocjax.schedule.simulate import simulate
from oocjax.schedule.units import MiB

DEFAULT_WINDOW_FACTOR = 1.5  # nnabla's default; its authors found it on ResNet-50
# Once a program has backtracked, a pass keeps a copy of its state every this many steps (or every
# 1/MOST_SNAPSHOTS of the program, whichever is more), to start again from after a backtrack.
SNAPSHOT_STEPS, MOST_SNAPSHOTS = 32, 32

# Buffer states during planning.
_CLEARED = 0  # not on the device and not needed there now
_IN = 1  # on the device
_OUT = 2  # on the device with an offload in flight
_HOST = 3  # only on host
_UNPREFETCHED = 4  # to be created by a step inside the window; memory is reserved when it runs


def plan_window(
    program: Program,
    budget_bytes: int,
    *,
    window_bytes: int | None = None,
    min_offload_bytes: int = MiB,
    in_ranges: bool = True,
    residents: bool = True,
) -> Schedule:
    """Plans offloads and prefetches so that device memory stays within ``budget_bytes``.

    Args:
      program: the step program.
      budget_bytes: device bytes the step may use at any time.
      window_bytes: bytes of distinct buffers the look-ahead may cover; default 1.5x the budget.
      min_offload_bytes: buffers smaller than this never move.
      in_ranges: plan in ranges of shares of the budget where the state is larger than it
        (``ranges.cheapest_in_ranges``); False: the plan step by step alone.
      residents: where the state is larger than the budget, also try plans that keep some inputs
        on the device (``homes.resident_candidates``); False: the window plan alone.

    Returns:
      A schedule that keeps everything on the device when that fits, else the window plan.

    Raises:
      BudgetInfeasibleError: when some step alone needs more than the budget.
      ValueError: for a non-positive budget or a window too small for some step.

    >>> p = Program.from_ops([("f", ["x"], ["y"]), ("g", ["y"], ["z"])], {"x": 8, "y": 8, "z": 8},
    ...                      inputs=["x"], outputs=["z"])
    >>> plan_window(p, budget_bytes=64).moves_nothing
    True
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    window = int(budget_bytes * DEFAULT_WINDOW_FACTOR) if window_bytes is None else window_bytes
    with gc_paused():
        if simulate(program, keep_all(program)).peak_bytes <= budget_bytes:
            return keep_all(program, budget_bytes=budget_bytes, strategy="window")
        check_feasible(program, budget_bytes, min_offload_bytes)
        check_window(program, window)
        step_by_step = _plan_steps(program, budget_bytes, window, min_offload_bytes, residents)
        if not in_ranges or program.state_bytes <= budget_bytes:
            return step_by_step
        plan = functools.partial(_plan_checked, window=window, min_offload_bytes=min_offload_bytes, residents=residents)
        return cheapest_in_ranges(program, budget_bytes, plan, step_by_step)


def _plan_checked(
    program: Program,
    budget_bytes: int,
    *,
    window: int,
    min_offload_bytes: int,
    residents=True,
) -> Schedule:
    check_feasible(program, budget_bytes, min_offload_bytes)
    check_window(program, window)
    return _plan_steps(program, budget_bytes, window, min_offload_bytes, residents)


def _plan_steps(program: Program, budget_bytes: int, window: int, min_offload_bytes: int, residents: bool) -> Schedule:
    """The window plan, homes settled; where the donated state is larger than the budget, planned
    again with inputs kept on the device (``resident_candidates``), the one that moves fewest
    bytes: the program is the same in each, so the fewest bytes is the shortest link time, and on
    a tie the plan with nothing kept by choice."""
    plan = functools.partial(_WindowPlanner, program, budget_bytes, window, min_offload_bytes)
    plans = [settle_homes(program, plan().plan())]
    for resident in resident_candidates(program, plans[0], budget_bytes, min_offload_bytes) if residents else ():
        plans.append(settle_homes(program, plan(resident).plan()))
    return min(plans, key=lambda schedule: schedule.moved_bytes(program))


class _WindowPlanner:
    """One planning problem: the access list and its tables, shared by every pass. ``plan`` runs
    passes until one gets through; a pass that finds no room for a step forbids some prefetches
    (``backtrack``) and the next starts over."""

    def __init__(self, program: Program, budget: int, window: int, min_offload: int, resident=frozenset()):
        self.program, self.budget, self.window = program, budget, window
        buffers = program.buffers
        self.nbytes = [b.nbytes for b in buffers]
        self.pinned = [b in resident or buffer.never_moves(min_offload) for b, buffer in enumerate(buffers)]
        # Inputs kept on the device (those too small to move) and constants hold their memory to the
        # end; the device copy of an input that lives on host is a prefetched one, freed like any other.
        self.held_to_end = [
            pinned and held_for_whole_step(buffer, reads)
            for pinned, buffer, reads in zip(self.pinned, buffers, program.uses.read_at)
        ]
        # The access list as parallel flat lists (access i: buffer, step), not records: the passes
        # index them once per access, and lists of ints are the fastest to build and read.
        n = len(program.steps)
        access_buffer = [b for step in program.steps for b in (*step.reads, *step.writes)]
        access_step = [k for k, step in enumerate(program.steps) for _ in range(len(step.reads) + len(step.writes))]
        returned = [b for b, buffer in enumerate(buffers) if buffer.is_output]
        access_buffer += returned  # returning an output is one more access, after the last step
        access_step += [n] * len(returned)
        self.access_buffer, self.access_step = access_buffer, access_step
        self.step_end = list(accumulate(len(step.reads) + len(step.writes) for step in program.steps))
        self.next_access = _next_access(access_buffer, len(buffers))
        self.stopper = [0] * len(access_buffer)  # access i may not enter the window before step stopper[i]
        self.backtracks = 0

    def plan(self) -> Schedule:
        """Passes until one gets through, each after a backtrack resumed (``_Pass.rewind``): the
        1.34B GPT at 4 GiB backtracked 1,532 times, each about two thirds into its program."""
        passing, start = _Pass(self), 0
        while (schedule := passing.run(start)) is None:
            self.backtracks += 1
            start = passing.rewind()
        return schedule

    def backtrack(self, k: int, head: int, count: list[int], state: list[int], available: int, needed: int) -> int:
        """Forbids the furthest prefetches before step k+1, until enough memory would be free; the
        first access it forbade."""
        access_buffer, stopper, nbytes, pinned = self.access_buffer, self.stopper, self.nbytes, self.pinned
        seen_later: dict[int, int] = {}
        first_future_access = self.step_end[k]
        for j in range(head - 1, first_future_access - 1, -1):
            b = access_buffer[j]
            if count[b] - seen_later.get(b, 0) == 1:  # j is b's first access in the window
                if state[b] == _IN and not pinned[b]:
                    available += nbytes[b]
                stopper[j] = k + 1
                if available >= needed:
                    return j
            seen_later[b] = seen_later.get(b, 0) + 1
        step = self.program.steps[k]
        raise AssertionError(  # check_feasible rules this out; reaching here is a planner bug
            f"window planner found no room for step {k} ({step.describe()}) after cancelling every prefetch"
        )


def _next_access(access_buffer: list[int], buffer_count: int) -> list[int]:
    """Per access, the index of the same buffer's next access (-1: none)."""
    next_access = [-1] * len(access_buffer)
    last_seen = [-1] * buffer_count
    for i in range(len(access_buffer) - 1, -1, -1):
        b = access_buffer[i]
        next_access[i] = last_seen[b]
        last_seen[b] = i
    return next_access


@dataclass(slots=True)
class _PlannedOffload:
    """An offload issued after ``after_step``. Mutable: whether and when it completes is known
    only later, when memory is short and it is waited for (``done_before_step``); an offload never
    waited for was cancelled (its value was needed again before that) or is still in flight at the
    end, and is dropped from the schedule."""

    buffer: int
    after_step: int
    done_before_step: int | None = None


class _Pass:
    """One pass of the window over the program: the state of every buffer and of the device.

    Slotted, with the hot loops binding what they read to locals: the planner visits every access
    once or twice per pass, so attribute lookups are what its time goes to."""

    __slots__ = (
        "count",
        "device",
        "forbidden",
        "head",
        "head_after",
        "host_copy",
        "host_inputs",
        "in_window",
        "moves",
        "open_offload",
        "outgoing",
        "pending",
        "planner",
        "snapshots",
        "state",
        "waited",
    )

    def __init__(self, planner: _WindowPlanner):
        self.planner = planner
        buffers, nbytes = planner.program.buffers, planner.nbytes
        self.state = [_CLEARED] * len(buffers)
        self.host_copy = [False] * len(buffers)
        self.host_inputs: set[int] = set()
        self.device = 0  # bytes on the device, offloads in flight included
        for b, buffer in enumerate(buffers):
            if buffer.kind == "computed":
                continue
            if planner.pinned[b]:
                self.state[b] = _IN
                self.device += nbytes[b]
            else:
                self.state[b], self.host_copy[b] = _HOST, True
                self.host_inputs.add(b)
        self.count = [0] * len(buffers)  # per buffer, its accesses in the window
        self.outgoing = 0  # bytes of device copies whose offload is in flight
        self.in_window = 0  # bytes of the distinct buffers in the window
        self.head = 0  # the first access not yet in the window
        self.pending: deque[_PlannedOffload] = deque()  # offloads in issue order, cancelled ones included
        self.open_offload: dict[int, _PlannedOffload] = {}  # buffer -> its offload in flight
        self.moves: list[Prefetch | _PlannedOffload] = []  # in the order they start
        self.waited: list[_PlannedOffload] = []  # in the order they were waited for
        self.head_after: list[int] = []  # per step passed, the head after its admissions
        self.snapshots: list[tuple] = []  # the pass at the start of some steps (``run``), oldest first
        self.forbidden = 0  # the first access the last backtrack forbade

    def run(self, start: int = 0) -> Schedule | None:
        """The schedule, or None after a backtrack; from step ``start``, where the pass stands."""
        steps, snapshots = self.planner.program.steps, self.planner.backtracks > 0
        every = max(SNAPSHOT_STEPS, len(steps) // MOST_SNAPSHOTS)
        for k in range(start, len(steps)):
            if snapshots and k % every == 0:
                self.snapshots.append(self._snapshot(k))
            self._admit_ahead(k)
            self.head_after.append(self.head)
            if self.head < self.planner.step_end[k]:  # check_feasible and check_window rule this out
                raise AssertionError(f"window planner could not admit every access of step {k}")
            step = steps[k]
            if not self._reserve(k, step.writes, step.transient_bytes):
                return None
            self._release_after(k)
        return self._schedule()

    def _snapshot(self, k: int) -> tuple:
        counts = (self.device, self.outgoing, self.in_window, self.head, len(self.moves), len(self.waited))
        return k, self.state[:], self.host_copy[:], self.count[:], list(self.pending), dict(self.open_offload), counts

    def rewind(self) -> int:
        """Back to (and off) the last snapshot before the step that admitted the access the last
        backtrack forbade first, as steps before it would pass again; the step to run from."""
        admitted = bisect_right(self.head_after, self.forbidden)
        while self.snapshots and self.snapshots[-1][0] > admitted:
            self.snapshots.pop()
        if not self.snapshots:  # the first backtrack, or one before the first snapshot
            self.__init__(self.planner)
            return 0
        k, state, host_copy, count, pending, open_offload, counts = self.snapshots.pop()
        self.state, self.host_copy, self.count = state, host_copy, count
        self.pending, self.open_offload = deque(pending), dict(open_offload)
        self.device, self.outgoing, self.in_window, self.head, moves, waited = counts
        del self.moves[moves:], self.head_after[k:]
        for offload in self.waited[waited:]:  # waited for after the snapshot: in flight again
            offload.done_before_step = None
        del self.waited[waited:]
        return k

    def _admit_ahead(self, k: int) -> None:
        """Moves the head forward while the window and the budget allow. The first access of a
        buffer in the window prefetches it (from host), cancels its offload (still on the device),
        or marks it to be created by a step ahead."""
        planner = self.planner
        access_buffer, access_step, stopper = planner.access_buffer, planner.access_step, planner.stopper
        nbytes = planner.nbytes
        state, count, head, in_window = self.state, self.count, self.head, self.in_window
        total, n, window_limit, budget = len(access_buffer), len(planner.program.steps), planner.window, planner.budget
        while head < total and stopper[head] <= k:
            b = access_buffer[head]
            if count[b] == 0:
                size = nbytes[b]
                if in_window + size > window_limit:
                    break
                st = state[b]
                if st == _HOST and access_step[head] < n:  # (an output on host is returned as is)
                    if self.device - self.outgoing + size > budget:
                        break  # even waiting for every offload would not make room
                    while self.device + size > budget:
                        self._wait_oldest(k)
                    self.moves.append(Prefetch(buffer=b, issue_step=k, use_step=access_step[head]))
                    state[b] = _IN
                    self.device += size
                elif st == _OUT:  # its device copy is still there: cancel the offload
                    del self.open_offload[b]
                    state[b] = _IN
                    self.outgoing -= size
                elif st == _CLEARED:
                    state[b] = _UNPREFETCHED
                in_window += size
            count[b] += 1
            head += 1
        self.head, self.in_window = head, in_window

    def _wait_oldest(self, k: int) -> None:
        """Waits, before step k, for the oldest offload in flight: its device copy is released."""
        pending, open_offload = self.pending, self.open_offload
        while open_offload.get(pending[0].buffer) is not pending[0]:  # cancelled
            pending.popleft()
        offload = pending.popleft()
        b = offload.buffer
        del self.open_offload[b]
        offload.done_before_step = k
        self.waited.append(offload)
        self.state[b], self.host_copy[b] = _HOST, True
        self.device -= self.planner.nbytes[b]
        self.outgoing -= self.planner.nbytes[b]

    def _reserve(self, k: int, writes: tuple[int, ...], transient: int) -> bool:
        """Reserves step k's outputs and scratch, waiting for offloads if memory is short; False
        (after a backtrack) when even waiting for every offload would not make room."""
        planner, state = self.planner, self.state
        reserve = transient
        for b in writes:
            if state[b] == _UNPREFETCHED:
                reserve += planner.nbytes[b]
                state[b] = _IN
        available = planner.budget - (self.device - self.outgoing)
        if reserve > available:
            self.forbidden = planner.backtrack(k, self.head, self.count, state, available, reserve)
            return False
        while self.device + reserve > planner.budget:
            self._wait_oldest(k)
        self.device += reserve - transient
        return True

    def _release_after(self, k: int) -> None:
        """After step k, each buffer whose next access is not in the window is freed (no further
        use), dropped (it has a host copy), kept (it never moves) or offloaded."""
        planner = self.planner
        access_buffer, next_access, nbytes = planner.access_buffer, planner.next_access, planner.nbytes
        pinned, held_to_end = planner.pinned, planner.held_to_end
        state, count, host_copy = self.state, self.count, self.host_copy
        device, outgoing, in_window = self.device, self.outgoing, self.in_window
        for i in range(planner.step_end[k - 1] if k else 0, planner.step_end[k]):
            b = access_buffer[i]
            count[b] -= 1
            if count[b]:
                continue
            in_window -= nbytes[b]
            if next_access[i] < 0:  # no further use
                if not held_to_end[b]:
                    device -= nbytes[b]
                    state[b] = _CLEARED
            elif pinned[b]:
                pass
            elif host_copy[b]:  # drop the device copy: the host one is still valid
                device -= nbytes[b]
                state[b] = _HOST
            else:
                offload = _PlannedOffload(buffer=b, after_step=k)
                self.pending.append(offload)
                self.open_offload[b] = offload
                self.moves.append(offload)
                state[b] = _OUT
                outgoing += nbytes[b]
        self.device, self.outgoing, self.in_window = device, outgoing, in_window

    def _schedule(self) -> Schedule:
        buffers = self.planner.program.buffers
        # Offloads still in flight at the end belong to outputs whose copy never had to be waited
        # for: the device copy was held anyway, so keep the output on the device and skip the copy.
        host_outputs = {b for b, buffer in enumerate(buffers) if buffer.is_output and self.state[b] == _HOST}
        moves: list[Move] = []
        for m in self.moves:
            if isinstance(m, Prefetch):
                moves.append(m)
            elif m.done_before_step is not None:  # else cancelled, or in flight at the end
                moves.append(Offload(buffer=m.buffer, after_step=m.after_step, done_before_step=m.done_before_step))
        return Schedule(
            strategy="window",
            budget_bytes=self.planner.budget,
            host_inputs=frozenset(self.host_inputs),
            host_outputs=frozenset(host_outputs),
            moves=tuple(moves),
        )
