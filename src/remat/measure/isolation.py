"""Measuring without side effects: the model and the caller's inputs are left as they were.

remat's own runs (measuring, sizing, rehearsing) run forwards and backwards on the user's
model: :func:`preserved_model_state` puts back its gradients, buffers, attributes and RNG
states afterwards, and :func:`isolated_inputs` gives the runs inputs of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.manual._rng import preserved_host_rng
from remat.manual._state import is_state_attribute, rehearsing
from remat.measure.parameters import alias_parameters
from remat.sharded import gathered_units

__all__ = ["isolated_inputs", "preserved_model_state"]


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, devices: list[torch.device]) -> Iterator[None]:
    """Runs the body as remat's own run: the model is left as it was.

    On exit, parameter gradients, every buffer (values and identity), every module's plain
    attributes (numbers, strings, tensors held outside buffers) and the RNG states are
    restored; meanwhile :func:`remat.is_recomputing` is True, so user code can tell these
    runs from training forwards. The units of a model sharded with FSDP2 are gathered for
    the body and sharded again after it (NOTE [FSDP2 units] in :mod:`remat.sharded`).
    """
    with gathered_units(model), _preserved(model, devices):
        yield


def preserved_state_bytes(model: nn.Module) -> int:
    """What :func:`preserved_model_state` holds while its body runs: a copy of every buffer."""
    return sum(
        b.numel() * b.element_size() for module in model.modules() for b in module._buffers.values() if b is not None
    )


@contextlib.contextmanager
def _preserved(model: nn.Module, devices: list[torch.device]) -> Iterator[None]:
    grads = [(p, p.grad) for p in model.parameters()]
    aliased = alias_parameters(model)
    buffers = [
        (module, name, b, b.detach().clone())
        for module in model.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    attributes = [(module, dict(module.__dict__)) for module in model.modules()]
    cuda = [d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=cuda), preserved_host_rng(), rehearsing():
            for p, _ in grads:
                p.grad = None
            yield
    finally:
        for table, name, parameter in aliased:
            table[name] = parameter
        with torch.no_grad():
            for module, name, b, saved in buffers:
                module._buffers[name] = b
                b.copy_(saved)
        for module, before in attributes:
            for name in [n for n in module.__dict__ if n not in before and _restored(n)]:
                del module.__dict__[name]
            for name, value in before.items():
                if _restored(name):
                    module.__dict__[name] = value
        for p, g in grads:
            p.grad = g


def _restored(name: str) -> bool:
    """Whether measurement puts a module's attribute back: its state, and its training mode."""
    return name == "training" or is_state_attribute(name)


def isolated_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, copied: AbstractSet[int] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs for remat's own runs: the caller's tensors are never touched.

    The measured steps run backward: on the caller's tensors that would accumulate
    gradients into them (and into whatever they were computed from) and free the
    caller's graph before its own backward; and a model that works in place on its input
    would change the caller's tensor before remat could refuse it. Each tensor is
    replaced by a copy with the same values and flags (one that requires grad gets a
    graph of its own). With `copied` (the positions, among the flattened inputs, of the
    tensors the model changes in place), the other tensors are detached aliases instead:
    no memory, and still no gradient or graph of the caller's.
    """
    leaves, spec = tree_flatten((args, kwargs))
    leaves = [
        (_copy(leaf) if copied is None or position in copied else _alias(leaf))
        if isinstance(leaf, torch.Tensor)
        else leaf
        for position, leaf in enumerate(leaves)
    ]
    return tree_unflatten(leaves, spec)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    alias = tensor.detach()
    return alias.requires_grad_(True) if tensor.requires_grad else alias


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    # A leaf stays a leaf: autocast caches its casts of leaves that require grad (until
    # its region ends), not those of activations (NOTE [autocast casts]).
    if tensor.requires_grad and not tensor.is_leaf:
        return tensor.detach().requires_grad_(True).clone()
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)
