"""Errors users can catch. No jax here: the planner raises these too."""

from __future__ import annotations


class OocError(Exception):
    """Base class of every error oocjax raises on purpose."""


class BudgetInfeasibleError(OocError, ValueError):
    """The budget is below what one operation needs on the device at once.

    Attributes:
      budget_bytes: the budget that was asked for.
      required_bytes: the smallest budget any schedule can meet.
      step: index of the operation that needs ``required_bytes``.
      where: that operation, as a user reads it (primitive and source line).
    """

    def __init__(self, message: str, *, budget_bytes: int, required_bytes: int, step: int, where: str):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.required_bytes = required_bytes
        self.step = step
        self.where = where

    def with_message(self, message: str) -> BudgetInfeasibleError:
        """The same finding (budget, floor, operation), told another way."""
        found = dict(budget_bytes=self.budget_bytes, required_bytes=self.required_bytes, step=self.step)
        return BudgetInfeasibleError(message, **found, where=self.where)


class UnsupportedPrimitiveError(OocError, NotImplementedError):
    """A higher-order primitive oocjax has no rule for; guessing could give wrong sizes."""
