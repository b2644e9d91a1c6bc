"""The automatic mode on a model in place: ``remat.enable(model, budget)``.

The model stays what it was: its type, attributes and methods, its parameters (the same
objects, so an optimizer built before or after keeps working), its ``state_dict`` keys and
its hooks. Only its call changes: ``model(x)`` in training runs the step a
:class:`~remat.Checkpointable` would run, measured, planned and executed within the
budget; in eval mode or without grad it is the model's own call.

How: the model's instance gets its own ``_call_impl`` (what ``nn.Module.__call__``
dispatches to, the one hook point remat uses for stages too, see
:mod:`remat.discover.intercept`). It holds a :class:`~remat.Checkpointable` over the model,
which is not a submodule of it: nothing is added to ``modules()``, ``parameters()`` or the
``state_dict``. While the controller runs (a training call, or its ``measure``), the
instance's ``_call_impl`` is put aside, so the model's own calls (hooks included) run as
they do in a plain call. ``remat.disable(model)``
removes it. ``copy.deepcopy`` gives a copy enabled with the same options (plans are made
again for it), and ``torch.save``/``torch.load`` of the whole model keep it enabled (the
options are saved, not the plans).

NOTE [compiled in place]
``model.compile()`` compiles the module's call as it is then, and ``nn.Module.__call__``
runs that compiled call before anything else. After enabling, that is the stand-in: the
model trains as ``torch.compile`` of an enabled model does (NOTE [a plan in the compiled
graph]), and while the controller runs the model's own call, the compiled one is put aside
with the stand-in (:func:`~remat.wrapper.model_own_call`), or the model's call would run the
stand-in again, without end. Before enabling, the compiled call is the model's own, which
would never reach remat: ``enable`` refuses such a model, saying to compile after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.automatic import Checkpointable
from remat.budget import Budget
from remat.errors import RematError
from remat.traced import remove_traced_plans
from remat.wrapper import CALL_SLOT as _SLOT
from remat.wrapper import COMPILED_SLOT

__all__ = ["controller", "disable", "enable", "is_enabled"]


def enable(model: nn.Module, mem_limit: Budget = None, **options: Any) -> Checkpointable:
    """Trains `model` within `mem_limit` from its next call on, in place.

    Args:
        model: any ``nn.Module``; it keeps its type, attributes, parameters and
            ``state_dict`` keys.
        mem_limit: the budget, in any form :func:`remat.parse_budget` reads (``"4GiB"``,
            a fraction of the step without recompute such as ``0.5``, ``"min"``).
        **options: the keyword options of :class:`remat.Checkpointable` (``loss_fn``,
            ``solver``, ``measure``, ``plan``, ``policy``: with a budget, policies the planner may
            store stages under, ``comm``: what recomputed stages do with their collectives, ...).

    Returns:
        The controller: ``.plan``, ``.plan_for(budget)``, ``.check_step()``,
        ``.minimum_budget_bytes()`` and the rest of :class:`~remat.Checkpointable`'s
        interface. Calling the model is what trains; the controller need not be kept.

    Raises:
        RematError: `model` is enabled already (``remat.disable`` it first, or change the
            budget with ``remat.controller(model).mem_limit = ...``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.enable takes an nn.Module, got {type(model).__name__}")
    if is_enabled(model):
        raise RematError(
            f"{type(model).__name__} is enabled already; call remat.disable(model) first, or set "
            "remat.controller(model).mem_limit to change its budget"
        )
    if model.__dict__.get(COMPILED_SLOT) is not None:  # NOTE [compiled in place]
        raise RematError(
            f"{type(model).__name__} was compiled in place (model.compile()) before remat.enable: its compiled "
            "call runs the model's own, and would never reach remat. Enable it first and compile it after "
            "(remat.enable(model, budget); model.compile()), or compile its blocks one by one"
        )
    enabled = _EnabledCall(Checkpointable(model, mem_limit, **options), options)
    model.__dict__[_SLOT] = enabled
    return enabled.controller


def _compiled_from(model: nn.Module) -> nn.Module:
    """The model ``torch.compile(model)`` wraps, or `model` itself."""
    original = model.__dict__.get("_modules", {}).get("_orig_mod")
    return original if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and original is not None else model


def disable(model: nn.Module) -> None:
    """Undoes :func:`enable`: the model's call is its own again (nothing to do if not enabled)."""
    model = _compiled_from(model)
    if is_enabled(model):
        enabled = model.__dict__.pop(_SLOT)
        remove_traced_plans(enabled.controller)  # NOTE [a plan in the compiled graph]
        enabled.disabled = True  # (a compiled call made of it may outlive it: model.compile())


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` was applied to `model` (or to the model ``torch.compile`` wrapped)."""
    return isinstance(_compiled_from(model).__dict__.get(_SLOT), _EnabledCall)


def controller(model: nn.Module) -> Checkpointable:
    """The controller of an enabled model (its plan, budget and checks).

    Raises:
        RematError: the model is not enabled.
    """
    enabled = _compiled_from(model).__dict__.get(_SLOT)
    if not isinstance(enabled, _EnabledCall):
        raise RematError(f"{type(model).__name__} is not enabled; call remat.enable(model, budget) first")
    return enabled.controller


class _EnabledCall:
    """Stands in the model's ``_call_impl`` while it is enabled."""

    def __init__(self, controller: Checkpointable, options: dict[str, Any]) -> None:
        self.controller = controller
        self.options = options
        self.disabled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.disabled:
            # model.compile() after enable compiled this stand-in: after disable, its compiled
            # call (which torch keeps) runs the model's own call, compiled again
            model = self.controller.model
            return type(model)._call_impl(model, *args, **kwargs)
        return self.controller(*args, **kwargs)  # which puts this stand-in aside meanwhile

    # A copy of the model is enabled with the same options; its plans are made again.
    def __deepcopy__(self, memo: dict[int, Any]) -> _EnabledCall:
        import copy

        model = memo.get(id(self.controller.model))
        if model is None:
            raise RematError("an enabled model's call can only be copied with its model (copy.deepcopy(model))")
        options = copy.deepcopy(self.options, memo)
        return _EnabledCall(Checkpointable(model, self.controller.mem_limit, **options), options)

    def __reduce__(self) -> tuple[Any, ...]:
        return _restored, (self.controller.model, self.controller.mem_limit, self.options)


def _restored(model: nn.Module, mem_limit: Budget, options: dict[str, Any]) -> _EnabledCall:
    """An enabled call read back by pickle (the model's state is set after it)."""
    return _EnabledCall(Checkpointable(model, mem_limit, **options), options)
