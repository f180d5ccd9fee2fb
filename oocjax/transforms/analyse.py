"""From a traced training step to the planner's program.

Two passes, each one loop over equations:

* ``flatten`` inlines nested ``jit`` calls, so that the planner sees the real operations of the
  step rather than a handful of calls, and numbers every value with a global buffer id.
* ``to_program`` sizes every buffer from its aval and turns each flat equation into a planner step.
  Other higher-order primitives (``scan``, ``while``, ``cond``, ``checkpoint``, ``custom_jvp_call``,
  ``custom_vjp_call``) stay one opaque step each; a rule per primitive names its bodies, whose own
  peak becomes the step's scratch (``transient_bytes``) and whose work its flops. An unknown
  higher-order primitive is an error: guessing its memory could break the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from oocjax.errors import UnsupportedPrimitiveError
from oocjax.schedule import Buffer, Program, Step, keep_all, simulate
from oocjax.schedule._gc import gc_paused
from oocjax.transforms import _compat as jc

Ref = int | jc.Literal  # a buffer id, or a literal operand


@dataclass(frozen=True, slots=True)
class FlatEquation:
    """One equation of the flattened step: its operands and results as buffer ids."""

    eqn: jc.JaxprEqn
    inputs: tuple[Ref, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatProgram:
    """A step with nested ``jit`` calls inlined. Buffer ids ``0 .. num_inputs-1`` are its arguments."""

    equations: tuple[FlatEquation, ...]
    avals: tuple[Any, ...]
    num_inputs: int
    constants: tuple[tuple[int, Any], ...]  # (buffer id, value)
    outputs: tuple[Ref, ...]


_INLINED = {jc.jit_p: "jaxpr", jc.closed_call_p: "call_jaxpr"}


def flatten(closed: jc.ClosedJaxpr) -> FlatProgram:
    """Inlines nested ``jit`` (and ``closed_call``) equations, giving every value a buffer id."""
    avals: list[Any] = []
    constants: list[tuple[int, Any]] = []
    equations: list[FlatEquation] = []

    def new(aval: Any) -> int:
        avals.append(aval)
        return len(avals) - 1

    def inline(jaxpr: jc.Jaxpr, consts: Sequence[Any], operands: Sequence[Ref]) -> list[Ref]:
        env: dict[jc.Var, Ref] = dict(zip(jaxpr.invars, operands, strict=True))
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = new(var.aval)
            constants.append((env[var], value))

        def read(atom: Any) -> Ref:
            return atom if isinstance(atom, jc.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            inputs = [read(atom) for atom in eqn.invars]
            if eqn.primitive in _INLINED:
                callee = eqn.params[_INLINED[eqn.primitive]]
                results = inline(callee.jaxpr, callee.consts, inputs)
            else:
                results = [new(var.aval) for var in eqn.outvars]
                equations.append(FlatEquation(eqn, tuple(inputs), tuple(results)))
            for var, result in zip(eqn.outvars, results, strict=True):
                if not isinstance(var, jc.DropVar):
                    env[var] = result
        return [read(atom) for atom in jaxpr.outvars]

    with gc_paused():
        arguments = [new(var.aval) for var in closed.jaxpr.invars]
        outputs = inline(closed.jaxpr, closed.consts, arguments)
    return FlatProgram(
        equations=tuple(equations),
        avals=tuple(avals),
        num_inputs=len(arguments),
        constants=tuple(constants),
        outputs=tuple(outputs),
    )


# Per higher-order primitive: its bodies, each with how many times it runs (for flops).
BodyRule = Callable[[jc.JaxprEqn], list[tuple[Any, int]]]
body_rules: dict[Any, BodyRule] = {
    jc.scan_p: lambda eqn: [(eqn.params["jaxpr"], int(eqn.params["length"]))],
    jc.while_p: lambda eqn: [(eqn.params["cond_jaxpr"], 1), (eqn.params["body_jaxpr"], 1)],
    jc.cond_p: lambda eqn: [(branch, 1) for branch in eqn.params["branches"]],
    jc.remat_p: lambda eqn: [(eqn.params["jaxpr"], 1)],
    jc.custom_jvp_call_p: lambda eqn: [(eqn.params["call_jaxpr"], 1)],
    jc.custom_vjp_call_p: lambda eqn: [(eqn.params["call_jaxpr"], 1)],
}


def _dot_general_flops(eqn: jc.JaxprEqn) -> int:
    (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(lhs.shape[d] for d in lhs_contracting)


def _conv_flops(eqn: jc.JaxprEqn) -> int:
    rhs = eqn.invars[1].aval
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * prod(eqn.outvars[0].aval.shape) * prod(rhs.shape) // max(out_features, 1)


flops_rules: dict[str, Callable[[jc.JaxprEqn], int]] = {
    "dot_general": _dot_general_flops,
    "conv_general_dilated": _conv_flops,
}


def _default_flops(eqn: jc.JaxprEqn) -> int:
    """Element-wise work: one operation per output element."""
    return sum(prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)


@dataclass(frozen=True, slots=True)
class _BodyCost:
    scratch_bytes: int
    flops: int


class _Analysis:
    """Sizes, labels and costs of one step; bodies of opaque calls are analysed once each."""

    def __init__(self) -> None:
        self.bodies: dict[int, _BodyCost] = {}
        self.lines: dict[int, str] = {}  # id(eqn) -> its source line: looked up once per equation

    def source_line(self, eqn: jc.JaxprEqn) -> str:
        key = id(eqn)
        if key not in self.lines:
            self.lines[key] = jc.source_line(eqn)
        return self.lines[key]

    def program(self, flat: FlatProgram, *, input_labels: Sequence[str], donated: Sequence[bool]) -> Program:
        constant_ids = {b for b, _ in flat.constants}
        defined_by: dict[int, jc.JaxprEqn] = {o: fe.eqn for fe in flat.equations for o in fe.outputs}
        outputs = [r for r in flat.outputs if isinstance(r, int)]
        aliases = _donation_aliases(flat, outputs, donated)
        returned = set(outputs)
        buffers = []
        for b, aval in enumerate(flat.avals):
            if b < flat.num_inputs:
                kind, label = "input", f"argument {input_labels[b]}"
            elif b in constant_ids:
                kind, label = "constant", f"constant {aval.str_short()}"
            else:
                eqn = defined_by[b]
                where = self.source_line(eqn)
                kind, label = "computed", f"output of {eqn.primitive.name}" + (f" from {where}" if where else "")
            buffers.append(
                Buffer(
                    nbytes=jc.nbytes(aval),
                    kind=kind,
                    is_output=b in returned,
                    donated=b < flat.num_inputs and bool(donated[b]),
                    aliased_input=aliases.get(b),
                    label=label,
                )
            )
        steps = tuple(self.step(fe, flat.avals) for fe in flat.equations)
        return Program(steps=steps, buffers=tuple(buffers))

    def step(self, fe: FlatEquation, avals: Sequence[Any]) -> Step:
        eqn = fe.eqn
        reads = tuple(dict.fromkeys(r for r in fe.inputs if isinstance(r, int)))
        scratch, flops = 0, flops_rules.get(eqn.primitive.name, _default_flops)(eqn)
        if eqn.primitive in body_rules:
            costs = [(self.body(body), trips) for body, trips in body_rules[eqn.primitive](eqn)]
            scratch = max(c.scratch_bytes for c, _ in costs)
            flops = max(c.flops * trips for c, trips in costs)
        elif eqn.primitive not in jc.combiner_primitives and any(True for _ in jc.sub_jaxprs(eqn.params)):
            where = jc.source_line(eqn) or "an unknown source line"
            raise UnsupportedPrimitiveError(
                f"oocjax has no rule for the higher-order primitive {eqn.primitive.name!r} (at {where}).\n"
                "It cannot size the memory such a call uses inside, and guessing could break the budget.\n"
                "Fixes:\n  1. move the call out of the function given to ooc_jit, or\n"
                f"  2. add a rule: oocjax.transforms.analyse.body_rules[{eqn.primitive.name}_p] = "
                "lambda eqn: [(body_jaxpr, trip_count), ...]"
            )
        touched = sum(jc.nbytes(avals[b]) for b in (*reads, *fe.outputs))
        return Step(
            reads=reads,
            writes=fe.outputs,
            transient_bytes=scratch,
            flops=flops,
            bytes_accessed=touched,
            name=eqn.primitive.name,
            label=self.source_line(eqn),
        )

    def body(self, jaxpr: Any) -> _BodyCost:
        """A body's own peak beyond its arguments and results, and its flops."""
        key = id(jaxpr)
        if key not in self.bodies:
            closed = jaxpr if isinstance(jaxpr, jc.ClosedJaxpr) else jc.ClosedJaxpr(jaxpr, ())
            flat = flatten(closed)
            labels = [f"body argument {i}" for i in range(flat.num_inputs)]
            program = self.program(flat, input_labels=labels, donated=[False] * flat.num_inputs)
            boundary = {*range(flat.num_inputs), *(r for r in flat.outputs if isinstance(r, int))}
            boundary_bytes = sum(program.buffers[b].nbytes for b in boundary)
            peak = simulate(program, keep_all(program)).peak_bytes
            self.bodies[key] = _BodyCost(max(0, peak - boundary_bytes), sum(s.flops for s in program.steps))
        return self.bodies[key]


def _donation_aliases(flat: FlatProgram, outputs: Sequence[int], donated: Sequence[bool]) -> dict[int, int]:
    """Which output takes over which donated input: as XLA pairs them, the first output of the same
    shape and dtype not yet taken, for each donated input in order."""
    free = [o for o in dict.fromkeys(outputs) if o >= flat.num_inputs]
    aliases: dict[int, int] = {}
    for b in range(flat.num_inputs):
        if not donated[b]:
            continue
        aval = flat.avals[b]
        for o in free:
            if flat.avals[o].shape == aval.shape and flat.avals[o].dtype == aval.dtype:
                aliases[o] = b
                free.remove(o)
                break
    return aliases


def to_program(flat: FlatProgram, *, input_labels: Sequence[str], donated: Sequence[bool]) -> Program:
    """The planner's program for a flattened step."""
    with gc_paused():
        return _Analysis().program(flat, input_labels=input_labels, donated=donated)
