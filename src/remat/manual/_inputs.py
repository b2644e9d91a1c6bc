"""The inputs a recomputed block keeps for its recomputes, and their checks.

A tensor input is kept as ``(tensor, requires_grad, tangent)``: the tensor detached when it
requires grad (the recompute runs on an alias of it, its own graph apart from the
original's), and its forward-mode tangent, if any. Its version goes beside it; an input of
another kind is kept as it is, beside what it holds (NOTE [tensors inside other inputs]).

NOTE [forward-mode tangents of inputs]
A block called on dual tensors (``torch.autograd.forward_ad``) computes its outputs'
tangents as it runs, and the operations that make them save tensors for the backward too
(the tangent of ``v @ W`` is ``t @ W``, which saves ``t`` for ``W``'s gradient). A recompute
on the bare inputs would save fewer tensors than the first forward, and raise. So each
input's tangent is kept beside it, and the recompute runs on the inputs made dual again,
in the dual level still open or, once it is closed (a backward after it), in one opened for
the recompute: the same operations save the same tensors. The tangents it computes are
dropped with its outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd import forward_ad

from remat.errors import RecomputeInputModified
from remat.manual._outputs import OutputOf
from remat.manual._outside import HeldInside, changed_by_own_forward, held_inside
from remat.manual._tensors import detached_alias

__all__ = ["dual_level_for", "ended_first_forward", "has_tangents", "kept_tensor", "materialised"]


def kept_tensor(value: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """How a tensor input is kept (NOTE [forward-mode tangents of inputs])."""
    tangent = None if forward_ad._current_level < 0 else forward_ad.unpack_dual(value).tangent
    return (value.detach() if value.requires_grad else value, value.requires_grad, tangent)


def has_tangents(inputs: list[Any], versions: list[Any]) -> bool:
    """Whether a kept tensor input has a tangent."""
    return any(type(version) is int and value[2] is not None for value, version in zip(inputs, versions, strict=True))


def materialised(inputs: list[Any], versions: list[Any], name: str) -> list[Any]:
    """The flattened inputs of a recompute of block `name`.

    Raises:
        RecomputeInputModified: a kept input was changed in place since the first forward.
    """
    flat: list[Any] = []
    for position, (value, version) in enumerate(zip(inputs, versions, strict=True)):
        if isinstance(value, OutputOf):
            flat.append(detached_alias(*value.frame.outputs_for_recompute()[value.leaf]))
        elif type(version) is int:
            tensor, requires_grad, tangent = value
            if tensor._version != version:
                raise RecomputeInputModified(
                    f"input {position} of the recomputed block {name!r} was modified in place after "
                    f"the forward (version {version} -> {tensor._version}); the recompute would see other "
                    "values. Clone it before modifying it, or do not recompute this block"
                )
            alias = detached_alias(tensor, requires_grad)
            if tangent is not None and forward_ad.unpack_dual(alias).tangent is None:
                with torch.enable_grad():  # (a backward runs without: the dual would not require grad)
                    alias = forward_ad.make_dual(alias, tangent)
            flat.append(alias)
        else:
            flat.append(value if version is None else version.checked(value, position, name))
    return flat


def ended_first_forward(inputs: list[Any], versions: list[Any], name: str) -> list[Any]:
    """The versions a recompute checks, once the block's first forward ended: what other
    inputs hold, as it left them (NOTE [tensors inside other inputs]).

    Raises:
        RecomputeInputModified: the block changed a tensor input in place (NOTE [inputs a block changes itself]).
    """
    for position, (value, version) in enumerate(zip(inputs, versions, strict=True)):
        if type(version) is int and value[0]._version != version:
            raise changed_by_own_forward(name, position, version, value[0]._version)
    pairs = zip(inputs, versions, strict=True)
    return [held_inside(value) if isinstance(held, HeldInside) else held for value, held in pairs]


@contextlib.contextmanager
def dual_level_for() -> Iterator[None]:
    """A dual level for a recompute whose inputs have tangents, when none is open."""
    if forward_ad._current_level < 0:
        with forward_ad.dual_level():
            yield
    else:
        yield
