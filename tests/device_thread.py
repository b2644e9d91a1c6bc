"""A backward run on a thread of its own, as autograd runs a GPU's (for tests on the CPU).

On a GPU autograd runs each backward on the device's thread, handing it a copy of torch's
per-thread state: grad mode, autocast, saved-tensor hooks, dispatch modes, and its store of
Python objects (where remat keeps its stacks, NOTE [state a backward's threads inherit]);
Python's thread-locals stay behind. A backward started on that thread (inside a backward) runs there.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from remat._inherited import KEYS

__all__ = ["grad_on_another_thread", "on_the_device_thread"]

_DEVICE = threading.local()  # whether this thread stands in for a device's


def on_the_device_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs `function` (a backward) on the stand-in device thread, with what autograd hands over."""
    if getattr(_DEVICE, "active", False):
        return function(*args, **kwargs)
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    modes = _get_current_dispatch_mode_stack()
    stored = {key: torch._C._get_obj_in_tls(key) for key in KEYS if torch._C._is_key_in_tls(key)}
    grad_enabled = torch.is_grad_enabled()
    autocast = {
        device_type: (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        for device_type in ("cpu", "cuda")
    }
    threads = torch.get_num_threads()  # (a setting of each thread's: a new one has the default)
    result: list[Any] = []

    def work() -> None:
        _DEVICE.active = True
        torch.set_num_threads(threads)
        try:
            for key, value in stored.items():
                torch._C._stash_obj_in_tls(key, value)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                for device_type, (enabled, dtype) in autocast.items():
                    if enabled:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype))
                if hooks is not None:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
                for mode in modes:
                    _push_mode(mode)
                    stack.callback(_pop_mode)
                result.append(function(*args, **kwargs))
        except BaseException as error:  # raised again on the calling thread
            result.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


#: ``torch.autograd.grad`` as on a GPU
grad_on_another_thread: Callable[..., tuple[torch.Tensor, ...]] = functools.partial(
    on_the_device_thread, torch.autograd.grad
)
