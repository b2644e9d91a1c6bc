"""The elementwise scope of the planned model being measured (NOTE [elementwise saves in
planned stages] in :mod:`remat.manual.elementwise`; NOTE [stages that make no recipe] in
:mod:`remat.plan.elementwise`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from remat.manual.elementwise import ElementwiseRecompute

__all__ = ["planned", "planning", "settle_scopes", "stage_call"]

_LOCAL = threading.local()


@contextmanager
def planned(elementwise: bool) -> Iterator[None]:
    """The stage calls of a planned model measured inside are scoped by a new state, if `elementwise`."""
    before = getattr(_LOCAL, "planned", None)
    _LOCAL.planned = ElementwiseRecompute() if elementwise else None
    try:
        yield
    finally:
        _LOCAL.planned = before


def planning() -> ElementwiseRecompute | None:
    """The state scoping the stage calls of the planned model being measured, if any."""
    return getattr(_LOCAL, "planned", None)


def stage_call(index: int) -> AbstractContextManager[None]:
    """The scope of stage call `index` of the planned model being measured (or none)."""
    state = planning()
    return nullcontext() if state is None else state.scoped(index)


def settle_scopes() -> None:
    """The sizing of the planned model being measured is done: from now on, only the stage
    calls that made a recipe in it run scoped (NOTE [stages that make no recipe])."""
    state = planning()
    if state is not None and state.scoped_stages is None:
        state.scoped_stages = frozenset(state.stages_with_recipes)
