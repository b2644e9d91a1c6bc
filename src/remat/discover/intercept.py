"""Stage interception: the one place that routes a stage module's calls elsewhere.

While a chain runs under remat (measured, or executing a schedule), every call of a stage
module in the model's own, unmodified forward goes to an *owner*:
``owner.call(index, module, args, kwargs)``. The owner decides how the stage runs and
calls :func:`call_original` to run the module itself. Nothing else in remat patches a
module's ``forward`` but marking (:mod:`remat.manual.marking`) and the plan for compiled
calls (:mod:`remat.traced`), whose stand-in is the stage itself when run eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat.discover.chain import Chain
from remat.errors import UnsupportedModel
from remat.manual.marking import is_traced_stage

__all__ = [
    "call_original",
    "call_stage",
    "compiled_call",
    "compiled_stages",
    "intercept_stages",
    "out_of_order",
    "refuse_compiled_state",
    "uncompiled",
]


# NOTE [stage hooks run once]
# A stage module is intercepted at its call (an instance-level ``_call_impl``, which
# ``nn.Module.__call__`` dispatches to), before any hook runs: the model's own call of
# the stage goes straight to the owner, and call_original makes the one real call, with
# the module's hooks and the global module hooks. Every hook thus runs once per call,
# inside the owner's measurement window or recompute region, exactly as it runs when a
# region is replayed (a plain module call): a hook that replaces the output is applied
# once, and the next stage is linked to the output as the hooks left it.
_INTERCEPT = "_call_impl"
# A module compiled with ``module.compile()`` is called through its compiled call instead:
# set aside while the module is intercepted, it makes the real call.
_COMPILED = "_compiled_call_impl"


def out_of_order(chain: Chain, index: int, expected: int, while_doing: str = "") -> UnsupportedModel:
    """The error for stage `index` called when stage `expected` was: the forward varies
    (it skipped stages), or the model runs its own modules again in its backward (its own
    checkpointing)."""
    called = f"stage {index} ({chain.names[index]!r}) was called when stage {expected} was expected{while_doing}"
    if torch._C._current_graph_task_id() != -1:
        return UnsupportedModel(
            f"{called}, during the backward: the model runs its own modules again in its backward "
            "(its own activation checkpointing: Hugging Face's gradient_checkpointing_enable(), "
            "torch.utils.checkpoint, or reversible layers). Turn that off (for Hugging Face, "
            "model.gradient_checkpointing_disable()) and let remat do the recomputing"
        )
    if index > expected:
        return _skipped(chain, expected, index, called, " before it")
    return UnsupportedModel(
        f"{called}; remat needs the chain's stages to run once each, in order, in every forward "
        "(use remat.mark for models whose forward varies)"
    )


def missing_stages(chain: Chain, ran: int, while_doing: str = "") -> UnsupportedModel:
    """The error for a forward that ended after calling the chain's first `ran` stages."""
    what = f"the forward ran {ran} of the chain's {len(chain)} stages{while_doing}"
    return _skipped(chain, ran, len(chain), what, "")


# NOTE [skipped stages]
# A model that skips layers at random while training (stochastic depth: Hugging Face's
# layerdrop, on by default in wav2vec2 and HuBERT) calls a different chain of stages at
# each step. A plan is made for one chain, and its recomputed regions replay the stages
# they hold: the skip is refused with what to do, never run under a plan made for
# another chain.
def _skipped(chain: Chain, first: int, stop: int, what: str, when: str) -> UnsupportedModel:
    names = ", ".join(repr(name) for name in chain.names[first : min(stop, first + 3)])
    more = f" and {stop - first - 3} more" if stop - first > 3 else ""
    return UnsupportedModel(
        f"{what}: {names}{more} did not run{when}. The model skips stages in this forward "
        "(layers dropped at random, as Hugging Face's layerdrop does in training, or a forward "
        "that changes with its input or its state), and remat's automatic mode plans a forward "
        "that runs every stage once, in order. Turn the skipping off while training with remat "
        "(Hugging Face: build the model with layerdrop=0.0, or encoder_layerdrop=0.0 and "
        "decoder_layerdrop=0.0), or mark the blocks to recompute with remat.mark, which a "
        "skipped block does not disturb"
    )


def call_original(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module as itself (hooks included, compiled if it was) while it is intercepted."""
    stand_in = module.__dict__.pop(_INTERCEPT)
    # Not while a dispatch mode is active (measuring: the tracker, fake tensors): Dynamo
    # would mark the compiled call's code to be skipped from then on, in every step.
    compiled = None if _get_current_dispatch_mode_stack() else stand_in.compiled
    if compiled is not None:
        module.__dict__[_COMPILED] = compiled
    try:
        return module(*args, **kwargs)
    finally:
        module.__dict__[_INTERCEPT] = stand_in
        if compiled is not None:
            module.__dict__[_COMPILED] = None


def call_stage(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls a stage module as itself, whether or not it is intercepted right now."""
    if isinstance(module.__dict__.get(_INTERCEPT), _CallThroughOwner):
        return call_original(module, args, kwargs)
    return module(*args, **kwargs)


@contextlib.contextmanager
def intercept_stages(chain: Chain, owner: Any) -> Iterator[None]:
    """Routes every call of the chain's stage modules to ``owner.call(index, module, args, kwargs)``.

    The stage's hooks run once, within the owner's :func:`call_original` (see NOTE [stage
    hooks run once]); the interceptions are instance attributes removed on exit, whatever
    happens.
    """
    installed: list[nn.Module] = []
    try:
        for index, module in enumerate(chain.modules):
            if "forward" in module.__dict__ and not is_traced_stage(module):  # (eagerly, those are the stage)
                raise UnsupportedModel(
                    f"stage {chain.names[index]!r} has its forward replaced on the instance (is it "
                    "marked with remat.mark?); unmark it before using remat.Checkpointable"
                )
            stand_in = _CallThroughOwner(owner, index, module)
            module.__dict__[_INTERCEPT] = stand_in
            installed.append(module)
            if stand_in.compiled is not None:
                module.__dict__[_COMPILED] = None
        yield
    finally:
        for module in installed:
            stand_in = module.__dict__.pop(_INTERCEPT, None)
            if stand_in is not None and stand_in.compiled is not None:
                module.__dict__[_COMPILED] = stand_in.compiled


class _CallThroughOwner:
    """Stands in a stage module's call while remat runs the chain."""

    def __init__(self, owner: Any, index: int, module: nn.Module) -> None:
        self.owner = owner
        self.index = index
        self.module = module
        self.compiled = compiled_call(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.call(self.index, self.module, args, kwargs)


def compiled_call(module: nn.Module) -> Any:
    """The call ``module.compile()`` gave the module, if any (None otherwise)."""
    return module.__dict__.get(_COMPILED)


@contextlib.contextmanager
def uncompiled(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within this block, those of `modules` compiled with ``module.compile()`` run uncompiled."""
    compiled = [(module, call) for module in modules if (call := compiled_call(module)) is not None]
    for module, _ in compiled:
        module.__dict__[_COMPILED] = None
    try:
        yield
    finally:
        for module, call in compiled:
            module.__dict__[_COMPILED] = call


def compiled_stages(chain: Chain) -> list[int]:
    """The stages compiled with ``module.compile()``."""
    return [index for index, module in enumerate(chain.modules) if compiled_call(module) is not None]


def refuse_compiled_state(chain: Chain, recomputed: list[int]) -> None:
    """Raises if one of the compiled stages `recomputed` holds running statistics.

    Compiled code (``module.compile()``) is opaque to remat's guard of module state: a
    normalisation layer inside would update its running statistics in the forward and
    again in the recompute.
    """
    for index in recomputed:
        module = chain.modules[index]
        stateful = [
            name
            for name, inner in module.named_modules()
            if isinstance(inner, nn.modules.batchnorm._NormBase) and inner.training and inner.track_running_stats
        ]
        if stateful:
            raise NotImplementedError(
                f"stage {chain.names[index]!r} is compiled (module.compile()) and the plan recomputes it, "
                f"but it holds running statistics ({', '.join(stateful)}) that its compiled forward updates: "
                "remat cannot replay state inside compiled code, and they would be updated twice. Compile the "
                "whole model with torch.compile and mark its blocks with remat.mark (the compiler updates them "
                "once), or leave this block uncompiled"
            )
