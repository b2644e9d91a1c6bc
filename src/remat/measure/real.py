"""Measuring for real a model that cannot run on fake tensors.

NOTE [measured for real when fake tensors fail]
The default measurement sizes a model on fake tensors (no device memory, exact sizes)
before anything runs for real, so that its timing pass is bounded by the budget. A model
that cannot run there (data-dependent shapes, ``.item()`` in its forward or its loss,
Hugging Face's layerdrop) is measured with a real step instead: one with every stage
recomputed (``measure="frugal"``), whose sizes are those of a plain step (NOTE [a frugal
step's forward as a plain one] in :mod:`remat.measure.costs`) in a fraction of its
memory; a model the frugal step refuses (its input changed in place) with a plain step.
A user's error raises there as itself. Nothing bounds that step by the budget before it
runs, so a warning names what it took; the steps after it hold the budget.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from remat.discover.chain import Chain
from remat.errors import UnsupportedModel
from remat.measure.assemble import ChainMeasurement
from remat.measure.step import frugal_refused, measure_on_device, step_device
from remat.units import format_bytes

__all__ = ["measured_for_real"]


def measured_for_real(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], Any] | None,
    error: str,
) -> tuple[ChainMeasurement, str]:
    """The measurement of a model whose run on fake tensors failed (`error` says why), and
    how it was measured (``"frugal"`` or ``"plain"``); see the NOTE."""
    try:
        refused = frugal_refused(step_device(model, args, kwargs).type)
        if refused:
            raise UnsupportedModel(refused)
        measurement = measure_on_device(model, chain, args, kwargs, loss_fn, frugal=True)
        how, step = "frugal", "a step with every stage recomputed (measure='frugal')"
    except UnsupportedModel as refusal:
        measurement = measure_on_device(model, chain, args, kwargs, loss_fn, frugal=False)
        how, step = "plain", f"a plain step, since a frugal one cannot run ({refusal})"
    warnings.warn(
        f"remat: the model cannot run on fake tensors ({error}), so its sizes could not be known "
        f"before it ran; it was measured with {step}, which took "
        f"{format_bytes(measurement.measured_peak_bytes)} whatever the budget (the steps after it "
        "hold the budget). The cause may be in the forward or in a hook it registers (a gradient hook "
        "that logs a value with .item() runs in measuring's backward passes too: skip it while "
        "remat.is_recomputing())",
        RuntimeWarning,
        stacklevel=4,
    )
    return measurement, how
