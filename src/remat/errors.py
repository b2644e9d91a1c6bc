"""The errors remat raises. Catch :class:`RematError` to catch them all."""

from __future__ import annotations

__all__ = [
    "BudgetTooSmall",
    "InvalidBudget",
    "NondeterministicRecompute",
    "NotCallableBlock",
    "RecomputeInputModified",
    "RematError",
    "UnsupportedModel",
]


class RematError(RuntimeError):
    """Base class of every error raised by remat."""


class InvalidBudget(RematError, ValueError):
    """A memory budget could not be understood."""


class BudgetTooSmall(RematError):
    """No schedule fits the budget.

    Attributes:
        budget_bytes: the budget that was asked for, in bytes.
        minimum_bytes: the smallest budget for which a schedule exists, in bytes.
    """

    def __init__(self, message: str, *, budget_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = int(budget_bytes)
        self.minimum_bytes = int(minimum_bytes)


class NotCallableBlock(RematError, TypeError):
    """The block given to recompute or mark is not callable."""


class NondeterministicRecompute(RematError):
    """The recomputed forward did not produce what the original forward saved."""


class RecomputeInputModified(RematError):
    """A tensor a backward would read was changed after the forward: an input kept for
    recompute (or a tensor inside one), a parameter the block uses, or a tensor saved for
    backward (offloaded, or made again from others); autograd raises for such changes too."""


class UnsupportedModel(RematError):
    """remat cannot find a chain of stages in this model."""
