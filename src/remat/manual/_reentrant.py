"""The reentrant implementation of recompute: a custom autograd Function.

The block runs under ``no_grad``; the Function's backward runs it again with grad enabled
from the kept inputs and calls ``torch.autograd.backward`` on the result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.errors import (
    NondeterministicRecompute,
    RecomputeInputModified,
    RematError,
)
from remat.manual import _debug, _state
from remat.manual._outside import (
    HeldInside,
    ModuleSlots,
    changed_by_own_forward,
    held_inside,
    outputs_held_inside,
)
from remat.manual._rng import ForwardState, capture_forward_state, replay_forward_state
from remat.manual._tensors import RecomputeOptions, TensorMeta, detached_alias, storage_key
from remat.manual.policies import save_nothing

__all__ = ["recompute_reentrant"]


# Marks where a tensor goes in a flattened structure (None and other values are constants).
_TENSOR: Any = object()


# NOTE [outputs of the reentrant Function]
# The block runs under no_grad, so a tensor it computes has no history; one that has a
# history of its own, or is a leaf requiring grad, was not computed by the block: an
# input returned as is, a parameter, a tensor from outside. Those are returned beside
# the Function, as themselves (their gradients flow as in plain autograd and their
# identity is kept), and so is an input that does not require grad. A view the block
# takes of such a tensor requires grad but has no history under no_grad: it goes through
# the Function like any computed tensor. Every
# tensor that does leaves the Function as a fresh alias (``detach()``): autograd gives
# each Function output a history of its own, and returning a tensor that exists outside
# the block (a constant, a buffer) would otherwise rewrite *that* tensor's history. So
# autograd takes two outputs that share memory (a tensor and a view of it) for tensors of
# their own: an in-place change of one would not reach the other's history. Their version
# is noted, and a backward after such a change raises (torch's reentrant checkpoint raises
# too); plain autograd, and the default implementation, follow it.
def _through_function(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    has_own_history = value.grad_fn is not None or (value.requires_grad and not value._is_view())
    return not has_own_history


class _ReentrantFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _ReentrantCall, _anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        ctx.save_for_backward(*tensors)
        ctx.requires = [t.requires_grad for t in tensors]
        # autograd checks the saved inputs' versions from the end of this forward: a block
        # that changes its own input in place is caught against the versions from its start
        ctx.versions = [t._version for t in tensors]
        ctx.leaves = [t.is_leaf for t in tensors]
        with (
            call.options.forward_context(call.name),
            torch.no_grad(),
            call.state_log.recording(),
            _debug.traced(call.options.debug) as trace,
        ):
            out = call.run(list(tensors))
        call.original_ops = trace.entries if trace is not None else None
        for position, (tensor, version) in enumerate(zip(tensors, ctx.versions, strict=True)):
            if tensor._version != version:  # NOTE [inputs a block changes itself]
                raise changed_by_own_forward(call.name, call.positions[position], version, tensor._version)
        call.note_held()
        flat, spec = tree_flatten(out)
        _refuse_tensors_inside(call, flat)
        call.out_spec = spec
        inputs = {id(t) for t in tensors}
        call.through = [_through_function(v) and id(v) not in inputs for v in flat]
        call.out_constants = [_TENSOR if through else v for v, through in zip(flat, call.through, strict=True)]
        tensors_out = tuple(v.detach() for v, through in zip(flat, call.through, strict=True) if through)
        call.out_metas = [TensorMeta.of(t) for t in tensors_out]
        call.note_shared_memory(tensors_out)
        return tensors_out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RematError(
                "recompute(..., use_reentrant=True) does not support torch.autograd.grad() or "
                "backward(inputs=...); use the default use_reentrant=False"
            )
        if torch.is_grad_enabled():  # a backward with create_graph=True: its gradients would have no graph
            raise RematError(
                "recompute(..., use_reentrant=True) does not support a backward with create_graph=True "
                "(a gradient penalty, a double backward): the gradients it gives would not be differentiable. "
                "Use the default use_reentrant=False"
            )
        call: _ReentrantCall = ctx.call
        message = (
            f"an input of the recomputed block {call.name!r} was modified in place after the block "
            "took it; the recompute would see other values. Clone it before modifying it, or do not "
            "recompute this block"
        )
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:
            # autograd checks the version of every saved tensor (the kept inputs here)
            if "modified by an inplace operation" not in str(error):
                raise
            raise RecomputeInputModified(message) from error
        if any(t._version != version for t, version in zip(saved, ctx.versions, strict=True)):
            raise RecomputeInputModified(message)
        call.check_held()
        call.check_shared_memory()
        leaves = [detached_alias(tensor, requires) for tensor, requires in zip(saved, ctx.requires, strict=True)]
        with (
            torch.enable_grad(),
            call.slots.put_back(),  # NOTE [parameters swapped in for a call]
            replay_forward_state(call.state),
            _state.recomputing(call.state_log),
            call.options.recompute_context(call.name),
            _debug.traced(call.options.debug) as trace,
        ):
            # An input that was not a leaf is given as a view of the leaf that collects its
            # gradient: autocast caches its casts of leaves only, so each use is cast as in
            # plain autograd.
            inputs = [
                t.view_as(t) if t.requires_grad and not leaf and t.layout == torch.strided else t
                for t, leaf in zip(leaves, ctx.leaves, strict=True)
            ]
            out = call.run(inputs)
        try:
            outs = _recomputed_outputs(call, out)
        except NondeterministicRecompute as error:
            raise _debug.explained(error, call.original_ops, trace) from None
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves)
        return (None, None) + input_grads


def _refuse_tensors_inside(call: _ReentrantCall, flat: list[Any]) -> None:
    """Raises for an output (`flat`: its pytree leaves) that holds tensors where the pytree
    does not look (a dataclass).

    Only the pytree's tensors go through the Function; one inside such a value would come
    back without its history, its gradient silently lost (NOTE [tensors inside other inputs]).
    """
    for leaf, path, tensor in outputs_held_inside(flat):
        if tensor.is_floating_point() or tensor.is_complex():
            raise RematError(
                f"the block {call.name!r} recomputed with use_reentrant=True returned a tensor in "
                f"{type(flat[leaf]).__name__}{path} (value {leaf} of its outputs): "
                "the reentrant implementation hands back only the tensors of tuples, lists, dicts and "
                "types registered with torch.utils._pytree, and this one would come back without its "
                "gradient. Use the default use_reentrant=False, return the tensors in a tuple or dict, or "
                "register the type with torch.utils._pytree"
            )


def _recomputed_outputs(call: _ReentrantCall, out: Any) -> list[torch.Tensor]:
    """The recompute's outputs that left the Function, checked against the original's.

    Raises:
        NondeterministicRecompute: a different number of values, or (with the check on)
            tensors of other shapes, dtypes or devices.
    """
    flat, _ = tree_flatten(out)
    if len(flat) != len(call.through):
        raise NondeterministicRecompute(
            f"the recompute of block {call.name!r} returned {len(flat)} values where the original "
            f"forward returned {len(call.through)}; the block must compute the same thing when it is "
            "recomputed"
        )
    outs = [v for v, through in zip(flat, call.through, strict=True) if through and isinstance(v, torch.Tensor)]
    metas = [TensorMeta.of(t) for t in outs]
    if call.options.checks and metas != call.out_metas:
        raise NondeterministicRecompute(
            f"the recompute of block {call.name!r} returned tensors "
            f"{[(tuple(m.shape), m.dtype, str(m.device)) for m in metas]} where the original "
            f"forward returned {[(tuple(m.shape), m.dtype, str(m.device)) for m in call.out_metas]}; "
            "the block must compute the same thing when it is recomputed (check control flow "
            "that depends on global state, and use remat.is_recomputing() for side effects)"
        )
    return outs


class _ReentrantCall:
    def __init__(self, function: Callable[..., Any], args: Any, kwargs: Any, state: ForwardState) -> None:
        self.function = function
        self.name = getattr(function, "__qualname__", None) or type(function).__name__
        flat, self.spec = tree_flatten((args, kwargs))
        self.positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        self.constants = [_TENSOR if isinstance(v, torch.Tensor) else v for v in flat]
        self.held: list[tuple[int, HeldInside]] = []  # NOTE [tensors inside other inputs]
        self.slots = ModuleSlots(function)  # NOTE [parameters swapped in for a call]
        self.state = state
        self.out_spec: Any = None
        self.out_constants: list[Any] = []
        self.through: list[bool] = []
        self.state_log = _state.StateLog()
        self.options = RecomputeOptions(save_nothing)
        self.out_metas: list[TensorMeta] = []
        self.original_ops: list[Any] | None = None  # debug=True (NOTE [op traces])
        self.shared: list[tuple[weakref.ref[torch.Tensor], int]] = []  # outputs sharing memory, versions

    def note_shared_memory(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Notes the outputs that share memory with another, and their version (NOTE [outputs
        of the reentrant Function]: autograd takes them for tensors of their own)."""
        by_storage: dict[int, list[torch.Tensor]] = {}
        for tensor in outputs:
            by_storage.setdefault(storage_key(tensor), []).append(tensor)
        self.shared = [(weakref.ref(t), t._version) for group in by_storage.values() if len(group) > 1 for t in group]

    def check_shared_memory(self) -> None:
        """Raises if an output sharing memory with another was changed in place since the forward."""
        for ref, version in self.shared:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise RematError(
                    f"the block {self.name!r}, recomputed with use_reentrant=True, returned tensors that share "
                    "memory (a tensor and a view of it), and one of them was modified in place after the block "
                    "returned: the reentrant implementation cannot follow the change from one to the other "
                    "(torch's reentrant checkpoint raises too). Use the default use_reentrant=False, or clone "
                    "the output before modifying it"
                )

    def note_held(self) -> None:
        """The block's forward ended: what other inputs hold, as it left them (NOTE [tensors inside other inputs])."""
        self.held = [(i, held) for i, v in enumerate(self.constants) if (held := held_inside(v)) is not None]

    def check_held(self) -> None:
        """Raises if a tensor inside an input the pytree keeps whole was replaced or changed."""
        for position, held in self.held:
            held.checked(self.constants[position], position, self.name)

    def tensors(self, args: Any, kwargs: Any) -> list[torch.Tensor]:
        flat, _ = tree_flatten((args, kwargs))
        return [flat[i] for i in self.positions]

    def run(self, tensors: list[torch.Tensor]) -> Any:
        flat = list(self.constants)
        for position, tensor in zip(self.positions, tensors, strict=True):
            flat[position] = tensor
        args, kwargs = tree_unflatten(flat, self.spec)
        with _state.module_call(self.function):
            return self.function(*args, **kwargs)


def recompute_reentrant(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RecomputeOptions
) -> Any:
    if not torch.is_grad_enabled():
        # still one module call, so that the state log's numbering matches the replay's
        with _state.module_call(function):
            return function(*args, **kwargs)
    flat, _ = tree_flatten((args, kwargs))
    module = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if (
        isinstance(module, nn.Module)
        and not any(t.requires_grad for t in flat if isinstance(t, torch.Tensor))
        and not any(p.requires_grad for p in module.parameters())
    ):
        # A frozen module on inputs without grad: as in plain autograd, its outputs need
        # no gradient, so there is nothing to recompute (and no anchor to add one).
        with _state.module_call(function):
            return function(*args, **kwargs)
    state = capture_forward_state(flat, preserve_rng_state=options.preserve_rng_state)
    call = _ReentrantCall(function, args, kwargs, state)
    call.options = options
    tensors = call.tensors(args, kwargs)
    # The anchor makes the output require grad even when no input does, so that the
    # parameters used inside the block still receive their gradients.
    anchor = torch.empty((), requires_grad=True)
    outs = list(_ReentrantFunction.apply(call, anchor, *tensors))
    outs.reverse()
    flat_out = [outs.pop() if c is _TENSOR else c for c in call.out_constants]
    call.out_constants = []  # what was returned beside the Function is not kept alive by it
    return tree_unflatten(flat_out, call.out_spec)


# =========================================================================== regions
