"""Recomputation, the transforms side: which equations may run twice, and a planner rewrite as a flat program.

``schedule.recompute`` decides, over the pure-Python ``Program``, which values to drop and compute
again. Two things it cannot know live here:

* **May an equation run twice?** (``recomputable_steps``). Only if running it again gives the same
  results and does nothing else. Per primitive, its rule's ``why_not_recomputable``
  (``transforms.rules``) says why not (or ``None``); the default rule refuses an equation if it has
  effects (a print, an ``io_callback``, a side-effecting FFI call: running it twice would do it
  twice), else allows it after the same check on every equation of the jaxprs it holds. Random
  numbers from explicit keys are allowed: a JAX key is a value, so a copy of ``random_bits`` on the
  same key gives the same bits (this is also what ``jax.checkpoint`` relies on).
* **The rewrite as equations** (``apply_rewrite``): per step of ``Rewrite.program``, the original
  equation it runs, on the rewrite's buffer ids. Copies are marked (``FlatEquation.recompute_of``),
  so that ``transforms.functions`` can keep XLA from merging a copy with its original again.
"""

from __future__ import annotations

from oocjax.schedule.program import Step
from oocjax.schedule.recompute import Rewrite
from oocjax.transforms.flat import FlatEquation, FlatProgram, Ref
from oocjax.transforms.rules import why_not_recomputable


def recomputable_steps(flat: FlatProgram) -> tuple[bool, ...]:
    """Per flat equation (a step of the program ``to_program`` builds), whether it may run twice:
    the ``recomputable`` argument of ``schedule.recompute`` is ``recomputable_steps(flat).__getitem__``.

    >>> import jax, jax.numpy as jnp
    >>> from oocjax.transforms.flatten import flatten
    >>> def f(x):
    ...     jax.debug.print("x = {}", x)
    ...     return jnp.sin(x)
    >>> recomputable_steps(flatten(jax.make_jaxpr(f)(1.0)))
    (False, True)
    """
    return tuple(why_not_recomputable(fe.eqn) is None for fe in flat.equations)


def apply_rewrite(flat: FlatProgram, rewrite: Rewrite) -> FlatProgram:
    """The flat program that runs ``rewrite.program`` step for step.

    Each new step binds the equation of its original step (``rewrite.origin_step``) on the new
    buffers: an operand is the buffer the step reads that holds the original operand's value
    (``rewrite.origin_buffer``), literals stay. Copies get ``recompute_of``: the index, in the
    returned program, of the original equation they run again.

    Args:
      flat: the flat program ``rewrite`` was made from (its ``to_program`` is the rewrite's input).
      rewrite: a rewrite of that program (``recompute_program``, ``choose_recompute``).

    Raises:
      ValueError: if ``rewrite`` does not fit ``flat`` (another program's rewrite).
    """
    origin_buffer, copied = rewrite.origin_buffer, set(rewrite.copied_steps)
    original_steps = len(rewrite.origin_step) - len(copied)
    original_buffers = len(origin_buffer) - sum(len(rewrite.program.steps[i].writes) for i in copied)
    if (original_steps, original_buffers) != (len(flat.equations), len(flat.avals)):
        raise ValueError(
            f"the rewrite was not made from this flat program: it rewrites {original_steps} steps of "
            f"{original_buffers} buffers, the flat program has {len(flat.equations)} equations of "
            f"{len(flat.avals)} buffers"
        )
    original_at: dict[int, int] = {}  # original equation -> its index in the new program
    equations = []
    for i, (s, step) in enumerate(zip(rewrite.origin_step, rewrite.program.steps, strict=True)):
        fe = _remapped(flat.equations[s], step, origin_buffer, i)
        if i in copied:
            equations.append(FlatEquation(fe.eqn, fe.inputs, fe.outputs, recompute_of=original_at[s]))
        else:
            original_at[s] = i
            equations.append(fe)
    return FlatProgram(
        equations=tuple(equations),
        avals=tuple(flat.avals[b] for b in origin_buffer),
        num_inputs=flat.num_inputs,
        constants=flat.constants,
        outputs=flat.outputs,
        loops=flat.loops,
        dead_equations=flat.dead_equations,
    )


def _remapped(fe: FlatEquation, step: Step, origin_buffer: tuple[int, ...], i: int) -> FlatEquation:
    """``fe`` on the buffers ``step`` reads and writes. The step lists each read once and no
    literals, so operands are matched by the original value each buffer holds, not by position."""
    holding = {origin_buffer[b]: b for b in step.reads}
    if len(holding) != len(step.reads) or holding.keys() != {r for r in fe.inputs if isinstance(r, int)}:
        raise ValueError(f"step {i} of the rewrite does not read one version of each operand of its equation")
    writes = tuple(origin_buffer[w] for w in step.writes)
    if writes != fe.outputs:
        raise ValueError(f"step {i} of the rewrite writes {writes} where its equation writes {fe.outputs}")

    def version(r: Ref) -> Ref:
        return holding[r] if isinstance(r, int) else r

    return FlatEquation(fe.eqn, tuple(map(version, fe.inputs)), step.writes)
