"""The benchmarks' and tests' supported window onto oocjax's internals, not part of the user API:
the names they time the stages behind ``ooc_jit`` with (trace, analyse, cut, execute), without
importing the modules that define them, so that those modules can be renamed or split with only
this file to follow; and ``with_seams``, how they replace a stage (``seams.Seams``: a fault
injected, an allocator read, the executor's waits switched off), never by replacing a module's names.
"""

from oocjax.api import OocJitted
from oocjax.schedule.chain import CopyIn, CopyOut, Launch
from oocjax.schedule.layer_cuts import segment_signature
from oocjax.schedule.layer_plan import MOVE_MARGIN
from oocjax.schedule.moves import move_order
from oocjax.schedule.synthetic import layered_training_step
from oocjax.seams import Seams
from oocjax.transforms.account import DeviceAccess, wait
from oocjax.transforms.analyse import to_program
from oocjax.transforms.execute import observe_segments
from oocjax.transforms.flatten import flatten
from oocjax.transforms.functions import chain_function, chain_jaxpr, segment_functions
from oocjax.transforms.memories import put, sharding
from oocjax.transforms.recompute import apply_rewrite, recomputable_steps
from oocjax.transforms.trace import TracedStep, trace_step

__all__ = [
    "MOVE_MARGIN",
    "CopyIn",
    "CopyOut",
    "DeviceAccess",
    "Launch",
    "Seams",
    "TracedStep",
    "apply_rewrite",
    "chain_function",
    "chain_jaxpr",
    "flatten",
    "layered_training_step",
    "move_order",
    "observe_segments",
    "put",
    "recomputable_steps",
    "segment_functions",
    "segment_signature",
    "sharding",
    "to_program",
    "trace_step",
    "wait",
    "with_seams",
]


def with_seams(step: OocJitted, **replaced) -> OocJitted:
    """``step`` (made by ``ooc_jit``) planned and run with the stages in ``replaced`` (``Seams``' fields)."""
    return OocJitted(step.arguments, budget_bytes=step.budget_bytes, options=step.options, seams=Seams(**replaced))
