"""Capture and replay of random-number-generator and autocast state."""

from __future__ import annotations

import contextlib
import ctypes
import random
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves

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
# Reading and setting NumPy's state goes through its 624 words one by one (about 25 us
# each way), Python's about 7 us: done naively around every replay, it cost a small block
# 160 us per call, more than the rest of a recompute. Most blocks draw nothing from
# them, so a replay first checks whether the generators still stand where the capture
# left them; when they do, nothing is set, and after the replay they are put back only if
# the replay moved them. NumPy's check reads the words of its MT19937 generator from the
# generator's own state struct (the address its ``ctypes`` interface gives): a capture
# keeps those bytes only when they match the state ``get_state()`` returned, word for
# word and position, so a different layout falls back to comparing full states. The
# words alone say nothing of the Gaussian that NumPy's legacy functions cache between
# two draws; a capture that holds one is compared in full. (A state set with
# ``numpy.random.set_state`` between a forward and its backward, with the very words of
# the capture and a cached Gaussian the capture did not have, would pass for it: no draw
# can make that state, since drawing a Gaussian moves the words.)

_MT19937_WORDS = 624
_MT19937_STATE_BYTES = _MT19937_WORDS * 4 + 4  # uint32 key[624]; int pos


class HostState(NamedTuple):
    """Python's and NumPy's global generators at one moment."""

    python: Any  # random.getstate()
    numpy: Any  # numpy.random.get_state(legacy=False), or None when NumPy was not imported
    words: bytes | None  # NumPy's MT19937 words as they lie in memory (NOTE [replaying host generators cheaply])


def _numpy_words(numpy: Any) -> bytes | None:
    """The bytes of the global MT19937 generator's state struct, or None if it is another generator."""
    get_bit_generator = getattr(numpy.random, "get_bit_generator", None)
    if get_bit_generator is None:
        return None
    generator = get_bit_generator()
    if type(generator).__name__ != "MT19937":
        return None
    return ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)


def _state_words(numpy: Any, state: Any) -> bytes | None:
    """The bytes `_numpy_words` reads, made from `state` (``get_state(legacy=False)``; None if not MT19937)."""
    if not (isinstance(state, dict) and state.get("bit_generator") == "MT19937"):
        return None
    key = numpy.asarray(state["state"]["key"], dtype=numpy.uint32)
    if key.shape != (_MT19937_WORDS,):
        return None
    return key.tobytes() + struct.pack("=i", int(state["state"]["pos"]))


def _host_rng() -> HostState:
    numpy = sys.modules.get("numpy")
    python = random.getstate()
    if numpy is None:
        return HostState(python, None, None)
    words = _numpy_words(numpy)
    state = numpy.random.get_state(legacy=False)  # a dict, for any bit generator
    if words is not None and words != _state_words(numpy, state):
        words = None  # another layout than the one read: compare full states
    return HostState(python, state, words)


def _set_host_rng(state: HostState) -> None:
    random.setstate(state.python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and state.numpy is not None:
        numpy.random.set_state(state.numpy)


def _equal_states(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") or hasattr(b, "shape"):  # NumPy arrays
        return type(a) is type(b) and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def _host_rng_is(state: HostState) -> bool:
    """Whether the generators stand where `state` was captured (NOTE [replaying host generators cheaply])."""
    if random.getstate() != state.python:
        return False
    numpy = sys.modules.get("numpy")
    if numpy is None or state.numpy is None:
        return True
    if state.words is not None and not state.numpy["has_gauss"]:  # no cached Gaussian in the capture
        words = _numpy_words(numpy)
        if words is not None:
            return words == state.words
    return _equal_states(numpy.random.get_state(legacy=False), state.numpy)


@contextlib.contextmanager
def _host_rng_set_to(state: HostState | None) -> Iterator[None]:
    if state is not None and _host_rng_is(state):
        try:
            yield
        finally:
            if not _host_rng_is(state):
                _set_host_rng(state)
        return
    before = _host_rng()
    if state is not None:
        _set_host_rng(state)
    try:
        yield
    finally:
        _set_host_rng(before)


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
        host_rng = _host_rng()
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
def replay_forward_state(state: ForwardState) -> Iterator[None]:
    """Runs the body with the captured RNG and autocast state; restores the RNG after."""
    with contextlib.ExitStack() as stack:
        if state.cpu_rng is not None:
            cuda_devices = [d.index for d in state.device_rng if d.type == "cuda"]
            stack.enter_context(torch.random.fork_rng(devices=cuda_devices, enabled=True))
            torch.set_rng_state(state.cpu_rng)
            for device, rng in state.device_rng.items():
                _device_module(device).set_rng_state(rng, device.index)
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
