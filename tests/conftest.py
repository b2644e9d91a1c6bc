"""Shared fixtures: a fixed seed for every test, a check that remat leaves no state behind."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

# One intra-op thread: the tests use small tensors, where thread hand-offs on a shared
# 2-core machine cost far more than they gain, and results do not depend on thread count.
torch.set_num_threads(1)

# REMAT_TEST_DEVICE=cuda runs the whole suite with CUDA as torch's default device: every
# tensor and module a test builds without naming a device lands on the GPU. Deterministic
# kernels are asked for, so the tests' torch.equal comparisons stay meaningful there.
TEST_DEVICE = os.environ.get("REMAT_TEST_DEVICE", "")
if TEST_DEVICE:
    torch.set_default_device(TEST_DEVICE)
    if TEST_DEVICE.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)

    class _GeneratorOnTheTestDevice(torch.Generator):
        """``torch.Generator()`` on the test device, as the tensors it fills are."""

        def __new__(cls, device: str | torch.device | None = None) -> _GeneratorOnTheTestDevice:
            return super().__new__(cls, TEST_DEVICE if device is None else device)  # type: ignore[call-arg]

    torch.Generator = _GeneratorOnTheTestDevice  # type: ignore[misc, assignment]

# REMAT_TEST_BACKWARD_THREAD=1 runs every backward as a GPU's runs: on a thread of its own,
# handed what autograd hands its device threads (tests/device_thread.py).
if os.environ.get("REMAT_TEST_BACKWARD_THREAD"):
    import functools

    from device_thread import on_the_device_thread

    torch.autograd.backward = functools.partial(on_the_device_thread, torch.autograd.backward)
    torch.autograd.grad = functools.partial(on_the_device_thread, torch.autograd.grad)

_recompute_module = importlib.import_module("remat.manual._frames")
_state_module = importlib.import_module("remat.manual._state")
_selective_module = importlib.import_module("remat.manual._selective")


def remat_leftovers() -> list[str]:
    """What remat's recompute machinery still holds in this thread (empty when idle)."""
    leftovers = []
    if _recompute_module._STACK.items:
        leftovers.append(f"recompute frame stack: {_recompute_module._STACK.items}")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        leftovers.append("saved-tensor hooks still installed")
    if _state_module.is_recomputing():
        leftovers.append("is_recomputing() is True")
    if _state_module._HOOK_HANDLES or _state_module._LOCAL.scopes:
        leftovers.append("module-state guard still installed")
    local = _selective_module._LOCAL
    if _selective_module._SCOPES or _selective_module._EXPLAINING or local.internal or local.function:
        leftovers.append("selective recompute state left on the thread")
    if torch.utils._python_dispatch._get_current_dispatch_mode_stack():
        leftovers.append("a dispatch mode is still active")
    return leftovers


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture
def clean_remat_state() -> None:
    """Fails the test if remat's recompute machinery is left holding state after it."""
    assert remat_leftovers() == []
    yield
    assert remat_leftovers() == []


@pytest.fixture(params=[False, True], ids=["hooks", "reentrant"])
def use_reentrant(request: pytest.FixtureRequest) -> bool:
    """Both implementations of recompute."""
    return request.param
