"""The benchmarks' and tests' supported window onto oocjax's internals.

Not part of the user API: these names let ``benchmarks/`` time and patch the stages behind
``ooc_jit`` (trace, analyse, plan, cut, execute) without importing the modules that define them, so
that those modules can be renamed or split with only this file to follow. Each name is imported
from its module on first use, as ``oocjax``'s own are, so that a benchmark of the planner alone
stays free of jax. A benchmark that turns the executor's switches or counts its copies gives the
step a ``DeviceAccess`` through ``with_seams``, never by replacing a module's names.
"""

from __future__ import annotations

import importlib

# name -> (module, attribute); attribute None: the module itself.
_WHERE = {
    # the planner (pure Python)
    "CopyIn": ("oocjax.schedule.chain", "CopyIn"),
    "CopyOut": ("oocjax.schedule.chain", "CopyOut"),
    "Launch": ("oocjax.schedule.chain", "Launch"),
    "cut_segments": ("oocjax.schedule.segments", "cut_segments"),
    "layered_training_step": ("oocjax.schedule.synthetic", "layered_training_step"),
    "plan_hybrid": ("oocjax.schedule.hybrid", "plan_hybrid"),
    "segment_signature": ("oocjax.schedule.layer_cuts", "segment_signature"),
    "Segment": ("oocjax.schedule.segments", "Segment"),
    "TracedStep": ("oocjax.transforms.trace", "TracedStep"),
    # tracing and analysis
    "apply_rewrite": ("oocjax.transforms.recompute", "apply_rewrite"),
    "flatten": ("oocjax.transforms.flatten", "flatten"),
    "recomputable_steps": ("oocjax.transforms.recompute", "recomputable_steps"),
    "to_program": ("oocjax.transforms.analyse", "to_program"),
    "trace_step": ("oocjax.transforms.trace", "trace_step"),
    # segments and the chain
    "chain_function": ("oocjax.transforms.segment", "chain_function"),
    "chain_jaxpr": ("oocjax.transforms.segment", "chain_jaxpr"),
    "segment_functions": ("oocjax.transforms.segment", "segment_functions"),
    # the executor
    "observe_segments": ("oocjax.transforms.execute", "observe_segments"),
    "sharding": ("oocjax.transforms.memories", "sharding"),
    "DeviceAccess": ("oocjax.transforms.account", "DeviceAccess"),
    "wait": ("oocjax.transforms.account", "wait"),
    "put": ("oocjax.transforms.memories", "put"),
    "Seams": ("oocjax.pipeline", "Seams"),
}

__all__ = sorted([*_WHERE, "with_seams"])


def with_seams(step, **replaced):
    """``step`` (made by ``ooc_jit``) planned and run with the stages in ``replaced`` (the fields
    of ``pipeline.Seams``: ``plan_window``, ``compile_segments``, ``device_access``, ...)."""
    from oocjax.api import OocJitted
    from oocjax.pipeline import Seams

    return OocJitted(step.arguments, budget_bytes=step.budget_bytes, options=step.options, seams=Seams(**replaced))


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'oocjax.testing' has no attribute {name!r}")
    module, attribute = _WHERE[name]
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)


def __dir__() -> list[str]:
    return __all__
