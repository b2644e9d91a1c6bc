"""Manual recompute: the function API, its two implementations, module marking, and residuals."""

from remat.manual._state import is_recomputing
from remat.manual.marking import apply, is_marked, mark, unmark
from remat.manual.recompute import recompute, recompute_sequential
from remat.manual.residuals import SavedTensor, format_saved_residuals, saved_residuals

__all__ = [
    "SavedTensor",
    "apply",
    "format_saved_residuals",
    "is_marked",
    "is_recomputing",
    "mark",
    "recompute",
    "recompute_sequential",
    "saved_residuals",
    "unmark",
]
