"""remat's own forward-only runs of a model: ``torch.no_grad()``, with the forward's tensor hooks let be.

NOTE [tensor hooks in runs without grad]
A forward may register a hook on an activation (``h.register_hook(clip)`` to clip or log
its gradient). remat runs the model's forward without grad to find its stages, to time
the stages whose backward is not timed, and to probe store options; there ``h`` does not
require grad and torch refuses the hook, with an error that does not point at remat. No
gradient reaches such a tensor in those runs, so its hook is not registered: the call
returns a handle whose ``remove()`` does nothing. Only tensors that do not require grad,
while grad is off, are let be: a hook on one that does, or one registered with grad on,
is registered as always. ``Tensor.register_hook`` is put back when the outermost run ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["forward_without_grad"]

_LOCK = threading.Lock()
_DEPTH = [0]
_OWN: list[Any] = [None]  # Tensor.register_hook as it was when the outermost run began


class _NotRegistered:
    """The handle of a hook not registered (NOTE [tensor hooks in runs without grad])."""

    def remove(self) -> None:
        pass

    def __enter__(self) -> _NotRegistered:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _register_hook(self: torch.Tensor, hook: Any) -> Any:
    if not torch.is_grad_enabled() and not self.requires_grad:
        return _NotRegistered()
    return _OWN[0](self, hook)


@contextlib.contextmanager
def forward_without_grad() -> Iterator[None]:
    """``torch.no_grad()`` for a forward of remat's own (NOTE [tensor hooks in runs without grad])."""
    with _LOCK:
        if _DEPTH[0] == 0:
            _OWN[0] = torch.Tensor.register_hook
            torch.Tensor.register_hook = _register_hook  # type: ignore[method-assign]
        _DEPTH[0] += 1
    try:
        with torch.no_grad():
            yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                torch.Tensor.register_hook = _OWN[0]  # type: ignore[method-assign]
