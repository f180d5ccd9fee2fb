"""oocjax: out-of-core training for JAX.

``ooc_jit`` is a drop-in for ``jax.jit`` that fits a training step in a device-memory budget by
moving tensors to host memory and back at planned points, between separately compiled segments.

The JAX-facing API is imported on first use, so ``import oocjax`` (and the pure-Python planner in
``oocjax.schedule``) stays cheap and free of jax until it is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from oocjax.errors import BudgetInfeasibleError, OocError, UnsupportedPrimitiveError

if TYPE_CHECKING:
    from oocjax.api import OocJitted, ooc_jit
    from oocjax.placement import to_device, to_host
    from oocjax.plan import Plan

__version__ = "0.1.0"
__all__ = [
    "BudgetInfeasibleError",
    "OocError",
    "OocJitted",
    "Plan",
    "UnsupportedPrimitiveError",
    "ooc_jit",
    "to_device",
    "to_host",
]

_LAZY = {
    "ooc_jit": "oocjax.api",
    "OocJitted": "oocjax.api",
    "Plan": "oocjax.plan",
    "to_device": "oocjax.placement",
    "to_host": "oocjax.placement",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'oocjax' has no attribute {name!r}")
