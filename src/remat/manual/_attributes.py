"""A module's plain attributes: which entries are its state, and what a call changed of them.

Part of the guard that keeps module state exact during a recompute (NOTE [module state
during recompute] in ``_state.py``).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import torch
from torch import nn

from remat.errors import RematError

__all__ = ["MISSING", "Attributes", "is_state_attribute", "set_attribute"]

#: an attribute's value before a call that added it
MISSING: Any = object()


_PLAIN_ATTRIBUTE_TYPES = (bool, int, float, complex, str, type(None), torch.Tensor)


def is_state_attribute(name: str) -> bool:
    """Whether an entry of a module's ``__dict__`` is the module's own state.

    nn.Module's own dictionaries (parameters, buffers, hooks) and private names, the
    training mode and an instance-level ``forward`` (a marking) are not.
    """
    return not name.startswith("_") and name not in ("training", "forward")


def _plain_of(items: Iterable[tuple[str, Any]]) -> dict[str, tuple[Any, int | None]]:
    return {
        name: (value, value._version if isinstance(value, torch.Tensor) else None)
        for name, value in items
        if is_state_attribute(name) and isinstance(value, _PLAIN_ATTRIBUTE_TYPES)
    }


# NOTE [noting a module's attributes cheaply]
# A recording notes a module's plain attributes before each call and compares them after
# it (NOTE [module state during recompute]). Almost no call changes any, so the notes are
# the module's ``__dict__`` itself, its names and values taken as two tuples, and the
# comparison after the call is one of identities, all in C: a name or value rebound, added
# or removed makes the names or values differ, and only then are the attributes sorted
# out one by one. The tuples hold the values, so no id can be reused meanwhile. A tensor
# attribute changed in place keeps its identity: modules holding tensors in their
# ``__dict__`` (rare) have their versions noted as well; they are found by the types of the
# values (``isinstance`` against ``torch.Tensor`` is slow, and most values are dicts).
_NOT_TENSORS = frozenset((bool, int, float, complex, str, type(None), dict, OrderedDict, set, list, tuple))


class Attributes:
    """A module's ``__dict__`` as it was before a call (NOTE [noting a module's attributes cheaply])."""

    __slots__ = ("names", "values", "versions")

    def __init__(self, module: nn.Module) -> None:
        state = module.__dict__
        self.names = tuple(state)
        self.values = tuple(state.values())
        self.versions: dict[str, int] | None = None
        if not _NOT_TENSORS.issuperset(map(type, self.values)) and any(
            map(isinstance, self.values, repeat(torch.Tensor))
        ):
            noted = _plain_of(zip(self.names, self.values, strict=True))
            self.versions = {name: version for name, (_, version) in noted.items() if version is not None}

    def plain(self) -> dict[str, Any]:
        """The plain attributes noted, by name."""
        return {name: value for name, (value, _) in _plain_of(zip(self.names, self.values, strict=True)).items()}

    def changed(self, module: nn.Module) -> dict[str, Any]:
        """The plain attributes the call rebound, added or removed, with their values before
        (``MISSING``: added); raises for a tensor attribute changed in place."""
        state = module.__dict__
        before: dict[str, Any] = {}
        if not (
            len(state) == len(self.names)
            and all(map(operator.is_, state, self.names))
            and all(map(operator.is_, state.values(), self.values))
        ):
            noted = dict(zip(self.names, self.values, strict=True))
            for name, value in state.items():  # rebound or added
                previous = noted.get(name, MISSING)
                if previous is not value and is_state_attribute(name) and _plain(value, previous):
                    before[name] = previous
            for name, previous in noted.items():  # removed
                if name not in state and is_state_attribute(name) and _plain(previous):
                    before[name] = previous
        for name, version in (self.versions or {}).items():
            value = state.get(name, MISSING)
            if name not in before and value._version != version:
                raise RematError(
                    f"{type(module).__name__}.{name} is a tensor attribute (not a buffer) that the "
                    "module's forward changes in place; a recompute could not see the value the "
                    f"original forward saw. Register it with module.register_buffer({name!r}, ...)"
                )
        return before


def _plain(*values: Any) -> bool:
    return any(isinstance(value, _PLAIN_ATTRIBUTE_TYPES) for value in values)


def set_attribute(module: nn.Module, name: str, value: Any) -> None:
    if value is MISSING:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = value
