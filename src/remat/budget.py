"""Memory budgets: the one vocabulary and the one parser of remat.

A budget is given as bytes (``268435456``), a string with a unit (``"512MiB"``,
``"1.5GB"``), a fraction of the activation memory without recompute (``0.5``), or None
for the memory the device has free. :func:`parse_budget` turns any of them into bytes;
the library, the command line and the benchmark all read budgets through it.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import torch

from remat.errors import BudgetTooSmall, InvalidBudget
from remat.units import format_bytes

__all__ = [
    "BUDGET_FORMS",
    "MINIMUM",
    "FREE_MEMORY_MARGIN",
    "Budget",
    "available_memory_bytes",
    "budget_too_small",
    "budget_from_text",
    "parse_budget",
]

Budget = int | float | str | None
"""A budget in any accepted form (see ``BUDGET_FORMS``)."""

#: The budget that asks for the smallest feasible one (where a planner can give it).
MINIMUM = "min"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

BUDGET_FORMS = (
    "an int number of bytes (e.g. 268435456); a string with a unit such as '512MiB', "
    "'1.5GB', '300kB', '4096B'; a float in (0, 1] for that fraction of the activation "
    "memory without recompute (e.g. 0.5, or '0.5' or '50%' as text); or None for the memory the "
    "device has free"
)

#: Fraction of the free device memory remat leaves untouched when the budget is None.
FREE_MEMORY_MARGIN = 0.1


def budget_too_small(total_bytes: int, minimum_bytes: int) -> BudgetTooSmall:
    """The error for a whole-step budget below the smallest one any schedule fits in."""
    return BudgetTooSmall(
        f"no recompute schedule fits a budget of {total_bytes} bytes ({format_bytes(total_bytes)}); the "
        f"smallest feasible budget for this model and input is {minimum_bytes} bytes "
        f"({format_bytes(minimum_bytes)}). Raise mem_limit to at least that, or use a smaller batch",
        budget_bytes=total_bytes,
        minimum_bytes=minimum_bytes,
    )


def available_memory_bytes(device: str | torch.device = "cpu") -> int:
    """Memory the device has free now: free CUDA memory, or available RAM on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def warn_default_cpu_budget(total_bytes: int, reference_bytes: int) -> None:
    """Warns that no budget means the host's available memory on the CPU (an honest default)."""
    warnings.warn(
        f"remat: no budget given (mem_limit=None): on the CPU that is the available host memory, "
        f"{format_bytes(total_bytes)}, against {format_bytes(reference_bytes)} for this step without recompute"
        f"{': nothing is recomputed' if total_bytes >= reference_bytes else ''}. Pass mem_limit (bytes, '4GiB', "
        "or a fraction such as 0.5) to train in less",
        UserWarning,
        stacklevel=6,
    )


def parse_budget(
    budget: int | float | str | None,
    *,
    reference_bytes: int | None = None,
    device: str | torch.device = "cpu",
) -> int:
    """Turns any accepted form of a memory budget into bytes.

    Args:
        budget: see ``BUDGET_FORMS``: bytes (int), a string with a unit, a fraction
            (float in (0, 1]) of ``reference_bytes``, or None for the free device memory
            minus a safety margin.
        reference_bytes: the activation memory without recompute, needed for fractions.
        device: the device whose free memory ``None`` means.

    Raises:
        InvalidBudget: the value is not one of the accepted forms.
    """
    if budget is None:
        return int(available_memory_bytes(device) * (1.0 - FREE_MEMORY_MARGIN))
    if isinstance(budget, bool):
        raise InvalidBudget(f"budget {budget!r} is a bool; use {BUDGET_FORMS}")
    if isinstance(budget, int):
        if budget <= 0:
            raise InvalidBudget(f"budget must be positive, got {budget} bytes; use {BUDGET_FORMS}")
        return budget
    if isinstance(budget, float):
        if not math.isfinite(budget) or not 0.0 < budget <= 1.0:
            raise InvalidBudget(f"a float budget is a fraction in (0, 1], got {budget!r}; use {BUDGET_FORMS}")
        if reference_bytes is None:
            raise InvalidBudget(
                f"the fractional budget {budget} needs the activation memory without recompute; "
                "measure the model first or give the budget in bytes"
            )
        return max(1, int(reference_bytes * budget))
    if isinstance(budget, str):
        text = budget.strip()
        if text.lower() in {"none", "auto", "free"}:
            return parse_budget(None, reference_bytes=reference_bytes, device=device)
        percent = _percent(text)
        if percent is not None:
            return parse_budget(percent, reference_bytes=reference_bytes, device=device)
        match = _BUDGET_RE.match(text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise InvalidBudget(f"cannot read the budget {budget!r}; use {BUDGET_FORMS}")
        number = float(match.group(1))
        unit = match.group(2).lower()
        if unit == "":
            if _is_fraction_text(match.group(1)):
                return parse_budget(number, reference_bytes=reference_bytes, device=device)
            raise InvalidBudget(
                f"the budget {budget!r} has no unit: write '{match.group(1)}B' for bytes, "
                f"'{match.group(1)}MiB' or '{match.group(1)}GB' for more; use {BUDGET_FORMS}"
            )
        value = int(number * _UNITS[unit])
        if value <= 0:
            raise InvalidBudget(f"budget must be positive, got {budget!r}; use {BUDGET_FORMS}")
        return value
    raise InvalidBudget(f"budget of type {type(budget).__name__} is not understood; use {BUDGET_FORMS}")


def budget_from_text(text: str, *, allow_minimum: bool = True) -> int | float | str:
    """Reads a budget written as text (a command-line option) into the form the library takes.

    ``"0.5"`` and ``"50%"`` are the fraction 0.5, ``"268435456"`` that many bytes, ``"512MiB"``
    and ``"4096B"`` stay text (read by :func:`parse_budget`), ``"min"`` is :data:`MINIMUM`
    where ``allow_minimum`` is set.

    Raises:
        InvalidBudget: the text is no accepted form; the message lists the forms.
    """
    stripped = text.strip()
    if stripped.isdigit():  # a number of bytes, as an int is in the library
        return parse_budget(int(stripped))
    if stripped.lower() == MINIMUM:
        if allow_minimum:
            return MINIMUM
        raise InvalidBudget(f"the budget {text!r} is not accepted here; use {BUDGET_FORMS}")
    parse_budget(stripped, reference_bytes=1)  # raises on a form it cannot read
    percent = _percent(stripped)
    if percent is not None:
        return percent
    match = _BUDGET_RE.match(stripped)
    if match is not None and match.group(2) == "" and _is_fraction_text(match.group(1)):
        return float(match.group(1))
    return stripped


def _percent(text: str) -> float | None:
    """``"50%"`` as the fraction 0.5; None for text that is no percentage.

    Raises:
        InvalidBudget: a percentage outside (0, 100].
    """
    if not text.endswith("%"):
        return None
    match = _BUDGET_RE.match(text[:-1])
    if match is None or match.group(2):
        raise InvalidBudget(f"cannot read the budget {text!r}; use {BUDGET_FORMS}")
    value = float(match.group(1))
    if not 0.0 < value <= 100.0:
        raise InvalidBudget(f"a percentage budget is in (0%, 100%], got {text!r}; use {BUDGET_FORMS}")
    return value / 100.0


def _is_fraction_text(number: str) -> bool:
    """Whether a unitless number reads as a fraction: a decimal point and a value in (0, 1]."""
    return "." in number and 0.0 < float(number) <= 1.0
