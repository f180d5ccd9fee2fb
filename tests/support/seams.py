"""Steps planned with some of their planner's stages replaced (``oocjax.pipeline.Seams``), and the
stages a first call logged: how the tests inject a fault or count what a call did."""

import logging

from oocjax.api import OocJitted
from oocjax.pipeline import Seams

REAL = Seams()  # the stages every planner uses


def with_seams(step: OocJitted, **replaced) -> OocJitted:
    """``step`` (made by ``ooc_jit``) with the planner stages in ``replaced`` (``Seams``' fields)."""
    return OocJitted(step.arguments, budget_bytes=step.budget_bytes, options=step.options, seams=Seams(**replaced))


def logged_stages(caplog) -> list[str]:
    """The stages the ``oocjax`` logger recorded so far in this test, by name (without the time)."""
    return [r.getMessage().rsplit(":", 1)[0] for r in caplog.records if r.name == "oocjax"]


def plans_made(caplog) -> int:
    """How many plans were made so far in this test: first plans and re-plans."""
    return sum(stage == "plan" or stage.startswith("re-plan") for stage in logged_stages(caplog))


def capture_stages(caplog) -> None:
    caplog.set_level(logging.INFO, logger="oocjax")
