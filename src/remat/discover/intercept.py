"""Stage interception: the one place that routes a stage module's calls elsewhere.

While a chain runs under remat (measured, or executing a schedule), every call of a stage
module in the model's own, unmodified forward goes to an *owner*:
``owner.call(index, module, args, kwargs)``. The owner decides how the stage runs and
calls :func:`call_original` to run the module itself. Nothing else in remat patches a
module's ``forward``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn

from remat.discover.chain import Chain
from remat.errors import UnsupportedModel

__all__ = ["call_original", "call_stage", "intercept_stages"]


# NOTE [stage hooks run once]
# While a stage is intercepted its hook dictionaries are set aside, so the model's own
# call of the stage runs no hooks; call_original puts them back around the stage's real
# call. The hooks thus run once per call, inside the owner's measurement window or
# recompute region, exactly as they run when a region is replayed (a plain module call):
# a hook that replaces the output is applied once, and the next stage is linked to the
# output as the hooks left it.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def call_original(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module with its own forward and hooks while it is intercepted."""
    stand_in = module.__dict__.pop("forward")
    set_aside = {name: module.__dict__[name] for name in _HOOK_DICTS}
    module.__dict__.update(stand_in.hooks)
    try:
        return module(*args, **kwargs)
    finally:
        module.__dict__.update(set_aside)
        module.__dict__["forward"] = stand_in


def call_stage(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module as itself, whether or not it is intercepted right now."""
    if isinstance(module.__dict__.get("forward"), _ForwardThroughOwner):
        return call_original(module, args, kwargs)
    return module(*args, **kwargs)


@contextlib.contextmanager
def intercept_stages(chain: Chain, owner: Any) -> Iterator[None]:
    """Routes every call of the chain's stage modules to ``owner.call(index, module, args, kwargs)``.

    The stage's own module hooks run once, within the owner's :func:`call_original` (see
    NOTE [stage hooks run once]); the overrides are instance attributes removed on exit,
    whatever happens.
    """
    installed: list[_ForwardThroughOwner] = []
    try:
        for index, module in enumerate(chain.modules):
            if "forward" in module.__dict__:
                raise UnsupportedModel(
                    f"stage {chain.names[index]!r} has its forward replaced on the instance (is it "
                    "marked with remat.mark?); unmark it before using remat.Checkpointable"
                )
            stand_in = _ForwardThroughOwner(owner, index, module)
            module.__dict__["forward"] = stand_in
            for name in _HOOK_DICTS:
                module.__dict__[name] = OrderedDict()
            installed.append(stand_in)
        yield
    finally:
        for stand_in in installed:
            module = stand_in.module
            module.__dict__.pop("forward", None)
            for name, hooks in stand_in.hooks.items():
                hooks.update(module.__dict__[name])  # hooks registered meanwhile
                module.__dict__[name] = hooks


class _ForwardThroughOwner:
    """Stands in a stage module's ``forward`` while remat runs the chain."""

    def __init__(self, owner: Any, index: int, module: nn.Module) -> None:
        self.owner = owner
        self.index = index
        self.module = module
        self.hooks = {name: module.__dict__[name] for name in _HOOK_DICTS}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.call(self.index, self.module, args, kwargs)
