"""Finding the chain of stages in a model, and how each stage's input is built.

A *stage* is one call of a submodule in the model's forward. For an ``nn.Sequential``
the stages are its leaves (nested ``Sequential`` containers are flattened). For any
other model remat watches one forward and looks for the longest run of submodule calls
made one after another by the same ``forward``, each taking what the previous one
computed: its output, or a tensor the model's own code made from it (the blocks of a
``ModuleList`` loop, ``x = x + block(x)``, the layers of a torchvision-style ResNet);
side inputs such as attention masks are kept as they are. What runs before the chain (the
*prefix*: embeddings, a stem) and after it (the *suffix*: a head, the loss) runs
normally and is accounted for as fixed memory.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from remat._no_grad import forward_without_grad
from remat.errors import RematError, UnsupportedModel
from remat.manual._state import in_manual_block
from remat.manual.marking import is_marked

__all__ = ["Chain", "StageLinks", "discover_chain", "sequential_chain"]


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
    # each link from the model down to a stage (parent, name), and the module it leads to
    edges: tuple[list[tuple[nn.Module, str]], list[nn.Module]] | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.modules)

    def still_in(self, model: nn.Module) -> bool:
        """Whether every stage module is still where it was found in `model` (NOTE [what a plan depends on])."""
        if self.edges is None:  # each link from the model down to a stage, once: one lookup each per call
            edges: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
            for name, module in zip(self.names, self.modules, strict=True):
                parent = model
                for part in name.split(".") if name else ():
                    child = parent._modules.get(part)
                    if child is None:
                        return False
                    edges[(id(parent), part)] = (parent, part, child)
                    parent = child
                if parent is not module:
                    return False
            self.edges = ([(parent, part) for parent, part, _ in edges.values()], [c for _, _, c in edges.values()])
        links, children = self.edges
        return [parent._modules.get(part) for parent, part in links] == children  # (modules compare as themselves)

    def refuse_plan_of(self, stage_calls: int) -> None:
        """Raises for a plan made for a chain of another length (a saved plan pinned on another
        model; 0: a plan that names no stage calls, taken as it is)."""
        if stage_calls and stage_calls != len(self):
            more = ", ..." if len(self) > 3 else ""
            raise RematError(
                f"the plan was made for a chain of {stage_calls} stage calls, and this model's forward makes "
                f"{len(self)} ({', '.join(self.names[:3])}{more}): a saved plan runs only on the model and "
                "inputs it was made for. Plan this model with a budget instead (remat.enable(model, budget)), "
                "and save that plan"
            )


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
    inputs_from: int = 0  # bit k set: an input was computed from the output of call k
    first_from: int = 0  # the same for its first tensor input (the activation it transforms)
    eligible: bool = True  # may be a stage: not a marked module (remat.mark recomputes it already)
    returned: int = 0  # how many calls had started when it returned
    first_input: Any = None  # a weak reference to its first tensor input
    output: Any = None  # a weak reference to its output, when that is one tensor
    takes_previous: bool = False  # its first input is its previous sibling's output (the first child: the parent's)
    children: list[int] = field(default_factory=list)
    returns_last: bool = False  # its output is its last child's
    stages: list[tuple[str, nn.Module]] = field(default_factory=list)  # what it expands to as a stage

    def derives_from(self, earlier: int) -> bool:
        return bool(self.inputs_from >> earlier & 1)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [v for v in leaves if isinstance(v, torch.Tensor)]


class _Provenance(TorchFunctionMode):
    """Follows, in a forward, which module calls each tensor was computed from.

    Each call has a bit; a tensor's mask is the union of its inputs' masks, and a call's
    outputs get the call's bit too. A call *derives* from an earlier one when one of its
    inputs has that call's bit: directly (it takes its output) or through the model's own
    code in between (``x + block(x)``, a norm, a concatenation).
    """

    def __init__(self) -> None:
        super().__init__()
        self.masks: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mask_of(self, tensors: list[torch.Tensor]) -> int:
        mask = 0
        for tensor in tensors:
            mask |= self.masks.get(tensor, 0)
        return mask

    def mark(self, tensors: list[torch.Tensor], mask: int) -> None:
        for tensor in tensors:
            self.masks[tensor] = self.masks.get(tensor, 0) | mask

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensor_leaves((args, kwargs))
        versions = [None if t.is_inference() else t._version for t in inputs]  # (inference tensors have none)
        out = func(*args, **kwargs)
        mask = self.mask_of(inputs)
        if mask:
            self.mark(_tensor_leaves(out), mask)
            # a call that changes a tensor in place makes it derive from its other inputs too
            self.mark([t for t, v in zip(inputs, versions, strict=True) if v is not None and t._version != v], mask)
        return out


def discover_chain(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    nested: bool = False,
) -> Chain:
    """Watches one forward of `model` (without grad) and returns its longest chain.

    Which modules each call's inputs were computed from is followed through the model's
    own code (:class:`_Provenance`), so a call is linked to an earlier one whether it
    takes its output or a tensor made from it. Calls the loss is not computed from (a
    pooler whose output the loss ignores) are not stages: they get no gradient.

    Args:
        model: the model.
        args: sample positional inputs.
        kwargs: sample keyword inputs.
        loss_fn: the training step's ``loss_fn(output)``; None: the loss the output
            carries (``output.loss``), else every tensor of the output.
        nested: split every stage whose own children form a chain into those children,
            recursively (NOTE [nested chains]), so that a plan can keep part of a block and
            recompute the rest.

    Raises:
        UnsupportedModel: no run of at least two linked submodule calls was found.
    """
    if isinstance(model, nn.Sequential) and not nested:
        return sequential_chain(model)
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[_Call] = []
    top: list[int] = []  # the calls the model's own forward makes
    stack: list[int] = []
    call_counts: dict[int, int] = {}
    provenance = _Provenance()

    # NOTE [stages of a model that recomputes by itself]
    # Modules called inside a block of remat.recompute or of a marked module are not
    # stages: that block's recompute calls them again, in backward, outside the chain's
    # order. The marked module itself is not one either (it recomputes already); the
    # chain is found among the other calls, and such blocks ride inside its stages.
    def pre_hook(module: nn.Module, hook_args: Any, hook_kwargs: Any) -> None:
        if in_manual_block():
            return
        parent = stack[-1] if stack else None
        call = _Call(module, names[id(module)], parent, eligible=not is_marked(module))
        tensors = _tensor_leaves((hook_args, hook_kwargs))
        call.inputs_from = provenance.mask_of(tensors)
        call.first_from = provenance.mask_of(tensors[:1])
        siblings = calls[parent].children if parent is not None else top
        if tensors:
            call.first_input = weakref.ref(tensors[0])
            if siblings:
                before = calls[siblings[-1]].output
            else:
                before = calls[parent].first_input if parent is not None else None
            call.takes_previous = before is not None and before() is tensors[0]
        siblings.append(len(calls))
        calls.append(call)
        stack.append(len(calls) - 1)
        call_counts[id(module)] = call_counts.get(id(module), 0) + 1

    def post_hook(module: nn.Module, hook_args: Any, hook_kwargs: Any, output: Any) -> None:
        if not stack or in_manual_block():
            return
        index = stack.pop()
        call = calls[index]
        call.returned = len(calls)
        provenance.mark(_tensor_leaves(output), 1 << index)
        if isinstance(output, torch.Tensor):
            call.output = weakref.ref(output)
            last = calls[call.children[-1]].output if call.children else None
            call.returns_last = last is not None and last() is output

    # hooks of each module (the global ones are not given keyword inputs: a decoder block's
    # memory=, a mask=), removed whatever happens
    handles = []
    keep_alive: list[Any] = []
    try:
        for module in {id(m): m for m in model.modules()}.values():
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
        with forward_without_grad(), provenance:  # NOTE [tensor hooks in runs without grad]
            keep_alive.append(model(*args, **kwargs))
            loss_from = _loss_from(provenance, keep_alive[0], loss_fn)
    finally:
        for handle in handles:
            handle.remove()
    del keep_alive
    for index, call in enumerate(calls):
        on_loss_path = loss_from is None or bool(loss_from >> index & 1)
        call.eligible = call.eligible and call_counts[id(call.module)] == 1 and on_loss_path
    _expand_passes(calls)
    best = _widest_chain(calls, _runs(calls))
    best = _deepen(calls, best, to_blocks=not nested)
    stages = [stage for i in best for stage in calls[i].stages]
    if len(stages) < 2:
        raise UnsupportedModel(
            f"remat found no chain in {type(model).__name__}: no two submodules are called one "
            "after another, each taking what the previous one computed, exactly once per forward. "
            "Wrap the model's repeated blocks in an nn.Sequential or nn.ModuleList called in a "
            "loop, or mark blocks to recompute by hand with remat.mark / remat.apply"
        )
    return Chain([n for n, _ in stages], [m for _, m in stages], whole_model=False)


# NOTE [nested chains]
# A stage whose own submodule calls form a chain (a transformer block's norms, attention
# and MLP; a residual block's convolutions and norms) can be split into them: the model's
# code around them (the residual additions, an activation, a shortcut) becomes the glue
# between stages, recorded and replayed like any other. Planning over the finer chain
# considers every plan of the coarse one (regions that start and end at the old
# boundaries) and the nested ones: a block that stores its attention and recomputes its
# MLP, a recompute inside a recomputed block. The smallest budget falls to what the
# largest indivisible call needs. A stage is split only where its chain is linked to the
# stages around it: its first call derives from the stage before, the stage after derives
# from its last call. What the glue keeps for its replays is planned as held through the
# step (NOTE [glue constants]), unless a replay makes it again (NOTE [constants an earlier
# stage takes] in remat.discover.glue: a residual stream, a query and a key).
def _deepen(calls: list[_Call], chain: list[int], *, to_blocks: bool = False) -> list[int]:
    """`chain` with every stage replaced by the chain of its own children where it has one,
    recursively; with `to_blocks`, only a stage that runs repeated blocks inside it (NOTE
    [blocks inside a stage])."""
    children = _eligible_children(calls)
    out = list(chain)
    position = 0
    while position < len(out):
        index = out[position]
        siblings = children.get(index, [])
        run = _longest_run(calls, siblings) if siblings else []
        linked = (
            _run_stages(calls, run) >= 2
            and (position == 0 or bool(calls[run[0]].first_from >> out[position - 1] & 1))
            and (position + 1 == len(out) or bool(calls[out[position + 1]].first_from >> run[-1] & 1))
        )
        if linked and (not to_blocks or _runs_blocks(calls, children, index, out)):
            out[position : position + 1] = run  # its calls may split further: not advanced
        else:
            position += 1
    return out


# NOTE [blocks inside a stage]
# A model may call beside its encoder as many modules of its own as the encoder has
# blocks, or more (DistilBERT's and ELECTRA's masked-LM heads: a product, an activation,
# a norm, a projection, the loss). The longest run is then the model's own calls, and the
# whole encoder one stage: the smallest budget near storing everything. A stage of the
# chain that is the only one of its kind and runs repeated blocks somewhere inside it (a
# run with two or more calls of one class of module that has submodules) is split into its
# children, down to the blocks, as nested chains split every stage (NOTE [nested chains]).
def _runs_blocks(calls: list[_Call], children: dict[int | None, list[int]], index: int, chain: list[int]) -> bool:
    """Whether call `index`, the only call of its module class in `chain`, runs repeated
    blocks somewhere inside it (two or more calls of one class of module with children, in
    one run)."""
    kind = type(calls[index].module)
    if sum(type(calls[i].module) is kind for i in chain) > 1:
        return False
    pending = [index]
    while pending:
        siblings = children.get(pending.pop(), [])
        if not siblings:
            continue
        kinds = Counter(type(calls[i].module) for i in _longest_run(calls, siblings) if _has_children(calls[i]))
        if kinds and max(kinds.values()) >= 2:
            return True
        pending.extend(siblings)
    return False


def _has_children(call: _Call) -> bool:
    return next(iter(call.module.children()), None) is not None


def _loss_from(provenance: _Provenance, output: Any, loss_fn: Callable[[Any], Any] | None) -> int | None:
    """The calls the loss is computed from (a mask), or None where that cannot be told."""
    if loss_fn is None:
        carried = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        tensors = [carried] if isinstance(carried, torch.Tensor) else _tensor_leaves(output)
    else:
        try:
            tensors = _tensor_leaves(loss_fn(output))
        except RuntimeError:
            # A loss function that runs its own backward cannot run without grad: every
            # call may then be a stage, as it is for a model whose loss is not known.
            return None
    # no tensor to follow (an output measuring refuses later, with its own message)
    return provenance.mask_of(tensors) if tensors else None


# NOTE [modules that pass through]
# A module whose forward only calls its children one after another, each on what the one
# before returned (the first on the module's input), and returns what the last returned
# (a ResNet stage looping over its blocks, any ModuleList loop in a module of its own) is
# an nn.Sequential by another name: in the chain it is its children's stages, so that a
# run of such modules (a ResNet's four stages) plans every block. Nothing runs between its
# children: splitting it adds no code between stages. Runs are still compared by their
# calls (`_stage_count`): counted by their blocks, the insides of a transformer block
# (whose MLP passes through its products) would outnumber the blocks.
def _expand_passes(calls: list[_Call]) -> None:
    """Sets what each call expands to as a stage: its children's stages for a module
    that passes through them, else itself (an nn.Sequential flattened)."""
    for call in reversed(calls):  # children come after their parent
        passes = (
            len(call.children) >= 2
            and call.returns_last
            and all(calls[c].eligible and calls[c].takes_previous for c in call.children)
        )
        if passes:
            call.stages = [stage for c in call.children for stage in calls[c].stages]
        else:
            call.stages = _flatten_sequential(call.name, call.module)


def _stage_count(call: _Call) -> int:
    # runs are compared by their calls, nested Sequentials expanded, not modules that pass
    # through: a transformer block's MLP (a product, an activation, a product) is one call,
    # and a block's insides do not outnumber the blocks
    return len(_flatten_sequential(call.name, call.module))


def _run_stages(calls: list[_Call], run: list[int]) -> int:
    """The stages a run of calls gives, nested Sequentials expanded."""
    return sum(_stage_count(calls[i]) for i in run)


def _runs(calls: list[_Call]) -> list[list[int]]:
    """Runs among the children of each call (and of the model), longest first.

    A run is a sequence of sibling calls whose first input (the activation, ahead of
    masks, positions and other side inputs) is computed from the call before it, directly
    or through the model's own code in between (a shared activation, ``x + block(x)``),
    and from no later sibling.
    Runs are compared by the stages they give, nested Sequentials expanded: the top-level
    run of a ResNet (stem, layer1..4, pooling) beats the run of blocks inside layer1. Once
    the longest run of a module's children is found, the longest among the others follows
    (an encoder's blocks and a decoder's, called by one forward).
    """
    runs = []
    for siblings in _eligible_children(calls).values():
        left = list(siblings)
        while len(left) >= 2:
            run = _longest_run(calls, left)
            runs.append(run)
            taken = set(run)
            left = [index for index in left if index not in taken]
    return sorted(runs, key=lambda run: -_run_stages(calls, run))


# NOTE [runs inside a block]
# The calls inside one block of a run of repeated blocks form a run of their own (a BART
# layer: self-attention, its norm, cross-attention, its norm, two products, an activation,
# a norm), and with few blocks it gives more stages than the blocks do (eight against four
# decoder layers and their embeddings). Taken as the chain, and joined with the next
# blocks' insides, it left the encoder out of the plan. Elsewhere the insides joined cover
# the whole model, finer than its blocks (a Swin's blocks' insides, its patch embedding's
# and its merges'). So the chain is joined twice: from the run of most stages, and from the
# one of most stages that is not the insides of a block (it runs inside one of the blocks,
# and is not itself a run of blocks, as a ResNet stage's are). The first is taken unless it
# leaves out more than a quarter of the leaf module calls the second covers (BART: 28 of 49;
# a Swin's insides, finer, leave out its merges' norms and little else: 51 of 59).
def _widest_chain(calls: list[_Call], runs: list[list[int]]) -> list[int]:
    """The chain joined from the longest run, or from the longest run that is not the
    insides of a block where the first leaves much of the model out (see the NOTE)."""
    first = _join_runs(calls, runs)
    blocks = _repeated_blocks(calls, runs)
    outside = [run for run in runs if not _inside(calls, run, blocks)]
    if not outside or outside[0] is runs[0]:
        return first
    second = _join_runs(calls, [outside[0], *(run for run in runs if run is not outside[0])], blocks=blocks)
    leaves = [0]
    for call in calls:
        leaves.append(leaves[-1] + (not call.children))

    def covered(chain: list[int]) -> int:
        return sum(leaves[calls[i].returned] - leaves[i] for i in chain)

    return second if covered(first) < 0.75 * covered(second) else first


def _repeated_blocks(calls: list[_Call], runs: list[list[int]]) -> set[int]:
    """The calls of `runs` that are blocks: one after another in a run, two or more calls of
    one module class with children (a block's two attentions, apart, are not)."""
    blocks: set[int] = set()
    for run in runs:
        for a, b in itertools.pairwise(run):
            if type(calls[a].module) is type(calls[b].module) and _has_children(calls[a]) and _has_children(calls[b]):
                blocks.update((a, b))
    return blocks


def _inside(calls: list[_Call], run: list[int], blocks: set[int]) -> bool:
    """Whether `run` is the insides of a block: it runs inside one of `blocks` (at any
    depth), and is not itself a run of blocks."""
    if any(i in blocks for i in run):
        return False
    parent = calls[run[0]].parent
    while parent is not None:
        if parent in blocks:
            return True
        parent = calls[parent].parent
    return False


def _eligible_children(calls: list[_Call]) -> dict[int | None, list[int]]:
    """The calls that may be stages, by the call they run inside (None: the model's own forward)."""
    children: dict[int | None, list[int]] = {}
    for index, call in enumerate(calls):
        if call.eligible:
            children.setdefault(call.parent, []).append(index)
    return children


def _longest_run(calls: list[_Call], siblings: list[int]) -> list[int]:
    # Each call continues the run of the latest sibling its first input was computed from
    # (not an earlier one through it: a decoder block follows the block before it, not
    # the encoder its memory came from); best[k] is the most stages of a run ending at k.
    best: list[int] = []
    before: list[int | None] = []
    for k, index in enumerate(siblings):
        call = calls[index]
        previous = next((j for j in range(k - 1, -1, -1) if call.first_from >> siblings[j] & 1), None)
        best.append(_stage_count(call) + (best[previous] if previous is not None else 0))
        before.append(previous)
    end: int | None = max(range(len(siblings)), key=lambda k: best[k])
    run = []
    while end is not None:
        run.append(siblings[end])
        end = before[end]
    return run[::-1]


def _join_runs(calls: list[_Call], runs: list[list[int]], *, blocks: set[int] | None = None) -> list[int]:
    """The longest run, joined with the runs that follow it or precede it.

    An encoder-decoder's blocks are two runs, in two modules or two loops: the decoder's
    first block takes (as its memory) what the encoder's last block computed. The run
    joined is the nearest one that takes anything computed by the chain's end (its calls
    before that are left to the code in between), or whose end the chain's start takes.
    Runs of one call are left out (a head stays after the chain). With `blocks`, of the runs
    inside a call, one that is not the insides of a block comes first (NOTE [runs inside a
    block]).
    """
    if not runs:
        return []
    chain = runs[0]
    candidates = [run for run in runs[1:] if len(run) >= 2]
    while True:
        last, first = calls[chain[-1]], calls[chain[0]]
        after = []
        for run in candidates:
            starts = [
                k for k, index in enumerate(run) if index >= last.returned and calls[index].derives_from(chain[-1])
            ]
            if starts and len(run) - starts[0] >= 2:
                after.append(run[starts[0] :])
        before = [run for run in candidates if chain[0] >= calls[run[-1]].returned and first.derives_from(run[-1])]
        if after:
            # the nearest; among the runs inside its first call (a decoder's blocks inside the
            # decoder), the one of most stages that does not run inside a block (NOTE [runs
            # inside a block])
            nearest = min(after, key=lambda run: run[0])
            inside = [run for run in after if nearest[0] <= run[0] < calls[nearest[0]].returned]
            joined = max(
                inside,
                key=lambda run: (
                    blocks is not None and not _inside(calls, run, blocks),
                    _run_stages(calls, run),
                    -run[0],
                ),
            )
            chain = chain + joined
        elif before:
            # the nearest: the one whose last call returned last; of a run and the runs inside
            # its last call, which return at the same point, the outer one (a ResNet stage's
            # blocks, not the shortcut and activation inside its last block)
            joined = max(before, key=lambda run: (calls[run[-1]].returned, -run[-1]))
            chain = joined + chain
        else:
            return chain
        used = set(chain)
        candidates = [run for run in candidates if not used & set(run)]


# ----------------------------------------------------------------------- input links
class StageLinks:
    """Follows a forward's stage calls: which inputs of a stage the stage before returned,
    and whether the model's own code changed those in place between the two.

    Only weak references are kept: following a forward changes no tensor's lifetime (a
    measured window would otherwise see the previous output alive longer than it is).
    """

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
        self._returned: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def changed_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The inputs of the stage being called that the stage before returned and the
        model's code changed in place since."""
        versions = {id(t): (t, version) for ref, version in self._returned if (t := ref()) is not None}
        return [
            value
            for value in _tensor_leaves((args, kwargs))
            if id(value) in versions and versions[id(value)][0] is value and value._version != versions[id(value)][1]
        ]

    def returned(self, index: int, output: Any) -> None:
        """Notes the output of stage `index` (the chain's output is not followed)."""
        leaves = _tensor_leaves(output) if index + 1 < self.n_stages else []
        if any(t.is_inference() for t in leaves):
            raise UnsupportedModel(
                f"stage {index} returned a tensor made under torch.inference_mode(): its versions are not "
                "followed, and the automatic mode follows what the model's code changes in place. Run that "
                "part under torch.no_grad() instead (it is replayed under no_grad as well)"
            )
        self._returned = [(weakref.ref(t), t._version) for t in leaves]
