"""Tensors from outside a recomputed block that its recompute reads: those held inside its
inputs and outputs where torch's pytree does not look, and the parameters it uses.

NOTE [tensors inside other inputs]
A recomputed block keeps its inputs, flattened with torch's pytree: the tensors of tuples,
lists, dicts and registered types are kept one by one, with their versions, and a recompute
that would read a tensor changed in place raises :class:`~remat.errors.RecomputeInputModified`.
Anything else is kept as it is, by reference: a dataclass holding a scale, a mapping of
another type (``UserDict``). A tensor inside such an input, changed in place after the
forward or replaced by another, would be read as it is then by the recompute (silently other
gradients, where plain autograd raises or uses what the forward saw). So the tensors found
inside those inputs (the fields of a dataclass, the values of a mapping, and the tuples,
lists and dicts among them, a few levels down, each container once) are noted with where
they are and their versions as the block's first forward leaves them (what the block changes
there itself, a field it caches or a counter it updates, is its own doing, as with a
module's state), and the recompute checks them first: another tensor at a place, or one
changed in place, raises. The same walk finds tensors that the reentrant implementation
could not hand back with their history (NOTE [outputs of the reentrant Function]).

NOTE [parameters changed before the recompute]
Plain autograd keeps the parameters a block's operations save (a weight, or the transpose a
product takes of it) and raises if one was changed in place before backward reads it: an
optimizer step between a forward and its backward (a GAN's discriminator stepped between the
generator's forward and backward), an update of an exponential average in place. A recompute
would silently run with the new values. So, while a block runs for the first time, the
parameters among what it saves (or the parameters they view) are noted; when it ends, their
versions; and a recompute that saves one changed since raises
:class:`~remat.errors.RecomputeInputModified` (one it does not read again, as a replay stopping
before a stage whose backward ran and whose parameters an optimizer in backward stepped, is not
refused). A parameter the block
changes in place itself (a clamp under ``no_grad``, an embedding's ``max_norm``) is noted
after that change, and again after each recompute, which changes it again: the next
recompute (of a nested block, or in a second backward of a retained graph) is not refused.
Not seen: a parameter no operation saves as itself (an embedding's weight; under autocast,
where the saved tensor is the weight's cast), where plain autograd does not raise either but
keeps the values it used, and the reentrant implementation, whose first forward saves
nothing. Buffers are not checked: remat puts back the values a forward changed (NOTE [module
state during recompute]) without moving their versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.nn import Parameter

from remat.errors import RecomputeInputModified

__all__ = [
    "HeldInside",
    "ModuleSlots",
    "ParametersRead",
    "changed_by_own_forward",
    "held_inside",
    "outputs_held_inside",
    "tensors_inside",
]

_DEPTH = 4


def tensors_inside(
    value: Any, path: str = "", depth: int = _DEPTH, seen: set[int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside `value`, a pytree leaf that is no tensor, with where each is (each
    container once: a structure that holds itself is walked once)."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    seen = set() if seen is None else seen
    if depth < 0 or id(value) in seen:
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.add(id(value))
        for field in dataclasses.fields(value):
            yield from tensors_inside(getattr(value, field.name, None), f"{path}.{field.name}", depth - 1, seen)
    elif isinstance(value, Mapping):
        seen.add(id(value))
        for key, item in list(value.items()):
            yield from tensors_inside(item, f"{path}[{key!r}]", depth - 1, seen)
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        for index, item in enumerate(value):
            yield from tensors_inside(item, f"{path}[{index}]", depth - 1, seen)


class HeldInside:
    """The tensors inside one input, with their versions as the block's first forward left them."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[tuple[str, torch.Tensor, int]]) -> None:
        self.tensors = tensors

    def checked(self, value: Any, position: int, name: str) -> Any:
        """`value`, once checked: the recompute would read the same tensors inside it, unchanged.

        Raises:
            RecomputeInputModified: a tensor inside the input was replaced or changed in place.
        """
        now = list(tensors_inside(value))
        for index, (path, tensor, version) in enumerate(self.tensors):
            what = (
                f"the tensor at {type(value).__name__}{path} inside input {position} of the recomputed block {name!r}"
            )
            if index >= len(now) or now[index][0] != path or now[index][1] is not tensor:
                raise RecomputeInputModified(
                    f"{what} was replaced after the forward; the recompute would read another tensor. "
                    "Give the block a new object instead of changing the one it took, or pass the tensor "
                    "itself as an argument"
                )
            if tensor._version != version:
                raise RecomputeInputModified(
                    f"{what} was modified in place after the forward (version {version} -> "
                    f"{tensor._version}); the recompute would see other values. Clone it before modifying it"
                )
        if len(now) != len(self.tensors):
            raise RecomputeInputModified(
                f"input {position} of the recomputed block {name!r} ({type(value).__name__}) holds other "
                "tensors than when the block took it; the recompute would read them"
            )
        return value


# NOTE [inputs a block changes itself]
# A block that changes one of its tensor inputs in place during its forward (an
# ``nn.ReLU(inplace=True)`` or ``x.relu_()`` on its input, ``x += ...``) has destroyed what its
# recompute starts from: run again, it would read the changed values. Plain autograd follows
# the change (the input's history now ends in the in-place operation). So the block's first
# forward checks, when it ends, the versions of its tensor inputs against those it took, and
# raises at once, naming the input and the ways out. (The reentrant implementation used to hand
# such an input back as itself, the block an identity for autograd: silently wrong gradients.)
def changed_by_own_forward(name: str, position: int, before: int, after: int) -> RecomputeInputModified:
    """The error for a block whose forward changed its tensor input `position` in place."""
    return RecomputeInputModified(
        f"the recomputed block {name!r} changed its input {position} in place during its own forward "
        f"(version {before} -> {after}): an in-place operation on an input, such as nn.ReLU(inplace=True), "
        "x.relu_() or x += ...; its recompute would start from the changed values. Use the out-of-place "
        "operation (inplace=False), or recompute the operation that makes this input together with the block"
    )


def held_inside(value: Any) -> HeldInside | None:
    """The tensors inside `value` (an input the pytree keeps whole), noted; None if it holds none."""
    if isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
        return None
    found = [(path, tensor, tensor._version) for path, tensor in tensors_inside(value)]
    return HeldInside(found) if found else None


def outputs_held_inside(leaves: list[Any]) -> list[tuple[int, str, torch.Tensor]]:
    """The tensors that an output's pytree `leaves` (other than tensors) hold, by leaf."""
    return [
        (index, path, tensor)
        for index, leaf in enumerate(leaves)
        if not isinstance(leaf, torch.Tensor)
        for path, tensor in tensors_inside(leaf)
    ]


# NOTE [parameters swapped in for a call]
# ``torch.func.functional_call`` (and ``torch.nn.utils.stateless``, ``stack_module_state``
# ensembles, MAML's fast weights) runs a module with other tensors in its parameters' and
# buffers' places, and puts the module's own back when the call returns: before the backward,
# and so before any recompute, which would silently run with the module's own weights (wrong
# gradients for the input, none for the tensors given; torch's checkpoint inside such a call
# does the same). So a block that is a module (or a module's method) notes, when its first
# forward starts, the tensor in each parameter and buffer place of its modules, and each of
# its recomputes runs with those put back, and the places' contents restored after it. The
# note costs a walk over the block's modules per call: 2 to 8 us on a CPU. A parameter's place
# is noted only when it holds a tensor that is no ``nn.Parameter`` (what functional_call gives):
# FSDP2 swaps its sharded and gathered parameters in and out of those places itself.
class ModuleSlots:
    """The tensors in a block's parameter and buffer places when its first forward started."""

    __slots__ = ("places",)

    def __init__(self, function: Any) -> None:
        # (a planned region's replay names the stage modules it runs)
        tops = getattr(function, "block_modules", None)
        if tops is None:
            module = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
            tops = [module] if isinstance(module, torch.nn.Module) else []
        # A parameter's place is put back only when it held another tensor than a parameter: a
        # framework that manages parameters (FSDP2's sharded and gathered ones) swaps nn.Parameters.
        # (A walk of its own: nn.Module.modules() builds every module's name, at each block call.)
        places = []
        stack = list(tops)
        while stack:
            m = stack.pop()
            for t in m._parameters.values():
                if t is not None and type(t) is not Parameter:  # (rare: the walk's cost is this loop's)
                    given = tuple((n, v) for n, v in m._parameters.items() if _given(v))
                    if given:
                        places.append((m, given, ()))
                    break
            if m._buffers:
                places.append((m, (), tuple(m._buffers.items())))
            stack.extend(child for child in m._modules.values() if child is not None)
        self.places = places

    def put_back(self) -> contextlib.AbstractContextManager[None]:
        """A context that runs its body with the noted tensors in their places (NOTE [parameters
        swapped in for a call]); nothing to do for a block whose modules hold no buffer nor given tensor."""
        return self._put_back() if self.places else _NOTHING

    @contextlib.contextmanager
    def _put_back(self) -> Iterator[None]:
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for module, parameters, buffers in self.places:
                pairs: tuple[tuple[dict[str, Any], tuple[tuple[str, Any], ...]], ...] = (
                    (module._parameters, parameters),
                    (module._buffers, buffers),
                )
                for places, items in pairs:
                    for name, tensor in items:
                        now = places.get(name, _ABSENT)
                        if now is not tensor:
                            swapped.append((places, name, now))
                            places[name] = tensor
            yield
        finally:
            for places, name, now in reversed(swapped):
                if now is _ABSENT:
                    del places[name]
                else:
                    places[name] = now


def _given(value: Any) -> bool:
    """Whether a parameter's place holds a tensor that is no parameter (what functional_call gives)."""
    return value is not None and not isinstance(value, Parameter)


_ABSENT: Any = object()
_NOTHING = contextlib.nullcontext()


class ParametersRead:
    """The parameters a block's first forward saved, and their versions when it ended
    (NOTE [parameters changed before the recompute])."""

    __slots__ = ("changed", "noted", "versions")

    def __init__(self) -> None:
        self.noted: dict[int, weakref.ref[torch.Tensor]] = {}
        self.versions: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.changed: dict[int, tuple[torch.Tensor, int]] = {}  # while a recompute runs: id -> (it, version noted)

    def saw(self, tensor: torch.Tensor) -> None:
        """`tensor` is saved by the first forward: noted if it is (a view of) a parameter."""
        base = _parameter_of(tensor)
        if base is not None and id(base) not in self.noted:
            self.noted[id(base)] = weakref.ref(base)

    def ended(self) -> None:
        """The first forward ended: the versions a recompute must find."""
        refs, self.noted = list(self.noted.values()), {}
        self._note(refs)

    def started(self) -> None:
        """A recompute starts: the parameters changed in place since the versions noted.

        Only those the recompute then saves again raise (:meth:`read`): a replay that stops
        before a stage whose backward has run does not read that stage's parameters, which
        an optimizer stepped from a gradient hook (an optimizer in backward) may have changed.
        """
        self.changed = {
            id(parameter): (parameter, version)
            for ref, version in self.versions
            if (parameter := ref()) is not None and parameter._version != version
        }

    def read(self, tensor: torch.Tensor, name: str) -> None:
        """The recompute saves `tensor` again.

        Raises:
            RecomputeInputModified: it is (a view of) a parameter changed before the recompute started.
        """
        base = _parameter_of(tensor)
        if base is not None and id(base) in self.changed:
            parameter, version = self.changed[id(base)]
            raise RecomputeInputModified(
                f"a parameter of shape {tuple(parameter.shape)} that the recomputed block {name!r} uses was "
                f"modified in place between its forward and its backward (version {version} -> "
                f"{parameter._version}), by an optimizer step or an update of your own; plain autograd "
                "raises for this too. Step after the backward, or do not recompute this block"
            )

    def ran(self) -> None:
        """A recompute of the block ran: what it changed itself (a clamp it makes again) is no
        change of the user's; the versions it left are those the next one must find, but for
        the parameters changed before it, which a later recompute may still read."""
        changed, self.changed = self.changed, {}
        self.versions = [
            (ref, version if id(parameter) in changed else parameter._version)
            for ref, version in self.versions
            if (parameter := ref()) is not None
        ]

    def _note(self, refs: list[weakref.ref[torch.Tensor]]) -> None:
        self.versions = [(ref, parameter._version) for ref in refs if (parameter := ref()) is not None]


def _parameter_of(tensor: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter `tensor` is, or is a view of; None for an activation (the common case)."""
    base: torch.Tensor | None = tensor if tensor.is_leaf else tensor._base if tensor._is_view() else None
    return base if isinstance(base, torch.nn.Parameter) else None
