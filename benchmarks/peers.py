"""What the benchmarks compare remat with: torch's selective checkpointing keeping matrix products.

Shared by ``planner.py`` and ``gpu.py``, which import it from this folder (they run as
scripts from here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

#: Operations torch's selective checkpointing keeps (every overload): products,
#: convolutions and fused attention.
KEPT_PACKETS = frozenset(
    {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.convolution,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_efficient_attention,
        torch.ops.aten._scaled_dot_product_cudnn_attention,
    }
)


def keep_matmuls(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A ``create_selective_checkpoint_contexts`` policy: keep ``KEPT_PACKETS``, recompute the rest."""
    if op.overloadpacket in KEPT_PACKETS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_selectively(blocks: Iterable[nn.Module]) -> None:
    """Puts each block's forward under torch's checkpoint with :func:`keep_matmuls` (in place)."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    for block in blocks:

        def checkpointed(*args: Any, _forward: Callable[..., Any] = block.forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = checkpointed
