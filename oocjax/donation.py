"""Donated arguments, as ``jax.jit`` treats them: a successful call deletes every donated array
(except one the step returns as it is), and a failed call says which it had already consumed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from oocjax.transforms.trace import TracedStep


def delete_donated_originals(leaves: Sequence[Any], copies: Sequence[bool], donated: Sequence[bool]) -> list[int]:
    """As ``jax.jit`` does with a donated argument: a donated array that was copied to the memory
    the plan wants it in is deleted (the copy has its own buffer). Returns their positions."""
    deleted = []
    for i, (original, copied, gave) in enumerate(zip(leaves, copies, donated)):
        if copied and gave and isinstance(original, jax.Array):
            original.delete()
            deleted.append(i)
    return deleted


def delete_unreturned(donated: Sequence[Any], results: Sequence[Any]) -> None:
    """After a successful call, every donated argument is deleted, as ``jax.jit`` deletes donated
    arguments, whether a segment consumed it, the call copied it or neither (then old and new state
    would otherwise both stay alive, in device or host memory). One that the step returns as it is stays."""
    returned = {id(x) for x in results}
    for x in donated:
        if id(x) not in returned and isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def consumed_note(traced: TracedStep, consumed: Sequence[int]) -> str:
    names = [traced.program.buffers[i].label.removeprefix("argument ") for i in consumed]
    shown = ", ".join(names)  # every one: the caller must know exactly which leaves to rebuild
    return (
        f"oocjax: the failed call had already consumed {len(names)} donated argument(s); "
        f"their buffers are gone: {shown}. The other donated arguments are intact."
    )
