"""The stages of making a plan, each timed and logged at INFO on the ``oocjax`` logger; a plan keeps
them (``Plan.timings``)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("oocjax")


class Timings:
    """``(stage, seconds)`` in the order the stages ended; ``done`` records one."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []
        self.since = time.perf_counter()

    def done(self, stage: str) -> None:
        """Records ``stage`` as having taken the time since the last stage ended (or since this
        record was made), and logs it."""
        now = time.perf_counter()
        self.stages.append((stage, now - self.since))
        logger.info("%s: %.3f s", stage, now - self.since)
        self.since = now
