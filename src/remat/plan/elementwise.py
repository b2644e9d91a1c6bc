"""The automatic mode's ``elementwise=True``: its options checked, and what a plan records of it.

See NOTE [elementwise saves in planned stages] in :mod:`remat.manual.elementwise`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from remat.errors import RematError

__all__ = ["marked", "planned_elementwise", "refuse_other_plan"]


def planned_elementwise(elementwise: bool, *, policy: Any, offload: Any, measure: str) -> bool:
    """Checks ``elementwise=`` of the automatic mode against its other options.

    Raises:
        TypeError: `elementwise` is not a bool.
        NotImplementedError: with store policies, offload, or a frugal measuring step.
    """
    if not isinstance(elementwise, bool):
        raise TypeError(f"elementwise is True or False, got {elementwise!r}")
    if not elementwise:
        return False
    refused = [
        what
        for what, given in (
            ("policy=", policy is not None),
            ("offload=", offload is not False),
            ('measure="frugal"', measure == "frugal"),
        )
        if given
    ]
    if refused:
        raise NotImplementedError(
            f"elementwise=True with {' and '.join(refused)} is not built: a stage stored under a policy, "
            "offloaded, or replayed by the frugal measuring step is not sized with what it leaves to "
            "backward. Use one or the other"
        )
    return True


def marked(measurement: Any, elementwise: bool) -> Any:
    """The measurement with ``metadata["elementwise"]`` set when its stages were sized so."""
    if not elementwise:
        return measurement
    profile = measurement.profile
    profile = dataclasses.replace(profile, metadata={**profile.metadata, "elementwise": True})
    return dataclasses.replace(measurement, profile=profile)


def refuse_other_plan(plan: Any, elementwise: bool) -> None:
    """A pinned plan must have been made as the model runs: with or without elementwise saves."""
    made_with = bool(plan.schedule.profile.metadata.get("elementwise", False))
    if made_with != elementwise:
        raise RematError(
            f"the plan was made {'with' if made_with else 'without'} elementwise=True and the model runs "
            f"{'with' if elementwise else 'without'} it: its stages would not keep what it planned. "
            f"Pass elementwise={made_with}, or plan again"
        )
