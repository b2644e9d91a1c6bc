"""Measuring without side effects: the model and the caller's inputs are left as they were.

remat's own runs (measuring, sizing, rehearsing) run forwards and backwards on the user's
model: :func:`preserved_model_state` puts back its gradients, buffers, attributes and RNG
states afterwards, and :func:`isolated_inputs` gives the runs inputs of their own.

NOTE [buffers measuring puts back]
To put a buffer back, its values before the runs are copied. A copy of every buffer held
through the runs is memory of the first step: a model with a large mask it only reads (a
causal mask of the longest sequence, GPT-BigCode's 1024 x 1024 booleans) would go over its
budget by that much, and its smallest budget would be above its plain step. Buffers a
forward changes are numbers it keeps (BatchNorm's statistics, an average codebook, a step or
usage counter), not booleans. So a boolean buffer of
:data:`~remat.manual._state.MASK_ELEMENTS` elements or more is not copied: its version is noted,
and if the runs changed it in place anyway, it cannot be put back, which raises, naming it
(one they replaced is put back as itself). Every other buffer is copied and put back (by
value: BatchNorm's kernel writes its statistics without moving their version).
:func:`preserved_state_bytes` counts the copies, which the budget of the first step holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.errors import RematError
from remat.manual._outside import tensors_inside
from remat.manual._rng import preserved_host_rng
from remat.manual._state import MASK_ELEMENTS, is_read_only_mask, is_state_attribute, learning_copy_bytes, rehearsing
from remat.measure.parameters import alias_parameters
from remat.sharded import gathered_units

__all__ = ["KeptInAttributes", "isolated_inputs", "preserved_model_state"]


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, devices: list[torch.device]) -> Iterator[KeptInAttributes]:
    """Runs the body as remat's own run: the model is left as it was.

    On exit, parameter gradients, every buffer (values and identity), every module's plain
    attributes (numbers, strings, tensors held outside buffers) and the RNG states are
    restored; meanwhile :func:`remat.is_recomputing` is True, so user code can tell these
    runs from training forwards. The units of a model sharded with FSDP2 are gathered for
    the body and sharded again after it (NOTE [FSDP2 units] in :mod:`remat.sharded`). It
    yields what the body's forwards left in modules' attributes, known on exit.
    """
    with gathered_units(model), _preserved(model, devices) as kept:
        yield kept


# NOTE [tensors kept in attributes]
# A forward that leaves a tensor it made in a module's attribute (``self.last = h.detach()``
# for a plot, the legacy ``torch.nn.utils.spectral_norm``'s computed weight) holds it past
# the step, and its storage with it (a detached activation keeps the activation's memory),
# where the plan would free or recompute it: steps went 15 to 45% over their budget. What
# measuring's forwards leave so is counted as held through the whole step (as the loss's
# extra bytes are: where it lives is not known), so the plan leaves room for it.
@dataclasses.dataclass
class KeptInAttributes:
    """The bytes of the tensors a measuring run left in modules' attributes (NOTE [tensors kept in attributes])."""

    before: list[tuple[nn.Module, dict[str, Any]]] = dataclasses.field(default_factory=list)
    bytes: int = 0
    known: set[int] = dataclasses.field(init=False)  # the tensors in attributes before the run

    def __post_init__(self) -> None:
        self.known = {id(t) for module, _ in self.before for t in _attribute_tensors(module)}

    def note(self) -> None:
        """Notes what the forwards so far left (the most any did; a fake run's before its tensors go)."""
        storages: dict[int, int] = {}
        for module, _ in self.before:
            for tensor in _attribute_tensors(module):
                if id(tensor) not in self.known and not isinstance(tensor, nn.Parameter):
                    base = tensor._base if tensor._base is not None else tensor
                    storages[id(base)] = tensor.untyped_storage().nbytes()
        self.bytes = max(self.bytes, sum(storages.values()))


#: nn.Module's own entries of a module's ``__dict__`` (its parameters, buffers, hooks): not its attributes
_MODULE_OWN = frozenset(vars(nn.Module()))


def _attribute_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a module holds in its own attributes, private ones and those in containers included."""
    for name, value in module.__dict__.items():
        if name not in _MODULE_OWN and not isinstance(value, nn.Module):
            for _, tensor in tensors_inside(value, depth=2):
                yield tensor


def preserved_state_bytes(model: nn.Module) -> int:
    """What :func:`preserved_model_state` holds while its body runs: the copies of the buffers
    it puts back (NOTE [buffers measuring puts back]), and those the module-state guard takes
    while it learns which modules change their state (:func:`~remat.manual._state.learning_copy_bytes`)."""
    copies = sum(
        _bytes(b)
        for module in model.modules()
        for b in module._buffers.values()
        if b is not None and not is_read_only_mask(b)
    )
    return copies + learning_copy_bytes(model)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Buffer:
    """One buffer, its version before remat's runs, and its values then (NOTE [buffers measuring puts back])."""

    __slots__ = ("copy", "module", "name", "tensor", "version")

    def __init__(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        self.module, self.name, self.tensor, self.version = module, name, tensor, tensor._version
        self.copy = tensor.detach().clone() if not is_read_only_mask(tensor) else None

    def put_back(self) -> str | None:
        """Puts it back; the buffer's name if it changed without a copy to put back."""
        self.module._buffers[self.name] = self.tensor
        if self.copy is None:  # a mask: its version tells (kernels that write without it write statistics)
            return None if self.tensor._version == self.version else f"{type(self.module).__name__}.{self.name}"
        with torch.no_grad():
            self.tensor.copy_(self.copy)
        return None


def _put_back(buffers: list[_Buffer]) -> None:
    """Every buffer is itself again, with its values (NOTE [buffers measuring puts back]).

    Raises:
        RematError: the runs changed a buffer that was not copied.
    """
    lost = [name for buffer in buffers if (name := buffer.put_back()) is not None]
    if lost:
        raise RematError(
            f"remat's measuring changed the buffer(s) {', '.join(lost)} in place, and cannot put them back: a "
            f"buffer of {MASK_ELEMENTS} booleans or more is taken for a mask the model only reads, and is not "
            "copied (NOTE [buffers measuring puts back]). Their values are now those of the measuring runs. "
            "Keep what a forward changes in a buffer of numbers, or in a smaller one"
        )


@contextlib.contextmanager
def _preserved(model: nn.Module, devices: list[torch.device]) -> Iterator[KeptInAttributes]:
    grads = [(p, p.grad) for p in model.parameters()]
    aliased = alias_parameters(model)
    buffers = [
        _Buffer(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None
    ]
    attributes = [(module, dict(module.__dict__)) for module in model.modules()]
    cuda = [d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"]
    kept = KeptInAttributes(attributes)
    try:
        with torch.random.fork_rng(devices=cuda), preserved_host_rng(), rehearsing():
            for p, _ in grads:
                p.grad = None
            yield kept
    finally:
        kept.note()
        for table, name, parameter in aliased:
            table[name] = parameter
        for module, before in attributes:
            for name in [n for n in module.__dict__ if n not in before and _restored(n)]:
                del module.__dict__[name]
            for name, value in before.items():
                if _restored(name):
                    module.__dict__[name] = value
        for p, g in grads:
            p.grad = g
        _put_back(buffers)  # last: it raises for a buffer it could not put back


def _restored(name: str) -> bool:
    """Whether measurement puts a module's attribute back: its state, and its training mode."""
    return name == "training" or is_state_attribute(name)


def isolated_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, copied: AbstractSet[int] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs for remat's own runs: the caller's tensors are never touched.

    The measured steps run backward: on the caller's tensors that would accumulate
    gradients into them (and into whatever they were computed from) and free the
    caller's graph before its own backward; and a model that works in place on its input
    would change the caller's tensor before remat could refuse it. Each tensor is
    replaced by a copy with the same values and flags (one that requires grad gets a
    graph of its own). With `copied` (the positions, among the flattened inputs, of the
    tensors the model changes in place), the other tensors are detached aliases instead:
    no memory, and still no gradient or graph of the caller's.
    """
    leaves, spec = tree_flatten((args, kwargs))
    leaves = [
        (_copy(leaf) if copied is None or position in copied else _alias(leaf))
        if isinstance(leaf, torch.Tensor)
        else leaf
        for position, leaf in enumerate(leaves)
    ]
    return tree_unflatten(leaves, spec)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    alias = tensor.detach()
    return alias.requires_grad_(True) if tensor.requires_grad else alias


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    # A leaf stays a leaf: autocast caches its casts of leaves that require grad (until
    # its region ends), not those of activations (NOTE [autocast casts]).
    if tensor.requires_grad and not tensor.is_leaf:
        return tensor.detach().requires_grad_(True).clone()
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)
