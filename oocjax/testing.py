"""The benchmarks' and tests' supported window onto oocjax's internals.

Not part of the user API: these names let ``benchmarks/`` time and patch the stages behind
``ooc_jit`` (trace, analyse, plan, cut, execute) without importing the modules that define them, so
that those modules can be renamed or split with only this file to follow. Each name is imported
from its module on first use, as ``oocjax``'s own are, so that a benchmark of the planner alone
stays free of jax. ``account`` and ``execute`` are modules, for the measurements that turn the
executor's switches (``account.ALLOCATOR_GATE``) or count its copies (``execute.put``).
"""

from __future__ import annotations

import importlib

# name -> (module, attribute); attribute None: the module itself.
_WHERE = {
    # the planner (pure Python)
    "ChainOffload": ("oocjax.schedule.chain", "Offload"),
    "ChainPrefetch": ("oocjax.schedule.chain", "Prefetch"),
    "Launch": ("oocjax.schedule.chain", "Launch"),
    "cut_segments": ("oocjax.schedule.segments", "cut_segments"),
    "fit_step_costs": ("oocjax.schedule.cost", "fit_step_costs"),
    "layered_training_step": ("oocjax.schedule.synthetic", "layered_training_step"),
    "plan_hybrid": ("oocjax.schedule.hybrid", "plan_hybrid"),
    "segment_signature": ("oocjax.schedule.layer_cuts", "segment_signature"),
    # tracing and analysis
    "apply_rewrite": ("oocjax.transforms.recompute", "apply_rewrite"),
    "flatten": ("oocjax.transforms.flatten", "flatten"),
    "recomputable_steps": ("oocjax.transforms.recompute", "recomputable_steps"),
    "to_program": ("oocjax.transforms.analyse", "to_program"),
    "trace_step": ("oocjax.transforms.trace", "trace_step"),
    # segments and the chain
    "chain_function": ("oocjax.transforms.segment", "chain_function"),
    "chain_jaxpr": ("oocjax.transforms.segment", "chain_jaxpr"),
    "flat_chain": ("oocjax.transforms.segment", "flat_chain"),
    "segment_functions": ("oocjax.transforms.segment", "segment_functions"),
    # the device's rates
    "default_profile": ("oocjax.transforms.calibrate", "default_profile"),
    "measure_profile": ("oocjax.transforms.calibrate", "measure_profile"),
    "time_segments": ("oocjax.transforms.calibrate", "time_segments"),
    # the executor
    "observe_segments": ("oocjax.transforms.execute", "observe_segments"),
    "sharding": ("oocjax.transforms.memories", "sharding"),
    "account": ("oocjax.transforms.account", None),
    "execute": ("oocjax.transforms.execute", None),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'oocjax.testing' has no attribute {name!r}")
    module, attribute = _WHERE[name]
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)


def __dir__() -> list[str]:
    return __all__
