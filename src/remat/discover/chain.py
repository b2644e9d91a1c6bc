"""Finding the chain of stages in a model, and how each stage's input is built.

A *stage* is one call of a submodule in the model's forward. For an ``nn.Sequential``
the stages are its leaves (nested ``Sequential`` containers are flattened). For any
other model remat watches one forward and looks for the longest run of submodule calls
made one after another by the same ``forward``, each taking the previous one's output
(the blocks of a ``ModuleList`` loop, the layers of a torchvision-style ResNet); side
inputs such as attention masks are kept as they are. What runs before the chain (the
*prefix*: embeddings, a stem) and after it (the *suffix*: a head, the loss) runs
normally and is accounted for as fixed memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.errors import RecomputeInputModified, UnsupportedModel
from remat.manual._state import in_manual_block
from remat.manual._tensors import detached_alias
from remat.manual.marking import is_marked

__all__ = ["Chain", "InputLink", "StageLinks", "discover_chain", "sequential_chain"]


@dataclass
class Chain:
    """The stages of a model, in call order.

    Attributes:
        names: qualified name of each stage module.
        modules: the stage modules.
        whole_model: True when the stages are all the model does (an ``nn.Sequential``):
            there is no prefix or suffix.
    """

    names: list[str]
    modules: list[nn.Module]
    whole_model: bool = True

    def __len__(self) -> int:
        return len(self.modules)


def _flatten_sequential(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    # A marked Sequential is not flattened: its children run inside its own recompute.
    # It stays one entry, which Checkpointable then refuses as a stage (unmark it, and
    # the planner decides what to recompute).
    if isinstance(module, nn.Sequential) and len(module) > 0 and not is_marked(module):
        out: list[tuple[str, nn.Module]] = []
        for name, child in module._modules.items():  # not named_children(): it hides repeats
            out.extend(_flatten_sequential(f"{prefix}.{name}" if prefix else name, child))
        return out
    return [(prefix or type(module).__name__, module)]


def sequential_chain(model: nn.Sequential) -> Chain:
    """The stages of an ``nn.Sequential``: its leaves, nested Sequentials flattened."""
    pairs = _flatten_sequential("", model)
    seen: set[int] = set()
    for name, module in pairs:
        if id(module) in seen:
            raise UnsupportedModel(
                f"the module {name!r} appears twice in the Sequential; remat needs each stage to be "
                "a distinct module (copy it, or recompute it with remat.mark)"
            )
        seen.add(id(module))
    return Chain([n for n, _ in pairs], [m for _, m in pairs], whole_model=True)


# ----------------------------------------------------------------------- discovery
@dataclass
class _Call:
    module: nn.Module
    name: str
    parent: int | None  # index of the enclosing call, None for the model itself
    inputs: list[int] = field(default_factory=list)  # ids of input tensors
    outputs: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    linked: bool = False  # takes (identically) a tensor output of the previous sibling call
    eligible: bool = True  # may be a stage: not a marked module (remat.mark recomputes it already)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def discover_chain(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Chain:
    """Watches one forward of `model` (without grad) and returns its longest chain.

    Raises:
        UnsupportedModel: no run of at least two linked submodule calls was found.
    """
    if isinstance(model, nn.Sequential):
        return sequential_chain(model)
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[_Call] = []
    stack: list[int] = []
    call_counts: dict[int, int] = {}
    last_child: dict[int | None, int] = {}

    # NOTE [stages of a model that recomputes by itself]
    # Modules called inside a block of remat.recompute or of a marked module are not
    # stages: that block's recompute calls them again, in backward, outside the chain's
    # order. The marked module itself is not one either (it recomputes already); the
    # chain is found among the other calls, and such blocks ride inside its stages.
    def pre_hook(module: nn.Module, hook_args: Any, hook_kwargs: Any) -> None:
        if id(module) not in names or in_manual_block():
            return
        parent = stack[-1] if stack else None
        call = _Call(module, names[id(module)], parent, eligible=not is_marked(module))
        call.inputs = [id(t) for t in _tensor_leaves((hook_args, hook_kwargs))]
        previous = last_child.get(parent)
        # Decided now, while the previous call's outputs are certainly alive.
        call.linked = previous is not None and _takes_output_of(call, calls[previous])
        last_child[parent] = len(calls)
        calls.append(call)
        stack.append(len(calls) - 1)
        call_counts[id(module)] = call_counts.get(id(module), 0) + 1

    def post_hook(module: nn.Module, hook_args: Any, hook_kwargs: Any, output: Any) -> None:
        if id(module) not in names or not stack or in_manual_block():
            return
        index = stack.pop()
        calls[index].outputs = [weakref.ref(t) for t in _tensor_leaves(output)]

    handles = [
        nn.modules.module.register_module_forward_pre_hook(_with_kwargs_pre(pre_hook)),
        nn.modules.module.register_module_forward_hook(_with_kwargs_post(post_hook), always_call=True),
    ]
    keep_alive: list[Any] = []
    try:
        with torch.no_grad():
            keep_alive.append(model(*args, **kwargs))
    finally:
        for handle in handles:
            handle.remove()

    # Children of each call, in order; a link means the call takes a tensor that is
    # (identically) an output of the sibling called just before it.
    children: dict[int | None, list[int]] = {}
    for index, call in enumerate(calls):
        children.setdefault(call.parent, []).append(index)
    # Runs are compared by the stages they give, nested Sequentials expanded: the top-level
    # run of a ResNet (stem, layer1..4, pooling) beats the run of blocks inside layer1.
    best: list[int] = []
    best_stages = 0
    for siblings in children.values():
        run: list[int] = []
        run_stages = 0
        for index in siblings:
            call = calls[index]
            if call_counts.get(id(call.module), 0) != 1 or not call.eligible:
                run, run_stages = [], 0
                continue
            if not (run and call.linked):
                run, run_stages = [], 0
            run.append(index)
            run_stages += len(_flatten_sequential(call.name, call.module))
            if run_stages > best_stages:
                best, best_stages = list(run), run_stages
    stages = _expand_sequentials([(calls[i].name, calls[i].module) for i in best])
    if len(stages) < 2:
        raise UnsupportedModel(
            f"remat found no chain in {type(model).__name__}: no two submodules are called one "
            "after another, each taking the previous one's output, exactly once per forward. "
            "Wrap the model's repeated blocks in an nn.Sequential or nn.ModuleList called in a "
            "loop, or mark blocks to recompute by hand with remat.mark / remat.apply"
        )
    del keep_alive
    return Chain([n for n, _ in stages], [m for _, m in stages], whole_model=False)


def _takes_output_of(call: _Call, previous: _Call) -> bool:
    outputs = {id(t) for ref in previous.outputs if (t := ref()) is not None}
    return any(i in outputs for i in call.inputs)


def _expand_sequentials(pairs: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, module in pairs:
        out.extend(_flatten_sequential(name, module))
    return out


def _with_kwargs_pre(hook: Any) -> Any:
    def wrapper(module: nn.Module, args: Any) -> None:
        hook(module, args, {})

    return wrapper


def _with_kwargs_post(hook: Any) -> Any:
    def wrapper(module: nn.Module, args: Any, output: Any) -> None:
        hook(module, args, {}, output)

    return wrapper


# ----------------------------------------------------------------------- input links
class InputLink:
    """How to rebuild a stage's inputs from the previous stage's output.

    Each tensor of the stage's (args, kwargs) that *is* a tensor output of the previous
    stage is remembered by its position in that output; every other value (a mask, a
    position table, a flag) is kept as it is, and so is a linked tensor that the model's
    own code changed in place between the two stages (given `previous_versions`, the
    versions of the previous output's tensors when it was returned).
    """

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        previous_output: Any,
        previous_versions: list[int] | None = None,
    ) -> None:
        flat, self._spec = tree_flatten((args, kwargs))
        previous = _tensor_leaves(previous_output) if previous_output is not None else []
        positions = {id(t): i for i, t in enumerate(previous)}
        self._sources: list[tuple[str, Any]] = []
        #: the linked tensors changed in place since the previous stage returned them:
        #: they are kept as they are (a replay of that stage would give the old values)
        self.changed_in_place: list[torch.Tensor] = []
        for value in flat:
            linked = isinstance(value, torch.Tensor) and id(value) in positions
            if linked and previous_versions is not None and value._version != previous_versions[positions[id(value)]]:
                self.changed_in_place.append(value)
                linked = False
            if linked:
                self._sources.append(("link", positions[id(value)]))
            elif isinstance(value, torch.Tensor):
                self._sources.append(("tensor", (value.detach(), value.requires_grad, value._version)))
            else:
                self._sources.append(("value", value))

    def build(self, previous_output: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The stage's (args, kwargs), with linked tensors taken from `previous_output`.

        Raises:
            RecomputeInputModified: a kept tensor was changed in place since the stage took it.
        """
        previous = _tensor_leaves(previous_output) if previous_output is not None else []
        flat: list[Any] = []
        for position, (kind, value) in enumerate(self._sources):
            if kind == "link":
                flat.append(previous[value])
            elif kind == "tensor":
                tensor, requires_grad, version = value
                if tensor._version != version:
                    raise RecomputeInputModified(
                        f"input {position} of a recomputed stage (shape {tuple(tensor.shape)}) was changed in "
                        "place after the stage took it; its recompute would see other values. Make the change "
                        "out of place"
                    )
                flat.append(detached_alias(tensor, requires_grad))
            else:
                flat.append(value)
        args, kwargs = tree_unflatten(flat, self._spec)
        return args, kwargs


class StageLinks:
    """Follows a forward's stage calls: how each stage's inputs come from the stage before.

    Remembers the previous stage's output and the versions of its tensors when it was
    returned, so that :meth:`link` notices a tensor the model's own code changed in place
    between the two stages.
    """

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
        self._output: Any = None
        self._versions: list[int] = []

    def link(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InputLink:
        """How the inputs of the stage being called come from the previous stage's output."""
        return InputLink(args, kwargs, self._output, self._versions)

    def returned(self, index: int, output: Any) -> None:
        """Notes the output of stage `index` (the chain's output is not followed)."""
        self._output = output if index + 1 < self.n_stages else None
        self._versions = [t._version for t in _tensor_leaves(self._output)]
