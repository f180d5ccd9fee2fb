"""The analysis: from a flat program (``transforms.flatten``) to the planner's program.

``to_program`` sizes every buffer from its aval and turns each flat equation into a planner step.
It labels every value as its user would name it: arguments and results by their pytree paths
(``argument state['w']``, ``result[0]['w']``), other values by the scope they were made in (a
Flax module path), the operation as users call it (``rules.user_name``) and the user's line.
Higher-order primitives that ``flatten`` leaves in place (``scan``, ``while``, ``cond``,
``custom_jvp_call``, ``custom_vjp_call``) stay one opaque step each, whose own peak becomes the
step's scratch (``transient_bytes``) and whose work its flops; each primitive's ``PrimitiveRule``
(``transforms.rules``) says which bodies it runs, how many times, and a first-order one's flops.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from oocjax.schedule import Buffer, Program, Step, keep_all, simulate
from oocjax.transforms import compat as jc
from oocjax.transforms.flat import FlatEquation, FlatProgram
from oocjax.transforms.flatten import flatten
from oocjax.transforms.rules import PrimitiveRule, rule_for, user_name


def _bodies(eqn: jc.JaxprEqn, rule: PrimitiveRule) -> Iterator[Any]:
    for param in rule.body_params:
        value = eqn.params[param]
        # A tuple param may hold unused places (``custom_linear_solve``'s jaxprs without a transpose).
        yield from (body for body in (value if isinstance(value, tuple) else (value,)) if body is not None)


@dataclass(frozen=True, slots=True)
class _BodyCost:
    scratch_bytes: int
    flops: int


class _Analysis:
    """Sizes, labels and costs of one step; bodies of opaque calls are analysed once each."""

    def __init__(self) -> None:
        self.bodies: dict[int, _BodyCost] = {}
        # id(eqn) -> (eqn, its source line): looked up once per equation. The equation is kept so that
        # its id is not reused (``flatten`` makes equations of inlined bodies anew).
        self.lines: dict[int, tuple[jc.JaxprEqn, str]] = {}

    def source_line(self, eqn: jc.JaxprEqn) -> str:
        key = id(eqn)
        if key not in self.lines:
            self.lines[key] = eqn, jc.source_line(eqn)
        return self.lines[key][1]

    def value_label(self, eqn: jc.JaxprEqn, called: str | None = None, root: str = "") -> str:
        """``"Block_2/Dense_0: output of dot_general from model.py:42 (__call__)"``: the scope (Flax
        module path) the value was made in, where there is one, then what made it, as its user calls
        it (``called``: the named function an inlined call of which returned it, else
        ``rules.user_name``), and the user's source line. ``root`` is left out of the scope."""
        what = f"output of {called or user_name(eqn)}"
        where = self.source_line(eqn)
        if where:
            what += f" from {where}"
        scope = jc.scope_path(eqn)
        if root and (scope == root or scope.startswith(root + "/")):
            scope = scope[len(root) + 1 :]
        return f"{scope}: {what}" if scope else what

    def program(
        self,
        flat: FlatProgram,
        *,
        input_labels: Sequence[str],
        donated: Sequence[bool],
        output_labels: Sequence[str] = (),
    ) -> Program:
        constant_ids = {b for b, _ in flat.constants}
        defined_by: dict[int, jc.JaxprEqn] = {o: fe.eqn for fe in flat.equations for o in fe.outputs}
        outputs = [r for r in flat.outputs if isinstance(r, int)]
        aliases = _donation_aliases(flat, outputs, donated)
        returned = set(outputs)
        # A result is named by where the step returns it, as an argument is by where it is given
        # (``result[0]['params']['w']``, jax's own spelling): that is the state leaf it becomes.
        result_labels: dict[int, str] = {}
        for r, label in zip(flat.outputs, output_labels):
            if isinstance(r, int) and r in defined_by:
                result_labels.setdefault(r, label)
        called = dict(flat.result_names)
        root = _common_root(jc.scope_path(fe.eqn) for fe in flat.equations)
        buffers = []
        for b, aval in enumerate(flat.avals):
            if b < flat.num_inputs:
                kind, label = "input", f"argument {input_labels[b]}"
            elif b in constant_ids:
                kind, label = "constant", f"constant {aval.str_short()}"
            else:
                kind = "computed"
                label = result_labels.get(b) or self.value_label(defined_by[b], called.get(b), root)
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
        rule = rule_for(eqn)
        scratch, flops = rule.scratch(eqn), rule.flops(eqn)
        if rule.body_params:
            costs = [self.body(body) for body in _bodies(eqn, rule)]
            scratch = max(c.scratch_bytes for c in costs)
            flops = rule.trip_count(fe) * rule.combine_flops(c.flops for c in costs)
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
            flat = flatten(closed, unroll=False)
            labels = [f"body argument {i}" for i in range(flat.num_inputs)]
            program = self.program(flat, input_labels=labels, donated=[False] * flat.num_inputs)
            boundary = {*range(flat.num_inputs), *(r for r in flat.outputs if isinstance(r, int))}
            boundary_bytes = sum(program.buffers[b].nbytes for b in boundary)
            peak = simulate(program, keep_all(program)).peak_bytes
            self.bodies[key] = _BodyCost(max(0, peak - boundary_bytes), sum(s.flops for s in program.steps))
        return self.bodies[key]


def _common_root(paths: Iterable[str]) -> str:
    """The first scope of every scoped equation, when they share one and it is named as a class is
    (a capital first letter): a Flax model's root module, which Flax names by its class (its
    submodules by attribute names or ``Dense_0``). It tells no two values apart, and Flax's own
    parameter paths start below it, so labels leave it out: ``Block_2/Dense_0`` rather than
    ``Transformer/Block_2/Dense_0``. A user's own scope (``jax.named_scope("encoder")``) stays."""
    roots = {path.split("/", 1)[0] for path in paths if path}
    root = roots.pop() if len(roots) == 1 else ""
    return root if root[:1].isupper() else ""


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


def to_program(
    flat: FlatProgram, *, input_labels: Sequence[str], donated: Sequence[bool], output_labels: Sequence[str] = ()
) -> Program:
    """The planner's program for a flattened step. Arguments are labelled ``argument <input label>``,
    results by their ``output_labels`` (``result[0]['w']``), other values by ``_Analysis.value_label``."""
    return _Analysis().program(flat, input_labels=input_labels, donated=donated, output_labels=output_labels)
