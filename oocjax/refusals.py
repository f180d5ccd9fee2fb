"""Why a step is not run, in the user's terms: a budget no plan fits, a plan the simulator rejects,
host memory the plan would overrun, tokens between segments, and compiled segments that stay over
the budget. Each message says what the user can do about it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from oocjax.arguments import ArgumentSpec
from oocjax.budget import Budget
from oocjax.errors import BudgetInfeasibleError, OocError
from oocjax.host_limit import PINNED_POOL_VARIABLE, HostLimit
from oocjax.options import HOST_MARGIN, PlannerOptions
from oocjax.schedule import Program, format_bytes, required_bytes
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.transforms import compat as jc

# Operations that run whole, as one step with their internal peak as scratch: when one of them sets
# the floor, the error says so.
OPAQUE_LOOPS = {
    jc.scan_p.name: "a scan",
    jc.while_p.name: "a while loop",
    jc.remat_p.name: "a remat (checkpoint) block",
}

# Added to the error of a call that holds on the device leaves an earlier call took in host memory.
STATE_RETURNED_ON_THE_DEVICE = (
    "Why they are on the device: an earlier call of {name} took these {count} leaves ({names}) in host memory, "
    "and this call passes them in device memory. Without donation a step returns its results in device "
    "memory, as jax.jit does: `state, metrics = step(state, batch)` brings a state passed as "
    "oocjax.to_host(state) onto the device, and the next call holds it there for the whole step.\n"
    "Fix: donate the state, ooc_jit(..., {donate}): the leaves the plan keeps in host memory then come back "
    "there, ready for the next call (or pass oocjax.to_host(state) on every call, a copy each time)."
)


def refuse_invalid(what: str, violations: tuple) -> None:
    """A plan the simulator rejects would lose data or break the budget at run time: never run it."""
    if violations:
        listed = "\n".join(f"  - {v.message}" for v in violations[:10])
        more = f"\n  ... and {len(violations) - 10} more" if len(violations) > 10 else ""
        raise OocError(
            f"oocjax made a {what} that its own simulator rejects ({len(violations)} problems), so it does not "
            f"run it: your arrays are untouched. This is a bug in oocjax; please report it with this message.\n"
            f"{listed}{more}\nUntil it is fixed, a slightly different budget or min_offload_bytes avoids it."
        )


def check_host_peak(host_peak_bytes: int, limit: HostLimit, copies: int = 1) -> None:
    """Host memory is finite too: a plan whose host copies would not fit is refused before it runs.
    The plan's figures (``host_peak_bytes``, its timeline's) are per device; this process holds
    them for each of its ``copies`` devices."""
    host_peak = host_peak_bytes * copies
    if limit.bytes is not None and host_peak > limit.bytes:
        raise OocError(host_peak_message(host_peak, limit))


def host_peak_message(host_peak: int, limit: HostLimit) -> str:
    """Why a plan over the host memory it may use is refused: the figures that limit it, which one
    binds, and what the user can do about each."""
    if limit.given_bytes is not None:
        memory, short = f"host_budget ({format_bytes(limit.given_bytes)})", "host_budget"
    else:
        figure = "unknown" if limit.machine_bytes is None else format_bytes(limit.machine_bytes)
        memory = f"the memory this machine has available less a {HOST_MARGIN:.0%} margin ({figure})"
        short = "the machine's memory"
    problem = (
        f"the plan needs {format_bytes(host_peak, round_up=True)} of host memory at its peak (host-kept state and "
        "copies of values moved off the device), more than "
    )
    fixes = ["raise the device budget, so that less moves to host"]
    if limit.pinned_pool_bytes is None:
        fixes.append("free host memory, or raise host_budget if the machine has more to give")
        return _with_fixes(f"{problem}{memory}.", fixes)
    pool = f"XLA's pool of pinned host memory ({format_bytes(limit.pinned_pool_bytes)}, {limit.pinned_pool_reading})"
    binding = limit.memory_bytes is None or limit.pinned_pool_bytes <= limit.memory_bytes
    cap = "on top of host_budget" if limit.given_bytes is not None else "whatever the machine has"
    if limit.memory_bytes is None:  # the machine's memory unknown: the pool alone limits the plan
        problem += f"the {format_bytes(limit.bytes)} it may use on this GPU, {pool}. "
    else:
        problem += (
            f"the {format_bytes(limit.bytes)} it may use on this GPU, the lesser of {memory} and {pool}: "
            f"{'the pinned pool' if binding else short} binds. "
        )
    problem += f"Every host copy comes from that pool, whose cap applies {cap}."
    if limit.pinned_pool_bytes < host_peak:
        fixes.append(
            f"if the machine has the memory, set {PINNED_POOL_VARIABLE}={-(-host_peak // 2**30)} (GiB) or more "
            "before the process first uses the GPU (XLA reads it once, when it starts)"
        )
    if limit.memory_bytes is not None and limit.memory_bytes < host_peak:
        act = "raise host_budget" if limit.given_bytes is not None else "free host memory, or pass host_budget"
        fixes.append(f"{act}='{format_bytes(host_peak, round_up=True)}' if the machine has more to give")
    return _with_fixes(problem, fixes)


def _with_fixes(problem: str, fixes: list[str]) -> str:
    fixes = [*fixes, "make the step smaller (a smaller batch or model)"]
    return problem + "\nFixes:" + ";".join(f"\n  {k}. {fix}" for k, fix in enumerate(fixes, 1)) + "."


def refuse_tokens_between(segments: tuple[Segment, ...], avals: tuple) -> None:
    """Tokens order effects inside one program; separately compiled segments cannot pass them on."""
    crossing = sorted({b for s in segments for b in (*s.inputs, *s.outputs) if not hasattr(avals[b], "shape")})
    if crossing:
        raise OocError(
            f"a token value (from jax.lax.create_token or after_all; buffers {crossing}) lives across the separately "
            "compiled segments this plan cuts the step into, and tokens cannot be passed between programs.\n"
            "Fixes:\n  1. create and use each token within a small part of the step;\n"
            "  2. raise the budget to the in-core estimate, where the step runs as jax.jit's one program."
        )


def refuse_infeasible(program: Program, error: BudgetInfeasibleError, budget: Budget, options: PlannerOptions):
    """Raises the planner's error, saying what the user can do about it."""
    _refuse_for_held_arguments(program, error, options)
    loop = OPAQUE_LOOPS.get(program.steps[error.step].name)
    tried = (
        ""
        if options.recompute == "off"
        else (
            "\nThat figure is the floor of plans that move values; plans that also recompute values were tried "
            "and did not fit this budget either (near the figure one may)."
        )
    )
    if loop is None and not budget.headroom_bytes and not tried:
        raise error
    note = tried + (
        ""
        if loop is None
        else (
            f"\nThat operation is {loop}: oocjax runs it whole, as one operation holding all its iterations' "
            "values, so it sets the floor whatever the model's depth. A Python loop over the layers (or no "
            "remat) lets each layer be planned on its own."
        )
    )
    if budget.headroom_bytes:
        note += (
            f"\nThe plan leaves {format_bytes(budget.headroom_bytes)} of the budget free for the device "
            "allocator's own overhead (headroom_bytes): the budget must cover both."
        )
    raise error.with_message(str(error) + note) from None


def _refuse_for_held_arguments(program: Program, error: BudgetInfeasibleError, options: PlannerOptions) -> None:
    """When the arguments the caller keeps on the device make the budget infeasible, say which to
    donate or pass in host memory."""
    held = [b for b, buffer in enumerate(program.buffers) if buffer.held_by_caller]
    if not held:
        return
    buffers = tuple(dataclasses.replace(buffer, held_by_caller=False) for buffer in program.buffers)
    released = Program(steps=program.steps, buffers=buffers)
    if max(required_bytes(released, options.min_offload_bytes)) > error.budget_bytes:
        return  # infeasible anyway: the planner's own error says why
    largest = sorted(held, key=lambda b: -program.buffers[b].nbytes)
    listed = "\n".join(
        f"  - {program.buffers[b].label.removeprefix('argument ')} ({format_bytes(program.buffers[b].nbytes)})"
        for b in largest[:10]
    )
    more = f"\n  ... and {len(held) - 10} more" if len(held) > 10 else ""
    total = format_bytes(sum(program.buffers[b].nbytes for b in held))
    raise error.with_message(
        f"a budget of {format_bytes(error.budget_bytes)} cannot hold the step together with the arguments "
        f"you keep on the device ({total}: passed in device memory and not donated, so they stay there for the "
        f"whole step):\n{listed}{more}\n"
        "Fixes:\n  1. donate them (donate_argnums), so that the step may move them;\n"
        "  2. pass them in host memory: oocjax.to_host(x), or jax.device_put(x, jax.memory.Space.Host);\n"
        f"  3. raise the budget to at least {format_bytes(error.required_bytes, round_up=True)}."
    ) from None


def over_budget_message(budget: int, history: list[tuple[int, int]], smallest: int | None) -> str:
    tries = "; ".join(f"planned for {format_bytes(p)}, measured {format_bytes(c)}" for p, c in history)
    limit = "" if smallest is None else f" (the planner cannot go below {format_bytes(smallest, round_up=True)})"
    return (
        f"the compiled segments of the step do not fit the budget of {format_bytes(budget)}: {tries}{limit}.\n"
        "XLA adds memory the plan's estimate cannot see (padding, fusion scratch, its own rematerialisation).\n"
        "Fixes:\n  1. raise the budget;\n  2. lower min_offload_bytes so that more values may move."
    )


def worst_segment(program: Program, segment: Segment, cost: SegmentCost) -> str:
    lines = list(dict.fromkeys(s.label for s in program.steps[segment.start : segment.stop] if s.label))
    shown = ", ".join(lines[:5]) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")
    return (
        f"\nThe largest segment runs equations {segment.start}..{segment.stop - 1} ({shown or 'no source lines'}): "
        f"it holds {format_bytes(segment.held_bytes)} when launched and its program allocates "
        f"{format_bytes(cost.launch_bytes)} more (scratch {format_bytes(cost.temp_bytes)}), "
        f"{format_bytes(segment.held_bytes + cost.launch_bytes)} in all."
    )


def state_returned_on_the_device(
    error: OocError,
    name: str,
    arguments: ArgumentSpec,
    earlier: Sequence[tuple[bool, ...]],
    held: tuple[bool, ...],
    call: tuple[tuple, dict],
) -> None:
    """When no plan fits with arguments the caller holds on the device, and an earlier call took
    those same leaves in host memory (``earlier``: which leaves each earlier plan of the signature
    had held by the caller), they are most likely that call's results (``state = step(state,
    batch)`` without donation, after ``to_host(state)``): say so, and to donate them.
    ``call`` is the call's ``(args, kwargs)``."""
    moved = [i for i, now in enumerate(held) if now and any(not h[i] for h in earlier)]
    if not moved:
        return
    args, kwargs = call
    paths = [path for path, _ in jax.tree.flatten_with_path(arguments.dynamic(args, kwargs))[0]]
    positions = sorted({arguments.position(paths[i], len(args)) for i in moved}, key=str)
    names = ", ".join(dict.fromkeys(arguments.label(paths[i][:2], len(args)) for i in moved))
    donate = ", ".join(str(p) for p in positions if p is not None)
    message = STATE_RETURNED_ON_THE_DEVICE.format(
        name=name,
        count=len(moved),
        names=names,
        donate=f"donate_argnums=({donate},)" if donate else "donate_argnums (pass it positionally)",
    )
    if isinstance(error, BudgetInfeasibleError):
        raise error.with_message(f"{error}\n{message}") from None
    error.add_note(message)
