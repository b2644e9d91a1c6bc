"""Capture and replay of random-number-generator and autocast state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from remat.manual import _host_generators as host_generators
from remat.manual._host_generators import HostState

__all__ = ["ForwardState", "capture_forward_state", "preserved_host_rng", "replay_forward_state"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _devices_of(values: Iterable[Any]) -> list[torch.device]:
    devices: dict[str, torch.device] = {}
    for leaf in tree_leaves(list(values)):
        if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
            devices[str(leaf.device)] = leaf.device
    return list(devices.values())


@dataclass
class ForwardState:
    """What a forward depended on besides its inputs: RNG states and autocast."""

    cpu_rng: torch.Tensor | None
    device_rng: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    autocast: dict[str, tuple[bool, torch.dtype, bool]] = field(default_factory=dict)
    host_rng: HostState | None = None  # NOTE [host random numbers]


# NOTE [host random numbers]
# A forward may draw from Python's or NumPy's global generator (a random scale, a mask
# made with numpy.random, a layer chosen with random.random()): its recompute would draw
# the next numbers instead, and the tensors it saves, made from them, would differ from
# the first forward's: silently wrong gradients (torch.utils.checkpoint preserves torch's
# generators only). Their states are captured with torch's and set again for the
# recompute, then put back as they were, so the draws of the training loop go on as
# without recompute. NumPy's state is captured only when NumPy is imported already; a
# numpy.random.Generator the model owns is its own state, out of reach.
#
# NOTE [replaying host generators cheaply]
# Most blocks draw nothing from the host generators, so a replay first checks whether
# they still stand where the capture left them; when they do, nothing is set, and after
# the replay they are put back only if the replay moved them. Reading and comparing
# their states is itself made cheap in _host_generators.py (NOTE [reading host
# generators directly]).


@contextlib.contextmanager
def _host_rng_set_to(state: HostState | None) -> Iterator[None]:
    if state is not None and host_generators.stands_at(state):
        try:
            yield
        finally:
            if not host_generators.stands_at(state):
                host_generators.restore(state)
        return
    before = host_generators.capture()
    if state is not None:
        host_generators.restore(state)
    try:
        yield
    finally:
        host_generators.restore(before)


def preserved_host_rng() -> contextlib.AbstractContextManager[None]:
    """Python's and NumPy's generators are put back as they were when the body ends."""
    return _host_rng_set_to(None)


def _device_module(device: torch.device) -> Any:
    return torch.get_device_module(device.type)


def capture_forward_state(values: Iterable[Any], *, preserve_rng_state: bool) -> ForwardState:
    """Captures the RNG state of the CPU and of every device holding one of `values`.

    The current CUDA device is included when CUDA is initialised, since kernels launched
    by the function may draw from it even when no input lives there.
    """
    cpu_rng = None
    host_rng = None
    device_rng: dict[torch.device, torch.Tensor] = {}
    if preserve_rng_state:
        cpu_rng = torch.get_rng_state()
        host_rng = host_generators.capture()
        devices = _devices_of(values)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            current = torch.device("cuda", torch.cuda.current_device())
            if all(d != current for d in devices):
                devices.append(current)
        for device in devices:
            module = _device_module(device)
            index = device.index if device.index is not None else module.current_device()
            device_rng[torch.device(device.type, index)] = module.get_rng_state(index)
    autocast = {}
    for device_type in _AUTOCAST_DEVICE_TYPES:
        autocast[device_type] = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )
    return ForwardState(cpu_rng, device_rng, autocast, host_rng)


@contextlib.contextmanager
def _torch_rng_set_to(state: ForwardState) -> Iterator[None]:
    """torch's CPU generator and those of `state`'s devices set to it, and put back after.

    Every device type of the capture is put back (torch.random.fork_rng forks one type).
    """
    assert state.cpu_rng is not None
    before_cpu = torch.get_rng_state()
    before = {device: _device_module(device).get_rng_state(device.index) for device in state.device_rng}
    torch.set_rng_state(state.cpu_rng)
    for device, rng in state.device_rng.items():
        _device_module(device).set_rng_state(rng, device.index)
    try:
        yield
    finally:
        torch.set_rng_state(before_cpu)
        for device, rng in before.items():
            _device_module(device).set_rng_state(rng, device.index)


@contextlib.contextmanager
def replay_forward_state(state: ForwardState) -> Iterator[None]:
    """Runs the body with the captured RNG and autocast state; restores the RNG after."""
    with contextlib.ExitStack() as stack:
        if state.cpu_rng is not None:
            stack.enter_context(_torch_rng_set_to(state))
        if state.host_rng is not None:
            stack.enter_context(_host_rng_set_to(state.host_rng))
        for device_type, (enabled, dtype, cache) in state.autocast.items():
            if device_type == "cuda" and not torch.cuda.is_available():
                continue
            current = (
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
                torch.is_autocast_cache_enabled(),
            )
            if current == (enabled, dtype, cache):
                continue  # already so: entering a context would only cost time
            stack.enter_context(
                torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
            )
        yield
