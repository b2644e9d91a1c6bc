"""Hooks on the output of a chain that recomputes: a retained graph is refused, a backward
inside the forward's autocast region is warned about."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from remat.errors import RematError
from remat.manual._state import is_recomputing
from remat.manual._tensors import graph_retained

__all__ = ["hook_chain_output"]


def hook_chain_output(out: Any, *, recomputes: bool) -> None:
    """Hooks on the chain's output: a retained graph is refused where stages are recomputed,
    and a backward inside the forward's autocast region is warned about."""
    hooks = []
    if recomputes:
        hooks.append(_refuse_retained_graph)
    device_types = {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    if any(torch.is_autocast_enabled(d) for d in device_types if d in ("cpu", "cuda")):
        hooks.append(functools.partial(_warn_backward_under_autocast, frozenset(device_types)))
    for tensor in tree_leaves(out):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            for hook in hooks:
                tensor.register_hook(hook)


def _warn_backward_under_autocast(device_types: frozenset[str], grad: torch.Tensor) -> None:
    """Warns when the backward runs inside the autocast region of the forward."""
    # NOTE [autocast casts] (remat.measure.outside): the plan counts autocast's cache of
    # weight casts as emptied when the autocast region ends, before the backward, as in
    # the training loop PyTorch recommends. A backward inside the region keeps it.
    if not is_recomputing() and any(torch.is_autocast_enabled(d) for d in device_types if d in ("cpu", "cuda")):
        warnings.warn(
            "remat: backward runs inside torch.autocast; its cache keeps every weight cast of the "
            "forward through the backward, which the plan does not count (it may go over the budget). "
            "Leave the autocast region before calling backward, as PyTorch recommends",
            RuntimeWarning,
            stacklevel=2,
        )


def _refuse_retained_graph(grad: torch.Tensor) -> None:
    """Raises when a backward that keeps its graph reaches a chain that recomputes."""
    # NOTE [retained graphs] (remat.manual._frames): a recompute's tensors are dropped as
    # backward takes them, but a stage the plan stores keeps its activations until the
    # graph is freed, on top of the recomputes the plan counted on their place.
    if graph_retained():
        raise RematError(
            "a backward that keeps its graph (backward(retain_graph=True), or torch.autograd.grad(..., "
            "create_graph=True) for a gradient penalty) reached a chain that remat plans: a retained graph "
            "keeps every stored stage's activations until it is freed, beyond the planned budget. Call "
            "backward once per forward (for several losses, backward their sum); for a gradient penalty "
            "through the model, recompute the blocks you choose with remat.mark or remat.apply, which take "
            "it exactly. Gradients of the parameters after the chain may already have been accumulated: "
            "zero them before the next step"
        )
