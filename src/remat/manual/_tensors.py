"""Small helpers shared by the two recompute implementations: options, tensor aliases, metadata."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from remat.errors import RematError
from remat.manual.policies import Policy

__all__ = ["DETERMINISM_CHECKS", "RecomputeOptions", "TensorMeta", "detached_alias", "graph_retained", "storage_key"]


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage while it lives: tensors sharing storage (views, aliases) share it."""
    if tensor.layout != torch.strided:
        return id(tensor)
    return int(tensor.untyped_storage()._cdata)


def graph_retained() -> bool:
    """Whether the backward running on this thread keeps its graph (retain_graph=True)."""
    return torch._C._current_graph_task_id() != -1 and torch._C._autograd._get_current_graph_task_keep_graph()


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


DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class RecomputeOptions:
    """How one recomputed block runs (the options of :func:`remat.recompute`).

    ``policy`` has no default: Dynamo (torch 2.11) cannot trace a dataclass ``__init__``
    whose default is an object of this project's."""

    policy: Policy
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    early_stop: bool = True
    context_fn: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] | None = None
    debug: bool = False

    @property
    def checks(self) -> bool:
        """Whether recomputed tensors are compared with the originals (shape, dtype, device)."""
        return self.determinism_check == "default"

    def forward_context(self, name: str) -> AbstractContextManager[Any]:
        """The context around the original forward of the block `name`."""
        if self.context_fn is None:
            return contextlib.nullcontext()
        return _Unsuppressing(self.context_fn()[0], name)

    def recompute_context(self, name: str) -> AbstractContextManager[Any]:
        """The context around one recompute of the block `name` (``context_fn`` is called again for each)."""
        if self.context_fn is None:
            return contextlib.nullcontext()
        return _Unsuppressing(self.context_fn()[1], name)


class _Unsuppressing:
    """A ``context_fn`` context that may not swallow the block's exception.

    A block whose exception is swallowed has no output to return (nor, recomputed, the
    tensors backward needs): that is refused at the context itself, for every caller.
    """

    def __init__(self, context: AbstractContextManager[Any], name: str) -> None:
        self.context = context
        self.name = name

    def __enter__(self) -> Any:
        return self.context.__enter__()

    def __exit__(self, *exc: Any) -> Literal[False]:
        if self.context.__exit__(*exc) and exc[0] is not None:
            raise RematError(
                f"a context of context_fn suppressed an exception raised by the block {self.name!r}, "
                "so the block has no output to return; a context_fn context must let exceptions through"
            ) from exc[1]
        return False
