"""Host copies of tensors, and the count of host memory they hold (see :mod:`remat.manual.offload`).

Apart from the offload module so that the selective-recompute mode (which keeps a policy's
offloaded outputs as host copies) and the offload module (which asks the recompute frames
whether a block is being recomputed) do not import each other.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["HostMemory", "from_host", "host_memory", "to_host"]


@dataclass
class HostMemory:
    """Bytes of host memory that offloaded tensors hold (a running count and its peak).

    Attributes:
        live_bytes: bytes held now.
        peak_bytes: the most held at once since the last :meth:`reset`.
        sent_bytes: bytes copied to host memory since the last reset.
        fetched_bytes: bytes copied back to the device since the last reset.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    sent_bytes: int = 0
    fetched_bytes: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Starts the peak and the totals again from what is held now."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.sent_bytes = self.fetched_bytes = 0

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes += nbytes
            self.sent_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def _fetched(self, nbytes: int) -> None:
        with self._lock:
            self.fetched_bytes += nbytes


_HOST_MEMORY = HostMemory()


def host_memory() -> HostMemory:
    """The process's count of host memory held by offloaded tensors (see :class:`HostMemory`)."""
    return _HOST_MEMORY


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _movable(tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is plain device data that can be copied out and back as bytes."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return False  # subclasses (fake tensors, DTensor, ...) are kept as they are
    if isinstance(tensor, FakeTensor) or tensor.is_meta or tensor.layout != torch.strided:
        return False
    if tensor.is_conj() or tensor.is_neg() or tensor.is_quantized or tensor.is_nested:
        return False
    return not (tensor.is_leaf and tensor.requires_grad)  # parameters stay where they are


class _HostCopy:
    """A tensor's bytes in host memory, with what it takes to make the tensor again."""

    __slots__ = ("device", "dtype", "host", "offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.dtype = tensor.dtype
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()
        storage = tensor.untyped_storage()
        nbytes = int(storage.nbytes())
        cuda = tensor.device.type == "cuda"
        with _disable_current_modes():
            self.host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
            # on the device's own stream, after the operation: ordered before any reuse of its memory
            self.host.copy_(_bytes_view(storage, tensor.device), non_blocking=cuda)
        _HOST_MEMORY._add(nbytes)
        weakref.finalize(self.host, _HOST_MEMORY._free, nbytes)


def to_host(tensor: torch.Tensor) -> Any:
    """`tensor`'s bytes copied to host memory (a :class:`_HostCopy`); a tensor that cannot be
    moved as bytes (see :func:`_movable`) stays on the device, detached."""
    return _HostCopy(tensor) if _movable(tensor) else tensor.detach()


def from_host(copy: _HostCopy) -> torch.Tensor:
    """The tensor of a :class:`_HostCopy` again, on its device (allocated where the tracker sees it)."""
    target = torch.empty(copy.host.numel(), dtype=torch.uint8, device=copy.device)
    with _disable_current_modes():
        target.copy_(copy.host, non_blocking=copy.device.type == "cuda")
        whole = target.view(copy.dtype)
        tensor = whole.as_strided(copy.size, copy.stride, copy.offset)
    _HOST_MEMORY._fetched(copy.host.numel())
    return tensor
