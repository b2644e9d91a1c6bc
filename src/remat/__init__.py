"""remat: train PyTorch models in less memory by recomputing activations in backward."""

from remat._state import is_recomputing
from remat.checkpointable import Checkpointable, PlannedChain
from remat.errors import (
    BudgetTooSmall,
    InvalidBudget,
    NondeterministicRecompute,
    NotCallableBlock,
    RecomputeInputModified,
    RematError,
    UnsupportedModel,
)
from remat.marking import apply, is_marked, mark, unmark
from remat.memory import MemoryTracker, format_bytes, parse_budget, track_memory
from remat.recompute import recompute

__version__ = "0.1.0"

__all__ = [
    "BudgetTooSmall",
    "Checkpointable",
    "InvalidBudget",
    "MemoryTracker",
    "NondeterministicRecompute",
    "NotCallableBlock",
    "PlannedChain",
    "RecomputeInputModified",
    "RematError",
    "UnsupportedModel",
    "apply",
    "format_bytes",
    "is_marked",
    "is_recomputing",
    "mark",
    "parse_budget",
    "recompute",
    "track_memory",
    "unmark",
]
