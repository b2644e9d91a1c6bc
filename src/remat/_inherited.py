"""Per-thread stacks that a backward's worker threads inherit from the thread that started it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["KEYS", "InheritedStack"]

T = TypeVar("T")

# NOTE [state a backward's threads inherit]
# On a GPU, autograd runs a backward on a thread of its own per device. It hands that
# thread a copy of what torch keeps per thread (grad mode, saved-tensor hooks, dispatch
# modes), taken when the backward starts, but not Python's thread-locals. A block that
# runs a backward inside its forward (a gradient penalty) has that backward's tensors
# packed by remat's saved-tensor hooks, and its operations seen by the policy mode, on the
# device's thread. With remat's stacks of running blocks in Python thread-locals, that
# thread found them empty: the inner backward's saved tensors and operations were left out
# of the block's numbering in its first forward and counted in its recompute (which runs
# on the device's thread itself), so the recompute filled the handles off by that many:
# wrong gradients wherever the shapes agreed.
#
# The stacks live in torch's own per-thread store of Python objects, which is part of what
# autograd hands to its threads. Each stack is an immutable chain of nodes: a push stores a
# new head, a pop stores the node below. A backward's thread starts from the head the
# starting thread had, as a backward on the CPU (which runs on the calling thread) does,
# and its own pushes and pops never touch the starting thread's stack, which a backward
# on the CPU side of the same graph may be using at the same time.

_get = torch._C._get_obj_in_tls
_stash = torch._C._stash_obj_in_tls

#: the keys of every stack in torch's per-thread store
KEYS: list[str] = []


class _Node(Generic[T]):
    __slots__ = ("value", "below", "flag")

    def __init__(self, value: T, below: _Node[T] | None, flag: bool) -> None:
        self.value, self.below, self.flag = value, below, flag


class InheritedStack(Generic[T]):
    """A stack per thread; a backward's worker thread starts from the starting thread's."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        assert key not in KEYS, f"a second stack under {key!r}"
        self._key = key
        KEYS.append(key)

    def _head(self) -> _Node[T] | None:
        try:
            head: _Node[T] | None = _get(self._key)
        except RuntimeError:  # this thread has never had one: it has none from now on
            _stash(self._key, None)
            return None
        return head

    def top(self) -> T | None:
        head = self._head()
        return None if head is None else head.value

    def flag(self) -> bool:
        """The flag pushed with the top value (False when empty)."""
        head = self._head()
        return head is not None and head.flag

    def push(self, value: T, flag: bool = False) -> None:
        _stash(self._key, _Node(value, self._head(), flag))

    def pop(self) -> T:
        head = self._head()
        assert head is not None, "pop from an empty stack"
        _stash(self._key, head.below)
        return head.value

    def __iter__(self) -> Iterator[T]:
        """From the top down."""
        node = self._head()
        while node is not None:
            yield node.value
            node = node.below

    def __bool__(self) -> bool:
        return self._head() is not None

    @property
    def items(self) -> list[Any]:
        """From the bottom up (a copy)."""
        return list(self)[::-1]
