"""A wrapper that stands for the model it wraps: its attributes and its state_dict keys."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ModelStandIn", "stand_for_model"]


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
