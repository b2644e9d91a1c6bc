"""remat: train PyTorch models in less memory by recomputing activations in backward."""

from remat import models as models
from remat import plan as plan
from remat import policies as policies
from remat.automatic import Checkpointable
from remat.budget import parse_budget
from remat.enable import controller, disable, enable, is_enabled
from remat.errors import (
    BudgetTooSmall,
    InvalidBudget,
    NondeterministicRecompute,
    NotCallableBlock,
    RecomputeInputModified,
    RematError,
    UnsupportedModel,
)
from remat.manual._selective import tag
from remat.manual._state import is_recomputing
from remat.manual.elementwise import ElementwiseRecompute, recompute_elementwise
from remat.manual.explain import ExplainedOp, Explanation, explain
from remat.manual.marking import apply, is_marked, mark, unmark
from remat.manual.offload import HostMemory, host_memory, offload
from remat.manual.recompute import recompute, recompute_sequential
from remat.manual.residuals import SavedTensor, format_saved_residuals, saved_residuals
from remat.memory import MemoryTracker, track_memory
from remat.plan.step import Plan
from remat.units import format_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetTooSmall",
    "Checkpointable",
    "ElementwiseRecompute",
    "ExplainedOp",
    "Explanation",
    "HostMemory",
    "InvalidBudget",
    "MemoryTracker",
    "NondeterministicRecompute",
    "NotCallableBlock",
    "Plan",
    "RecomputeInputModified",
    "RematError",
    "SavedTensor",
    "UnsupportedModel",
    "apply",
    "controller",
    "disable",
    "enable",
    "explain",
    "format_bytes",
    "format_saved_residuals",
    "host_memory",
    "is_enabled",
    "is_marked",
    "is_recomputing",
    "mark",
    "offload",
    "parse_budget",
    "policies",
    "recompute",
    "recompute_elementwise",
    "recompute_sequential",
    "saved_residuals",
    "tag",
    "track_memory",
    "unmark",
]
