"""The outputs of blocks run with ``output_recompute=True``: kept by no one, recomputed on demand.

A later recomputed block that takes such an output as an input keeps a lazy reference
(:class:`OutputOf`) instead of the tensor, and gets the value by recomputing the block
that made it (see :func:`remat.recompute`'s ``output_recompute``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from remat.manual._frames import _Frame

__all__ = ["OutputOf", "lazy_output", "register_outputs"]


class OutputOf:
    """A lazy input: output number `leaf` of a frame run with output_recompute=True."""

    __slots__ = ("frame", "leaf")

    def __init__(self, frame: _Frame, leaf: int) -> None:
        self.frame = frame
        self.leaf = leaf


# id(tensor) -> (weakref to tensor, frame, flat output index, version when returned) for
# the outputs of output_recompute blocks
_RECOMPUTABLE_OUTPUTS: dict[int, tuple[weakref.ref[torch.Tensor], _Frame, int, int]] = {}


def lazy_output(value: Any) -> OutputOf | None:
    if not isinstance(value, torch.Tensor):
        return None
    entry = _RECOMPUTABLE_OUTPUTS.get(id(value))
    if entry is None or entry[0]() is not value:
        return None
    if value._version != entry[3]:
        # Changed in place since its block returned it: a recompute of that block would
        # give the old values, so the block taking it keeps it as an ordinary input.
        return None
    return OutputOf(entry[1], entry[2])


def _forget_output(key: int) -> Callable[[Any], None]:
    outputs = _RECOMPUTABLE_OUTPUTS  # bound here: at interpreter exit the global may be gone

    def forget(_ref: Any) -> None:
        outputs.pop(key, None)

    return forget


def register_outputs(frame: _Frame, out: Any) -> None:
    for leaf_index, leaf in enumerate(tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            key = id(leaf)
            _RECOMPUTABLE_OUTPUTS[key] = (
                weakref.ref(leaf, _forget_output(key)),
                frame,
                leaf_index,
                leaf._version,
            )
