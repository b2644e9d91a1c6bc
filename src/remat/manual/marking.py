"""Module marking: the PyTorch form of MindSpore's ``Cell.recompute()`` / ``Primitive.recompute()``.

A marked module keeps its parameters, buffers, ``state_dict`` keys and hooks; only the
way its ``forward`` runs changes: every call goes through :func:`remat.recompute`, so
everything the module computes internally (its operations and submodules) is recomputed
in backward, and only its output is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.errors import NotCallableBlock, RematError
from remat.manual.offload import offload
from remat.manual.recompute import recompute

__all__ = ["apply", "is_marked", "is_traced_stage", "mark", "traced_stage", "unmark", "untraced_stage"]

_RECOMPUTE_OPTIONS = {
    "use_reentrant",
    "preserve_rng_state",
    "output_recompute",
    "determinism_check",
    "early_stop",
    "context_fn",
    "debug",
    "policy",
    "comm",
}

Where = Callable[[str, nn.Module], bool] | type | tuple[type, ...]


class _InstanceForward:
    """A module's instance-level forward (one accelerate installs), with the module it belongs to."""

    def __init__(self, forward: Any, module: nn.Module) -> None:
        self.forward = forward
        self.block_modules = (module,)
        self.__qualname__ = getattr(forward, "__qualname__", None) or f"{type(module).__name__}.forward"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class _RecomputedForward:
    """Stands in an instance's ``forward``; picklable and deep-copyable with the module."""

    def __init__(self, module: nn.Module, options: dict[str, Any], original: Any = None) -> None:
        self.module = module
        self.options = dict(options)
        self.original = original  # an instance-level forward the module had before, if any
        # the class's forward bound here, not in each call: Dynamo (torch 2.11) cannot trace `__get__`
        self.bound = type(module).forward.__get__(module)
        # an instance-level forward, with its module (NOTE [parameters swapped in for a call])
        self.instance = None if original is None else _InstanceForward(original, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.instance if self.instance is not None else self.bound
        if self.options.get("offload"):
            return offload(forward, *args, **kwargs)
        return recompute(forward, *args, **self.options, **kwargs)

    def __reduce__(self) -> Any:
        return (_RecomputedForward, (self.module, self.options, self.original))

    def __repr__(self) -> str:
        return f"<recomputed forward of {type(self.module).__name__} {self.options}>"


def mark(
    module: nn.Module, *, output_recompute: bool = False, offload: bool = False, **recompute_options: Any
) -> nn.Module:
    """Marks `module` so that every call of it is recomputed in backward (or offloaded).

    Args:
        module: a block (``nn.Sequential``, a transformer layer, ...) or a single-operation
            module (``nn.ReLU``, ``nn.GELU``, ``nn.Linear``).
        output_recompute: do not keep the module's output either (see :func:`remat.recompute`).
        **recompute_options: ``policy``, ``use_reentrant``, ``preserve_rng_state``,
            ``determinism_check``, ``early_stop``, ``context_fn``, ``debug`` and ``comm`` (a
            recomputed block's collectives), as for :func:`remat.recompute`. With a policy, only
            the operations it does not keep are recomputed (``policy=remat.policies.recompute_ops("gelu")`` on a block
            recomputes its activations and keeps the rest).
        offload: instead of recomputing, keep what the module saves for backward in host
            memory until the backward needs it (:func:`remat.offload`); takes no other option.

    Returns:
        The same module, marked (marking again replaces the options).

    Raises:
        NotCallableBlock: `module` is not an ``nn.Module``.
        RematError: an unknown option.
    """
    if not isinstance(module, nn.Module):
        raise NotCallableBlock(
            f"mark() takes an nn.Module, got {type(module).__name__}; to recompute a function, "
            "call remat.recompute(function, *args)"
        )
    unknown = set(recompute_options) - _RECOMPUTE_OPTIONS
    if unknown:
        raise RematError(f"unknown option(s) {sorted(unknown)} for mark(); accepted: {sorted(_RECOMPUTE_OPTIONS)}")
    if offload:
        if recompute_options or output_recompute:
            raise RematError(
                f"mark(offload=True) recomputes nothing, so it takes no recompute option; got "
                f"{sorted(recompute_options) + (['output_recompute'] if output_recompute else [])}"
            )
        options: dict[str, Any] = {"offload": True}
    else:
        options = dict(recompute_options, output_recompute=output_recompute)
    current = module.__dict__.get("forward")
    original = current.original if isinstance(current, _RecomputedForward) else current
    module.__dict__["forward"] = _RecomputedForward(module, options, original)
    return module


def unmark(module: nn.Module) -> nn.Module:
    """Undoes :func:`mark`; does nothing to a module that is not marked."""
    _take_off(module, _RecomputedForward)
    return module


def _take_off(module: nn.Module, kind: type) -> None:
    """Puts back the forward a stand-in of `kind` stands over (nothing to do without one)."""
    current = module.__dict__.get("forward")
    if isinstance(current, kind):
        original = getattr(current, "original", None)  # what the stand-in was put over
        if original is not None:
            module.__dict__["forward"] = original
        else:
            del module.__dict__["forward"]


def is_marked(module: nn.Module) -> bool:
    """Whether :func:`mark` applies to `module`."""
    return isinstance(module.__dict__.get("forward"), _RecomputedForward)


def apply(model: nn.Module, where: Where, **options: Any) -> nn.Module:
    """Marks every submodule of `model` (the model itself included) selected by `where`.

    Args:
        model: the model to walk.
        where: ``where(name, module) -> bool``, or a module class, or a tuple of classes.
        **options: options for :func:`mark`.

    Returns:
        `model`, with the selected submodules marked.

    Example::

        remat.apply(model, nn.TransformerEncoderLayer)
        remat.apply(model, lambda name, m: name.startswith("layers."))
    """
    if isinstance(where, type) or (isinstance(where, tuple) and all(isinstance(c, type) for c in where)):
        classes: Any = where
        selected = [m for _, m in model.named_modules() if isinstance(m, classes)]
    elif callable(where):
        selected = [m for name, m in model.named_modules() if where(name, m)]
    else:
        raise RematError(
            f"apply() needs where=a function (name, module) -> bool, a module class or a tuple of "
            f"classes; got {type(where).__name__}"
        )
    for module in selected:
        mark(module, **options)
    return model


class _TracedStage:
    """Stands in a stage's ``forward``: traced while the plan being traced (``calls.tracing``)
    recomputes the stage (its ``name`` is among the plan's ``names``), the stage runs through
    :func:`recompute`; otherwise, and always eagerly, it is itself."""

    def __init__(self, module: nn.Module, original: Any, calls: Any, name: str) -> None:
        self.module = module
        self.original = original  # an instance-level forward the module had before, if any
        self.calls, self.name = calls, name
        self.bound = type(module).forward.__get__(module)  # (Dynamo cannot trace `__get__`)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original if self.original is not None else self.bound
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            tracing = self.calls.tracing
            if tracing is not None and self.name in tracing.names:
                return recompute(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    def __reduce__(self) -> Any:
        # a copy (deepcopy, torch.save) has no plan: the plans are its controller's, made anew
        return (_TracedStage, (self.module, self.original, _NO_PLAN, self.name))

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__}, recomputed where a compiled plan says>"


class _NoPlan:
    """What the stand-ins of a copied model read: no plan is being traced."""

    tracing = None


_NO_PLAN = _NoPlan()


def traced_stage(module: nn.Module, calls: Any, name: str) -> _TracedStage:
    """The stand-in forward of stage `name`, which plans for compiled calls may recompute
    (NOTE [a plan in the compiled graph] in remat.traced; `calls` holds the plan being traced),
    over the module's own (instance) forward if any, in place of a stand-in a copy carries."""
    untraced_stage(module)
    return _TracedStage(module, module.__dict__.get("forward"), calls, name)


def untraced_stage(module: nn.Module) -> None:
    """Takes :func:`traced_stage`'s stand-in off `module` (nothing to do without one)."""
    _take_off(module, _TracedStage)


def is_traced_stage(module: nn.Module) -> bool:
    """Whether `module` has the stand-in forward of a plan for compiled calls."""
    return isinstance(module.__dict__.get("forward"), _TracedStage)
