"""Thread-local recompute state, and the guard that keeps normalisation statistics exact."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["is_recomputing", "recomputing", "running_stats_guard"]


class _Local(threading.local):
    def __init__(self) -> None:
        self.recompute_depth = 0
        self.guard_depth = 0
        # (module, buffers before its recomputed forward), innermost call last
        self.stat_snapshots: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []


_LOCAL = _Local()


def is_recomputing() -> bool:
    """True only while remat is re-running a forward to recompute activations.

    Use it in a forward to skip side effects that must happen once per step (logging,
    counters, statistics). It is thread-local: a recompute in one thread does not show
    in another.
    """
    return _LOCAL.recompute_depth > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks the current thread as recomputing, with the normalisation guard on."""
    _LOCAL.recompute_depth += 1
    try:
        with running_stats_guard():
            yield
    finally:
        _LOCAL.recompute_depth -= 1


# NOTE [running statistics during recompute]
# A normalisation layer with running statistics (every BatchNorm, SyncBatchNorm and
# InstanceNorm with track_running_stats=True) updates running_mean, running_var and
# num_batches_tracked in its training forward. A recompute re-runs that forward, which
# would update them a second time (torch.utils.checkpoint has this defect). The output of
# a training-mode normalisation depends only on the batch, not on the running statistics,
# so the guard lets the recomputed forward run unchanged and puts the three buffers back,
# bit for bit, the moment it returns. It works through global module hooks that exist
# only while some thread recomputes, and act only in that thread.
#
# Two details matter:
# * A recompute is cut short by a BaseException raised from a saved-tensor hook once it
#   has produced what backward needs, often inside the normalisation op itself (after it
#   updated the statistics). nn.Module runs "always call" forward hooks only on Exception,
#   so the snapshots live on a thread-local stack and the guard restores whatever is left
#   on it when it exits, however it exits.
# * The op saved the running buffers for backward (the reentrant recompute checks their
#   version). Training-mode backward does not read their values, so they are restored
#   without bumping the version counter; a bump would make backward fail.

_GUARD_LOCK = threading.Lock()
_GUARD_USERS = 0
_GUARD_HANDLES: list[Any] = []


def _has_running_stats(module: nn.Module) -> bool:
    return (
        isinstance(module, _NormBase)
        and module.training
        and module.track_running_stats
        and module.running_mean is not None
    )


def snapshot_bytes(module: nn.Module) -> int:
    """Bytes the guard copies at most at once while `module` is recomputed.

    The guard snapshots one normalisation layer's buffers at a time, around its forward.
    """
    sizes = [
        sum(buf.numel() * buf.element_size() for buf in m.buffers(recurse=False))
        for m in module.modules()
        if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None
    ]
    return max(sizes, default=0)


def _pre_hook(module: nn.Module, args: Any) -> None:
    if _LOCAL.recompute_depth == 0 or not _has_running_stats(module):
        return
    snapshot = {name: buf.detach().clone() for name, buf in module.named_buffers(recurse=False) if buf is not None}
    _LOCAL.stat_snapshots.append((module, snapshot))


def _restore(module: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and name in snapshot:
            with torch.autograd._unsafe_preserve_version_counter(buf), torch.no_grad():
                buf.copy_(snapshot[name])


def _post_hook(module: nn.Module, args: Any, output: Any) -> None:
    if _LOCAL.recompute_depth == 0:
        return
    stack = _LOCAL.stat_snapshots
    for position in range(len(stack) - 1, -1, -1):
        if stack[position][0] is module:
            _restore(*stack.pop(position))
            return


def _restore_all() -> None:
    stack = _LOCAL.stat_snapshots
    while stack:
        _restore(*stack.pop())


@contextlib.contextmanager
def running_stats_guard() -> Iterator[None]:
    """While active in this thread, normalisation layers do not change their running stats."""
    global _GUARD_USERS
    if _LOCAL.guard_depth > 0:
        _LOCAL.guard_depth += 1
        try:
            yield
        finally:
            _LOCAL.guard_depth -= 1
        return
    with _GUARD_LOCK:
        if _GUARD_USERS == 0:
            _GUARD_HANDLES.append(nn.modules.module.register_module_forward_pre_hook(_pre_hook))
            _GUARD_HANDLES.append(nn.modules.module.register_module_forward_hook(_post_hook, always_call=True))
        _GUARD_USERS += 1
    _LOCAL.guard_depth += 1
    try:
        yield
    finally:
        _LOCAL.guard_depth -= 1
        _restore_all()
        with _GUARD_LOCK:
            _GUARD_USERS -= 1
            if _GUARD_USERS == 0:
                for handle in _GUARD_HANDLES:
                    handle.remove()
                _GUARD_HANDLES.clear()
