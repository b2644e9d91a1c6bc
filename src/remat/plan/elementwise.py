"""The automatic mode's ``elementwise=True``: its options checked, and what a plan records of it.

See NOTE [elementwise saves in planned stages] in :mod:`remat.manual.elementwise`.

NOTE [stages that make no recipe]
The scope costs its dispatch mode's few microseconds on every operation of a stage call,
and a stage whose saves no cheap operation made (a block whose activation is one
operation, a convolution with its normalization and ReLU) pays them for nothing. So the
sizing step notes the stage calls that made a recipe (``stages_with_recipes``, by their
place in the chain); once it is done (``settle_scopes`` in
:mod:`remat.manual._planned_scope`), the timing pass scopes those alone, the plan names
them (``metadata["elementwise_stages"]``) and the executor scopes those alone. A stage
call that made no recipe saves the same tensors without the scope, so its sizes stand. A
plan in which none does runs as the plain step at a full budget (NOTE [nothing to
recompute] in :mod:`remat.execute`). A step measured for real sizes and times at once:
there every stage is timed in the scope (its time a little high where it made no recipe).
A plan that does not name them (made before they were named) scopes every stored stage
call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from remat.errors import RematError

__all__ = ["elementwise_stages", "marked", "planned_elementwise", "refuse_other_plan"]


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


def marked(measurement: Any, state: Any) -> Any:
    """The measurement with ``metadata["elementwise"]`` set when its stages were sized in the
    scope of `state` (an ``ElementwiseRecompute``; None: not), and ``"elementwise_stages"``,
    the stage calls that made a recipe (NOTE [stages that make no recipe])."""
    if state is None:
        return measurement
    metadata = {
        **measurement.profile.metadata,
        "elementwise": True,
        "elementwise_stages": sorted(state.stages_with_recipes),
    }
    profile = dataclasses.replace(measurement.profile, metadata=metadata)
    return dataclasses.replace(measurement, profile=profile)


def elementwise_stages(profile: Any, n_calls: int) -> tuple[int, ...]:
    """The stage calls (of `n_calls`) a plan of `profile` runs scoped: those the profile names,
    every one for a profile made before it named them, none for one made without elementwise=True."""
    metadata = profile.metadata
    if not metadata.get("elementwise", False):
        return ()
    stages = metadata.get("elementwise_stages")
    return tuple(range(n_calls)) if stages is None else tuple(int(stage) for stage in stages)


def refuse_other_plan(plan: Any, elementwise: bool) -> None:
    """A pinned plan must have been made as the model runs: with or without elementwise saves."""
    made_with = bool(plan.schedule.profile.metadata.get("elementwise", False))
    if made_with != elementwise:
        raise RematError(
            f"the plan was made {'with' if made_with else 'without'} elementwise=True and the model runs "
            f"{'with' if elementwise else 'without'} it: its stages would not keep what it planned. "
            f"Pass elementwise={made_with}, or plan again"
        )
