"""Capture and replay of random-number-generator, autocast and default-device state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _python_dispatch
from torch.utils._pytree import tree_leaves

from remat.manual import _host_generators as host_generators
from remat.manual._host_generators import HostState

__all__ = ["ForwardState", "capture_forward_state", "preserved_host_rng", "replay_forward_state"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_CPU = torch.device("cpu")


def default_device() -> torch.device:
    """The device a device-less factory call makes its tensor on, in this thread."""
    if not torch._C._len_torch_function_stack():
        return _CPU  # no mode at all, the common case: skip the look through the stack
    return torch.get_default_device()


def _devices_of(values: Iterable[Any]) -> list[torch.device]:
    devices: dict[str, torch.device] = {}
    for value in values:
        for leaf in (value,) if isinstance(value, torch.Tensor) else tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and not (leaf.is_cpu or leaf.is_meta):
                devices[str(leaf.device)] = leaf.device
    return list(devices.values())


@dataclass
class ForwardState:
    """What a forward depended on besides its inputs: RNG states, autocast, the default device."""

    cpu_rng: torch.Tensor | None
    device_rng: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    autocast: dict[str, tuple[bool, torch.dtype, bool]] = field(default_factory=dict)
    host_rng: HostState | None = None  # NOTE [host random numbers]
    default_device: torch.device = _CPU  # NOTE [the default device in a recompute]
    compile_skipped: bool = False  # NOTE [compiled code in a recompute]


# NOTE [compiled code in a recompute]
# While a dispatch mode is active (remat's tracker, a FLOP counter), Dynamo runs compiled
# functions eagerly. That holds on the thread that entered the mode only: a GPU's backward
# thread runs the compiled code of the same function, whose saved tensors differ from the
# eager forward's (the recompute is refused as nondeterministic). Whether Dynamo stood
# aside in the forward is captured, and a recompute then runs under the "force_eager"
# stance (torch.compiler.set_stance), as the forward ran. The stance is the process's:
# while such a recompute runs, compiled code elsewhere runs eagerly too (exactly).


def _compile_skipped() -> bool:
    """Whether Dynamo runs compiled functions eagerly here, for an active dispatch mode."""
    check = getattr(_python_dispatch, "is_in_any_mode_without_ignore_compile_internals", None)
    if check is None:  # (an older torch: any mode but torch's own)
        return _python_dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)
    return bool(check())


# NOTE [the default device in a recompute]
# A forward run under `torch.set_default_device("cuda")` or `with torch.device("cuda"):`
# makes its device-less tensors (a causal mask, `torch.ones(n)`, a scalar) on that device.
# Both are torch-function modes, and a recompute run by autograd does not run under them
# (on a GPU's backward thread, and on the CPU even with the backward called inside the
# context): it would make those tensors on the CPU and fail (or, where the tensor meets
# only CPU tensors, differ).
# The forward's default device is captured with its RNG and set again for the recompute
# when the recompute's thread has another; torch.utils.checkpoint does so in its
# non-reentrant mode only.


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


class _HostGeneratorsSetTo:
    """Python's and NumPy's generators set to `state` (None: left as they are), put back after.

    A class rather than a generator: it runs around every recompute of every block.
    """

    __slots__ = ("_state", "_back")

    def __init__(self, state: HostState | None) -> None:
        self._state = state
        self._back: HostState | bool | None = None  # what to put back (True: check first)

    def __enter__(self) -> None:
        state = self._state
        if state is not None and host_generators.stands_at(state):
            self._back = True
            return
        self._back = host_generators.capture()
        if state is not None:
            host_generators.restore(state)

    def __exit__(self, *exc: Any) -> None:
        back, self._back = self._back, None
        if back is True:
            assert self._state is not None
            if not host_generators.stands_at(self._state):
                host_generators.restore(self._state)
        elif isinstance(back, HostState):
            host_generators.restore(back)


def preserved_host_rng() -> contextlib.AbstractContextManager[None]:
    """Python's and NumPy's generators are put back as they were when the body ends."""
    return _HostGeneratorsSetTo(None)


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
        if torch.cuda.is_initialized() and torch.cuda.is_available():
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
    return ForwardState(cpu_rng, device_rng, autocast, host_rng, default_device(), _compile_skipped())


class replay_forward_state:  # noqa: N801 - used as a function returning a context manager
    """Runs the body with the captured RNG, autocast and default device; restores the RNG after.

    Every device type of the capture is put back (torch.random.fork_rng forks one type).
    A class rather than a generator: it runs around every recompute of every block, where
    the generator machinery cost a small block a noticeable share of its step.
    """

    __slots__ = ("_state", "_cpu", "_devices", "_host", "_autocast", "_device", "_stance")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._cpu: torch.Tensor | None = None
        self._devices: dict[torch.device, torch.Tensor] = {}
        self._host: _HostGeneratorsSetTo | None = None
        self._autocast: list[torch.autocast] = []
        self._device: torch.device | None = None  # a device context entered, to leave
        self._stance: Any = None  # the "force_eager" stance entered, to leave

    def __enter__(self) -> None:
        state = self._state
        if state.cpu_rng is not None:
            devices = {d: _device_module(d).get_rng_state(d.index) for d in state.device_rng}
            self._cpu, self._devices = torch.get_rng_state(), devices
        try:  # from here on, whatever fails is put back by __exit__
            if state.cpu_rng is not None:
                torch.set_rng_state(state.cpu_rng)
                for device, rng in state.device_rng.items():
                    _device_module(device).set_rng_state(rng, device.index)
            if state.host_rng is not None:
                self._host = _HostGeneratorsSetTo(state.host_rng)
                self._host.__enter__()
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
                context = torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
                context.__enter__()
                self._autocast.append(context)
            if state.default_device != default_device():
                state.default_device.__enter__()  # NOTE [the default device in a recompute]
                self._device = state.default_device  # (left by __exit__ only once entered)
            if state.compile_skipped:  # NOTE [compiled code in a recompute]
                stance = torch.compiler.set_stance("force_eager")
                stance.__enter__()
                self._stance = stance
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            stance, self._stance = self._stance, None
            if stance is not None:
                stance.__exit__(None, None, None)
            device, self._device = self._device, None
            if device is not None:
                device.__exit__(None, None, None)
            while self._autocast:
                self._autocast.pop().__exit__(None, None, None)
        finally:
            try:
                host, self._host = self._host, None
                if host is not None:
                    host.__exit__(None, None, None)
            finally:
                if self._cpu is not None:
                    torch.set_rng_state(self._cpu)
                    for device, rng in self._devices.items():
                        _device_module(device).set_rng_state(rng, device.index)
                    self._cpu, self._devices = None, {}
