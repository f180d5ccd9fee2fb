"""The JAX side of a plan: trace a step, find its layers, rewrite it for what it recomputes, cut it
into segment functions, compile them and run the chain. The names the pipeline
(``oocjax.pipeline``) builds a step with are here."""

from oocjax.transforms.calibrate import default_profile
from oocjax.transforms.compile import compile_segments
from oocjax.transforms.execute import ChainExecutor
from oocjax.transforms.flat import FlatProgram
from oocjax.transforms.layers import layer_runs
from oocjax.transforms.recompute import apply_rewrite, recomputable_steps
from oocjax.transforms.segment import chain_function, chain_jaxpr, executable_chain, segment_functions
from oocjax.transforms.shardings import Layout
from oocjax.transforms.trace import TracedStep

__all__ = [
    "ChainExecutor",
    "FlatProgram",
    "Layout",
    "TracedStep",
    "apply_rewrite",
    "chain_function",
    "chain_jaxpr",
    "compile_segments",
    "default_profile",
    "executable_chain",
    "layer_runs",
    "recomputable_steps",
    "segment_functions",
]
