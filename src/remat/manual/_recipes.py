"""What :mod:`remat.manual.elementwise` notes and holds: how a tensor was made, and the
recipe autograd holds in its place (NOTE [recomputing elementwise saves])."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from remat.manual.elementwise import ElementwiseRecompute


def _key(tensor: torch.Tensor) -> int:
    """What the saved entries are filed under: an id, which a later tensor may take again."""
    return id(tensor)


class _Made:
    """How a tensor was made: one elementwise operation and its (flat) arguments."""

    __slots__ = ("operation", "args", "kwargs", "version")

    def __init__(self, operation: Any, args: tuple[Any, ...], kwargs: dict[str, Any], version: int) -> None:
        self.operation = operation
        self.args = args  # a tensor argument is an _Argument
        self.kwargs = kwargs
        self.version = version  # the output's version when made: a later in-place change makes this stale


class _Argument:
    """A tensor argument of a noted operation: the tensor (weakly), its version then, how it was made."""

    __slots__ = ("key", "ref", "version", "made")

    def __init__(self, tensor: torch.Tensor, made: _Made | None) -> None:
        self.key = _key(tensor)
        self.ref = weakref.ref(tensor)  # the one weak reference to it, so also its identity once dead
        self.version = tensor._version
        self.made = made


class _Step:
    """One operation of a recipe: its arguments are tensors, values, or steps run before it."""

    __slots__ = ("operation", "args", "kwargs")

    def __init__(self, operation: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.operation = operation
        self.args = args
        self.kwargs = kwargs


class _Recipe:
    """What autograd holds in place of a saved tensor: how to make it again."""

    __slots__ = ("owner", "step", "view", "tensors", "ref", "version", "changed", "__weakref__")

    def __init__(
        self,
        owner: ElementwiseRecompute,
        step: _Step,
        tensors: list[tuple[torch.Tensor, int]],
        tensor: torch.Tensor,
        view: bool,
    ) -> None:
        self.owner = owner
        self.step = step
        # a view of what the recipe makes: its size, strides and offset
        self.view = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset()) if view else None
        self.tensors = tensors  # each tensor read, with the version the recipe needs
        self.ref = weakref.ref(tensor)
        self.version = tensor._version
        self.changed = False


class _Kept:
    """A tensor saved as it is: what holds it, and its version then.

    Under other hooks (`value` is what they packed), the tensor itself is held too: recipes
    read it. Its memory is the same but for hooks that move what they pack elsewhere.
    """

    __slots__ = ("value", "tensor", "version")

    def __init__(self, value: Any, tensor: torch.Tensor) -> None:
        self.value = value
        self.tensor = tensor
        self.version = tensor._version


class _FirstOutput:
    """An operation with several outputs, run for its first (a layer norm's output, not its
    mean and inverse deviation, which autograd saves as they are)."""

    __slots__ = ("operation",)

    def __init__(self, operation: Any) -> None:
        self.operation = operation

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.operation(*args, **kwargs)[0]

    def __repr__(self) -> str:
        return f"{self.operation}[0]"
