"""Spans: where each nested block's saved tensors start and stop in its root's numbering,
as the first forward recorded them (NOTE [nested recompute frames] in :mod:`remat.manual._frames`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat.manual._frames import _Context, _Frame

__all__ = ["Span", "recorded_span"]


class Span:
    """Where a nested block's handles start and stop in its root, and its own nested blocks."""

    __slots__ = ("start", "stop", "children", "op_start", "original_ops", "policy_key")

    def __init__(self, start: int, op_start: int = 0) -> None:
        self.start = start
        self.stop: int | None = None
        self.children: list[Span] = []
        self.policy_key: int | None = None  # its policy block's ordinal (NOTE [selective recompute])
        self.op_start = op_start  # its first operation in the root's op trace (debug=True)
        self.original_ops: list[Any] | None = None  # its own trace, when only it has debug=True


def recorded_span(parent: _Frame, context: _Context) -> Span | None:
    """The span the first forward recorded for the nested block `parent` meets now."""
    ordinal = context.children_met
    context.children_met += 1
    if parent.span is None or ordinal >= len(parent.span.children):
        return None
    span = parent.span.children[ordinal]
    if span.start != parent.cursor or span.stop is None:
        return None
    return span
