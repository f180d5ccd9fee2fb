"""Steps planned with some of their planner's stages replaced (``oocjax.pipeline.Seams``), and the
stages a first call logged: how the tests inject a fault or count what a call did."""

import logging

from oocjax.testing import Seams, with_seams

__all__ = ["REAL", "capture_stages", "logged_stages", "plans_made", "with_seams"]
REAL = Seams()  # the stages every planner uses


def logged_stages(caplog) -> list[str]:
    """The stages the ``oocjax`` logger recorded so far in this test, by name (without the time)."""
    return [r.getMessage().rsplit(":", 1)[0] for r in caplog.records if r.name == "oocjax"]


def plans_made(caplog) -> int:
    """How many plans were made so far in this test: first plans and re-plans."""
    return sum(stage == "plan" or stage.startswith("re-plan") for stage in logged_stages(caplog))


def capture_stages(caplog) -> None:
    """Records the ``oocjax`` logger's stages from here on (what an INFO level set outside the test,
    such as ``--log-level``, captured before is dropped)."""
    caplog.set_level(logging.INFO, logger="oocjax")
    caplog.clear()
