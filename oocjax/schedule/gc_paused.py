"""Pausing CPython's cyclic garbage collector around whole-program passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Analysis and planning allocate many small objects and no reference cycles; the cyclic
    collector would rescan them again and again as they accumulate (quadratic on large steps)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
