"""The storages that hold a tensor's memory, through tensor subclasses that wrap others.

NOTE [wrapper tensors]
A tensor subclass that wraps others (DTensor around its local shard, the
AsyncCollectiveTensor of a functional collective) reports a storage of its own, sized
for its whole (global) shape, that holds no memory: the memory is its inner tensors'.
The tracker counts, everywhere, the storages of the inner tensors instead, so a
tensor-parallel layer's output counts its local shard once, and the local tensor taken
out of it is the same allocation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["BUFFERED_LOSSES", "PLAIN_TYPES", "buffered_loss_bytes", "is_wrapper", "storage_key", "unwrapped"]

#: Tensor types that wrap nothing (checked first: the tracker sees every operator's outputs).
PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor})


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether `tensor` wraps inner tensors that hold its memory (see the NOTE)."""
    return type(tensor) not in PLAIN_TYPES and is_traceable_wrapper_subclass(tensor)


def unwrapped(leaves: list[Any]) -> list[Any]:
    """`leaves` with each wrapper tensor replaced by its inner tensors (see the NOTE)."""
    if all(type(leaf) in PLAIN_TYPES or not isinstance(leaf, torch.Tensor) for leaf in leaves):
        return leaves
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and is_wrapper(leaf):
            attributes, _ = leaf.__tensor_flatten__()  # type: ignore[attr-defined]
            out.extend(unwrapped([getattr(leaf, name) for name in attributes]))
        else:
            out.append(leaf)
    return out


def storage_key(tensor: torch.Tensor) -> int | None:
    """The key of the storage holding `tensor`'s memory (a wrapper's first inner tensor's),
    or None for a meta, sparse or storage-less tensor."""
    if is_wrapper(tensor):
        inner = unwrapped([tensor])
        if not inner:
            return None
        tensor = inner[0]
    if tensor.is_meta or tensor.layout != torch.strided:
        return None
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


# NOTE [losses that keep their buffer]
# mse_loss, smooth_l1_loss, soft_margin_loss and binary_cross_entropy reduce their
# elementwise losses in place and return the scalar in that buffer's storage: the loss
# holds its input's size of memory until it dies. This was first seen on the CPU; on an
# H200 the tracker found a mean square loss planned as a stage 32,764 bytes above its
# plan, one (128, 64) float buffer less its four counted bytes: the same there. Their
# fake counterparts return four bytes, so the tracker counts the buffer for a fake one on
# any device (a loss module planned as a stage is sized right; after the chain, the loss
# probe on real tensors finds it too). Where a device's kernel lets the buffer go, this
# counts it once too often: on the safe side.
BUFFERED_LOSSES = frozenset(
    {
        torch.ops.aten.mse_loss.default,
        torch.ops.aten.smooth_l1_loss.default,
        torch.ops.aten.soft_margin_loss.default,
        torch.ops.aten.binary_cross_entropy.default,
    }
)


def buffered_loss_bytes(func: Any, args: Any, out: Any) -> int:
    """The bytes of the buffer behind the output of `func` (its input's size) when it is a
    fake loss of ``BUFFERED_LOSSES``, else 0."""
    if func not in BUFFERED_LOSSES or not isinstance(out, FakeTensor) or out.dim() != 0:
        return 0
    first = args[0]
    return int(first.numel() * first.element_size()) if isinstance(first, torch.Tensor) else 0
