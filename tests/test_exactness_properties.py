"""Exactness on random models (hypothesis): remat against plain autograd, bit for bit.

Each example builds a small random model from layers that are hard to recompute exactly:
in-place ops on intermediates and on views of them, views and ops on views, module state
changed in forward (BatchNorm, buffer counters, running means, reassigned buffers, plain
attributes, both ``spectral_norm`` APIs), dropout and other random ops, shared layers,
recompute inside a layer's own forward, and outputs that are dicts and tuples holding
``None``, constants and passed-through inputs and parameters. The model is deep-copied
before remat touches it; the copy gets remat in the ways drawn: ``remat.recompute`` around
random (nested) runs of layers and inside layers, ``remat.mark`` on random submodules
(both implementations, ``output_recompute``, ``early_stop=False``), or
``remat.Checkpointable`` under a random budget, solver and measurement, with marked
modules inside its stages. Both run the same seeded training steps (optionally under CPU
autocast, with gradient accumulation over two forwards, then an SGD update); outputs,
parameter and input gradients, parameters, buffers, plain attributes and the global RNG
state must be equal after every step (``torch.equal``).

Not generated, because README documents them as deliberate differences: state kept in
containers, tensor attributes changed in place, a recomputed block that modifies its own
input in place (in-place modules are never marked, and layers modify only tensors they
computed themselves), and the limits of the reentrant implementation (NOTE [reentrant
limits]).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, reject, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils._pytree import tree_flatten

import remat
from remat.plan import ChainProfile, OptimalSolver

pytestmark = pytest.mark.usefixtures("clean_remat_state")

WIDTH = 8
HALF = WIDTH // 2
BATCH = 4

#: How a block is called: plainly, or recomputed by one of remat's implementations
#: ("merged": hook-based with ``output_recompute=True``; "to the end": hook-based with
#: ``early_stop=False``).
MODES: tuple[str | None, ...] = (None, "hooks", "reentrant", "merged", "to the end")
RECOMPUTE_MODES = MODES[1:]


def recompute_options(mode: str) -> dict[str, Any]:
    return {
        "use_reentrant": mode == "reentrant",
        "output_recompute": mode == "merged",
        "early_stop": mode != "to the end",
    }


def call(mode: str | None, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, recomputed as `mode` says (plainly for None)."""
    if mode is None:
        return function(*args, **kwargs)
    return remat.recompute(function, *args, **recompute_options(mode), **kwargs)


# ------------------------------------------------------------------ in-place ops and views
def _set_column(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h[:, 1] = x[:, 2] * 2.0
    return h


def _add_strided(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h[:, ::2] += x[:, 1::2]
    return h


def _add_in_place(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h += torch.sin(x)
    return h


def _scale_view_of_view(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h.view(BATCH, 2, HALF).transpose(1, 2)[:, 0].mul_(3.0)
    return h


def _shift_narrowed(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h.narrow(1, 2, 3).sub_(1.0)
    return h


def _relu_view(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h.t()[1:3].relu_()
    return h


def _scale_diagonal(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h[:, :BATCH].diagonal().mul_(2.0)
    return h


def _index_add(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h.index_add_(1, torch.tensor([0, 5]), x[:, 2:4].to(h.dtype))


def _chunks(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, dim=1)
    return torch.cat([b * a, a + b], dim=1)


#: Ops on a layer's intermediate `h` (given the layer input `x`); each returns the new `h`.
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # in place
    "relu_": lambda h, x: h.relu_(),
    "sigmoid_": lambda h, x: h.sigmoid_(),
    "add_": lambda h, x: h.add_(0.5),
    "mul_": lambda h, x: h.mul_(-1.5),
    "mul_input_": lambda h, x: h.mul_(x),
    "set_column": _set_column,
    "add_strided": _add_strided,
    "add_in_place": _add_in_place,
    "scale_view_of_view_": _scale_view_of_view,
    "shift_narrowed_": _shift_narrowed,
    "relu_view_": _relu_view,
    "dropout_": lambda h, x: F.dropout(h, 0.25, training=True, inplace=True),
    "randn_": lambda h, x: h.add_(torch.randn_like(h), alpha=0.1),
    "masked_fill_": lambda h, x: h.masked_fill_(x > 0.5, 0.0),
    "index_add_": _index_add,
    "scale_diagonal_": _scale_diagonal,
    # out of place, on views
    "tanh": lambda h, x: torch.tanh(h),
    "mul_input": lambda h, x: h * x,
    "transpose": lambda h, x: h.view(BATCH, 2, HALF).transpose(1, 2).reshape(BATCH, WIDTH),
    "view": lambda h, x: h.view(2, -1).t().t().reshape(BATCH, WIDTH),
    "chunks": _chunks,
    "roll": lambda h, x: torch.cat([h[:, 1:], h[:, :1] * 2.0], dim=1),
    "dropout": lambda h, x: F.dropout(h, 0.25, training=True),
    "rand": lambda h, x: h + 0.1 * torch.rand_like(h),
    "bernoulli": lambda h, x: h * torch.empty_like(h).bernoulli_(0.7),
    "expand": lambda h, x: h * h[:, :1].expand(-1, WIDTH),
    "unbind": lambda h, x: torch.stack([t * (i + 1) for i, t in enumerate(h.unbind(1))], dim=1),
    "split": lambda h, x: torch.cat([t.flip(1) for t in h.split([3, 5], dim=1)], dim=1),
}
IN_PLACE = frozenset(
    {
        "relu_",
        "sigmoid_",
        "add_",
        "mul_",
        "mul_input_",
        "set_column",
        "add_strided",
        "add_in_place",
        "scale_view_of_view_",
        "shift_narrowed_",
        "relu_view_",
        "dropout_",
        "randn_",
        "masked_fill_",
        "index_add_",
        "scale_diagonal_",
    }
)
#: Ops whose backward reads their result: `h` may not be changed in place after them.
SAVES_RESULT = frozenset({"relu_", "sigmoid_", "relu_view_", "tanh"})
#: Ops whose result is a view of their input (what was saved of `h` stays saved).
VIEWS = frozenset({"view"})


def planned_ops(ops: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Each op of a program, with whether it is applied to a clone of `h`.

    An in-place op that would overwrite what an earlier op saved for backward (plain
    autograd's "modified by an inplace operation") is applied to a clone instead.
    """
    saved = True  # by the ReLU(inplace=True) that starts every program
    planned = []
    for op in ops:
        planned.append((op, op in IN_PLACE and saved))
        if op in SAVES_RESULT:
            saved = True
        elif op not in VIEWS:
            saved = False
    return planned


class Ops(nn.Module):
    """A linear layer and an in-place ReLU, then a program of in-place ops and views on the result."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU(inplace=True)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.linear(x))
        for op, cloned in planned_ops(self.ops):
            h = OPS[op](h.clone() if cloned else h, x)
        return h


# ------------------------------------------------------------------ state changed in forward
class BufferCounter(nn.Module):
    """Counts calls in a registered buffer that the output depends on."""

    steps: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return torch.tanh(self.linear(x)) * (1.0 + 0.25 * self.steps.float())


class Attributes(nn.Module):
    """Plain attributes changed in forward and read by it: an int, a float, a bool, a reassigned tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.scale = 1.0
        self.flip = False
        self.last = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scale = self.scale * 0.5 + 0.25
        self.flip = not self.flip
        h = torch.sin(self.linear(x)) * (self.scale / self.calls) + self.last
        self.last = h.detach().mean()
        return -h if self.flip else h


class RunningMean(nn.Module):
    """Subtracts a running mean of its input kept in a buffer (reads, then updates it)."""

    mean: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x - self.mean
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return out


class ReassignedBuffer(nn.Module):
    """Replaces a registered buffer by a new tensor in forward (not in place), and reads it."""

    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + 0.1 * self.total
        self.total = self.total + x.detach().sum(0)
        return out


class ScaledBuffer(nn.Module):
    """Updates a buffer, then multiplies by it: autograd saves the buffer itself."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9).add_(x.abs().mean(0), alpha=0.1)
        return x * self.scale


# ------------------------------------------------------------------ nesting and structured outputs
class Parts(nn.Module):
    """Takes and returns nested structures: None, a constant, its input and a parameter passed through."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, extras: dict[str, Any]) -> dict[str, Any]:
        return {
            "y": self.first(x) * extras["scale"],
            "none": None,
            "same": x,
            "pair": (torch.tanh(self.second(x)), extras["none"]),
            "bias": self.second.bias,
            "count": 3,
        }


class Structured(nn.Module):
    """Calls Parts (recomputed as `mode` says) with a dict of keyword inputs, and combines its dict.

    With `outside_gradients` off, what Parts passes through is used by value only (see
    ``NOTE [reentrant limits]``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.parts = Parts()
        self.mode: str | None = None
        self.outside_gradients = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = call(self.mode, self.parts, x, extras={"scale": x.detach().sigmoid(), "none": None})
        assert out["none"] is None and out["pair"][1] is None and out["count"] == 3
        assert out["same"] is x and out["bias"] is self.parts.second.bias, "a tensor passed through is another one"
        same = out["same"] if self.outside_gradients else out["same"].detach()
        return out["y"] * out["pair"][0] + same * out["count"] + out["bias"]


class Nest(nn.Module):
    """Runs its layers, recomputed together as `mode` says: a recompute inside the layer's forward."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.mode: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call(self.mode, self.body, x)


@dataclasses.dataclass(frozen=True)
class Region:
    """Layers ``start`` to ``stop`` of a Net, called as `mode` says, with regions inside."""

    start: int
    stop: int
    mode: str | None
    inner: tuple[Region, ...] = ()


class Net(nn.Module):
    """Layers in a row, grouped in (nested) regions; the output is a dict holding None and the input.

    Each region is a function returning a tuple that holds None and the region's input
    too; the input is added back to the region's result (a residual).
    """

    def __init__(self, layers: list[nn.Module], regions: tuple[Region, ...], *, outside_gradients: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(WIDTH, 3)
        self.regions = regions
        self.outside_gradients = outside_gradients

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self._run(self.regions, 0, len(self.layers), x)
        return {"out": self.head(h), "none": None, "input": x, "pair": (h, None)}

    def loss(self, output: dict[str, Any]) -> torch.Tensor:
        used = [output["out"], output["pair"][0]] + ([output["input"]] if self.outside_gradients else [])
        return sum((weighted(t) for t in used), torch.zeros(()))

    def _run(self, regions: tuple[Region, ...], start: int, stop: int, h: torch.Tensor) -> torch.Tensor:
        for region in regions:
            h = self._layers(start, region.start, h)
            out = call(region.mode, self._region, region, h)
            assert out[1] is None and out[2]["input"] is h, "a tensor passed through is another tensor"
            h = out[0] + 0.5 * (out[2]["input"] if self.outside_gradients else out[2]["input"].detach())
            start = region.stop
        return self._layers(start, stop, h)

    def _region(self, region: Region, h: torch.Tensor) -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
        return self._run(region.inner, region.start, region.stop, h), None, {"input": h}

    def _layers(self, start: int, stop: int, h: torch.Tensor) -> torch.Tensor:
        for index in range(start, stop):
            h = self.layers[index](h)
        return h


def weighted(t: torch.Tensor) -> torch.Tensor:
    """A loss term of `t` that gives each element another gradient."""
    return (t * torch.linspace(-1.0, 2.0, t.numel()).view_as(t)).sum()


# ------------------------------------------------------------------ building models from specs
Spec = tuple[Any, ...]
"""A layer: ``(kind, *arguments)``, e.g. ``("ops", ("relu_", "view"))`` or ``("nest", "hooks", [...])``."""

SIMPLE_LAYERS: dict[str, Callable[..., nn.Module]] = {
    "ops": Ops,
    "batchnorm": lambda momentum: nn.BatchNorm1d(WIDTH, momentum=momentum),
    "buffer_counter": BufferCounter,
    "attributes": Attributes,
    "running_mean": RunningMean,
    "scaled_buffer": ScaledBuffer,
    "reassigned_buffer": ReassignedBuffer,
    "spectral_norm": lambda: nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH)),
    "parametrized_spectral_norm": lambda: parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)),
    "dropout": lambda p: nn.Dropout(p),
    # a conv-net block: its last two modules change their input in place
    "block": lambda: nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.2, inplace=True), nn.ReLU(inplace=True)
    ),
    # standalone in-place modules (Checkpointable chains only: a stage that changes its input)
    "relu_inplace": lambda: nn.ReLU(inplace=True),
    "dropout_inplace": lambda p: nn.Dropout(p, inplace=True),
}


class Builder:
    """Builds layers from specs; ``("again", i)`` calls the i-th layer built so far again (shared)."""

    def __init__(self, *, share: bool, outside_gradients: bool) -> None:
        self.share = share  # False: ("again", i) is a copy (same initial weights, not shared)
        self.outside_gradients = outside_gradients

    def layers(self, specs: list[Spec]) -> list[nn.Module]:
        built: list[nn.Module] = []
        for spec in specs:
            built.append(self.layer(spec, built))
        return built

    def layer(self, spec: Spec, built: list[nn.Module]) -> nn.Module:
        kind, *arguments = spec
        if kind == "again":
            earlier = built[arguments[0] % len(built)]
            return earlier if self.share else copy.deepcopy(earlier)
        if kind == "nest":
            nest = Nest(self.layers(arguments[1]))
            nest.mode = arguments[0]
            return nest
        if kind == "structured":
            structured = Structured()
            structured.mode = arguments[0]
            structured.outside_gradients = self.outside_gradients
            return structured
        return SIMPLE_LAYERS[kind](*arguments)


def uses_reentrant(value: Any) -> bool:
    """Whether a spec (any nesting of tuples, lists and Regions) asks for use_reentrant=True anywhere."""
    if isinstance(value, Region):
        return value.mode == "reentrant" or uses_reentrant(value.inner)
    if isinstance(value, tuple | list):
        return any(uses_reentrant(item) for item in value)
    return value == "reentrant"


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def without_recompute(model: ModuleT) -> ModuleT:
    """`model` with every layer's own recompute turned off (the plain reference)."""
    for module in model.modules():
        if isinstance(module, Nest | Structured):
            module.mode = None
        if isinstance(module, Net):
            module.regions = _plain_regions(module.regions)
    return model


def _plain_regions(regions: tuple[Region, ...]) -> tuple[Region, ...]:
    return tuple(Region(r.start, r.stop, None, _plain_regions(r.inner)) for r in regions)


def changes_its_input(module: nn.Module) -> bool:
    return bool(getattr(module, "inplace", False))


# ------------------------------------------------------------------ strategies
modes = st.sampled_from(MODES)
op_programs = st.lists(st.sampled_from(sorted(OPS)), max_size=6).map(tuple)

simple_layers: st.SearchStrategy[Spec] = st.one_of(
    op_programs.map(lambda ops: ("ops", ops)),
    st.sampled_from([0.1, None]).map(lambda momentum: ("batchnorm", momentum)),
    st.sampled_from(
        [
            ("buffer_counter",),
            ("attributes",),
            ("running_mean",),
            ("scaled_buffer",),
            ("reassigned_buffer",),
            ("spectral_norm",),
            ("parametrized_spectral_norm",),
            ("block",),
        ]
    ),
    st.sampled_from([0.0, 0.3, 1.0]).map(lambda p: ("dropout", p)),
    modes.map(lambda mode: ("structured", mode)),
)


def layer_lists(leaves: st.SearchStrategy[Spec], max_size: int, *, again: bool = True) -> st.SearchStrategy[list[Spec]]:
    """Lists of layers; with `again`, a layer after the first may be an earlier one called again (shared)."""
    items = st.one_of(leaves, st.integers(0, 7).map(lambda index: ("again", index))) if again else leaves
    return st.tuples(leaves, st.lists(items, max_size=max_size - 1)).map(lambda pair: [pair[0], *pair[1]])


layers_with_nests: st.SearchStrategy[Spec] = st.recursive(
    simple_layers,
    lambda children: st.tuples(st.just("nest"), modes, layer_lists(children, 3)),
    max_leaves=6,
)


@st.composite
def regions(draw: st.DrawFn, start: int, stop: int, depth: int = 2) -> tuple[Region, ...]:
    """Disjoint, possibly empty, runs of layers in [start, stop), each with regions inside."""
    if depth == 0:
        return ()
    cuts = sorted(draw(st.lists(st.integers(start, stop), max_size=4)))
    return tuple(
        Region(first, last, draw(modes), draw(regions(first, last, depth - 1)))
        for first, last in zip(cuts[0::2], cuts[1::2])
    )


@dataclasses.dataclass(frozen=True)
class Case:
    """A random model and how remat is applied to its copy."""

    layers: list[Spec]
    regions: tuple[Region, ...]
    marks: tuple[tuple[str, str], ...]  # (module name, mode)
    input_requires_grad: bool
    autocast: bool  # the forward runs under CPU autocast to bfloat16
    micro_batches: int  # forwards before each backward
    steps: int

    def build(self) -> tuple[Net, Net]:
        """The plain model and the model with remat, with equal parameters and buffers."""
        # NOTE [reentrant limits] (README, "Limits of the reentrant implementation"; found
        # by this property, kept as strict xfails below): a reentrant block sums the
        # gradients of a tensor's uses inside it before those from outside, where plain
        # autograd sums all of them in the order they arrive (other last bits), and under
        # autocast it cannot share the one cached cast of a leaf used inside and outside.
        # Examples that use use_reentrant=True leave out just those constructs: they share
        # no layers, use what a block passes through (residuals, Structured's input, the
        # Net's input) outside by value only, run one forward per backward and no autocast
        # (see `cases`).
        reentrant = uses_reentrant([self.layers, self.regions, self.marks])
        torch.manual_seed(0)
        builder = Builder(share=not reentrant, outside_gradients=not reentrant)
        recomputed = Net(builder.layers(self.layers), self.regions, outside_gradients=not reentrant)
        plain = without_recompute(copy.deepcopy(recomputed))
        modules = dict(recomputed.named_modules())
        for name, mode in self.marks:
            remat.mark(modules[name], **recompute_options(mode))
        return plain, recomputed


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layers = draw(layer_lists(layers_with_nests, 5))
    torch.manual_seed(0)
    sample = Net(Builder(share=True, outside_gradients=True).layers(layers), (), outside_gradients=True)
    names = [name for name, module in sample.named_modules() if not changes_its_input(module)]
    marks = draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(RECOMPUTE_MODES)), max_size=4))
    region_tree = draw(regions(0, len(layers)))
    reentrant = uses_reentrant([layers, region_tree, marks])
    return Case(
        layers=layers,
        regions=region_tree,
        marks=tuple(dict(marks).items()),
        input_requires_grad=draw(st.booleans()),
        autocast=draw(st.booleans()) and not reentrant,  # NOTE [reentrant limits]
        micro_batches=1 if reentrant else draw(st.sampled_from([1, 2])),
        steps=draw(st.sampled_from([2, 1])),
    )


# ------------------------------------------------------------------ one training step, compared
@dataclasses.dataclass
class StepResult:
    """Everything a training step leaves, to compare."""

    output: list[Any]
    output_structure: Any
    tensors: dict[str, torch.Tensor | None]
    attributes: dict[str, Any]


def plain_attributes(model: nn.Module) -> dict[str, Any]:
    """Every submodule's attributes of plain types (tensors that are not parameters or buffers included)."""
    found = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key != "mode" and isinstance(value, bool | int | float | str | torch.Tensor):
                found[f"{name}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return found


def train_step(
    model: nn.Module,
    inner: nn.Module,
    x: torch.Tensor,
    *,
    requires_grad: bool,
    autocast: bool,
    micro_batches: int,
    seed: int,
    loss_fn: Callable[[Any], torch.Tensor],
    lr: float = 0.01,
) -> StepResult:
    """One seeded step: `micro_batches` forwards, ``loss_fn`` of each, one backward, an SGD update of `inner`.

    `inner` is the model inside `model` (the model itself, or the one a Checkpointable wraps).
    """
    inner.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(requires_grad)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # gradient accumulation: earlier forwards whose graphs the backward reaches too
        earlier = [model(x * (0.5 + index)) for index in range(micro_batches - 1)]
        output = model(x)
    if isinstance(output, dict):
        assert output["input"] is x, "the input passed through is another tensor"
    sum((loss_fn(out) for out in earlier), loss_fn(output)).backward()
    found: dict[str, torch.Tensor | None] = {"rng state": torch.get_rng_state(), "input grad": x.grad}
    found.update({f"grad {name}": p.grad for name, p in inner.named_parameters()})
    with torch.no_grad():
        for p in inner.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
    found.update({f"param {name}": p.detach().clone() for name, p in inner.named_parameters()})
    found.update({f"buffer {name}": b.clone() for name, b in inner.named_buffers()})
    leaves, structure = tree_flatten(output)
    output_values = [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return StepResult(output_values, structure, found, plain_attributes(inner))


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of tensors (NaN where NaN), plain equality of anything else."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            nan = a.isnan()
            return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


def assert_same_step(expected: StepResult, actual: StepResult, step: int) -> None:
    assert expected.output_structure == actual.output_structure, f"step {step}: output structures differ"
    wrong = [f"output {i}" for i, (e, a) in enumerate(zip(expected.output, actual.output)) if not same(e, a)]
    for what, e_map, a_map in (
        ("", expected.tensors, actual.tensors),
        ("attribute ", expected.attributes, actual.attributes),
    ):
        assert e_map.keys() == a_map.keys(), f"step {step}: different names"
        wrong += [
            f"{what}{name}"
            for name, value in e_map.items()
            if not (value is None and a_map[name] is None) and not same(value, a_map[name])
        ]
    assert not wrong, f"step {step}: differ from plain autograd: {', '.join(wrong)}"


#: Errors of plain autograd on a model that changes in place what it may not (the generator
#: avoids most of them; e.g. ``Dropout(0.0)`` returns its input itself, which Loop may scale).
PLAIN_AUTOGRAD_REFUSALS = ("modified by an inplace operation", "a leaf Variable that requires grad")


def run_plain(model: nn.Module, x: torch.Tensor, *, steps: int, **step_options: Any) -> list[StepResult]:
    """The reference steps; a model that plain autograd itself rejects is not an example."""
    results = []
    for step in range(steps):
        try:
            results.append(train_step(model, model, x, seed=step, **step_options))
        except RuntimeError as error:
            assume(not any(refusal in str(error) for refusal in PLAIN_AUTOGRAD_REFUSALS))
            raise
    return results


# ------------------------------------------------------------------ the properties
@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=cases())
def test_manual_recompute_matches_plain_autograd(case: Case) -> None:
    plain, recomputed = case.build()
    x = torch.randn(BATCH, WIDTH)
    options: dict[str, Any] = {
        "requires_grad": case.input_requires_grad,
        "autocast": case.autocast,
        "micro_batches": case.micro_batches,
    }
    expected = run_plain(plain, x, steps=case.steps, loss_fn=plain.loss, **options)
    for step, reference in enumerate(expected):
        actual = train_step(recomputed, recomputed, x, seed=step, loss_fn=recomputed.loss, **options)
        assert_same_step(reference, actual, step)


class Loop(nn.Module):
    """An unmodified model whose forward loops over its blocks (not an nn.Sequential).

    After the blocks listed in `scaled_after`, the forward scales the block's output in
    place before the next block takes it.
    """

    def __init__(self, layers: list[nn.Module], scaled_after: frozenset[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.scaled_after = scaled_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index in self.scaled_after:
                x.mul_(1.5)
        return self.head(x)


def chain_model(layers: list[Spec], loop: frozenset[int] | None, *, outside_gradients: bool) -> nn.Module:
    """An nn.Sequential of the layers and a head, or (`loop` not None) a Loop model of them."""
    torch.manual_seed(0)
    built = Builder(share=False, outside_gradients=outside_gradients).layers(layers)
    return nn.Sequential(*built, nn.Linear(WIDTH, WIDTH)) if loop is None else Loop(built, loop)


CHECKPOINTABLE_REFUSALS = ("is it marked with remat.mark?", "remat found no chain", "the frugal measurement")


chain_layers: st.SearchStrategy[Spec] = st.one_of(
    simple_layers,
    st.sampled_from([("relu_inplace",), ("dropout_inplace", 0.3)]),
    st.tuples(st.just("nest"), modes, layer_lists(simple_layers, 2, again=False)),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    layers=layer_lists(chain_layers, 6, again=False),
    loop=st.sampled_from([None, frozenset(), frozenset({0}), frozenset({1, 3})]),
    budget=st.one_of(st.just("min"), st.floats(0.3, 1.0)),
    solver=st.sampled_from(["optimal", "periodic", "inputs", "none"]),
    frugal_measure=st.booleans(),
    with_loss_fn=st.booleans(),
    input_requires_grad=st.booleans(),
    autocast=st.booleans(),
    micro_batches=st.sampled_from([1, 2]),
    steps=st.sampled_from([2, 1]),
    data=st.data(),
)
@pytest.mark.filterwarnings("ignore:stages .* allocate memory that outlives the forward:RuntimeWarning")
def test_checkpointable_matches_plain_autograd(
    layers: list[Spec],
    loop: frozenset[int] | None,
    budget: float | str,
    solver: str,
    frugal_measure: bool,
    with_loss_fn: bool,
    input_requires_grad: bool,
    autocast: bool,
    micro_batches: int,
    steps: int,
    data: st.DataObject,
) -> None:
    # marks on modules inside the stages (a marked stage is refused, documented)
    names = sorted(
        name
        for name, module in chain_model(layers, loop, outside_gradients=True).named_modules()
        if name.count(".") > 1 and not changes_its_input(module)
    )
    marks = dict(
        data.draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(RECOMPUTE_MODES)), max_size=2))
        if names
        else []
    )
    reentrant = uses_reentrant([layers, list(marks.values())])  # NOTE [reentrant limits]
    autocast = autocast and not reentrant
    micro_batches = 1 if reentrant else micro_batches
    model = chain_model(layers, loop, outside_gradients=not reentrant)
    plain = without_recompute(copy.deepcopy(model))
    modules = dict(model.named_modules())
    for name, mode in marks.items():  # manual recompute inside the automatic mode's stages
        remat.mark(modules[name], **recompute_options(mode))
    wrapped = remat.Checkpointable(
        model,
        budget,
        solver=solver,
        measure="frugal" if frugal_measure else "sized",
        loss_fn=weighted if with_loss_fn else None,
    )
    x = torch.randn(BATCH, WIDTH)
    options: dict[str, Any] = {
        "requires_grad": input_requires_grad,
        "autocast": autocast,
        "micro_batches": micro_batches,
        "loss_fn": weighted,
    }
    expected = run_plain(plain, x, steps=steps, **options)
    for step, reference in enumerate(expected):
        try:
            actual = train_step(wrapped, model, x, seed=step, **options)
        except remat.BudgetTooSmall as error:
            assert step == 0 and budget != "min" or solver == "none", error
            assert error.minimum_bytes > error.budget_bytes
            # the refused first call must have left the model as it was
            wrapped.mem_limit = "min" if budget != "min" else error.minimum_bytes
            actual = train_step(wrapped, model, x, seed=step, **options)
        except remat.UnsupportedModel as error:
            # refused at the first call, as documented: a marked stage, a chain all marked,
            # a chain input changed in place that the frugal measurement cannot keep
            assert step == 0 and any(refusal in str(error) for refusal in CHECKPOINTABLE_REFUSALS), error
            reject()
        except NotImplementedError as error:
            # NOTE [autocast's cache after measuring]: no frugal measuring step under autocast
            assert step == 0 and frugal_measure and autocast and "under autocast" in str(error), error
            reject()
        assert_same_step(reference, actual, step)


# ------------------------------------------------------------------ what these properties found
# One test each, on the smallest model that showed it. The defects were fixed while this
# file was written; the two reentrant limits are documented instead (NOTE [reentrant
# limits]): they are strict xfails, so that lifting one shows here, together with the
# property's exclusion to remove.
def gradients_of(model: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """The input's and every parameter's gradient after one backward of ``run(model, x)``."""
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run(model, x).square().sum().backward()
    return {"input": x.grad} | {name: p.grad for name, p in model.named_parameters()}


def assert_same_gradients(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert expected.keys() == actual.keys()
    wrong = [name for name in expected if not same(expected[name], actual[name])]
    assert not wrong, f"differ from plain autograd: {', '.join(wrong)}"


@pytest.mark.xfail(
    strict=True,
    reason="documented reentrant limit: a block sums the gradients of a tensor's uses inside it before adding "
    "those from outside; plain autograd sums them in arrival order (other last bits)",
)
def test_reentrant_block_sums_gradients_in_plain_autograd_order() -> None:
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def block(a: torch.Tensor) -> torch.Tensor:
        return first(a) * second(a)  # the input is used twice inside the block

    def input_grad(recompute: bool) -> torch.Tensor | None:
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = x * 1.5
        y = remat.recompute(block, h, use_reentrant=True) if recompute else block(h)
        (y + h).sum().backward()  # and once outside it (a residual)
        return x.grad

    assert same(input_grad(False), input_grad(True))


@pytest.mark.parametrize(
    "use_reentrant",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="documented reentrant limit: autocast shares one cast of a leaf between its uses inside "
                "and outside a block; the reentrant recompute casts a detached copy anew",
            ),
        ),
    ],
)
def test_reentrant_block_under_autocast_shares_a_leafs_cast_with_the_outside(use_reentrant: bool) -> None:
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)  # a leaf, used inside the block and outside it

    def input_grad(recompute: bool) -> torch.Tensor | None:
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = remat.recompute(first, x, use_reentrant=use_reentrant) if recompute else first(x)
            y = inside * torch.tanh(second(x))
        y.float().square().sum().backward()
        return x.grad

    assert same(input_grad(False), input_grad(True))


def test_reentrant_block_under_autocast_is_exact() -> None:
    # the reentrant recompute ran on leaf copies of the block's inputs, whose casts autocast
    # cached: two uses shared one bfloat16 cast
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def block(a: torch.Tensor) -> torch.Tensor:
        return first(a) * torch.tanh(second(a))  # the input is used twice inside the block

    def input_grad(recompute: bool) -> torch.Tensor | None:
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x * 1.5
            y = remat.recompute(block, h, use_reentrant=True) if recompute else block(h)
        y.float().square().sum().backward()
        return x.grad

    assert same(input_grad(False), input_grad(True))


class MarkedBody(nn.Module):
    """A model that recomputes its body itself (a marked nn.Sequential in a block), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Nest(
            [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        )
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("frugal_measure", [False, True])
@pytest.mark.filterwarnings("ignore:stages .* allocate memory that outlives the forward:RuntimeWarning")
def test_checkpointable_of_a_model_with_a_marked_body_is_exact(frugal_measure: bool) -> None:
    plain = MarkedBody()
    model = copy.deepcopy(plain)
    remat.mark(model.block.body)
    # the marked body's modules were taken as the chain's stages, which its own recompute
    # calls again: refused while measuring, or wrong gradients when measured frugally
    wrapped = remat.Checkpointable(model, "min", measure="frugal" if frugal_measure else "sized")
    assert_same_gradients(gradients_of(plain, lambda m, x: m(x)), gradients_of(model, lambda m, x: wrapped(x)))


def test_optimal_plan_is_valid_with_a_pinned_stage_after_a_break() -> None:
    # baselines.within_breaks stored a pinned stage that ends a cut region twice, and the
    # optimal solver, which checks the baselines' plans, raised InvalidPlan
    profile = ChainProfile(
        names=tuple(f"s{stage}" for stage in range(5)),
        forward_time_s=(1.0, 1.0, 1.0, 2.0, 1.0),
        backward_time_s=(1.0,) * 5,
        saved_bytes=(64, 64, 0, 64, 0),
        saves_input=(False,) * 5,
        saves_output=(False,) * 5,
        forward_temp_bytes=(0,) * 5,
        backward_temp_bytes=(0, 0, 0, 0, 144),
        activation_bytes=(0,) * 6,
        gradient_bytes=(0,) * 6,
        region_breaks=(1,),
        pinned_stages=(2,),
    )
    solver = OptimalSolver(implementation="numpy")
    minimum = solver.minimum_bytes(profile)
    assert solver(profile, minimum).predicted_peak_bytes <= minimum


@pytest.mark.parametrize("outer", ["hooks", "reentrant"])
def test_marked_module_with_a_weight_pre_hook_inside_a_block_gets_its_gradients(outer: str) -> None:
    # nn.utils.spectral_norm sets `weight` in a pre-hook; replaying the weight set in a
    # reentrant block's no_grad forward left weight_orig without a gradient
    plain = nn.Sequential(nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH)))
    model = copy.deepcopy(plain)
    remat.mark(model[0])
    expected = gradients_of(plain, lambda m, x: m(x))
    actual = gradients_of(model, lambda m, x: remat.recompute(m, x, use_reentrant=outer == "reentrant"))
    assert_same_gradients(expected, actual)


class ViewChangedInPlace(nn.Module):
    """Returns a view of its linear layer's output, changed in place through a view of the view."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).view(2, -1).view(BATCH, WIDTH)
        h[:, 1] = 0.0
        return h


def test_stage_returning_a_view_changed_in_place_is_measured() -> None:
    # Tensor.register_hook on such a view crashed PyTorch (a segmentation fault) unless its
    # grad_fn was read first; measurement hooks every stage output
    plain = nn.Sequential(ViewChangedInPlace(), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    model = copy.deepcopy(plain)
    expected = gradients_of(plain, lambda m, x: m(x))
    actual = gradients_of(model, lambda m, x: remat.Checkpointable(m, "min")(x))
    assert_same_gradients(expected, actual)


@pytest.mark.parametrize("mode", ["hooks", "reentrant"])
def test_block_changing_its_own_input_in_place_is_refused_with_remat_error(mode: str) -> None:
    # the reentrant mode raised torch's "a leaf Variable that requires grad is being used in
    # an in-place operation" (documented: RecomputeInputModified)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    h = first(torch.randn(BATCH, WIDTH, requires_grad=True))
    with pytest.raises(remat.RecomputeInputModified):
        remat.recompute(lambda a: second(torch.relu_(a)), h, use_reentrant=mode == "reentrant").sum().backward()
