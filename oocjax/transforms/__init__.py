"""The JAX side of a plan: trace a step, find its layers, rewrite it for what it recomputes, cut it
into segment functions, compile them and run the chain. The names the pipeline
(``oocjax.pipeline``) builds a step with are here, each read from its module when first used
(so that importing one module of this package does not import them all)."""

import importlib

_MODULE_OF = {
    "ChainExecutor": "execute",
    "DeviceAccess": "account",
    "FlatProgram": "flat",
    "Layout": "shardings",
    "TracedStep": "trace",
    "apply_rewrite": "recompute",
    "chain_function": "segment",
    "chain_jaxpr": "segment",
    "compile_segments": "compile",
    "executable_chain": "segment",
    "layer_runs": "layers",
    "recomputable_steps": "recompute",
    "segment_functions": "segment",
    "trace_arguments": "trace",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'oocjax.transforms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"oocjax.transforms.{_MODULE_OF[name]}"), name)
