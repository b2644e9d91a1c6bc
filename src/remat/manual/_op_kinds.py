"""What an ATen operation is to the selective mode: numbered or not, random, what it writes."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["unnumbered"]

# op -> "unnumbered" (views, in-place, out=), "random" or "plain"
_KINDS: dict[Any, str] = {}
# op -> the positions and names of the arguments it writes to
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _writes(op: Any) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments `op` writes to (its ``Tensor(a!)`` ones)."""
    writes = _WRITES.get(op)
    if writes is None:
        schema = getattr(op, "_schema", None)
        arguments = schema.arguments if schema is not None else []
        writes = tuple(
            (position, a.name)
            for position, a in enumerate(arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[op] = writes
    return writes


def _written(op: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors `op` changes in place (its ``Tensor(a!)`` arguments)."""
    found = []
    for position, name in _writes(op):
        value = args[position] if position < len(args) else kwargs.get(name)
        found += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return found


def _fills_self(op: Any, args: Any, written: list[torch.Tensor]) -> bool:
    """Whether `op` is an in-place operation on its first argument alone, returning it, that
    changes its values only (not its shape or strides)."""
    if len(written) != 1 or not args or written[0] is not args[0] or torch.Tag.inplace_view in op.tags:
        return False
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.arguments or len(schema.returns) != 1:
        return False
    first, returned = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and returned is not None and returned.before_set == first.before_set


def _kind(op: Any) -> str:
    kind = _KINDS.get(op)
    if kind is None:
        schema = getattr(op, "_schema", None)
        returns = schema.returns if schema is not None else []
        if (
            not any("Tensor" in str(r.type) for r in returns)
            or any(r.alias_info is not None for r in returns)
            # it fills an argument it was given (rrelu's noise, which its backward reads): a kept
            # output would leave the recompute's argument unfilled, so it runs again
            or _writes(op)
        ):
            kind = "unnumbered"
        elif torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            kind = "random"
        else:
            kind = "plain"
        _KINDS[op] = kind
    return kind


def unnumbered(op: Any) -> bool:
    """Whether `op` is never kept (a view, an in-place or ``out=`` operation, or one that fills
    an argument it was given)."""
    return _kind(op) == "unnumbered"
