"""Helpers on a model's weights: count them, copy them between layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["copy_weights", "count_parameters", "depth_factory"]


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """The number of scalar parameters of ``model``.

    A parameter shared between modules (tied weights) is counted once.

    Args:
        model: any module.
        trainable_only: count only parameters with ``requires_grad``.

    Returns:
        The total number of elements.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def copy_weights(source: nn.Module, destination: nn.Module) -> None:
    """Copies parameters and buffers from ``source`` into ``destination``, by order.

    The two models may name their modules differently (an original model with
    its own ``forward`` and the chain built from it); what must agree is the
    order of :meth:`~torch.nn.Module.parameters` and
    :meth:`~torch.nn.Module.buffers` and the shape at each position. Every pair
    is checked before anything is written.

    Args:
        source: the model to read.
        destination: the model to overwrite, in place.

    Raises:
        ValueError: the models differ in the number of parameters or buffers,
            or in the shape at some position (the message names both tensors).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for kind, source_named, destination_named in (
        ("parameter", list(source.named_parameters()), list(destination.named_parameters())),
        ("buffer", list(source.named_buffers()), list(destination.named_buffers())),
    ):
        if len(source_named) != len(destination_named):
            raise ValueError(f"source has {len(source_named)} {kind}s, destination has {len(destination_named)}")
        for index, ((source_name, from_tensor), (destination_name, to_tensor)) in enumerate(
            zip(source_named, destination_named, strict=True)
        ):
            if from_tensor.shape != to_tensor.shape:
                raise ValueError(
                    f"{kind} {index} differs: source {source_name!r} has shape "
                    f"{tuple(from_tensor.shape)}, destination {destination_name!r} has shape "
                    f"{tuple(to_tensor.shape)}"
                )
            pairs.append((from_tensor, to_tensor))
    with torch.no_grad():
        for from_tensor, to_tensor in pairs:
            to_tensor.copy_(from_tensor)


def depth_factory(
    family: Callable[..., nn.Sequential], name: str, depth: int, doc: str
) -> Callable[..., nn.Sequential]:
    """A named factory for one depth of a family: ``name(num_classes, **options)``."""

    def factory(num_classes: int = 1000, **options: Any) -> nn.Sequential:
        return family(depth, num_classes, **options)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory
