"""``debug=True``: the operations of a block's original forward and of its recompute.

NOTE [op traces]
With ``debug=True`` a block records every operation its first forward runs, and every
recompute records its own. When a recompute does not match the original (the errors of
:class:`~remat.NondeterministicRecompute`), the error shows the two traces side by side
from a little before the first operation where they differ, each with the line of the
user's code that ran it. The trace is taken below autograd (a ``TorchDispatchMode``),
so it sees the ATen operations in the order they run; it costs a Python call per
operation, which is why it is off by default.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.errors import NondeterministicRecompute

__all__ = ["OpTrace", "explained", "original_ops", "traced"]


def original_ops(root: Any, span: Any) -> tuple[list[Any] | None, int]:
    """The original forward's trace of a block (debug=True) and where the block starts in it."""
    if span is not None and span.original_ops is not None:
        return span.original_ops, 0
    return root.original_ops, span.op_start if span is not None else 0


_CONTEXT_OPS = 3  # operations shown before the first difference


@dataclass(frozen=True)
class _Entry:
    """One operation: its name, the shapes of its tensor outputs, and the user's line."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    where: str

    def __str__(self) -> str:
        shapes = ", ".join(str(shape) for shape in self.shapes) or "-"
        return f"{self.name} -> {shapes}  ({self.where})"


_TORCH_DIR = os.path.dirname(torch.__file__ or "") + os.sep
_REMAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_line() -> str | None:
    """``file:line in function`` of the innermost frame outside torch and remat.

    None when the innermost frame outside torch is remat's own: an operation of remat's
    hooks (a detach when a saved tensor is filled), not of the block.
    """
    frame = sys._getframe(2)
    # torch's frames, and those of a trace nested in another (its dispatch passes the
    # operation on to the outer trace), are not the block's
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None and frame.f_code.co_filename.startswith(_REMAT_DIR):
        return None
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class OpTrace(TorchDispatchMode):
    """Records the operations that run while it is active (see NOTE [op traces])."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[_Entry] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        where = _user_line()
        if where is not None:
            shapes = tuple(tuple(leaf.shape) for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor))
            self.entries.append(_Entry(str(func), shapes, where))
        return out


@contextlib.contextmanager
def traced(debug: bool) -> Iterator[OpTrace | None]:
    """An :class:`OpTrace` active inside the block when ``debug``; else nothing, and None."""
    if not debug:
        yield None
        return
    trace = OpTrace()
    with trace:
        yield trace


def explained(
    error: NondeterministicRecompute, original: list[_Entry] | None, recomputed: OpTrace | None, start: int = 0
) -> NondeterministicRecompute:
    """`error`, with the two traces compared when both were recorded.

    Args:
        error: the mismatch found.
        original: the original forward's operations (None: not traced).
        recomputed: the recompute's trace (None: not traced).
        start: where the recomputed part begins in ``original`` (a nested block's first op).
    """
    if original is None or recomputed is None or getattr(error, "explained", False):
        return error
    again = recomputed.entries
    before = original[start : start + len(again) + 1] if again else original[start:]
    differ = next((k for k, (a, b) in enumerate(zip(before, again, strict=False)) if a.name != b.name), None)
    if differ is None:
        differ = min(len(before), len(again))
    first = max(0, differ - _CONTEXT_OPS)
    lines = [
        str(error),
        "",
        f"debug=True: the original forward and the recompute first differ at operation #{differ}:",
    ]
    for label, entries in (("original forward", before), ("recompute", again)):
        lines.append(f"  {label}:")
        shown = entries[first : differ + 1]
        lines += [f"    #{first + k}{' >' if first + k == differ else '  '} {entry}" for k, entry in enumerate(shown)]
        if differ >= len(entries):
            lines.append(f"    #{differ} >  (no operation: it ran {len(entries)})")
    result = NondeterministicRecompute("\n".join(lines))
    result.explained = True  # type: ignore[attr-defined]
    return result
