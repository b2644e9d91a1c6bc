"""The key a plan is cached under: everything about a step that changes its costs."""

from __future__ import annotations

import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter
from torch.utils._pytree import MappingKey, SequenceKey, keystr, tree_flatten, tree_flatten_with_path

from remat.budget import Budget

__all__ = ["MAX_SETUPS", "PlanOptions", "Setups", "forget", "shape_family", "signature", "what_changed"]


class PlanOptions(NamedTuple):
    """Everything a plan depends on besides the measurement (the key of the plan cache)."""

    mem_limit: Budget
    mem_limit_form: str  # 1 (one byte) and 1.0 (all of it) are equal values, but not equal budgets
    solver_name: str
    slots: int | None
    margin: float | None
    output_kept: bool


# NOTE [what a plan depends on]
# A plan is made for the costs of one step. They change with the inputs (structure,
# shapes, dtypes, devices, which require grad), with the model (which parameters require
# grad and so keep activations for their gradients; their dtypes, devices and shapes, after
# model.half(), .to() or resize_token_embeddings(), a lazy module's before its first call
# having none; which modules are in training mode), with autocast (on which device, to
# which dtype, with its cache) and with the kernels allowed (attention kernels,
# deterministic algorithms). Each of these is part of the key a plan is cached under: a
# change gives a new measurement and plan, never a stale one. A stage module replaced by
# another (a new head) is no part of the key (the ranks of a distributed run compare their
# keys, and a module's id is its process's): the chain found for a key is checked at each
# call to still be the model's (Chain.still_in), and what was measured and planned for the
# key is forgotten otherwise.
_KEY_PARTS = (
    "the input structure",
    "the parameters (requires_grad, dtype, device or shape)",
    "the modules' training modes",
    "autocast",
    "the autocast cache",
    "the attention kernels allowed",
    "deterministic algorithms",
)


def what_changed(previous: Hashable | None, key: Hashable) -> str:
    """Names what differs between two plan keys (see :func:`signature`), for the log."""
    if not isinstance(previous, tuple) or not isinstance(key, tuple):
        return "the first input"
    changed = [name for name, a, b in zip(_KEY_PARTS, previous, key, strict=False) if a != b]
    if _numbers_changed(previous, key):
        changed.append("a Python number argument")
    elif previous[len(_KEY_PARTS) :] != key[len(_KEY_PARTS) :]:
        changed.append("the input shapes, dtypes or devices")
    return "a change in " + ", ".join(changed) if changed else "the same input again"


def signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    leaves, spec = tree_flatten((args, kwargs))
    modules, parameters = _modules_and_parameters(model)
    parts: list[Any] = [
        str(spec),
        tuple(
            (p.requires_grad, p.dtype, p.device, p.shape if p.__class__ is not UninitializedParameter else None)
            for p in parameters
        ),
        tuple(m.training for m in modules),
        tuple(
            (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
            for device in ("cpu", "cuda")
        ),
        torch.is_autocast_cache_enabled(),
        # scaled_dot_product_attention's kernels differ in what they keep (the math one
        # keeps the whole attention matrix), and deterministic kernels can allocate more
        _attention_kernels(),
        torch.are_deterministic_algorithms_enabled(),
    ]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            # (a non-contiguous one's strides too: a transposed input of the same shape makes a reshape copy it)
            layout = None if leaf.is_contiguous() else leaf.stride()
            parts.append((tuple(leaf.shape), layout, leaf.dtype, str(leaf.device), leaf.requires_grad))
        elif _is_number(leaf):
            parts.append((_NUMBER, repr(leaf)))  # a value: its family leaves it out (shape_family)
        else:
            parts.append(repr(leaf))
    return tuple(parts)


def forget(key: Hashable, *caches: dict[Any, Any]) -> None:
    """Drops what `caches` hold for `key`: entries under it, or under a tuple that starts with it."""
    for cache in caches:
        for entry in [k for k in cache if k == key or (isinstance(k, tuple) and len(k) == 2 and k[0] == key)]:
            del cache[entry]


def _modules_and_parameters(model: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """``list(model.modules())`` and ``list(model.parameters())``, in their order, in one walk.

    The key is computed at every call of the model: nn.Module's own generators walk the
    tree once for each and build every name on the way, which on a model of a hundred
    small blocks cost more than the rest of a call that recomputes nothing.
    """
    modules: list[nn.Module] = []
    parameters: list[nn.Parameter] = []
    seen_modules: set[nn.Module] = set()
    seen_parameters: set[int] = set()  # ids: a tensor's own hash is a Python call

    def visit(module: nn.Module) -> None:  # as deep as nn.Module.modules() goes
        seen_modules.add(module)
        modules.append(module)
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen_parameters:
                seen_parameters.add(id(parameter))
                parameters.append(parameter)
        for child in module._modules.values():
            if child is not None and child not in seen_modules:
                visit(child)

    visit(model)
    return modules, parameters


def _attention_kernels() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
    )


def shape_family(key: Hashable) -> Hashable:
    """The key with the input tensors' sizes left out (their number of dimensions kept).

    Two steps of one family differ only in their inputs' sizes (a batch, a sequence
    length) and in the values of their Python numbers (a temperature, a count): one can
    be planned from the other's times, scaled (:mod:`remat.measure.scale`; a number that
    changes the stages themselves gives another chain, which is timed).
    """
    if not isinstance(key, tuple):
        return key
    head, leaves = key[: len(_KEY_PARTS)], key[len(_KEY_PARTS) :]
    return head + tuple(
        (len(leaf[0]), _stride_order(leaf[1]), *leaf[2:])
        if isinstance(leaf, tuple) and leaf and isinstance(leaf[0], tuple)
        else (_NUMBER,)
        if _is_number_part(leaf)
        else leaf
        for leaf in leaves
    )


def _stride_order(layout: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """A non-contiguous layout as the order of its strides, whatever the sizes (None: contiguous)."""
    return None if layout is None else tuple(sorted(range(len(layout)), key=lambda dim: -layout[dim]))


_NUMBER = "a Python number"


def _is_number(leaf: Any) -> bool:
    return isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)


def _is_number_part(part: Any) -> bool:
    return isinstance(part, tuple) and len(part) == 2 and part[0] == _NUMBER


def _numbers_changed(previous: tuple[Any, ...], key: tuple[Any, ...]) -> list[int]:
    """The leaf positions whose Python numbers differ between two keys alike in all else ([] otherwise)."""
    if len(previous) != len(key) or previous[: len(_KEY_PARTS)] != key[: len(_KEY_PARTS)]:
        return []  # (the head holds the input structure: the leaves line up)
    changed = []
    for position, (a, b) in enumerate(zip(previous[len(_KEY_PARTS) :], key[len(_KEY_PARTS) :], strict=True)):
        if a != b:
            if not (_is_number_part(a) and _is_number_part(b)):
                return []
            changed.append(position)
    return changed


#: The most setups (plan keys) an automatic-mode model keeps measurements and plans for;
#: the least recently used beyond it are forgotten, and measured again if they come back.
MAX_SETUPS = 256
#: A Python number argument that takes this many values, each measured, is said once.
NUMBER_VALUES_SAID = 3


class Setups:
    """The setups an automatic-mode model was called at, the most recently used last.

    NOTE [setups kept]
    Each setup holds its chain, measurement, plans and executors. A model called at ever
    new setups (a Python number that changes at each step is one: a temperature, a step
    count) would hold them without end: at most `limit` are kept, the least recently used
    forgotten (measured again if they come back). A number taking new values is said once,
    at its third, with the argument named: pass it as a tensor, whose value is no part of
    the setup. Its new values are planned from the timed values' times, scaled
    (:func:`shape_family`), not timed again.

    Args:
        limit: the most setups kept (None: ``MAX_SETUPS``).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_SETUPS if limit is None else limit
        self._recent: OrderedDict[Hashable, None] = OrderedDict()
        self._values: dict[tuple[Hashable, int], set[str]] | None = {}  # None once said

    def entered(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Hashable]:
        """Notes a call at `key` (`args`, `kwargs`: its inputs); returns the setups to forget."""
        if key in self._recent:
            self._recent.move_to_end(key)
            return []
        if self._values is not None and isinstance(key, tuple):
            self._note_numbers(key, args, kwargs)
        self._recent[key] = None
        forgotten = []
        while len(self._recent) > self.limit:
            forgotten.append(self._recent.popitem(last=False)[0])
        return forgotten

    def _note_numbers(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._values is not None
        for alike in reversed(self._recent):
            if isinstance(alike, tuple) and (positions := _numbers_changed(alike, key)):
                break
        else:
            return
        for position in positions:
            values = self._values.setdefault((_without_numbers(key), position), {alike[len(_KEY_PARTS) + position][1]})
            values.add(key[len(_KEY_PARTS) + position][1])
            if len(values) >= NUMBER_VALUES_SAID:
                self._values = None
                _warn_at_caller(_numbers_message(args, kwargs, position, len(values), self.limit))
                return


def _without_numbers(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((_NUMBER,) if _is_number_part(part) else part for part in key)


def _numbers_message(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, count: int, limit: int) -> str:
    path, value = tree_flatten_with_path((args, kwargs))[0][position]
    where, *rest = path[1:]
    if isinstance(path[0], SequenceKey) and path[0].idx == 1 and isinstance(where, MappingKey):
        name = f"the argument {where.key}{keystr(tuple(rest))}"
    else:
        name = f"the positional argument {where.idx if isinstance(where, SequenceKey) else where}{keystr(tuple(rest))}"
    return (
        f"remat measured and planned the model again for each new value of {name}, a Python number "
        f"({count} values so far, now {value!r}): a number is part of a plan's setup, as it can change "
        "what the model runs. Pass it as a tensor (torch.tensor(value)), whose value is not, or keep it "
        f"out of the model's call; remat keeps the {limit} setups used last (NOTE [setups kept])"
    )


_LIBRARIES = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def _warn_at_caller(message: str) -> None:
    """Warns at the first frame outside remat and torch: the user's call of the model."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)
