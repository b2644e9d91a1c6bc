"""Moving the tensors autograd saves to host memory, and bringing them back for the backward.

An :class:`OffloadGroup` is one block's saved tensors. While its :meth:`~OffloadGroup.hooks`
are in force, every tensor autograd saves is packed by storage (two saved views of one
storage make one copy, and come back as views of one storage again). Nothing moves until
the block's owner calls :meth:`~OffloadGroup.send`, naming the tensors that stay on the
device anyway (the block's input and output, its parameters and buffers): then each other
storage is copied to host memory. :meth:`~OffloadGroup.release` lets the device copies go,
:meth:`~OffloadGroup.prefetch` starts bringing them back, and a saved tensor the backward
unpacks waits for its own copy (or copies it back itself, if no one prefetched it).

NOTE [offload streams]
On CUDA the copies run on a side stream into pinned host memory, so that they overlap the
computation: a copy out waits for the computation that made the tensor; the device copy is
let go (:meth:`release`) only once the main stream has waited for the copy, so the
allocator cannot hand the memory to a later kernel before the copy has read it; a copy back
writes into memory allocated on the main stream, and the kernel that reads it waits for the
copy. On the CPU (the stand-in device that the tests use) the copies are synchronous; the
host copies are made where no dispatch mode sees them, so that the live-tensor tracker
counts only device memory, as on a GPU. The bytes in host memory are counted by the group's
:class:`HostMemory`.

NOTE [saved tensors changed in place]
Autograd raises when backward reads a saved tensor that was changed in place after it was
saved; a tensor saved through hooks is not checked. A packed tensor notes its version, and
unpacking it raises :class:`~remat.errors.RecomputeInputModified` where autograd would have
raised. Each packing holds its tensor (or the base it views, which shares its version) until
the block returns, where it costs nothing: the group holds its storage anyway. There a tensor
copied to host memory is checked (changed inside the block after it was saved) and let go;
from then on it is checked while something else keeps it alive, and its bytes are those of
the copy. A tensor that stays on the device (the block's input or output, a parameter) stays
held, as autograd holds it, so its version is read however it changed.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from remat.errors import RecomputeInputModified, RematError
from remat.manual._frames import active_mode
from remat.manual._host import _HOST_MEMORY, HostMemory, _bytes_view, _movable, host_memory

__all__ = ["HostMemory", "OffloadGroup", "StageOffloads", "host_memory", "offload", "offload_time_per_byte_s"]


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _copy_aside(target: torch.Tensor, source: torch.Tensor, device: torch.device) -> Any:
    """Copies `source` into `target`: on CUDA on the side stream, after what the main stream
    has queued, returning the event the copy records (NOTE [offload streams]); else at once (None)."""
    if device.type != "cuda":
        target.copy_(source)
        return None
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        target.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


class _Entry:
    """One device storage saved by a group: where its bytes are, and the copies in flight."""

    __slots__ = (
        "back_event", "device", "device_storage", "host", "nbytes", "out_event", "packed", "sent", "__weakref__",
    )  # fmt: skip

    def __init__(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        self.device_storage: torch.UntypedStorage | None = storage
        self.packed: list[weakref.ref[_Packed]] = []  # the saved tensors packed into it
        self.device = device
        self.nbytes = int(storage.nbytes())
        self.host: torch.Tensor | None = None
        self.sent = False
        self.out_event: Any = None
        self.back_event: Any = None

    def send(self) -> None:
        """Starts the copy to host memory (NOTE [offload streams])."""
        assert self.device_storage is not None
        cuda = self.device.type == "cuda"
        with _disable_current_modes():
            source = _bytes_view(self.device_storage, self.device)
            host = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
            self.out_event = _copy_aside(host, source, self.device)
        self.host = host
        self.sent = True
        _HOST_MEMORY._add(self.nbytes)
        weakref.finalize(host, _HOST_MEMORY._free, self.nbytes)

    def release(self) -> None:
        """Lets the device copy go, once the copy to host memory is done."""
        if not self.sent or self.device_storage is None:
            return
        if self.out_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.out_event)
            self.out_event = None
        self.device_storage = None

    def prefetch(self) -> None:
        """Starts bringing the bytes back into device memory (allocated here, where the tracker sees it)."""
        if self.device_storage is not None or self.host is None:
            return
        target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        host = self.host
        with _disable_current_modes():
            self.back_event = _copy_aside(target, host, self.device)
        self.device_storage = target.untyped_storage()
        _HOST_MEMORY._fetched(self.nbytes)

    def storage(self) -> torch.UntypedStorage:
        """The device storage, waiting for (or making) its copy back."""
        if self.device_storage is None:
            self.prefetch()
        if self.back_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.back_event)
            self.back_event = None
        assert self.device_storage is not None
        return self.device_storage


class _Packed:
    """What a saved tensor is packed into: its storage's entry and its view of it, and the
    tensor's version then (NOTE [saved tensors changed in place])."""

    __slots__ = ("changed", "dtype", "entry", "held", "offset", "ref", "size", "stride", "version", "__weakref__")

    def __init__(self, entry: _Entry, tensor: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()
        # a view shares its base's version counter, and its base lives on (a parameter, an input)
        base = tensor._base if tensor._is_view() and tensor._base is not None else tensor
        self.ref = weakref.ref(base)
        self.version = base._version
        self.held: torch.Tensor | None = base  # until sent, and for good where it stays on the device
        self.changed = False
        entry.packed.append(weakref.ref(self))

    def sent(self) -> None:
        """Its bytes go to host memory: from now on it is checked while something keeps it alive."""
        if self.held is not None and self.held._version != self.version:
            self.changed = True  # changed inside the block: autograd raises when backward reads it
        self.held = None

    def unpack(self) -> torch.Tensor:
        tensor = self.held if self.held is not None else self.ref()
        if self.changed or (tensor is not None and tensor._version != self.version):
            version = "another" if tensor is None else tensor._version
            raise RecomputeInputModified(
                f"a tensor of shape {tuple(self.size)} that remat.offload saved for backward was modified by "
                f"an in-place operation after it was saved (version {self.version} -> {version}); "
                "autograd raises for this too. Clone it before changing it."
            )
        storage = self.entry.storage()
        with _disable_current_modes():  # a view of bytes the tracker already counts
            whole = _bytes_view(storage, self.entry.device).view(self.dtype)
            return whole.as_strided(self.size, self.stride, self.offset)


def storage_keys(tensors: Iterable[Any]) -> set[int]:
    """The storages of the plain tensors among `tensors` (to name what stays on the device)."""
    keys: set[int] = set()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.layout == torch.strided:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                keys.add(tensor.untyped_storage()._cdata)
    return keys


class OffloadGroup:
    """The saved tensors of one block, moved to host memory and back as a whole.

    Args:
        name: what the group is, for errors.
    """

    def __init__(self, name: str = "block") -> None:
        self.name = name
        # held by what the graph saved: the group lets them go with the graph
        self._entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
        self.sent = False
        self.released = False
        self.prefetched = False

    @contextlib.contextmanager
    def hooks(self) -> Iterator[OffloadGroup]:
        """Packs what autograd saves inside into this group (nothing moves yet)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not _movable(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._entries.get(key)
        if entry is None or entry.device_storage is None:
            entry = self._entries[key] = _Entry(storage, tensor.device)
        return _Packed(entry, tensor)

    @property
    def device_bytes(self) -> int:
        """Bytes of the storages this group moves (or would move) to host memory."""
        return sum(entry.nbytes for entry in self._entries.values())

    def send(self, staying: Iterable[Any] = ()) -> None:
        """Starts copying to host memory every packed storage but those of `staying`."""
        if self.sent:
            return
        self.sent = True
        keep = storage_keys(staying)
        for key, entry in list(self._entries.items()):
            if key in keep:
                del self._entries[key]  # stays on the device: unpacked from its own storage
            else:  # (one that stays is held on, as autograd holds it: NOTE [saved tensors changed in place])
                for ref in entry.packed:
                    packed = ref()
                    if packed is not None:
                        packed.sent()
                entry.send()

    def release(self) -> None:
        """Lets the device copies go once the copies to host memory are done."""
        self.released = True
        for entry in self._entries.values():
            entry.release()

    def prefetch(self) -> None:
        """Starts bringing every storage back to the device (once)."""
        if self.prefetched or not self.released:
            return
        self.prefetched = True
        for entry in self._entries.values():
            entry.prefetch()


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack() if isinstance(packed, _Packed) else packed


class _Chain(threading.local):
    def __init__(self) -> None:
        self.last: weakref.ref[OffloadGroup] | None = None  # the last block offloaded by this thread


_CHAIN = _Chain()


def offload(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``function(*args, **kwargs)`` keeping what it saves for backward in host memory.

    Everything autograd saves inside the block, but its inputs, its outputs and (for a
    module) its parameters and buffers, which stay where they are, is copied to host
    memory when the block returns; the device copies are let go once the copies are done
    (the computation after the block waits for them on the GPU's stream, not on the host).
    When the backward reaches the output of a block offloaded after this one, this block's
    tensors start coming back, so that the copy overlaps that block's backward; the last
    block offloaded in a forward brings its own back when its backward needs them.
    Gradients are bit-identical to plain autograd: nothing is recomputed. Inside a block
    that :func:`remat.recompute` recomputes, the block runs plainly (the recompute decides).

    On the CPU the host and the device are one memory: offloading there saves nothing and
    only shows what would move (the exact tracker leaves host copies out, as on a GPU).
    The planner (``remat.enable(model, budget, offload=True)``) offloads with more
    overlap: it knows which stage runs next (NOTE [offloaded stages]).

    Args:
        function: any callable (an ``nn.Module``, a function).
        *args: its positional arguments, tensors nested in structures included.
        **kwargs: its keyword arguments.

    Returns:
        What ``function`` returns.
    """
    if active_mode() is not None:
        # Inside a block remat.recompute is recomputing: its frame decides what is kept.
        return function(*args, **kwargs)
    name = getattr(function, "__qualname__", type(function).__name__)
    group = OffloadGroup(name)
    with group.hooks():
        out = function(*args, **kwargs)
    if not group.device_bytes:
        return out
    module = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    staying = list(tree_leaves((args, kwargs, out)))
    if isinstance(module, torch.nn.Module):
        staying += list(module.parameters()) + list(module.buffers())
    group.send(staying)
    group.release()
    previous = _CHAIN.last() if _CHAIN.last is not None else None
    _CHAIN.last = weakref.ref(group)
    if previous is not None and torch.is_grad_enabled():
        fired = [False]

        def bring_back(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                previous.prefetch()

        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(bring_back)
    return out


#: Bytes moved by each timed copy: large enough that the copy runs at the link's speed.
PROBE_BYTES = 64 * 2**20

_MEASURED: dict[str, float] = {}


def offload_time_per_byte_s(device: torch.device | str, *, repeats: int = 5) -> float:
    """Seconds per byte of the slower direction between `device` and pinned host memory.

    Measured once per device and process: the median of `repeats` copies each way, timed
    with CUDA events.

    Raises:
        RematError: `device` is not a CUDA device. On the CPU the device's memory and host
            memory are the same: offloading would move bytes and free nothing.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise RematError(
            f"offload=True measures the link between a CUDA device and host memory, but the model is on "
            f"{device}: there, host memory is the device's own memory and offloading frees nothing. Pass "
            "offload as a number of bytes per second to plan as if it had such a link (what the tests do)"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _MEASURED:
        on_device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
        on_host = torch.empty(PROBE_BYTES, dtype=torch.uint8, device="cpu", pin_memory=True)
        times: dict[str, list[float]] = {"out": [], "back": []}
        for index in range(repeats + 1):
            for direction, (target, source) in (("out", (on_host, on_device)), ("back", (on_device, on_host))):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                target.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                if index:  # the first round warms up
                    times[direction].append(start.elapsed_time(end) / 1000.0)
        _MEASURED[key] = max(statistics.median(values) for values in times.values()) / PROBE_BYTES
    return _MEASURED[key]


def _plain_tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


class StageOffloads:
    """The offloaded stages of one forward of a planned chain (NOTE [offloaded stages] in
    ``remat.plan.simulate``); the executor calls it around every stage call.

    What stage ``i`` and its glue save is packed while they run (:meth:`open`); the copy to
    host memory starts when stage ``i+1`` is called, all but the tensors that stay on the
    device anyway (``i``'s inputs and outputs, ``i+1``'s inputs, ``i``'s parameters and
    buffers); the device copies go when the forward of stage ``i+1`` returns, and a hook
    on its output brings them back when the backward reaches it.
    """

    def __init__(self) -> None:
        self._open: tuple[int, OffloadGroup, Any, list[Any]] | None = None
        self._sent: tuple[int, OffloadGroup] | None = None

    def open(self, index: int, module: torch.nn.Module, inputs: Any) -> None:
        group = OffloadGroup(f"stage call {index}")
        hooks = group.hooks()
        hooks.__enter__()
        staying = _plain_tensors(inputs) + list(module.parameters()) + list(module.buffers())
        self._open = (index, group, hooks, staying)

    def before(self, index: int, inputs: Any) -> None:
        if self._open is None:
            return
        opened, group, hooks, staying = self._open
        self._open = None
        hooks.__exit__(None, None, None)
        group.send(staying + _plain_tensors(inputs))
        self._sent = (index, group)
        del opened

    def after(self, index: int, out: Any) -> None:
        if self._open is not None and self._open[0] == index:
            self._open[3].extend(_plain_tensors(out))
        if self._sent is None or self._sent[0] != index:
            return
        _, group = self._sent
        self._sent = None
        group.release()
        if not torch.is_grad_enabled():
            return
        fired = [False]

        def prefetch(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                group.prefetch()

        for tensor in _plain_tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(prefetch)

    def abort(self) -> None:
        if self._open is not None:
            hooks = self._open[2]
            self._open = None
            hooks.__exit__(None, None, None)
