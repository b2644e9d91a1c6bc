"""Small tensor helpers shared by the two recompute implementations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorMeta", "detached_alias"]


def detached_alias(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new leaf sharing `tensor`'s storage, requiring grad as the original did.

    Recomputes run on such aliases: the same operations save the same tensors as in the
    original forward, and the recompute's own graph stays apart from the original one.
    """
    if not requires_grad and not tensor.requires_grad:
        return tensor  # nothing to cut: the recompute sees the very tensor, attributes and all
    alias = tensor.detach()
    if requires_grad and (alias.is_floating_point() or alias.is_complex()):
        alias.requires_grad_(True)
    return alias


@dataclass(frozen=True)
class TensorMeta:
    """The shape, dtype and device of a tensor, to compare a recompute with its original."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(t.shape, t.dtype, t.device)
