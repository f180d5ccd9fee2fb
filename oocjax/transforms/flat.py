"""The flat program: a traced step as one list of equations over numbered buffers.

``transforms.flatten`` makes it from a jaxpr (nested calls inlined, every value a buffer id); the
later passes read it: ``transforms.analyse`` sizes and costs it for the planner,
``transforms.recompute`` rewrites it with copies, ``transforms.functions`` makes its segments into functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oocjax.transforms import compat as jc

Ref = int | jc.Literal  # a buffer id, or a literal operand


@dataclass(frozen=True, slots=True)
class FlatEquation:
    """One equation of the flattened step: its operands and results as buffer ids."""

    eqn: jc.JaxprEqn
    inputs: tuple[Ref, ...]
    outputs: tuple[int, ...]
    recompute_of: int | None = None  # for a copy (``transforms.recompute``): the equation it runs again


@dataclass(frozen=True, slots=True)
class FlatProgram:
    """A step with nested ``jit`` calls inlined. Buffer ids ``0 .. num_inputs-1`` are its arguments."""

    equations: tuple[FlatEquation, ...]
    avals: tuple[Any, ...]
    num_inputs: int
    constants: tuple[tuple[int, Any], ...]  # (buffer id, value)
    outputs: tuple[Ref, ...]
    loops: tuple[LoopInfo, ...] = ()  # top-level scans, unrolled or not
    dead_equations: int = 0  # equations ``flatten`` dropped because nobody reads their results
    # (buffer, name) for each buffer an inlined call of a named function returned (``jax.nn.silu``'s
    # jit): the name its user calls it by, for its label.
    result_names: tuple[tuple[int, str], ...] = ()

    @property
    def result_buffers(self) -> tuple[int | None, ...]:
        """Per result of the step, in order, its buffer (None for a literal)."""
        return tuple(r if type(r) is int else None for r in self.outputs)

    @property
    def recomputed_pairs(self) -> tuple[tuple[int, int], ...]:
        """(original, copy) per recomputed equation."""
        return tuple((fe.recompute_of, k) for k, fe in enumerate(self.equations) if fe.recompute_of is not None)


def dataflow(flat: FlatProgram) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Per equation, the buffers it reads (literals left out) and those it writes."""
    return [[r for r in fe.inputs if type(r) is int] for fe in flat.equations], [fe.outputs for fe in flat.equations]


@dataclass(frozen=True, slots=True)
class LoopInfo:
    """A top-level ``scan``: where it is, its length, and whether it runs one iteration at a time."""

    label: str
    length: int
    unrolled: bool
