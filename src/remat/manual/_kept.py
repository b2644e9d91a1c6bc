"""The outputs policy blocks keep: held, handed over, or let go when nothing reads them.

NOTE [keeping only what the recompute reads]
A policy keeps an operation's output so that the recompute need not run the operation.
Many outputs it keeps are read by nothing in the recompute: ``x ** 3`` in a GELU written
out, whose product with a constant is kept too and whose backward saves ``x``, not the
cube. Held until the block's backward, such an output costs memory and saves nothing
(torch's selective checkpointing holds it all the same: a policy naming the few operations
to recompute could take more memory than no recompute at all). So when a policy block's
first forward ends, each kept output is let go, and its operation is not run by the
recompute either (it is *skipped*: the recompute gets an uninitialised tensor of the same
shape, strides, type and device in its place), when all of these hold:

* autograd saved none of its tensors (storage-wise: views included) during the first
  forward of the root; the recompute saves the same ones;
* no operation that runs in the recompute read it: an operation the policy does not keep,
  an in-place or ``out=`` one, one run without grad, one returning no tensor (``item()``);
  a view only makes another name for the same storage, and reads nothing;
* nothing outside remat holds it: the storage's reference count is that of remat's own
  aliases (the block's outputs, a tensor the block stored, a view of either, a tensor an
  autograd function holds all count), so no later code can read or change it;
* the operations that could still run again instead of being served are known: a kept
  output changed in place runs again and reads its inputs, so the inputs of kept
  operations dropped during the forward, and of those still held outside remat, count as
  read. (An output kept through :func:`tag` has no recorded inputs; when one of those may
  run again, nothing of the block is let go.)

NOTE [outputs filled in place]
A random mask is often made by filling a fresh tensor in place: ``F.dropout`` on the CPU is
``empty_like``, ``bernoulli_``, ``div_``. In-place operations are never kept (and not
numbered), so the entry of the fresh tensor would go at the first fill, and the recompute
would draw the mask again. Instead, while a kept output has been read by nothing (no
operation, kept or not, has read its storage and autograd has not saved it), an in-place
operation of the same block that writes to it, and that the policy would keep, is
taken into its entry: the entry then holds the filled value, and the recompute, served
that value, skips the fills in order (a random one sets the generator to the state after
it, as a kept random operation does). Since nothing saw the values in between, a fill of a
part (through a view) is taken in as well: the value served is the storage's last one. The
fills' other arguments are counted among the entry's inputs. A fill the policy names, one
of another block, one that changes a tensor's shape or strides (``resize_``, ``t_``), or
any write after a read, drops the entry as before.

Reads and saves are recorded as the kept entries they reach at that moment, not as storage
addresses: a storage freed during the forward can come back at the same address as a later
kept output, which an address would then count as read.

A skipped random operation sets the generator to the state after it, as a kept one does.
Not let go: offloaded outputs (in host memory) and outputs of tensor subclasses. While a
recompute runs, an operation that would read a skipped placeholder raises
:class:`~remat.errors.NondeterministicRecompute` instead of computing from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from remat.manual._host import _HostCopy, from_host, to_host
from remat.manual._tensors import storage_key
from remat.memory import note_kept_for_backward

__all__ = ["OpCache", "strided_storage_keys"]


class _Kept:
    """One kept operation output.

    Kept as aliases made below autograd, which have version counters of their own: an
    in-place change of the original during the block's first forward is seen by the mode
    (:meth:`OpCache.changed`). When that forward ends, the outputs still referenced
    (returned by the block, or stored) are aliased again above autograd, sharing their
    version counters, so that a change made after the block returned is seen too; the
    others are gone, and nothing can change them any more.
    """

    __slots__ = (
        "op",
        "value",
        "rng_after",
        "originals",
        "watchers",
        "versions",
        "offloaded",
        "inputs",
        "skipped",
        "fills",
        "fillable",
    )

    def __init__(
        self,
        op: Any,
        out: Any,
        rng_after: dict[str, Any] | None,
        offload: bool = False,
        inputs: frozenset[tuple[int, int]] | None = None,
    ) -> None:
        self.op = op
        self.rng_after = rng_after
        self.offloaded = offload
        # the kept entries the operation read (None: not known); NOTE [keeping only what the recompute reads]
        self.inputs = inputs
        self.skipped = False
        # NOTE [outputs filled in place]: the in-place operations taken in (op, RNG state after)
        self.fills: list[tuple[Any, dict[str, Any] | None]] = []
        self.fillable = not offload and inputs is not None and isinstance(out, torch.Tensor)
        if offload:  # a copy of what the operation returned: later changes of the output do not reach it
            self.value = tree_map(lambda t: to_host(t) if isinstance(t, torch.Tensor) else t, out)
            self.originals: list[weakref.ref[torch.Tensor]] = []
            self.watchers: list[torch.Tensor] = []
            self.versions: tuple[int, ...] | None = ()
            return
        self.value = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        # every tensor of the first forward sharing its storage (the outputs, their views)
        self.originals = [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # once sealed: aliases sharing the version counters of those still alive, and their versions
        self.watchers = []
        self.versions = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds on the device (none when offloaded)."""
        if self.offloaded:
            return []
        return [t for t in tree_leaves(self.value) if isinstance(t, torch.Tensor)]

    def seal(self) -> None:
        """Its block's first forward ended: watch the tensors still alive so that later changes show."""
        if self.versions is not None:
            return
        alive = [t for t in (ref() for ref in self.originals) if t is not None]
        self.originals = []
        self.watchers = [t.detach() for t in alive]  # above autograd: the same version counter
        self.versions = tuple(t._version for t in self.watchers)

    def intact(self) -> bool:
        return self.versions is None or tuple(t._version for t in self.watchers) == self.versions

    def skip(self) -> None:
        """Nothing reads the output in the recompute: let it go, keep only its layout."""
        self.value = tree_map(lambda t: _Layout(t) if isinstance(t, torch.Tensor) else t, self.value)
        self.originals = []
        self.skipped = True

    def served(self) -> Any:
        if self.skipped:
            return tree_map(lambda t: t.placeholder() if isinstance(t, _Layout) else t, self.value)
        if self.offloaded:
            return tree_map(lambda t: from_host(t) if isinstance(t, _HostCopy) else t, self.value)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, self.value)


class _Layout:
    """The shape, strides, offset, type and device of a skipped output."""

    __slots__ = ("size", "stride", "offset", "dtype", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size, self.stride, self.offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        self.dtype, self.device = tensor.dtype, tensor.device

    def placeholder(self) -> torch.Tensor:
        """An uninitialised tensor of this layout (in a storage as long as its view needs)."""
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(self.size, self.stride, strict=True))
        elements = self.offset + (extent if all(self.size) else 0)
        base = torch.empty(elements, dtype=self.dtype, device=self.device)
        return base.as_strided(self.size, self.stride, self.offset)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_uses(key: int) -> int:
    """How many tensors (and other owners) hold the storage `key` (see :func:`storage_key`),
    less what holds any storage once looked up (its Python object: see :data:`_LOOKED_UP`).
    Where torch cannot tell, a number larger than any: nothing is let go."""
    if _USE_COUNT is None:
        return 1 << 62
    return int(_USE_COUNT(key)) - _LOOKED_UP


def _looked_up_uses() -> int:
    if _USE_COUNT is None:
        return 0
    probe = torch.empty(1, device="cpu")
    return int(_USE_COUNT(storage_key(probe))) - 1


#: References a storage has once :func:`storage_key` has looked it up, beyond its tensors'
_LOOKED_UP = _looked_up_uses()


def strided_storage_keys(tree: Any) -> Iterator[int]:
    """The storages of the strided tensors in `tree` (see :func:`storage_key`)."""
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            yield storage_key(t)


def _plain(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and (
        type(tensor) is torch.Tensor or isinstance(tensor, torch._subclasses.fake_tensor.FakeTensor)
    )


class OpCache:
    """The outputs a root frame's policies kept: ``entries[block][index]``."""

    __slots__ = ("entries", "storages", "ops", "reads", "autograd_saved", "at_risk", "__weakref__")

    def __init__(self) -> None:
        self.entries: dict[int, dict[int, _Kept]] = {}
        self.ops: dict[int, list[Any]] = {}  # each policy block's numbered operations, in order
        # while the first forward runs: storage -> the entries holding it
        self.storages: dict[int, list[tuple[int, int]]] | None = {}
        # NOTE [keeping only what the recompute reads], while the first forward runs: the kept
        # entries read by operations the recompute runs, and those autograd saved
        self.reads: set[tuple[int, int]] = set()
        self.autograd_saved: set[tuple[int, int]] = set()
        self.at_risk = False  # a kept output of unknown inputs was dropped: it reads anything

    def keep(self, block: int, index: int, kept: _Kept) -> None:
        self.entries.setdefault(block, {})[index] = kept
        if self.storages is not None:
            for t in kept.tensors():
                if t.layout == torch.strided:
                    self.storages.setdefault(storage_key(t), []).append((block, index))

    def changed(self, tensor: torch.Tensor) -> None:
        """`tensor` is changed in place during the first forward: entries holding its storage go."""
        if self.storages and tensor.layout == torch.strided:
            for block, index in self.storages.pop(storage_key(tensor), ()):
                kept = self.get(block, index)
                if kept is not None:  # its operation runs again, and reads its inputs
                    self._reads_of(kept)
                self.drop(block, index)

    def _reads_of(self, kept: _Kept) -> None:
        if kept.inputs is None:
            self.at_risk = True
        else:
            self.reads |= kept.inputs

    def kept_in(self, tree: Any) -> frozenset[tuple[int, int]]:
        """The entries holding a storage of the tensors in `tree`, now."""
        if not self.storages:
            return frozenset()
        found: set[tuple[int, int]] = set()
        for key in strided_storage_keys(tree):
            found.update(self.storages.get(key, ()))
        return frozenset(found)

    def read(self, args: Any, kwargs: Any) -> None:
        """An operation the recompute runs too reads these arguments."""
        entries = self.kept_in((args, kwargs))
        self.reads |= entries
        self.closed(entries)

    def saved(self, tensor: torch.Tensor) -> None:
        """Autograd saved `tensor` during the root's first forward."""
        entries = self.kept_in(tensor)
        self.autograd_saved |= entries
        self.closed(entries)

    def closed(self, entries: frozenset[tuple[int, int]]) -> None:
        """These entries were read: no in-place operation is taken into them any more."""
        for block, index in entries:
            kept = self.get(block, index)
            if kept is not None:
                kept.fillable = False

    def fill_target(self, tensor: torch.Tensor, block: int) -> tuple[int, int] | None:
        """The entry of policy block `block` that an in-place write of `tensor` (any part of the
        entry's output) may be taken into (NOTE [outputs filled in place]), if there is one."""
        if not self.storages or tensor.layout != torch.strided:
            return None
        live = {entry for entry in self.storages.get(storage_key(tensor), ()) if self.get(*entry) is not None}
        if len(live) != 1:
            return None
        entry = next(iter(live))
        kept = self.get(*entry)
        assert kept is not None
        if entry[0] != block or not kept.fillable or kept.versions is not None:
            return None
        return entry

    def filled(self, entry: tuple[int, int], op: Any, rng_after: dict[str, Any] | None, others: Any) -> None:
        """In-place operation `op` wrote all of `entry`'s output, reading `others` besides."""
        kept = self.get(*entry)
        assert kept is not None and kept.inputs is not None
        kept.fills.append((op, rng_after))
        kept.inputs = kept.inputs | (self.kept_in(others) - {entry})

    def sharing(self, out: Any) -> None:
        """The outputs of an operation of the first forward: those sharing a kept storage are watched too."""
        if not self.storages:
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                for block, index in self.storages.get(storage_key(t), ()):
                    kept = self.get(block, index)
                    if kept is not None and kept.versions is None:
                        kept.originals.append(weakref.ref(t))

    def get(self, block: int, index: int) -> _Kept | None:
        entries = self.entries.get(block)
        return None if entries is None else entries.get(index)

    def drop(self, block: int, index: int) -> None:
        entries = self.entries.get(block)
        if entries is not None:
            entries.pop(index, None)

    def release(self, block: int | None) -> None:
        """Drops what policy block `block` kept (its frame will not run again)."""
        if block is not None:
            self.entries.pop(block, None)

    def seal(self, block: int | None = None) -> None:
        """The first forward of policy block `block` ended, or with None, the root's (see :class:`_Kept`)."""
        fresh = [
            ((key, index), kept)
            for key, entries in self.entries.items()
            if block is None or key == block
            for index, kept in entries.items()
            if kept.versions is None and not kept.skipped
        ]
        if fresh and self.storages is not None and not torch.compiler.is_compiling():
            self._let_go(fresh)
        for _, kept in fresh:
            if not kept.skipped:
                for t in kept.tensors():  # measured as kept for backward, as a saved tensor is
                    note_kept_for_backward(t)
                kept.seal()
        if block is None:
            self.storages = None
            self.reads, self.autograd_saved = set(), set()

    def _let_go(self, fresh: list[tuple[tuple[int, int], _Kept]]) -> None:
        """NOTE [keeping only what the recompute reads]: skips the outputs nothing reads."""
        candidates = []
        for entry, kept in fresh:
            tensors = kept.tensors()
            if kept.offloaded or not tensors or not all(_plain(t) for t in tensors):
                outside = True
            else:
                outside = any(_storage_uses(key) > self._held(key) for key in map(storage_key, tensors))
            if outside:  # it may be changed in place later, and its operation run again
                self._reads_of(kept)
            else:
                candidates.append((entry, kept))
        if self.at_risk:
            return
        for entry, kept in candidates:
            if entry not in self.reads and entry not in self.autograd_saved:
                kept.skip()

    def _held(self, key: int) -> int:
        """How many of remat's own aliases hold storage `key` (the entries that kept it, still kept)."""
        assert self.storages is not None
        held = 0
        for block, index in set(self.storages.get(key, ())):
            kept = self.get(block, index)
            if kept is not None:
                held += sum(1 for t in kept.tensors() if t.layout == torch.strided and storage_key(t) == key)
        return held
