"""Saved tensors made by cheap elementwise operations, recomputed when backward reads them.

NOTE [recomputing elementwise saves]
Autograd keeps many tensors that are a cheap elementwise function of other tensors it keeps
anyway. A GELU written out (``0.5 * x * (1 + tanh(...))``) keeps ``x``, the ``tanh``, the
two factors of the last product, and the product itself for the next layer: five tensors of
the same size, of which ``x`` and the ``tanh`` suffice to make the other three with a
multiplication or an addition each. A dropout's output is its input times the mask it keeps.
Recomputing those when backward reads them frees their memory for the price of a pass over
memory, where recomputing a whole block costs its matrix products too. torch.compile's
partitioner does this for the graphs it compiles; :func:`recompute_elementwise` does it in
eager code.

How. While the context is active, a dispatch mode notes, for each output of a *cheap*
elementwise operation (an arithmetic one or a cast on one device: the names in
:data:`CHEAP_OPERATIONS`; no random one, no transcendental one, no in-place one, no view),
how it was made: the operation, its
arguments, and for each tensor argument a weak reference, its version then, and how *it*
was made. When autograd saves such a tensor, the pack hook looks for a recipe: each tensor
argument must be one autograd already saved in this context (and unchanged since), a
tensor that requires grad and has no history (a parameter), or a tensor of one element; or
else be made, by the same rule, from such tensors, with at most ``max_operations``
operations in all. With a recipe, autograd holds the recipe instead of the tensor, and the
tensor's memory goes when the model lets go of it. Without one, the tensor is saved as
usual, and from then on it can be a recipe's argument itself.

When backward reads a tensor held as a recipe:

* if the tensor is still alive (something else held it), it is returned, as autograd would;
* otherwise the recipe runs, in backward's own grad mode (so that a ``create_graph``
  backward builds the graph through it, to the tensors it was made from). Each read runs
  its recipe: a tensor saved twice (``s * s``) is made twice, which costs less than keeping
  a made value around for a read that may never come.

Exactness. The same operation on the same tensors gives the same bits: these operations
are deterministic, and the recipe runs them on the very tensors of the forward. A recipe
is refused, and raises :class:`~remat.errors.RecomputeInputModified` when backward reads
it, if any tensor it reads was changed in place after the forward used it, or if the saved
tensor itself was changed in place after it was saved (while the context was active, or
while it is still alive): autograd raises for the same changes. A change of a tensor
between its making and its use by the recipe's next operation is followed through its
version: the recipe then goes back to how it was made.

NOTE [layer norms made again]
A layer norm keeps its input (with its mean and inverse deviation) for its own backward, and
the projection after it keeps its output: two tensors of the same size where one suffices,
and the norm costs about three passes over memory, as cheap as the operations above. So
``native_layer_norm`` is in :data:`CHEAP_OPERATIONS` too, though not elementwise: its output
is noted as made by the norm run again for its first output (``_FirstOutput``), from its
input, weight and bias, which autograd keeps anyway. The same kernel on the same tensors
gives the same bits (each row is reduced alone, on a CPU and on CUDA, so neither the thread
count nor the device's scheduling changes it). On a transformer block that is its two norms'
outputs: on the planner benchmark's GPT-2, 2 of the 41 MiB each block keeps.

NOTE [versions of tensors saved through hooks]
Autograd checks that a saved tensor was not changed in place before backward reads it only
when it holds the tensor itself; a tensor saved through ``saved_tensors_hooks`` is not
checked. So each tensor this context saves as it is goes with its version, and backward
raises :class:`~remat.errors.RecomputeInputModified` where autograd would have raised.

NOTE [elementwise saves in planned stages]
With ``elementwise=True``, a planned model (:class:`remat.Checkpointable`,
:func:`remat.enable`) leaves to backward what each stage it stores saves and can make
again, and the planner plans with it: the measuring step runs each stage call inside
:meth:`ElementwiseRecompute.stage_call`, so the sizes are those of the stages as they will
run. A stage is sized once and planned wherever it is stored, so a recipe reads only what
its own stage call saved (and parameters): what a stage keeps does not depend on whether
the stage before it is stored or recomputed. The executor runs every stored stage call so
(every one that made a recipe when sized: NOTE [stages that make no recipe] in
:mod:`remat.plan.elementwise`):
in the first forward with hooks over the active ones; in a replay, where the recompute
frame filling the replay holds what autograd saves, the frame asks :func:`filling` and
holds a recipe in place of the tensor (:meth:`ElementwiseRecompute.hold`), made again by
:func:`read_held` when backward reads it. The frame holds a detached alias of each tensor
saved as it is, so a recipe reads that alias: the saved entries point, weakly, at the value
held, and an argument is known by its weak reference once the tensor itself is gone. The model's
own code between stages (its glue) runs outside any stage call and saves as usual, when
measured and when run.

Memory. A recipe holds only tensors that autograd holds anyway (or parameters, or tensors
of one element); it may hold one of them a little longer than autograd would, until the
node that saved the recipe runs its backward. Under other saved-tensor hooks, a tensor
saved as it is stays held itself beside what those hooks packed (recipes read it). Tensor
subclasses are never recomputed (but for the fake tensors remat sizes steps with).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from remat.errors import RecomputeInputModified
from remat.manual import _recipes
from remat.manual._recipes import _Argument, _FirstOutput, _Kept, _Made, _Recipe, _Step

__all__ = [
    "CHEAP_NORMALISATIONS",
    "CHEAP_OPERATIONS",
    "ElementwiseRecompute",
    "filling",
    "read_held",
    "recompute_elementwise",
]

#: Elementwise operations cheap enough to run again in backward: arithmetic, comparisons,
#: selections, clamps and casts on one device (``_to_copy``, what autocast runs), by ATen
#: name (each costs about one pass over memory on a CPU, where a ``tanh``, ``exp`` or
#: ``erf`` costs twenty), and the layer norm (NOTE [layer norms made again]).
CHEAP_OPERATIONS = frozenset(
    {
        "_to_copy", "abs", "add", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "clamp",
        "clamp_max", "clamp_min", "clone", "div", "eq", "ge", "gt", "hardtanh", "le",
        "leaky_relu", "logical_and", "logical_not", "logical_or", "lt", "masked_fill",
        "maximum", "minimum", "mul", "ne", "neg", "pow", "reciprocal", "relu", "rsqrt", "rsub",
        "sign", "sqrt", "square", "sub", "threshold", "where",
        "native_layer_norm",
    }
)  # fmt: skip

#: Operations in :data:`CHEAP_OPERATIONS` that are not elementwise but as cheap: a layer
#: norm reads its input twice and writes its output once (NOTE [layer norms made again]).
CHEAP_NORMALISATIONS = frozenset({"native_layer_norm"})


_OTHER, _WRITES, _ELEMENTWISE, _CAST, _NORMALISATION = range(5)
_NOTED_TYPES = (torch.Tensor, FakeTensor)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_LOCAL = threading.local()


class _Noting(TorchDispatchMode):
    """Notes how each output of a cheap elementwise operation was made (NOTE [recomputing elementwise saves])."""

    def __init__(self, owner: ElementwiseRecompute) -> None:
        super().__init__()
        self.owner = owner
        self.kinds = owner.kinds
        self.firsts = owner.firsts

    def _kind(self, func: Any) -> int:
        if func._schema.is_mutable:
            kind = _WRITES
        elif func._opname not in self.owner.operations:
            kind = _OTHER
        elif torch.Tag.pointwise in func.tags:
            kind = _ELEMENTWISE
        elif func._opname in CHEAP_NORMALISATIONS and func._overloadname == "default":
            kind = _NORMALISATION
            self.firsts[func] = _FirstOutput(func)
        else:
            kind = _CAST if func is torch.ops.aten._to_copy.default else _OTHER
        self.kinds[func] = kind
        return kind

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = self.kinds.get(func)
        if kind is None:
            kind = self._kind(func)
        if kind == _OTHER:
            return out
        owner = self.owner
        if kind == _WRITES:
            owner.written(func, args, kwargs or {})
        elif kind == _NORMALISATION:
            first = out[0]
            if type(first) in _NOTED_TYPES and not owner.running and torch.is_grad_enabled() and not first._is_view():
                owner.note(first, self.firsts[func], args, kwargs or {})
        elif (
            type(out) in _NOTED_TYPES
            and not owner.running
            and torch.is_grad_enabled()
            and not out._is_view()
            and (kind == _ELEMENTWISE or _is_cast(args, out))
        ):
            owner.note(out, func, args, kwargs or {})
        return out


class ElementwiseRecompute:
    """The state of one :func:`recompute_elementwise` context; ``saved_bytes_recomputed`` reports."""

    def __init__(
        self,
        *,
        max_operations: int = 4,
        operations: frozenset[str] = CHEAP_OPERATIONS,
        scoped_stages: frozenset[int] | None = None,
    ) -> None:
        self.max_operations = max_operations
        self.operations = operations
        # Kept while the context is active, by id, each with a weak reference that tells a
        # live entry from one whose tensor died (and whose id may be taken again)
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], _Made]] = {}
        # saved as is: its version, the stage call that saved it, and the value held (a
        # recompute frame holds a detached alias of it: NOTE [elementwise saves in planned stages]).
        # A list per id: a tensor a frame saved dies at once, and its id may be a later one's.
        self._saved: dict[int, list[tuple[weakref.ref[torch.Tensor], int, int | None, weakref.ref[torch.Tensor]]]] = {}
        self.stage: int | None = None  # the stage call running (automatic mode), whose saves alone recipes read
        self._stages = 0
        self._index: int | None = None  # the chain index of that call, when known
        #: chain indices of the stage calls that made a recipe (NOTE [stages that make no recipe])
        self.stages_with_recipes: set[int] = set()
        self.scoped_stages = scoped_stages  # the stage calls that run scoped; None: all (till sized)
        self._recipes: dict[int, list[weakref.ref[_Recipe]]] = {}  # by storage, for writes seen later
        self.kinds: dict[Any, int] = {}  # operation -> what it is to the noting mode
        self.firsts: dict[Any, _FirstOutput] = {}  # a normalisation -> it, run for its output
        self.running = False
        self.tensors_recomputed = 0
        self.saved_bytes_recomputed = 0
        self.tensors_saved = 0
        self.operations_run = 0  # operations backward ran to make saved tensors again

    # -- forward: noting and saving

    def _made_of(self, tensor: torch.Tensor) -> _Made | None:
        entry = self._made.get(id(tensor))
        if entry is None or entry[0]() is not tensor or entry[1].version != tensor._version:
            return None
        return entry[1]

    def _argument(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if type(value) not in _PLAIN_TYPES:
                raise _NotNoted
            return _Argument(value, self._made_of(value))
        if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
            raise _NotNoted
        return value

    def note(self, out: torch.Tensor, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            made = _Made(
                func,
                tuple(self._argument(value) for value in args),
                {name: self._argument(value) for name, value in kwargs.items()},
                out._version,
            )
        except _NotNoted:
            return
        self._made[id(out)] = (weakref.ref(out), made)

    def written(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """An in-place or ``out=`` operation: a recipe of what it writes can no longer be trusted.

        How the written tensor was made goes stale by itself (its version moves on); a tensor
        held as a recipe that is written while alive is marked, and backward raises for it.
        """
        if not self._recipes:
            return
        for index, schema_argument in enumerate(func._schema.arguments):
            if schema_argument.alias_info is None or not schema_argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(schema_argument.name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(tensor, torch.Tensor):
                    continue
                for ref in self._recipes.get(_storage(tensor), ()):
                    recipe = ref()
                    if recipe is not None and recipe.ref() is not None:
                        recipe.changed = True

    def _available(self, argument: _Argument) -> torch.Tensor | None:
        """What a recipe reads for `argument`: the tensor saved (or the value held for it), a
        parameter, a tensor of one element; None if it must be made again itself."""
        for saved, version, stage, value in self._saved.get(argument.key, ()):
            if saved is argument.ref and version == argument.version and stage == self.stage:
                held = value()  # (held by autograd, or by a recompute frame: never by this entry)
                return held if held is not None and held._version == argument.version else None
        tensor = argument.ref()
        if tensor is None or tensor._version != argument.version:
            return None
        return tensor if (tensor.is_leaf and tensor.requires_grad) or tensor.numel() <= 1 else None

    def _step(self, made: _Made, tensors: list[tuple[torch.Tensor, int]], budget: list[int]) -> _Step | None:
        budget[0] -= 1
        if budget[0] < 0:
            return None
        args = []
        for value in made.args:
            value = self._resolve(value, tensors, budget)
            if value is _FAILED:
                return None
            args.append(value)
        kwargs = {}
        for name, value in made.kwargs.items():
            value = self._resolve(value, tensors, budget)
            if value is _FAILED:
                return None
            kwargs[name] = value
        return _Step(made.operation, tuple(args), kwargs)

    def _resolve(self, value: Any, tensors: list[tuple[torch.Tensor, int]], budget: list[int]) -> Any:
        if not isinstance(value, _Argument):
            return value
        tensor = self._available(value)
        if tensor is not None:
            tensors.append((tensor, value.version))
            return tensor
        step = None if value.made is None else self._step(value.made, tensors, budget)
        return _FAILED if step is None else step

    def recipe_for(self, tensor: torch.Tensor) -> _Recipe | None:
        """A recipe for a tensor being saved, if it is made of what is available."""
        made = None
        if type(tensor) in _NOTED_TYPES:
            # a view (a reshape for a matrix product) is made again from what it views
            made_from = tensor._base if tensor._is_view() else tensor
            if made_from is not None and made_from._base is None:
                made = self._made_of(made_from)
        if made is None:
            return None
        tensors: list[tuple[torch.Tensor, int]] = []
        step = self._step(made, tensors, [self.max_operations])
        if step is None:
            return None
        recipe = _Recipe(self, step, tensors, tensor, tensor._is_view())
        self._recipes.setdefault(_storage(tensor), []).append(weakref.ref(recipe))
        self.tensors_recomputed += 1
        self.saved_bytes_recomputed += tensor.untyped_storage().nbytes()
        if self._index is not None:
            self.stages_with_recipes.add(self._index)
        return recipe

    def saved_as_is(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """`tensor` is saved as it is (`value`: what holds it), so recipes may read it."""
        entry = (weakref.ref(tensor), tensor._version, self.stage, weakref.ref(value))
        self._saved.setdefault(_recipes._key(tensor), []).append(entry)
        self.tensors_saved += 1

    def hold(self, tensor: torch.Tensor, value: torch.Tensor) -> Any:
        """What holds `tensor` once saved: a recipe, or `value` (what holds it as it is: the
        tensor under hooks, a detached alias in a recompute frame filling a planned replay,
        NOTE [elementwise saves in planned stages])."""
        recipe = self.recipe_for(tensor)
        if recipe is not None:
            return recipe
        self.saved_as_is(tensor, value)
        return value

    def hooks(self, outer: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """Pack and unpack hooks that keep recipes, and pass what is saved as it is to
        `outer` (the hooks that were active, if any)."""
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            held = self.hold(tensor, tensor)
            if isinstance(held, _Recipe):
                return held
            return _Kept(tensor if outer_pack is None else outer_pack(tensor), tensor)

        def unpack(packed: Any) -> Any:
            if isinstance(packed, _Recipe):
                return self.unpack(packed)
            # NOTE [versions of tensors saved through hooks]: autograd does not check the
            # version of a tensor saved through hooks, so the check is made here
            tensor = packed.tensor
            if tensor._version != packed.version:
                raise RecomputeInputModified(
                    f"one of the tensors saved for backward (shape {tuple(tensor.shape)}) was modified by an "
                    f"in-place operation: it is at version {tensor._version}, it was saved at version "
                    f"{packed.version} (autograd raises for this too). Clone it before changing it."
                )
            return packed.value if outer_unpack is None else outer_unpack(packed.value)

        return pack, unpack

    def scoped(self, index: int, *, replay: bool = False) -> AbstractContextManager[None]:
        """:meth:`stage_call` if stage call `index` runs scoped (NOTE [stages that make no recipe])."""
        if self.scoped_stages is None or index in self.scoped_stages:
            return self.stage_call(index, replay=replay)
        return nullcontext()

    @contextmanager
    def stage_call(self, index: int | None = None, *, replay: bool = False) -> Iterator[None]:
        """A stage call of a planned model runs: its recipes read only what it saves itself.

        In the first forward (and when measuring), the hooks go over those active; in a
        replay, the recompute frame filling it asks :func:`filling` (NOTE [elementwise
        saves in planned stages]). `index`: the call's place in the chain, noted in
        ``stages_with_recipes`` when it makes a recipe.
        """
        previous, previous_index = self.stage, self._index
        self._stages += 1
        self.stage, self._index = self._stages, index
        try:
            if replay:
                before = getattr(_LOCAL, "filling", None)
                _LOCAL.filling = self
                try:
                    with _Noting(self):
                        yield
                finally:
                    _LOCAL.filling = before
            else:
                outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
                with torch.autograd.graph.saved_tensors_hooks(*self.hooks(outer)), _Noting(self):
                    yield
        finally:
            self.stage, self._index = previous, previous_index

    # -- backward: reading

    def unpack(self, packed: _Recipe) -> torch.Tensor:
        """Makes a tensor held as a recipe (or returns it, alive)."""
        tensor = packed.ref()
        if packed.changed or (tensor is not None and tensor._version != packed.version):
            raise RecomputeInputModified(
                "a tensor saved for backward was modified by an in-place operation after it was saved "
                "(remat.recompute_elementwise); autograd raises for this too. Clone it before changing it, "
                "or change a copy."
            )
        if tensor is not None:
            return tensor
        for read, version in packed.tensors:
            if read._version != version:
                raise RecomputeInputModified(
                    f"a tensor of shape {tuple(read.shape)} that a saved elementwise result is recomputed "
                    "from (remat.recompute_elementwise) was modified by an in-place operation after the "
                    "forward; autograd raises for this too. Clone it before changing it."
                )
        self.running = True
        try:
            value = self._run(packed.step)
        finally:
            self.running = False
        return value if packed.view is None else value.as_strided(*packed.view)

    def _run(self, step: _Step) -> torch.Tensor:
        args = [self._run(value) if isinstance(value, _Step) else value for value in step.args]
        kwargs = {name: self._run(value) if isinstance(value, _Step) else value for name, value in step.kwargs.items()}
        value = step.operation(*args, **kwargs)
        self.operations_run += 1
        return value

    @contextmanager
    def active(self) -> Iterator[ElementwiseRecompute]:
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self.hooks()), _Noting(self):
                yield self
        finally:
            # what was noted serves the forward's saves only; recipes hold what they read
            self._made.clear()
            self._saved.clear()
            self._recipes.clear()


def _is_cast(args: Any, out: torch.Tensor) -> bool:
    """A copy to another type on the same device (``_to_copy``, not tagged elementwise)."""
    return isinstance(args[0], torch.Tensor) and args[0].device == out.device and args[0].shape == out.shape


class _NotNoted(Exception):
    """A tensor subclass, or a list of tensors, among an operation's arguments: not noted."""


_FAILED = object()  # a recipe's argument that cannot be made again


def filling() -> ElementwiseRecompute | None:
    """The state of the planned replay a recompute frame is filling, if any."""
    return getattr(_LOCAL, "filling", None)


def read_held(value: Any) -> Any:
    """What a recompute frame held for a saved tensor, made again if it is a recipe."""
    return value.owner.unpack(value) if isinstance(value, _Recipe) else value


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@contextmanager
def recompute_elementwise(
    *, max_operations: int = 4, operations: frozenset[str] | None = None
) -> Iterator[ElementwiseRecompute]:
    """Recompute in backward the saved tensors that cheap elementwise operations made.

    Inside the context, a tensor that autograd saves for backward and that is a cheap
    elementwise function (at most ``max_operations`` operations: additions, products,
    comparisons, clamps, ``where``...) of tensors autograd saves anyway is not kept: backward
    makes it again when it reads it. The products, additions and selections of a GELU
    written out, of a gated MLP and of a dropout's output keep no memory of their own.
    Gradients are bit for bit those of plain autograd (see NOTE [recomputing elementwise
    saves] in :mod:`remat.manual.elementwise`). The forward must run inside the context;
    backward may run inside or after it. It combines with remat's other recompute: inside
    a recomputed block that block's own handling applies.

    .. warning:: It works on eager code: under ``torch.compile`` (which recomputes
       elementwise operations itself) the compiled frames are skipped by the dispatch mode.
       Each ATen operation of the forward also pays a Python call, about 6 us on a CPU:
       under 1% of a step of a GPT-2 of 8 x 256 on 4 x 256 tokens, up to 30% of a toy
       model's 20 ms step.

    Args:
        max_operations: the most operations one saved tensor may take to make again.
        operations: the ATen names of the operations that may run again (default
            :data:`CHEAP_OPERATIONS`); only elementwise ones (``torch.Tag.pointwise``),
            ``_to_copy`` on one device and the layer norms of :data:`CHEAP_NORMALISATIONS`
            are ever run again.

    Yields:
        An :class:`ElementwiseRecompute`, whose ``tensors_recomputed`` and
        ``saved_bytes_recomputed`` say how many saved tensors (and how many bytes of
        storage) were left to backward to make again, ``tensors_saved`` how many were kept,
        and ``operations_run`` how many operations backward has run to make them.

    Example::

        with remat.recompute_elementwise():
            loss = model(x).sum()
        loss.backward()
    """
    if isinstance(max_operations, bool) or not isinstance(max_operations, int) or max_operations < 1:
        raise ValueError(f"max_operations must be a positive integer, got {max_operations!r}")
    names = CHEAP_OPERATIONS if operations is None else frozenset(operations)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"operations must be ATen operation names (strings), got {sorted(map(repr, names))}")
    state = ElementwiseRecompute(max_operations=max_operations, operations=names)
    with state.active():
        yield state
