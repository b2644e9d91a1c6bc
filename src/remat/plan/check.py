"""The per-step check: a training step's exact peak against its plan's prediction and budget."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from remat.memory import MemoryTracker
from remat.plan.step import Plan
from remat.units import format_bytes

__all__ = ["StepCheck", "checked_step"]

logger = logging.getLogger("remat")


@dataclass
class StepCheck:
    """What :func:`checked_step` saw, filled in when its block ends.

    Attributes:
        measured_peak_bytes: the step's exact peak of live tensor bytes (parameter
            gradients excluded), from :class:`~remat.memory.MemoryTracker`.
        predicted_peak_bytes: the plan's predicted peak (None without a plan).
        budget_bytes: the plan's whole-step budget (None without a plan or a budget).
    """

    measured_peak_bytes: int = 0
    predicted_peak_bytes: int | None = None
    budget_bytes: int | None = None

    @property
    def within_budget(self) -> bool:
        """Whether the measured peak is at most the budget (True without a budget)."""
        return self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes

    @property
    def ratio(self) -> float | None:
        """Measured peak over predicted peak (None without a prediction)."""
        if not self.predicted_peak_bytes:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes

    def __str__(self) -> str:
        if self.predicted_peak_bytes is None:
            return f"measured peak {format_bytes(self.measured_peak_bytes)} (no plan)"
        budget = "no budget" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        return (
            f"measured peak {format_bytes(self.measured_peak_bytes)}, predicted "
            f"{format_bytes(self.predicted_peak_bytes)} (x{self.ratio:.3f}), {budget}"
        )


@contextlib.contextmanager
def checked_step(plan_of: Callable[[], Plan | None], parameters: Iterable[torch.Tensor]) -> Iterator[StepCheck]:
    """Tracks the step inside the block exactly; on exit compares it with the plan then in use.

    Logs one INFO line on the ``remat`` logger and warns (``RuntimeWarning``) when the
    peak went over the budget. The tracker sees every operator: a step takes about two
    to three times as long on small operations, fine for a debugging run.

    Args:
        plan_of: gives the plan of the step (read on exit: the step may plan on its way).
        parameters: the model's parameters (their gradients are not activation memory).
    """
    check = StepCheck()
    with MemoryTracker(exclude_grads_of=list(parameters)) as tracker:
        yield check
    plan = plan_of()
    check.measured_peak_bytes = tracker.peak_bytes
    if plan is not None:
        check.predicted_peak_bytes = plan.predicted_peak_bytes
        check.budget_bytes = plan.budget_bytes
    logger.info("remat step check: %s", check)
    if not check.within_budget:
        warnings.warn(f"remat: the step went over its budget: {check}", RuntimeWarning, stacklevel=3)
