"""A wrapper that stands for the model it wraps: its attributes, its state_dict keys, and
the conventions of the models it wraps (a Hugging Face key/value cache)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat.errors import UnsupportedModel
from remat.traced import traced_plan_for
from remat.units import format_bytes

__all__ = [
    "COMPILED_SLOT",
    "CallsInFlight",
    "CACHE_TURNED_OFF",
    "COMPILED_CALL",
    "PARTIAL_COVERAGE",
    "PARTIAL_COVERAGE_BYTES",
    "is_partial",
    "ModelStandIn",
    "eager_under_compile",
    "model_own_call",
    "partial_coverage",
    "stand_for_model",
    "without_cache",
]

#: Below this share of the step's activation memory in the chain found, remat says so,
PARTIAL_COVERAGE = 0.75
#: when what is outside the chain is at least this many bytes (a toy model's loss may
#: outweigh its few layers, with nothing to gain).
PARTIAL_COVERAGE_BYTES = 1 << 20


def is_partial(measurement: Any) -> bool:
    """Whether the chain found holds too little of the step's activation memory (see
    :attr:`remat.measure.ChainMeasurement.coverage`) for a plan to matter much."""
    outside = measurement.outside_activation_bytes
    return bool(measurement.coverage < PARTIAL_COVERAGE and outside >= PARTIAL_COVERAGE_BYTES)


def partial_coverage(chain: Any, measurement: Any) -> str:
    """What to tell a user whose model's chain holds little of its activation memory."""
    names = chain.names
    found = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return (
        f"remat: the chain of stages found in the model's forward ({found}, {len(names)} stage calls) "
        f"holds {measurement.coverage:.0%} of the step's activation memory "
        f"({format_bytes(measurement.chain_activation_bytes)}); the rest "
        f"({format_bytes(measurement.outside_activation_bytes)}: what the code before or around it holds, "
        "and the peak of the code after it, the loss included) is outside any plan, so no budget goes much "
        "below that. If the model's blocks are outside the chain (a block called several times, with shared "
        "weights, or blocks whose calls do not follow one another), mark them with remat.mark(block) or "
        "remat.apply(model, BlockClass) to recompute them yourself"
    )


CACHE_TURNED_OFF = (
    "remat: use_cache=True is incompatible with recompute in training (a key/value cache would be "
    "filled again by every recomputed block); training calls run with use_cache=False, eval and "
    "generation keep the cache"
)


#: The instance attribute through which ``nn.Module.__call__`` reaches a module's call: an
#: enabled model's stand-in (``remat.enable``) lives there.
CALL_SLOT = "_call_impl"


#: Where ``nn.Module.compile()`` puts a module's compiled call, which ``nn.Module.__call__`` takes first.
COMPILED_SLOT = "_compiled_call_impl"


@contextlib.contextmanager
def model_own_call(model: nn.Module) -> Iterator[None]:
    """Runs the body with the model's own call: a stand-in on the instance (an enabled
    model's, see :mod:`remat.enable`) is put aside, and back on exit, whatever happens; so is
    the call ``model.compile()`` compiled after enabling, which runs that stand-in (NOTE
    [compiled in place])."""
    own = model.__dict__.pop(CALL_SLOT, None)
    compiled = model.__dict__.get(COMPILED_SLOT) if own is not None else None
    if compiled is not None:
        model.__dict__[COMPILED_SLOT] = None
    try:
        yield
    finally:
        if own is not None:
            model.__dict__[CALL_SLOT] = own
        if compiled is not None:
            model.__dict__[COMPILED_SLOT] = compiled


def refuse_unmeasurable(model: nn.Module) -> None:
    """Refuses a model remat cannot measure: one whose own activation checkpointing is on
    (Hugging Face's ``gradient_checkpointing_enable()``), whose blocks would run again in its
    backward, outside remat's plan, so that measuring would size a step that is not the model's
    plain one; and a ``DistributedDataParallel(static_graph=True)`` itself, whose reducer
    records its first iterations' graph from the forwards measuring runs, and then stops
    averaging gradients (silently)."""
    if getattr(model, "static_graph", False) is True and hasattr(model, "reducer"):
        raise UnsupportedModel(
            f"remat cannot measure the {type(model).__name__} with static_graph=True it was given: DDP records "
            "its static graph from the forwards remat's measuring runs, and would then stop averaging gradients. "
            "Enable the model inside it instead (remat.enable(model, ...) before DDP(model, static_graph=True)), "
            "or pass static_graph=False"
        )
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", None) is True:
            where = f" ({name!r})" if name else ""
            raise UnsupportedModel(
                f"{type(model).__name__} has its own activation checkpointing turned on{where}: Hugging Face's "
                "gradient_checkpointing_enable(). remat plans the recompute itself and cannot plan around it. "
                "Turn it off (model.gradient_checkpointing_disable()) before training with remat.enable or "
                "remat.Checkpointable"
            )


def without_cache(model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A training call's kwargs with ``use_cache=False`` for a model whose forward takes
    it (NOTE [key/value caches] in ``remat.measure.losses``), unless the caller chose; and
    whether that turned off a cache the model's config turns on (Hugging Face's gradient
    checkpointing does the same). It is passed even when the config says False: some
    models build a cache for a sub-stack whose own config says True (T5's decoder). A
    forward that takes it only through ``**kwargs`` (Switch Transformers, the GraniteMoE
    family, Llava) gets it where the model's config has ``use_cache``."""
    if "use_cache" in kwargs:
        return kwargs, False
    takes = _takes_use_cache(model.forward)
    config = getattr(model, "config", None)
    if takes == _NO or (takes == _THROUGH_KWARGS and not hasattr(config, "use_cache")):
        return kwargs, False
    # (said only for a forward that names it: through **kwargs, an encoder's config may turn on a cache it never makes)
    return {**kwargs, "use_cache": False}, takes == _NAMED and getattr(config, "use_cache", False) is True


# whether a forward function takes ``use_cache``: asked at every training call, and
# inspect.signature costs tens of microseconds. A plain dict: forward functions are few
# and live as long as their classes. Under torch.compile's tracing it is asked directly,
# as a cache the traced code reads or fills would cost a recompile.
_TAKES_USE_CACHE: dict[Any, str] = {}
_NAMED, _THROUGH_KWARGS, _NO = "named", "through **kwargs", "no"


def _takes_use_cache(forward: Any) -> str:
    if torch.compiler.is_compiling():
        return _signature_takes_use_cache(forward)
    function = getattr(forward, "__func__", forward)  # a bound method's function
    try:
        return _TAKES_USE_CACHE[function]
    except (KeyError, TypeError):  # not asked yet, or not hashable
        pass
    takes = _signature_takes_use_cache(forward)
    try:
        _TAKES_USE_CACHE[function] = takes
    except TypeError:  # not hashable: asked again next time
        pass
    return takes


def _signature_takes_use_cache(forward: Any) -> str:
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return _NO
    if "use_cache" in parameters:
        return _NAMED
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return _THROUGH_KWARGS if takes_any else _NO


class ModelStandIn(nn.Module):
    """A module whose ``model`` submodule answers for it: an attribute the wrapper does not
    have is the model's (``.config``, ``.generate``, ``.device``); call
    :func:`stand_for_model` once ``self.model`` is set for the state_dict keys."""

    model: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or "model" not in modules or name.startswith("__"):
                raise
            return getattr(modules["model"], name)


def stand_for_model(wrapper: nn.Module) -> None:
    """Gives `wrapper` the state_dict keys of its ``model`` (NOTE [the wrapper's state_dict])."""
    wrapper._register_state_dict_hook(_without_model_prefix)
    wrapper._register_load_state_dict_pre_hook(_with_model_prefix)


# NOTE [the wrapper's state_dict]
# A Checkpointable's state is its model's: its state_dict drops the "model." that the
# submodule adds to every key, and load_state_dict puts it back on keys that lack it, so
# a checkpoint moves between the model and its wrapper either way, at the top level or
# inside a larger model.
_MODEL_PREFIX = "model."


def _without_model_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    wrapped = prefix + _MODEL_PREFIX
    for key in [k for k in state_dict if k.startswith(wrapped)]:
        state_dict[prefix + key[len(wrapped) :]] = state_dict.pop(key)


def _with_model_prefix(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    wrapped = prefix + _MODEL_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)


# NOTE [the automatic mode under torch.compile]
# The automatic mode measures with hooks and an exact tracker, plans in numpy, and runs
# its plan with saved-tensor hooks and replays of the model's glue: none of it is code a
# Dynamo graph can hold. Called from code that torch.compile traces, the first training
# call of an input is a graph break: Dynamo compiles the code around the call, and the
# model runs as remat runs it eagerly, its plan and guarantees unchanged (exact gradients,
# the budget); that is said once. The call then plans the input for compiled calls, whose
# stages the next traces recompute as torch's checkpoint operation (NOTE [a plan in the
# compiled graph] in remat.traced). Blocks compiled one by one (``block.compile()``) are
# run by the plan as its stages. (remat.recompute and remat.mark inside compiled code are
# compiled: remat.manual._compiled.)
COMPILED_CALL = (
    "remat: the automatic mode runs eagerly under torch.compile at the first training call of an input (one "
    "graph break where the model is called; Dynamo compiles the code around it): it measures and plans as "
    "without compile, then plans that input for compiled calls (NOTE [a plan in the compiled graph])"
)

# the reason of the graph break, which fullgraph=True raises instead
COMPILED_TRAINING = (
    "remat's automatic mode runs its plan eagerly at the first compiled training call of an input, which "
    "fullgraph=True cannot hold: make that call with fullgraph=False (one graph break), and the next calls run "
    "a plan in the graph, fullgraph=True included; or compile the model's blocks one by one (block.compile() "
    "for each) and call the enabled model uncompiled"
)

# (torch 2.4 names no reason for a disabled function's graph break)
_dynamo_disable = (
    functools.partial(torch._dynamo.disable, reason=COMPILED_TRAINING)
    if "reason" in inspect.signature(torch._dynamo.disable).parameters
    else torch._dynamo.disable
)


def eager_under_compile(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run eagerly when torch.compile traces its caller for training, said once
    (see the NOTE); evaluation, and a forward without grad, run the model's own forward,
    compiled."""

    @_dynamo_disable
    def eager(self: Any, traced: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if traced and not getattr(self, "_compiled_call_told", False):
            self._compiled_call_told = True
            warnings.warn(COMPILED_CALL, UserWarning, stacklevel=3)
        out = forward(self, *args, **kwargs)
        if traced and self.model.training and torch.is_grad_enabled():
            traced_plan_for(self, args, kwargs)  # NOTE [a plan in the compiled graph]
        return out

    @functools.wraps(forward)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        traced = torch.compiler.is_compiling()
        if traced and not (self.model.training and torch.is_grad_enabled()):
            # the model's own call, compiled; the class's, past the stand-in an enabled model
            # has on the instance (Dynamo, torch 2.11, cannot trace putting it aside)
            return nn.Module._call_impl(self.model, *args, **kwargs)
        plan = self._traced.plan_of(self.model, self.mem_limit, args, kwargs) if traced else None
        if plan is not None:  # NOTE [a plan in the compiled graph]: the stages' stand-ins recompute
            training_kwargs = self._training_kwargs(kwargs)
            return self._traced.run(plan, lambda: nn.Module._call_impl(self.model, *args, **training_kwargs))
        return eager(self, traced, args, kwargs)

    return run


# NOTE [one call per step]
# A budget is that of one training call: its plan stores what the call's backward needs
# until that backward runs. A step that calls the model twice before its backward (a siamese
# or contrastive loss, DPO's chosen and rejected answers) holds what both calls store, up to
# twice the budget. That cannot be planned from one call, so it is said: each training call
# hooks its outputs, and a call that starts while the last call's outputs live and no gradient
# has reached them warns, once. A loss that keeps none of the outputs (a cross-entropy of each
# call, summed) leaves nothing alive to see: that step is not told.
TWO_CALLS_IN_FLIGHT = (
    "remat: the model was called for training again before the backward of its previous call; "
    "each call keeps what its plan stores until its own backward, so this step can hold up to the "
    "budget once per call (NOTE [one call per step]). Call the model once on the inputs joined "
    "along the batch, or give it a budget that leaves room for every call of the step"
)


class CallsInFlight:
    """Follows whether the last training call's backward has begun (NOTE [one call per step])."""

    def __init__(self) -> None:
        self._last: list[weakref.ref[torch.Tensor]] = []
        self._warned = False

    def called(self, out: Any) -> Any:
        """`out` is a training call's output: warns if the last call's is still waiting; returns `out`."""
        if not self._warned and any(ref() is not None for ref in self._last):
            self._warned = True
            warnings.warn(TWO_CALLS_IN_FLIGHT, UserWarning, stacklevel=4)
        # (made by the call: a leaf it returns, a parameter, would keep a hook of every call)
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        self._last = [weakref.ref(t) for t in tensors]
        last = self._last

        def reached(grad: torch.Tensor) -> None:
            last.clear()  # (the list of this call, which a later call has replaced)

        for tensor in tensors:
            tensor.register_hook(reached)
        return out
