"""The key a plan is cached under: everything about a step that changes its costs."""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.budget import Budget

__all__ = ["PlanOptions", "shape_family", "signature", "what_changed"]


class PlanOptions(NamedTuple):
    """Everything a plan depends on besides the measurement (the key of the plan cache)."""

    mem_limit: Budget
    mem_limit_form: str  # 1 (one byte) and 1.0 (all of it) are equal values, but not equal budgets
    solver_name: str
    slots: int | None
    margin: float | None
    output_kept: bool


# NOTE [what a plan depends on]
# A plan is made for the costs of one step. They change with the inputs (structure,
# shapes, dtypes, devices, which require grad), with the model (which parameters require
# grad and so keep activations for their gradients; their dtypes, devices and shapes, after
# model.half(), .to() or resize_token_embeddings(); which modules it is made of, a head
# replaced for fine-tuning being a new stage; which are in training mode), with autocast (on which
# device, to which dtype, with its cache) and with the kernels allowed (attention kernels,
# deterministic algorithms). Each of these is part of the key a plan is cached under: a
# change gives a new measurement and plan, never a stale one.
_KEY_PARTS = (
    "the input structure",
    "the parameters (requires_grad, dtype, device or shape)",
    "the modules (one replaced by another) or their training modes",
    "autocast",
    "the autocast cache",
    "the attention kernels allowed",
    "deterministic algorithms",
)


def what_changed(previous: Hashable | None, key: Hashable) -> str:
    """Names what differs between two plan keys (see :func:`signature`), for the log."""
    if not isinstance(previous, tuple) or not isinstance(key, tuple):
        return "the first input"
    changed = [name for name, a, b in zip(_KEY_PARTS, previous, key, strict=False) if a != b]
    if previous[len(_KEY_PARTS) :] != key[len(_KEY_PARTS) :]:
        changed.append("the input shapes, dtypes or devices")
    return "a change in " + ", ".join(changed) if changed else "the same input again"


def signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    leaves, spec = tree_flatten((args, kwargs))
    modules, parameters = _modules_and_parameters(model)
    parts: list[Any] = [
        str(spec),
        tuple((p.requires_grad, p.dtype, p.device, p.shape) for p in parameters),
        (_makeup(model, modules), tuple(m.training for m in modules)),
        tuple(
            (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
            for device in ("cpu", "cuda")
        ),
        torch.is_autocast_cache_enabled(),
        # scaled_dot_product_attention's kernels differ in what they keep (the math one
        # keeps the whole attention matrix), and deterministic kernels can allocate more
        _attention_kernels(),
        torch.are_deterministic_algorithms_enabled(),
    ]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        else:
            parts.append(repr(leaf))
    return tuple(parts)


# NOTE [numbering a model's modules]
# A module replaced by another (a new head) changes the step, so the key holds which modules
# the model is made of. Not as ids: the ranks of a distributed run compare their keys (NOTE
# [one plan for all ranks]), and ids differ between processes. Each model numbers the sets of
# modules it is seen made of (by their ids, in order), in the order it is seen made of them:
# ranks that build and change the same model number them alike. While a plan's chain holds
# its stage modules, their ids are theirs; a module it does not hold, replaced by one that
# takes its id, changes no stage of the chain, and a change of its parameters' shapes is
# in the key anyway.
_MAKEUPS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], int]] = weakref.WeakKeyDictionary()


def _makeup(model: nn.Module, modules: list[nn.Module]) -> int:
    """The number of the set of modules `model` is made of (NOTE [numbering a model's modules])."""
    seen = _MAKEUPS.get(model)
    if seen is None:
        seen = _MAKEUPS[model] = {}
    return seen.setdefault(tuple(map(id, modules)), len(seen))


def _modules_and_parameters(model: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """``list(model.modules())`` and ``list(model.parameters())``, in their order, in one walk.

    The key is computed at every call of the model: nn.Module's own generators walk the
    tree once for each and build every name on the way, which on a model of a hundred
    small blocks cost more than the rest of a call that recomputes nothing.
    """
    modules: list[nn.Module] = []
    parameters: list[nn.Parameter] = []
    seen_modules: set[nn.Module] = set()
    seen_parameters: set[int] = set()  # ids: a tensor's own hash is a Python call

    def visit(module: nn.Module) -> None:  # as deep as nn.Module.modules() goes
        seen_modules.add(module)
        modules.append(module)
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen_parameters:
                seen_parameters.add(id(parameter))
                parameters.append(parameter)
        for child in module._modules.values():
            if child is not None and child not in seen_modules:
                visit(child)

    visit(model)
    return modules, parameters


def _attention_kernels() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
    )


def shape_family(key: Hashable) -> Hashable:
    """The key with the input tensors' sizes left out (their number of dimensions kept).

    Two steps of one family differ only in their inputs' sizes (a batch, a sequence
    length): one can be planned from the other's times, scaled (:mod:`remat.measure.scale`).
    """
    if not isinstance(key, tuple):
        return key
    head, leaves = key[: len(_KEY_PARTS)], key[len(_KEY_PARTS) :]
    return head + tuple(
        (len(leaf[0]), *leaf[1:]) if isinstance(leaf, tuple) and leaf and isinstance(leaf[0], tuple) else leaf
        for leaf in leaves
    )
