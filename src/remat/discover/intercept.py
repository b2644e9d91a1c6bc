"""Stage interception: the one place that routes a stage module's calls elsewhere.

While a chain runs under remat (measured, or executing a schedule), every call of a stage
module in the model's own, unmodified forward goes to an *owner*:
``owner.call(index, module, args, kwargs)``. The owner decides how the stage runs and
calls :func:`call_original` to run the module itself. Nothing else in remat patches a
module's ``forward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from remat.discover.chain import Chain
from remat.errors import UnsupportedModel

__all__ = ["call_original", "call_stage", "intercept_stages"]


# NOTE [stage hooks run once]
# A stage module is intercepted at its call (an instance-level ``_call_impl``, which
# ``nn.Module.__call__`` dispatches to), before any hook runs: the model's own call of
# the stage goes straight to the owner, and call_original makes the one real call, with
# the module's hooks and the global module hooks. Every hook thus runs once per call,
# inside the owner's measurement window or recompute region, exactly as it runs when a
# region is replayed (a plain module call): a hook that replaces the output is applied
# once, and the next stage is linked to the output as the hooks left it.
_INTERCEPT = "_call_impl"


def call_original(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module as itself (hooks included) while it is intercepted."""
    stand_in = module.__dict__.pop(_INTERCEPT)
    try:
        return module(*args, **kwargs)
    finally:
        module.__dict__[_INTERCEPT] = stand_in


def call_stage(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module as itself, whether or not it is intercepted right now."""
    if isinstance(module.__dict__.get(_INTERCEPT), _CallThroughOwner):
        return call_original(module, args, kwargs)
    return module(*args, **kwargs)


@contextlib.contextmanager
def intercept_stages(chain: Chain, owner: Any) -> Iterator[None]:
    """Routes every call of the chain's stage modules to ``owner.call(index, module, args, kwargs)``.

    The stage's hooks run once, within the owner's :func:`call_original` (see NOTE [stage
    hooks run once]); the interceptions are instance attributes removed on exit, whatever
    happens.
    """
    installed: list[nn.Module] = []
    try:
        for index, module in enumerate(chain.modules):
            if "forward" in module.__dict__:
                raise UnsupportedModel(
                    f"stage {chain.names[index]!r} has its forward replaced on the instance (is it "
                    "marked with remat.mark?); unmark it before using remat.Checkpointable"
                )
            module.__dict__[_INTERCEPT] = _CallThroughOwner(owner, index, module)
            installed.append(module)
        yield
    finally:
        for module in installed:
            module.__dict__.pop(_INTERCEPT, None)


class _CallThroughOwner:
    """Stands in a stage module's call while remat runs the chain."""

    def __init__(self, owner: Any, index: int, module: nn.Module) -> None:
        self.owner = owner
        self.index = index
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.call(self.index, self.module, args, kwargs)
