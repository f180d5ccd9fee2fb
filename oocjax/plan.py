"""``Plan``: what ``ooc_jit`` decided for one signature of a step, in the user's terms."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import oocjax.plan_json as plan_json
from oocjax.schedule import Chain, MemoryTimeline, Program, Schedule, format_bytes
from oocjax.schedule.profiles import DeviceProfile
from oocjax.schedule.segments import Segment, SegmentCost
from oocjax.schedule.units import counted


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadInfo:
    """One value sent to host during the step.

    Attributes:
      label: where it comes from ("output of dot_general from model.py:42").
      nbytes: its size.
      offload_after: the equation after which it is copied out.
      prefetch_before: the equation at whose start it is copied back; None if it never comes back
        (an output returned in host memory).
    """

    label: str
    nbytes: int
    offload_after: int
    prefetch_before: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class HostInputInfo:
    """An argument that lives in host memory between steps and is streamed in where it is read."""

    label: str
    nbytes: int
    prefetch_before: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputeInfo:
    """A value dropped after its early (forward) reads and computed again for its later ones.

    Attributes:
      label: where it comes from ("output of tanh from model.py:42").
      nbytes: its size: what the device does not hold between the two.
      dropped_after: the last equation that reads the original.
      recomputed_at: the equation (of the step as it runs, copies included) that computes it again.
    """

    label: str
    nbytes: int
    dropped_after: int
    recomputed_at: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan:
    """The plan for one argument signature. Equation indices refer to ``source_jaxpr`` with nested
    ``jit`` calls inlined (the planner's steps).

    Attributes:
      budget_bytes: the device budget.
      peak_bytes: simulated device peak with the plan.
      baseline_peak_bytes: the same estimate with nothing moved (in-core).
      host_peak_bytes: simulated host memory peak (host state and host copies).
      offloads: one entry per value copied to host during the step, in plan order.
      host_inputs: arguments kept on host between steps.
      host_outputs: labels of results returned in host memory.
      jaxpr: the step as it runs: segment calls (``jit`` equations named ``segment_<i>``, each
        holding its part of the step) with the transfers and waits between them, in execution
        order; the traced step itself when nothing moves. Traced when first read (it is for
        people: the executor runs ``chain``).
      source_jaxpr: the step as traced.
      program, schedule, timeline, baseline_timeline: the planner's view, for tools and plots.
      segments: the compiled programs the step runs as, in order (empty when nothing moves: then
        the step is ``jax.jit``'s own program).
      chain: those segments with the waits and transfers around them, in the order they run
        (``schedule.Chain``): the very value the executor runs and the simulator's chain check
        replayed; None when nothing moves.
      segment_costs: per segment, its compiled program's own memory (``memory_analysis``).
      executed_peak_bytes: the chain's device peak from those measurements: per segment, what the
        executor holds when it launches it plus what its program allocates. None when nothing moves.
        The schedule's ``budget_bytes`` is the budget it was planned for, smaller than
        ``budget_bytes`` where a first plan measured over it.
      input_kinds: the memory kind (``"device"`` or ``"pinned_host"``) each argument leaf
        (``jax.tree.leaves`` of the non-static arguments) is kept in between steps; an argument
        given in the other one is moved first.
      attempts: the executed peak measured for each plan made, in order: more than one where a
        chain measured over the budget was planned again with its segments' real scratch.
      headroom_bytes: device memory the plan leaves free within the budget for what the allocator
        takes beyond the arrays and programs it accounts for (on a GPU: a default share of the
        budget at first, more after a call measured over the budget).
      loops: the step's top-level scans (``transforms.analyse.LoopInfo``: label, length, and whether
        it runs one iteration at a time or whole, as one operation).
      device: the device the step was planned and compiled for (``"cpu"``, ``"NVIDIA H200"``), or
        the device profile it was planned for (``"h200"``: ``step.plan(..., profile="h200")``);
        empty for a plan built by hand.
      compiled: whether ``segment_costs`` are the compiled segments' own reports. False for a plan
        made for a device profile: nothing was compiled, each segment's memory is the planner's
        estimate, and ``executed_peak_bytes`` is None.
      mesh: on several devices, the mesh (``"8 devices, mesh data=2 model=4"``): the budget and
        every byte figure are then per device. Empty on one device.
      recomputed: the values recomputed instead of kept or moved (``RecomputeInfo``); then
        ``program`` holds the copies of their producing equations.
      extra_flops: the work those copies add to the step.
      postponed: the equations run where the backward pass first reads their results instead of
        in the forward pass, which never reads them (a derivative made for the backward alone).
      origin_step: where ``program`` recomputes, per step the step of ``source_jaxpr`` it runs (a copy,
        or an original run where its results are first read); empty where it is the traced step.
      layer_policy: where the step was planned by layer (``schedule.layer_plan``), its policy, one
        line per kind of layer; empty where it was planned one operation at a time.
      layer_alternatives: the other layer policies timed, one line each with why it was not taken.
      step_time_s, swap_only_time_s: the simulated step time of this plan and of the swap-only plan
        it was chosen against (on the device profile it was planned with; None where not compared).
      swap_only_moved_bytes: what that swap-only plan's copies move, both ways together.
      layers: ``(start, stop, kind)`` per run of a layer's steps in ``program``, forward, backward
        (``"transpose Block"``) and update (``"update Block"``), where layers were found.
      in_core_time_s: the simulated step time on the same profile with nothing moved or
        recomputed, as ``jax.jit`` would run it on a device large enough (None where not planned).
      timings: ``(stage, seconds)`` per stage of making the plan, in order (trace, layers, plan,
        cut, compile, measure, re-plans, build), as the ``oocjax`` logger recorded them at INFO.
    """

    budget_bytes: int
    peak_bytes: int
    baseline_peak_bytes: int
    host_peak_bytes: int
    offloads: tuple[OffloadInfo, ...]
    host_inputs: tuple[HostInputInfo, ...]
    host_outputs: tuple[str, ...]
    jaxpr_maker: Callable[[], Any] | None = field(repr=False)  # makes ``jaxpr``
    source_jaxpr: Any
    program: Program
    schedule: Schedule
    timeline: MemoryTimeline
    baseline_timeline: MemoryTimeline
    segments: tuple[Segment, ...] = ()
    segment_costs: tuple[SegmentCost, ...] = ()
    executed_peak_bytes: int | None = None
    attempts: tuple[int, ...] = ()
    input_kinds: tuple[str, ...] = ()
    headroom_bytes: int = 0
    loops: tuple[Any, ...] = ()
    device: str = ""
    compiled: bool = True
    mesh: str = ""  # on several devices: "8 devices, mesh data=8" (every byte figure is per device)
    recomputed: tuple[RecomputeInfo, ...] = ()
    extra_flops: int = 0
    postponed: int = 0
    origin_step: tuple[int, ...] = ()
    layer_policy: tuple[str, ...] = ()
    layer_alternatives: tuple[str, ...] = ()
    step_time_s: float | None = None
    swap_only_time_s: float | None = None
    swap_only_moved_bytes: int | None = None
    in_core_time_s: float | None = None
    layers: tuple[tuple[int, int, str], ...] = ()
    chain: Chain | None = None
    timings: tuple[tuple[str, float], ...] = ()

    @functools.cached_property
    def jaxpr(self) -> Any:
        return None if self.jaxpr_maker is None else self.jaxpr_maker()

    @classmethod
    def build(
        cls,
        *,
        program: Program,
        schedule: Schedule,
        timeline: MemoryTimeline,
        baseline_timeline: MemoryTimeline,
        jaxpr: Any,
        source_jaxpr: Any,
        budget_bytes: int | None = None,
        rewrite: Any = None,
        **measured: Any,
    ) -> Plan:
        """The plan of ``schedule`` for ``program`` with its ``timeline`` (the replay it was checked
        with) and the in-core ``baseline_timeline`` of the step as traced; ``measured`` sets the
        fields that come from tracing, compiling and running it (``chain``, ``segments``,
        ``segment_costs``, ``executed_peak_bytes``, ``attempts``, ``input_kinds``, ...).
        ``rewrite`` (``schedule.Rewrite``) says which values ``program`` recomputes. ``jaxpr`` is
        the jaxpr, or a function of nothing that traces it when first read."""
        fetches = {b: [p.issue_step for p in ps] for b, ps in schedule.prefetches_by_buffer.items()}
        buffers = program.buffers
        offloads = tuple(
            OffloadInfo(
                label=buffers[m.buffer].label,
                nbytes=buffers[m.buffer].nbytes,
                offload_after=m.after_step,
                prefetch_before=fetches.get(m.buffer, [None])[0],
            )
            for m in schedule.offloads
        )
        host_inputs = tuple(
            HostInputInfo(label=buffers[b].label, nbytes=buffers[b].nbytes, prefetch_before=tuple(fetches.get(b, ())))
            for b in sorted(schedule.host_inputs)
        )
        return cls(
            budget_bytes=schedule.budget_bytes if budget_bytes is None else budget_bytes,
            peak_bytes=timeline.peak_bytes,
            baseline_peak_bytes=baseline_timeline.peak_bytes,
            host_peak_bytes=timeline.host_peak_bytes,
            offloads=offloads,
            host_inputs=host_inputs,
            host_outputs=tuple(buffers[b].label for b in sorted(schedule.host_outputs)),
            jaxpr_maker=jaxpr if callable(jaxpr) or jaxpr is None else lambda: jaxpr,
            source_jaxpr=source_jaxpr,
            program=program,
            schedule=schedule,
            timeline=timeline,
            baseline_timeline=baseline_timeline,
            recomputed=() if rewrite is None else _recomputed(program, rewrite),
            extra_flops=0 if rewrite is None else rewrite.extra_flops,
            postponed=0 if rewrite is None else len(rewrite.postponed_steps),
            origin_step=() if rewrite is None else rewrite.origin_step,
            **measured,
        )

    @property
    def moved_bytes(self) -> int:
        """Bytes copied each way together during one step."""
        return self.timeline.h2d_bytes + self.timeline.d2h_bytes

    def __repr__(self) -> str:
        executed = "" if self.executed_peak_bytes is None else f", executed {format_bytes(self.executed_peak_bytes)}"
        on_host = f", {counted(len(self.host_inputs), 'argument')} kept on host" if self.host_inputs else ""
        by_layer = " by layer" if self.layer_policy else ""
        recomputed = f", {counted(len(self.recomputed), 'value')} recomputed{by_layer}" if self.recomputed else ""
        mesh = f", per device on {self.mesh}" if self.mesh else ""
        return (
            f"Plan(peak={format_bytes(self.peak_bytes)} / budget {format_bytes(self.budget_bytes)}{executed}, "
            f"in-core {format_bytes(self.baseline_peak_bytes)}, {counted(len(self.segments), 'segment')}, "
            f"{counted(len(self.offloads), 'offload')}{on_host}{recomputed}, "
            f"{format_bytes(self.moved_bytes)} moved{mesh})"
        )

    # -- views (oocjax.render, oocjax.plotting) ------------------------------------------------

    def summary(self, profile: DeviceProfile | str | None = None, *, largest: int = 10) -> str:
        """A text report: budget, in-core and planned peaks (and where), measured peak, traffic,
        host memory and the largest moves; with a ``profile`` (a name from
        ``oocjax.schedule.profiles.PROFILES`` such as ``"h100"``, or a ``DeviceProfile``), also the step
        time simulated on a model of that device, not a measurement; the report names the modelled
        device and its rates, and says so when the plan was made for another."""
        from oocjax.render import summary

        return summary(self, profile, largest=largest)

    def plot(self, ax: Any = None, profile: DeviceProfile | str | None = None) -> Any:
        """Device memory over the program, in-core against planned, with the budget, what is on
        host and every move, over the step's phases (forward, backward, optimizer) and layers,
        shaded and named. In a figure of its own (no ``ax``), tables of the largest moves and
        recomputed values under it; with a ``profile``, a panel with the compute and copy streams
        over time. Needs matplotlib (``pip install oocjax[plot]``). Returns the memory axes, or
        (memory axes, stream axes) with a profile."""
        from oocjax.plotting import plot

        return plot(self, ax=ax, profile=profile)

    def pretty_jaxpr(self, *, full: bool = False) -> str:
        """The step as it runs: segments in order, with the transfers and waits between them and
        what moves (label and size); ``full=True`` appends the chain's whole jaxpr."""
        from oocjax.jaxpr_view import pretty_jaxpr

        return pretty_jaxpr(self, full=full)

    def _repr_html_(self) -> str:
        from oocjax.render import html_view

        return html_view(self)

    # -- saving (oocjax.plan_json) -----------------------------------------------------------------

    def to_json(self, *, full: bool = False) -> str:
        """The plan as JSON, small enough to keep beside each run's logs: device, budget, peaks,
        traffic, attempts and every move with its label and size. ``full=True`` adds what
        ``from_json`` rebuilds the plan from: the planner's program and schedule, and the segments
        the step runs as with their measured costs."""
        return plan_json.dumps(self, full=full)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan saved with ``to_json(full=True)``, segments included; its ``jaxpr`` and
        ``source_jaxpr`` are None (so its plot has no phases or layers), and so are its ``loops``."""
        built, restored = plan_json.loads(text)
        plan = cls.build(**built)
        recomputed = tuple(RecomputeInfo(**r) for r in restored.pop("recomputed"))
        return dataclasses.replace(plan, recomputed=recomputed, **restored)


def _recomputed(program: Program, rewrite: Any) -> tuple[RecomputeInfo, ...]:
    """Per recomputed value, where its original dies and where its copy is made."""
    copy_of: dict[int, int] = {}  # original buffer -> the copy step that computes it again
    for step in rewrite.copied_steps:
        for b in program.steps[step].writes:
            copy_of.setdefault(rewrite.origin_buffer[b], step)
    reads = program.uses.read_at
    return tuple(
        RecomputeInfo(
            label=program.buffers[b].label,
            nbytes=program.buffers[b].nbytes,
            dropped_after=reads[b][-1] if reads[b] else program.uses.defined_at[b],
            recomputed_at=copy_of[b],
        )
        for b in rewrite.recomputed
        if b in copy_of
    )
