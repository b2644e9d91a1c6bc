"""Tensors from outside a recomputed block that its recompute reads: those held inside its
inputs and outputs where torch's pytree does not look, and the parameters it uses.

NOTE [tensors inside other inputs]
A recomputed block keeps its inputs, flattened with torch's pytree: the tensors of tuples,
lists, dicts and registered types are kept one by one, with their versions, and a recompute
that would read a tensor changed in place raises :class:`~remat.errors.RecomputeInputModified`.
Anything else is kept as it is, by reference: a dataclass holding a scale, a mapping of
another type (``UserDict``). A tensor inside such an input, changed in place after the
forward or replaced by another, would be read as it is then by the recompute (silently other
gradients, where plain autograd raises or uses what the forward saw). So the tensors found
inside those inputs (the fields of a dataclass, the values of a mapping, and the tuples,
lists and dicts among them, a few levels down, each container once) are noted with where
they are and their versions as the block's first forward leaves them (what the block changes
there itself, a field it caches or a counter it updates, is its own doing, as with a
module's state), and the recompute checks them first: another tensor at a place, or one
changed in place, raises. The same walk finds tensors that the reentrant implementation
could not hand back with their history (NOTE [outputs of the reentrant Function]).

NOTE [parameters changed before the recompute]
Plain autograd keeps the parameters a block's operations save (a weight, or the transpose a
product takes of it) and raises if one was changed in place before backward reads it: an
optimizer step between a forward and its backward (a GAN's discriminator stepped between the
generator's forward and backward), an update of an exponential average in place. A recompute
would silently run with the new values. So, while a block runs for the first time, the
parameters among what it saves (or the parameters they view) are noted; when it ends, their
versions; and a recompute first checks them, raising
:class:`~remat.errors.RecomputeInputModified` for one changed since. A parameter the block
changes in place itself (a clamp under ``no_grad``, an embedding's ``max_norm``) is noted
after that change, and again after each recompute, which changes it again: the next
recompute (of a nested block, or in a second backward of a retained graph) is not refused.
Not seen: a parameter no operation saves as itself (an embedding's weight; under autocast,
where the saved tensor is the weight's cast), where plain autograd does not raise either but
keeps the values it used, and the reentrant implementation, whose first forward saves
nothing. Buffers are not checked: remat puts back the values a forward changed (NOTE [module
state during recompute]) without moving their versions.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from remat.errors import RecomputeInputModified

__all__ = ["HeldInside", "ParametersRead", "held_inside", "outputs_held_inside", "tensors_inside"]

_DEPTH = 4


def tensors_inside(
    value: Any, path: str = "", depth: int = _DEPTH, seen: set[int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside `value`, a pytree leaf that is no tensor, with where each is (each
    container once: a structure that holds itself is walked once)."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    seen = set() if seen is None else seen
    if depth < 0 or id(value) in seen:
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.add(id(value))
        for field in dataclasses.fields(value):
            yield from tensors_inside(getattr(value, field.name, None), f"{path}.{field.name}", depth - 1, seen)
    elif isinstance(value, Mapping):
        seen.add(id(value))
        for key, item in list(value.items()):
            yield from tensors_inside(item, f"{path}[{key!r}]", depth - 1, seen)
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        for index, item in enumerate(value):
            yield from tensors_inside(item, f"{path}[{index}]", depth - 1, seen)


class HeldInside:
    """The tensors inside one input, with their versions as the block's first forward left them."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[tuple[str, torch.Tensor, int]]) -> None:
        self.tensors = tensors

    def checked(self, value: Any, position: int, name: str) -> Any:
        """`value`, once checked: the recompute would read the same tensors inside it, unchanged.

        Raises:
            RecomputeInputModified: a tensor inside the input was replaced or changed in place.
        """
        now = list(tensors_inside(value))
        for index, (path, tensor, version) in enumerate(self.tensors):
            what = (
                f"the tensor at {type(value).__name__}{path} inside input {position} of the recomputed block {name!r}"
            )
            if index >= len(now) or now[index][0] != path or now[index][1] is not tensor:
                raise RecomputeInputModified(
                    f"{what} was replaced after the forward; the recompute would read another tensor. "
                    "Give the block a new object instead of changing the one it took, or pass the tensor "
                    "itself as an argument"
                )
            if tensor._version != version:
                raise RecomputeInputModified(
                    f"{what} was modified in place after the forward (version {version} -> "
                    f"{tensor._version}); the recompute would see other values. Clone it before modifying it"
                )
        if len(now) != len(self.tensors):
            raise RecomputeInputModified(
                f"input {position} of the recomputed block {name!r} ({type(value).__name__}) holds other "
                "tensors than when the block took it; the recompute would read them"
            )
        return value


def held_inside(value: Any) -> HeldInside | None:
    """The tensors inside `value` (an input the pytree keeps whole), noted; None if it holds none."""
    if isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
        return None
    found = [(path, tensor, tensor._version) for path, tensor in tensors_inside(value)]
    return HeldInside(found) if found else None


def outputs_held_inside(leaves: list[Any]) -> list[tuple[int, str, torch.Tensor]]:
    """The tensors that an output's pytree `leaves` (other than tensors) hold, by leaf."""
    return [
        (index, path, tensor)
        for index, leaf in enumerate(leaves)
        if not isinstance(leaf, torch.Tensor)
        for path, tensor in tensors_inside(leaf)
    ]


class ParametersRead:
    """The parameters a block's first forward saved, and their versions when it ended
    (NOTE [parameters changed before the recompute])."""

    __slots__ = ("noted", "versions")

    def __init__(self) -> None:
        self.noted: dict[int, weakref.ref[torch.Tensor]] = {}
        self.versions: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def saw(self, tensor: torch.Tensor) -> None:
        """`tensor` is saved by the first forward: noted if it is (a view of) a parameter."""
        base: torch.Tensor | None = tensor if tensor.is_leaf else tensor._base if tensor._is_view() else None
        if base is None:
            return  # an activation: the common case
        if isinstance(base, torch.nn.Parameter) and id(base) not in self.noted:
            self.noted[id(base)] = weakref.ref(base)

    def ended(self) -> None:
        """The first forward ended: the versions a recompute must find."""
        refs, self.noted = list(self.noted.values()), {}
        self._note(refs)

    def ran(self) -> None:
        """A recompute of the block ran: what it changed itself (a clamp it makes again) is no
        change of the user's; the versions it left are those the next one must find."""
        self._note([ref for ref, _ in self.versions])

    def _note(self, refs: list[weakref.ref[torch.Tensor]]) -> None:
        self.versions = [(ref, parameter._version) for ref in refs if (parameter := ref()) is not None]

    def check(self, name: str) -> None:
        """Raises if a parameter was changed in place since the first forward ended.

        Raises:
            RecomputeInputModified: one was.
        """
        for ref, version in self.versions:
            parameter = ref()
            if parameter is not None and parameter._version != version:
                raise RecomputeInputModified(
                    f"a parameter of shape {tuple(parameter.shape)} that the recomputed block {name!r} uses was "
                    f"modified in place between its forward and its backward (version {version} -> "
                    f"{parameter._version}), by an optimizer step or an update of your own; plain autograd "
                    "raises for this too. Step after the backward, or do not recompute this block"
                )
