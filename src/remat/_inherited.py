"""Per-thread stacks that a backward's worker threads inherit from the thread that started it."""

from __future__ import annotations

import threading
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
_has = torch._C._is_key_in_tls
_stash = torch._C._stash_obj_in_tls
_remove = torch._C._remove_obj_from_tls
_compiling = torch.compiler.is_compiling

#: the keys of every stack in torch's per-thread store
KEYS: list[str] = []

# NOTE [what torch's per-thread store may hold]
# A value left in torch's store when a thread ends is let go by C++ as the thread ends,
# and if the process is exiting by then, that can abort it ("terminate called without an
# active exception"). So a stack is in the store only while it holds something: a pop to
# empty removes its key, and a read of a missing key stores nothing.
#
# Dynamo cannot trace a read of that store (it is a torch function that returns no tensor),
# and code it compiles can read a stack (remat.tag, remat.offload). A thread-local mirror
# of the stack's head, kept by the pushes and pops of its own thread, is what traced code
# reads; Dynamo guards on it as on any thread-local. A backward's thread reads the store.


class _Node(Generic[T]):
    __slots__ = ("value", "below", "flag", "thread")

    def __init__(self, value: T, below: _Node[T] | None, flag: bool) -> None:
        self.value, self.below, self.flag = value, below, flag
        self.thread = threading.get_ident()  # the thread that pushed it


class InheritedStack(Generic[T]):
    """A stack per thread; a backward's worker thread starts from the starting thread's."""

    __slots__ = ("_key", "_mirror")

    def __init__(self, key: str) -> None:
        assert key not in KEYS, f"a second stack under {key!r}"
        self._key = key
        self._mirror = threading.local()  # NOTE [what torch's per-thread store may hold]
        KEYS.append(key)

    def _head(self) -> _Node[T] | None:
        if _compiling():
            return getattr(self._mirror, "head", None)
        if not _has(self._key):
            return None
        head: _Node[T] | None = _get(self._key)
        return head

    def _set(self, head: _Node[T] | None) -> None:
        if head is None:
            if _has(self._key):
                _remove(self._key)
        else:
            _stash(self._key, head)
        # the mirror holds only what this thread pushed (a backward's thread lets go of
        # the inherited nodes when its own are popped)
        self._mirror.head = head if head is not None and head.thread == threading.get_ident() else None

    def top(self) -> T | None:
        head = self._head()
        return None if head is None else head.value

    def flag(self) -> bool:
        """The flag pushed with the top value (False when empty)."""
        head = self._head()
        return head is not None and head.flag

    def push(self, value: T, flag: bool = False) -> None:
        self._set(_Node(value, self._head(), flag))

    def pop(self) -> T:
        head = self._head()
        assert head is not None, "pop from an empty stack"
        self._set(head.below)
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
