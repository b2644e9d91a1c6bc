"""The loss of a measured step: the user's, the one the output carries, or a sum, and its backward."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from remat.errors import RematError, UnsupportedModel
from remat.manual._outside import tensors_inside
from remat.memory import MemoryTracker

__all__ = ["output_loss", "output_tensors"]


class _DefaultLoss:
    """The loss of a step measured without a ``loss_fn``: the one the output carries, if any."""

    def __init__(self) -> None:
        self.from_output = False

    def __call__(self, output: Any) -> torch.Tensor:
        carried = output_loss(output)
        if carried is not None:
            self.from_output = True
            return carried
        return _default_loss(output)


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries (``output.loss`` or ``output["loss"]``, a scalar
    that requires grad: a Hugging Face model called with ``labels``), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return loss
    return None


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: its pytree's, and those inside the dataclasses among its
    leaves (not pytree nodes)."""
    found = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(tensor for _, tensor in tensors_inside(leaf))
    return found


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in output_tensors(output) if t.requires_grad and t.is_floating_point()]
    if not tensors:
        found = sorted({f"{t.dtype}, requires_grad={t.requires_grad}" for t in output_tensors(output)})
        what = "tensors of " + "; ".join(found) if found else f"no tensor ({type(output).__name__})"
        raise RematError(
            f"remat cannot form a default loss from the model's output: it holds {what}, and the "
            "default (the sum of the outputs) needs a real floating-point tensor that requires "
            "grad. Pass loss_fn=lambda output: ... to remat.Checkpointable (the loss of your "
            "training step), and check that the model is in training mode and its parameters "
            "require grad"
        )
    return torch.stack([t.sum() for t in tensors]).sum()


def _loss_and_backward(
    loss_fn: Callable[[Any], Any],
    output: list[Any],
    on_loss: Callable[[Any], None] | None = None,
    leaves: Callable[[torch.Tensor], list[torch.Tensor] | None] | None = None,
) -> None:
    """Computes the loss, drops the output (as a training loop does), then runs backward.

    `output` is a one-element list so that this function holds the only reference;
    `on_loss` is called with the loss once it is computed, before its backward; `leaves`
    gives the leaves the backward runs for (None from it: all of them).
    """
    loss = loss_fn(output.pop())
    if on_loss is not None:
        on_loss(loss)
    if loss is None:  # the loss function ran the backward itself
        return
    if not isinstance(loss, torch.Tensor):
        raise RematError(f"loss_fn must return the loss tensor (or None), got {type(loss).__name__}")
    if loss.numel() != 1:
        loss = loss.sum()
    # A training loop leaves the autocast region before its backward, which empties the
    # cache of weight casts: measured so, the casts the backward still needs are those the
    # stages saved (the executor warns about a backward inside the region).
    torch.clear_autocast_cache()
    inputs = leaves(loss) if leaves is not None else None
    if inputs is None or inputs:
        loss.backward(inputs=inputs)


#: The fields a Hugging Face output holds its key/value cache in (renamed to ``cache`` in transformers 5).
_CACHE_FIELDS = ("past_key_values", "cache", "cache_params")


def _check_no_cache(output: Any) -> None:
    # NOTE [key/value caches]
    # A model that fills a key/value cache in its training forward (Hugging Face models
    # built with use_cache=True) appends to it again when remat recomputes a block: the
    # recompute then attends over twice the keys (NondeterministicRecompute, or a silently
    # corrupted cache), and the cache keeps the blocks' tensors alive against the plan.
    if isinstance(output, dict):  # (dict's own get: Hugging Face's outputs warn when asked for a renamed field)
        cache = next((dict.get(output, name) for name in _CACHE_FIELDS if dict.get(output, name) is not None), None)
    elif isinstance(output, Mapping):
        cache = output.get("past_key_values")
    else:
        cache = getattr(output, "past_key_values", None)
    if cache is not None:
        raise UnsupportedModel(
            "the model returned a key/value cache (past_key_values) from its training forward; "
            "recomputing a block would append to that cache again. Build the model with "
            "use_cache=False (Hugging Face: from_pretrained(..., use_cache=False) or "
            "config.use_cache = False) or call it with use_cache=False"
        )


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorShape(tuple(value.shape), value.dtype, value.requires_grad)
    return _fields_mapped(_shape_of, value)


def _fields_mapped(function: Callable[[Any], Any], value: Any) -> Any:
    """A dataclass output (a pytree leaf) copied with `function` mapped over its fields' pytrees;
    any other value as it is."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    copied = copy.copy(value)
    for field in dataclasses.fields(value):
        if hasattr(value, field.name):
            object.__setattr__(copied, field.name, tree_map(function, getattr(value, field.name)))
    return copied


def _loss_widening(outputs: list[torch.Tensor]) -> float:
    """How much wider a loss computes than the output is stored: a loss on half-precision
    floats upcasts them to float32 (NOTE [loss allowance] in remat.plan.share)."""
    sizes = [t.element_size() for t in outputs if t.is_floating_point()]
    return max([4 / size for size in sizes if size < 4], default=1.0)


@dataclasses.dataclass(frozen=True)
class _TensorShape:  # (not a pytree node: tree_map leaves it whole)
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _loss_probe(run_loss: Callable[[list[Any]], None], output: Any, device: torch.device) -> int:
    """Bytes the loss needs on real tensors beyond fake ones, on an output of zeros of the model's shapes."""

    def zeros(value: Any) -> Any:
        if isinstance(value, _TensorShape):
            return torch.zeros(value.shape, dtype=value.dtype, device=device).requires_grad_(value.requires_grad)
        return _fields_mapped(zeros, value)

    peaks = []
    for fake in (False, True):
        context = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        with context:
            holder = [tree_map(zeros, output)]
        tracker = MemoryTracker(device=device.type, count_fake=True)
        with context, tracker:
            run_loss(holder)
        peaks.append(tracker.peak_bytes)
    return max(0, peaks[0] - peaks[1])
