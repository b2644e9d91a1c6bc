"""Seeing what autograd keeps for backward: each saved tensor, its size, and where it came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.units import format_bytes

__all__ = ["SavedTensor", "format_saved_residuals", "saved_residuals"]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward.

    Attributes:
        shape: its shape.
        dtype: its dtype.
        nbytes: bytes of its storage (shared storages are reported once, at first sight).
        module: qualified name of the innermost module running when it was saved ("" for
            code outside any submodule).
        kind: "parameter", "input" (an argument of the function) or "activation".
        shared: True when its storage was already reported (a view, or saved twice).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    module: str
    kind: str
    shared: bool


def saved_residuals(function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[SavedTensor]:
    """Runs ``function(*args, **kwargs)`` once and lists every tensor saved for backward.

    Useful to decide what to recompute: the largest activations are the ones worth
    dropping. Nothing is kept after the call (the graph is freed).

    Example::

        for saved in remat.saved_residuals(model, x):
            print(saved)
    """
    root = function if isinstance(function, nn.Module) else None
    names: dict[int, str] = {}
    if root is not None:
        names = {id(m): n for n, m in root.named_modules()}
    stack: list[str] = []
    parameter_keys: set[int] = set()
    input_keys: set[int] = set()
    if root is not None:
        parameter_keys = {_key(p) for p in root.parameters()}
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            input_keys.add(_key(value))
    seen: set[int] = set()
    found: list[SavedTensor] = []

    def pack(tensor: torch.Tensor) -> Any:
        key = _key(tensor)
        if key in input_keys:
            kind = "input"
        elif key in parameter_keys or (tensor.is_leaf and tensor.requires_grad):
            kind = "parameter"
        else:
            kind = "activation"
        shared = key in seen
        seen.add(key)
        nbytes = int(tensor.untyped_storage().nbytes()) if tensor.layout == torch.strided else 0
        found.append(SavedTensor(tuple(tensor.shape), tensor.dtype, nbytes, stack[-1] if stack else "", kind, shared))
        return tensor

    def pre_hook(module: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(module), type(module).__name__))

    def post_hook(module: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    if root is not None:
        handles = [
            nn.modules.module.register_module_forward_pre_hook(pre_hook),
            nn.modules.module.register_module_forward_hook(post_hook, always_call=True),
        ]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = function(*args, **kwargs)
        del out
    finally:
        for handle in handles:
            handle.remove()
    return found


def format_saved_residuals(saved: list[SavedTensor]) -> str:
    """A readable table of :func:`saved_residuals` output, largest activations first."""
    rows = sorted(saved, key=lambda s: (s.kind != "activation", -s.nbytes))
    lines = [f"{'bytes':>12}  {'kind':<10}  {'dtype':<14}  {'shape':<22}  module"]
    for s in rows:
        size = "(shared)" if s.shared else format_bytes(s.nbytes)
        lines.append(f"{size:>12}  {s.kind:<10}  {str(s.dtype):<14}  {str(list(s.shape)):<22}  {s.module}")
    total = sum(s.nbytes for s in saved if s.kind == "activation" and not s.shared)
    lines.append(f"activations kept for backward: {format_bytes(total)}")
    return "\n".join(lines)


def _key(tensor: torch.Tensor) -> int:
    if tensor.layout != torch.strided:
        return id(tensor)
    return int(tensor.untyped_storage()._cdata)
