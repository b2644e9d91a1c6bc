"""Seeing what autograd keeps for backward: each saved tensor, its size, and where it came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import torch
from torch import nn

from remat.manual import _selective
from remat.manual._tensors import storage_key
from remat.manual.policies import PolicyLike
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


def saved_residuals(
    function: Callable[..., Any], *args: Any, policy: PolicyLike | EllipsisType = ..., **kwargs: Any
) -> list[SavedTensor]:
    """Runs ``function(*args, **kwargs)`` once and lists every tensor kept for backward.

    Useful to decide what to recompute: the largest activations are the ones worth
    dropping. Nothing is kept after the call (the graph is freed).

    Args:
        function: the block (a module or any callable) to run.
        *args: its positional arguments.
        policy: with a policy (:mod:`remat.policies`, None meaning whole-block recompute),
            what :func:`remat.recompute` keeps with it: the block's inputs and the
            outputs the policy keeps. Without (default), what plain autograd saves.
        **kwargs: its keyword arguments.

    Example::

        for saved in remat.saved_residuals(model, x, policy=remat.policies.save_matmuls):
            print(saved)
    """
    listing = _Listing(function, args, kwargs)
    handles = []
    if isinstance(function, nn.Module):
        handles = [
            nn.modules.module.register_module_forward_pre_hook(listing.pre_hook),
            nn.modules.module.register_module_forward_hook(listing.post_hook, always_call=True),
        ]
    kept = _KeptOutputs(listing.stack)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(listing.pack, lambda t: t):
            if isinstance(policy, EllipsisType):
                out = function(*args, **kwargs)
            else:
                from remat.manual.recompute import recompute

                with _selective.observed_by(kept):
                    out = recompute(function, *args, policy=policy, **kwargs)
        for tensor in kept.inputs:
            listing.note(tensor, "")
        for tensor, module in kept.outputs():
            listing.note(tensor, module)
        del out
    finally:
        for handle in handles:
            handle.remove()
    return listing.found


class _Listing:
    """The tensors kept for backward, each with its kind and the module that was running."""

    def __init__(self, function: Any, args: Any, kwargs: Any) -> None:
        root = function if isinstance(function, nn.Module) else None
        self.names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self.stack: list[str] = []
        self.parameter_keys = {storage_key(p) for p in root.parameters()} if root is not None else set()
        self.input_keys = {storage_key(v) for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)}
        self.seen: set[int] = set()
        self.found: list[SavedTensor] = []

    def note(self, tensor: torch.Tensor, module: str) -> None:
        key = storage_key(tensor)
        if key in self.input_keys:
            kind = "input"
        elif key in self.parameter_keys or (tensor.is_leaf and tensor.requires_grad):
            kind = "parameter"
        else:
            kind = "activation"
        shared = key in self.seen
        self.seen.add(key)
        nbytes = int(tensor.untyped_storage().nbytes()) if tensor.layout == torch.strided else 0
        self.found.append(SavedTensor(tuple(tensor.shape), tensor.dtype, nbytes, module, kind, shared))

    def pack(self, tensor: torch.Tensor) -> Any:
        self.note(tensor, self.stack[-1] if self.stack else "")
        return tensor

    def pre_hook(self, module: nn.Module, _args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def post_hook(self, module: nn.Module, _args: Any, _out: Any) -> None:
        if self.stack:
            self.stack.pop()


class _KeptOutputs:
    """Told by remat's recompute what a policy keeps (and which inputs a block keeps)."""

    def __init__(self, stack: list[str]) -> None:
        self.stack = stack
        self.inputs: list[torch.Tensor] = []
        self.kept: list[tuple[Any, Any, str]] = []  # (cache, (block, index), module)

    def on_saved(self, tensor: torch.Tensor, discarded: bool) -> None:
        if not discarded:
            self.inputs.append(tensor)

    def on_kept(self, cache: Any, key: Any) -> None:
        self.kept.append((cache, key, self.stack[-1] if self.stack else ""))

    def on_served(self, func: Any, out: Any, key: Any) -> None:
        pass

    def outputs(self) -> list[tuple[torch.Tensor, str]]:
        """The outputs still kept once the forward ended, with the module that made each."""
        found = []
        for cache, (block, index), module in self.kept:
            entry = cache.get(block, index)
            if entry is not None:
                found += [(t, module) for t in entry.tensors()]
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
