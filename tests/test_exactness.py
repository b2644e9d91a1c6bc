"""Exactness where models are adversarial: state changed in forward, in-place writes, odd outputs.

Every case is compared with plain autograd bit for bit (``torch.equal``), in the two
manual implementations and in the automatic mode, or asserts the error remat raises
instead (by type and message).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils import parametrizations

import remat
from chain_helpers import assert_same_tensors, compare_training, grads_of, state_of
from remat import RematError
from remat.plan import Region, Schedule, Store

pytestmark = pytest.mark.usefixtures("clean_remat_state")

MANUAL = ["hooks", "reentrant"]


def run_manual(model: nn.Module, x: torch.Tensor, mode: str, *, nested: bool = False) -> torch.Tensor:
    """One forward of `model` recomputed whole (and, if `nested`, each child again inside)."""
    use_reentrant = mode == "reentrant"
    if nested:
        children = list(model.children())

        def body(h: torch.Tensor) -> torch.Tensor:
            for child in children:
                h = remat.recompute(child, h, use_reentrant=use_reentrant)
            return h

        return remat.recompute(body, x, use_reentrant=use_reentrant)
    return remat.recompute(model, x, use_reentrant=use_reentrant)


def assert_manual_matches(make: Callable[[], nn.Module], x: torch.Tensor, mode: str, *, nested: bool = False) -> None:
    """Two seeded training steps, plain against recomputed: outputs, gradients, state."""
    torch.manual_seed(0)
    plain = make()
    recomputed = copy.deepcopy(plain)
    for step in range(2):
        for model in (plain, recomputed):
            model.zero_grad(set_to_none=True)
        inputs = [x.clone().requires_grad_(True) for _ in range(2)]
        torch.manual_seed(step)
        expected = plain(inputs[0])
        (expected * torch.linspace(-1, 1, expected.shape[-1])).sum().backward()
        torch.manual_seed(step)
        actual = run_manual(recomputed, inputs[1], mode, nested=nested)
        (actual * torch.linspace(-1, 1, actual.shape[-1])).sum().backward()
        assert torch.equal(expected, actual), f"step {step}: outputs differ"
        assert_same_tensors(grads_of(plain), grads_of(recomputed), f"step {step}: gradients")
        assert_same_tensors({"x": inputs[0].grad}, {"x": inputs[1].grad}, f"step {step}: input gradients")  # type: ignore[dict-item]
        assert_same_tensors(state_of(plain), state_of(recomputed), f"step {step}: state")  # type: ignore[arg-type]
        assert vars_of(plain) == vars_of(recomputed), f"step {step}: plain attributes differ"


def vars_of(model: nn.Module) -> dict[str, Any]:
    """The plain number attributes of every submodule."""
    return {
        f"{name}.{key}": value
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


# ------------------------------------------------------------------ stateful modules
class BufferCounter(nn.Module):
    """Counts steps in a buffer and scales its output by the count (the forward reads it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return torch.tanh(self.linear(x)) * self.steps.float()


class AttributeCounter(nn.Module):
    """Counts calls in a plain int attribute and uses it in the computation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.sin(self.linear(x)) / self.calls


class RunningMean(nn.Module):
    """Keeps a running mean of its input in a buffer and subtracts it (reads then writes)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x - self.mean
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return out


def stateful_model() -> nn.Module:
    width = 32
    return nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(width, width)),
        nn.Tanh(),
        parametrizations.spectral_norm(nn.Linear(width, width)),
        BufferCounter(width),
        RunningMean(width),
        AttributeCounter(width),
        nn.BatchNorm1d(width),
        nn.Dropout(0.3),
        nn.Linear(width, width),
    )


@pytest.mark.parametrize("nested", [False, True], ids=["whole", "nested"])
@pytest.mark.parametrize("mode", MANUAL)
def test_state_changed_in_forward_is_replayed_exactly(mode: str, nested: bool) -> None:
    assert_manual_matches(stateful_model, torch.randn(16, 32), mode, nested=nested)


@pytest.mark.parametrize("mode", MANUAL)
def test_marked_stateful_modules_are_exact(mode: str) -> None:
    def make() -> nn.Module:
        model = stateful_model()
        for child in list(model)[::2]:
            remat.mark(child, use_reentrant=mode == "reentrant")
        return model

    torch.manual_seed(0)
    plain = stateful_model()
    marked = make()
    marked.load_state_dict(plain.state_dict())
    x = torch.randn(16, 32)
    for step in range(2):
        torch.manual_seed(step)
        plain(x).square().sum().backward()
        torch.manual_seed(step)
        marked(x).square().sum().backward()
        assert_same_tensors(grads_of(plain), grads_of(marked), f"step {step}: gradients")
        assert_same_tensors(state_of(plain), state_of(marked), f"step {step}: state")  # type: ignore[arg-type]
        assert vars_of(plain) == vars_of(marked)


@pytest.mark.parametrize("budget", ["min", 0.8])
def test_automatic_mode_replays_state_exactly(budget: Any) -> None:
    torch.manual_seed(0)
    plain = stateful_model()
    wrapped = remat.Checkpointable(copy.deepcopy(plain), budget)
    compare_training(plain, wrapped, [torch.randn(16, 32)], lambda out: out.square().sum(), steps=3)
    assert vars_of(plain) == vars_of(wrapped.model)


def test_plain_attribute_tensor_changed_in_place_is_refused() -> None:
    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.total = torch.zeros(3)  # not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(1)
            return x * 2

    with pytest.raises(RematError, match=r"Cache.total is a tensor attribute.*register_buffer\('total'"):
        remat.recompute(Cache(), torch.randn(3, requires_grad=True))


class LazyScale(nn.Module):
    """Creates a plain attribute in its first forward, then changes it in every later one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in vars(self):
            self.scale = 2.0
        else:
            self.scale += 1.0
        return torch.sin(self.linear(x) * self.scale)


@pytest.mark.parametrize("nested", [False, True], ids=["whole", "nested"])
@pytest.mark.parametrize("mode", MANUAL)
def test_an_attribute_the_forward_creates_is_absent_again_in_the_recompute(mode: str, nested: bool) -> None:
    # The recompute of the first step must see the module without `scale`, as the first
    # forward did: with it, it would take the later branch and compute sin(3 * ...).
    assert_manual_matches(
        lambda: nn.Sequential(nn.Linear(8, 8), LazyScale(8), nn.Tanh()), torch.randn(4, 8), mode, nested=nested
    )


@pytest.mark.parametrize("mode", MANUAL)
def test_a_global_hook_that_counts_calls_on_torch_layers_counts_each_once(mode: str) -> None:
    def count(module: nn.Module, args: Any) -> None:
        module.calls = vars(module).get("calls", 0) + 1  # type: ignore[assignment]

    handle = nn.modules.module.register_module_forward_pre_hook(count)
    try:
        assert_manual_matches(
            lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), torch.randn(4, 8), mode
        )
    finally:
        handle.remove()


@pytest.mark.parametrize("mode", MANUAL)
def test_a_global_hook_installed_between_forward_and_backward_leaves_the_replay_in_step(mode: str) -> None:
    # The recording left torch's layers out of its numbering; the replay, run while a
    # global hook of the user's is installed, must number the calls as the recording did.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 8))
    recomputed = copy.deepcopy(plain)
    x = torch.randn(16, 8)
    plain(x).square().sum().backward()
    out = remat.recompute(recomputed, x, use_reentrant=mode == "reentrant")
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        out.square().sum().backward()
    finally:
        handle.remove()
    assert_same_tensors(grads_of(plain), grads_of(recomputed), "gradients")
    assert_same_tensors(state_of(plain), state_of(recomputed), "state")  # type: ignore[arg-type]


def test_the_attributes_a_call_changed_are_those_it_rebound_added_or_removed() -> None:
    from remat.manual._attributes import MISSING, Attributes

    module = nn.Linear(2, 2)
    module.count, module.name, module.gone, module.history = 1, "a", 2.0, [1]  # type: ignore[assignment]
    module.kept = [0]  # type: ignore[assignment]
    before = Attributes(module)
    assert before.changed(module) == {}
    module.count += 1  # type: ignore[operator]
    del module.gone
    module.added = 3  # type: ignore[assignment]
    module.history = 4  # type: ignore[assignment]  # a list before: put back as the list
    module.kept = [1]  # type: ignore[assignment]  # neither value plain: not state
    module._private = 5  # type: ignore[assignment]
    assert before.changed(module) == {"count": 1, "gone": 2.0, "added": MISSING, "history": [1]}


class _HookedScale(nn.Module):
    """A forward pre-hook on a torch layer that changes one of the layer's attributes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.linear.factor = 1.0  # type: ignore[assignment]
        self.linear.register_forward_pre_hook(self._grow)

    @staticmethod
    def _grow(module: nn.Module, args: Any) -> tuple[torch.Tensor]:
        module.factor = module.factor * 2  # type: ignore[operator, assignment]
        return (args[0] * module.factor,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("mode", MANUAL)
def test_a_torch_layer_whose_hook_changes_it_is_replayed(mode: str) -> None:
    # torch's own layers are not noted (NOTE [layers that keep no state]) unless, as here,
    # a hook of theirs may change them.
    assert_manual_matches(lambda: nn.Sequential(_HookedScale(8), nn.GELU(), _HookedScale(8)), torch.randn(4, 8), mode)


# ------------------------------------------------------------------ outputs
@pytest.mark.parametrize("mode", MANUAL)
def test_outputs_holding_none_and_constants(mode: str) -> None:
    linear = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def block(a: torch.Tensor) -> Any:
        return {"y": linear(a), "none": None, "n": 3, "pair": (None, torch.tanh(a))}

    out = remat.recompute(block, x, use_reentrant=mode == "reentrant")
    assert out["none"] is None and out["n"] == 3 and out["pair"][0] is None
    (out["y"].sum() + out["pair"][1].sum()).backward()
    expected_x = x.grad
    x.grad = None
    plain = block(x)
    (plain["y"].sum() + plain["pair"][1].sum()).backward()
    assert torch.equal(expected_x, x.grad)
    # a block returning nothing at all, and a block mapped over inputs
    assert remat.recompute(lambda a: None, x, use_reentrant=mode == "reentrant") is None
    mapped = list(map(lambda a: remat.recompute(block, a, use_reentrant=mode == "reentrant"), [x, x]))
    assert len(mapped) == 2 and mapped[1]["none"] is None


@pytest.mark.parametrize("mode", MANUAL)
@pytest.mark.parametrize(
    "passthrough",
    ["input", "view", "constant", "parameter", "input_twice", "non_grad_input", "global"],
)
def test_outputs_not_computed_inside_the_block(mode: str, passthrough: str) -> None:
    linear = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    side = torch.randn(2, 3)

    def block(a: torch.Tensor, b: torch.Tensor) -> Any:
        extra = {
            "input": a,
            "view": a[0],
            "constant": torch.ones(3),
            "parameter": linear.weight,
            "input_twice": (a, a),
            "non_grad_input": b,
            "global": GLOBAL_CONSTANT,
        }[passthrough]
        return torch.tanh(linear(a)), extra

    def loss(out: Any) -> torch.Tensor:
        return sum(t.sum() * (i + 1) for i, t in enumerate(torch.utils._pytree.tree_leaves(out)))  # type: ignore[return-value]

    def gradients(out: Any) -> list[torch.Tensor]:
        for t in (x, linear.weight, linear.bias):
            t.grad = None
        loss(out).backward()
        return [t.grad for t in (x, linear.weight, linear.bias)]  # type: ignore[misc]

    expected = gradients(block(x, side))
    actual = gradients(remat.recompute(block, x, side, use_reentrant=mode == "reentrant"))
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)
    # a tensor from outside the block keeps its own (absent) history
    assert GLOBAL_CONSTANT.grad_fn is None and not GLOBAL_CONSTANT.requires_grad
    assert side.grad_fn is None and not side.requires_grad


GLOBAL_CONSTANT = torch.ones(3)


# ------------------------------------------------------------------ in place after the region
def test_output_changed_in_place_before_the_next_block_is_not_replayed_stale() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def run(recompute: bool) -> list[torch.Tensor]:
        def one(a: torch.Tensor) -> torch.Tensor:
            return first(a) * 2

        def two(a: torch.Tensor) -> torch.Tensor:
            return torch.tanh(second(a))

        if recompute:
            h = remat.recompute(one, x, output_recompute=True)
            h.mul_(1.5)
            h[:, 0] = 0.0
            y = remat.recompute(two, h, output_recompute=True)
        else:
            h = one(x)
            h.mul_(1.5)
            h[:, 0] = 0.0
            y = two(h)
        return list(torch.autograd.grad(y.square().sum(), [x, first.weight, second.weight]))

    for e, a in zip(run(False), run(True)):
        assert torch.equal(e, a)


def test_saved_tensor_without_grad_keeps_its_identity() -> None:
    x = torch.randn(3, requires_grad=True)
    weight = torch.randn(3)
    y = remat.recompute(lambda a: a * weight, x)
    assert y.grad_fn._saved_other is weight  # type: ignore[union-attr]


# ------------------------------------------------------------------ the first step
class Logged(nn.Module):
    """Logs is_recomputing() at each forward in a list, counts calls in an attribute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.2)
        self.log: list[bool] = []
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(remat.is_recomputing())
        self.calls += 1
        return self.dropout(torch.tanh(self.linear(x)))


class Loop(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Logged(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["sequential", "loop"])
@pytest.mark.parametrize("budget", ["min", 1.0])
def test_first_step_is_one_plain_step_to_the_user(kind: str, budget: Any) -> None:
    """Measurement runs report is_recomputing(); model, RNG and hooks end as after one step."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(Logged(16) for _ in range(5))) if kind == "sequential" else Loop(16, 5)
    model = copy.deepcopy(plain)
    hooked: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: hooked.append(type(module).__name__) if not remat.is_recomputing() else None
    )
    try:
        x = torch.randn(8, 16)
        torch.manual_seed(7)
        plain(x).sum().backward()
        plain_rng, plain_hooks = torch.get_rng_state(), list(hooked)
        hooked.clear()
        torch.manual_seed(7)
        remat.Checkpointable(model, budget)(x).sum().backward()
        remat_rng = torch.get_rng_state()
    finally:
        handle.remove()
    logged = [m for m in model.modules() if isinstance(m, Logged)]
    assert all(m.log.count(False) == 1 for m in logged)  # one forward the user sees
    # global hooks: once per call outside remat's own runs (the wrapper is a module too)
    assert [name for name in hooked if name != "Checkpointable"] == plain_hooks
    assert torch.equal(plain_rng, remat_rng)
    assert vars_of(plain) == vars_of(model)
    assert_same_tensors(grads_of(plain), grads_of(model), "gradients")
    assert_same_tensors(state_of(plain), state_of(model), "state")  # type: ignore[arg-type]


class InPlaceFirst(nn.Module):
    """A loop model whose first stage changes the model's input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4 if i == 0 else 32, 32), nn.Tanh()) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(x)
        for block in self.blocks:
            x = block(x)
        return x


def _changes_the_chain_input(kind: str) -> nn.Module:
    tail = [nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    if kind == "loop":
        return InPlaceFirst()
    if kind == "relu_ first":
        return nn.Sequential(nn.ReLU(inplace=True), *tail)
    # the first stage returns its input itself; the second changes it in place through it
    first = nn.Identity() if kind == "identity, then relu_" else nn.Dropout(0.0)
    return nn.Sequential(first, nn.ReLU(inplace=True), *tail)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kind", ["relu_ first", "identity, then relu_", "dropout(0), then relu_", "loop"])
def test_a_chain_input_changed_in_place_is_never_recomputed(kind: str, requires_grad: bool) -> None:
    torch.manual_seed(0)
    plain = _changes_the_chain_input(kind)
    model = copy.deepcopy(plain)
    wrapped = remat.Checkpointable(model, "min")
    results = []
    for net in (plain, wrapped):
        base = torch.randn(16, 4, generator=torch.Generator().manual_seed(1), requires_grad=requires_grad)
        x = base * 1.0 if requires_grad else base  # a leaf requiring grad cannot change in place
        net(x).square().sum().backward()
        results.append((x.detach().clone(), base.grad))
    # the caller's input is changed exactly as the plain forward changes it, once
    assert torch.equal(results[0][0], results[1][0])
    assert (results[0][1] is None) == (results[1][1] is None)
    if requires_grad:
        assert torch.equal(results[0][1], results[1][1])
    assert_same_tensors(grads_of(plain), grads_of(model), "gradients")
    assert wrapped.plan is not None
    assert wrapped.plan.schedule.profile.pinned_stages == (0,)
    assert any(isinstance(item, Region) for item in wrapped.plan.schedule.items)  # the rest is recomputed


@pytest.mark.parametrize("kind", ["relu_ first", "identity, then relu_", "loop"])
def test_frugal_measurement_refuses_a_changed_chain_input_and_leaves_it_untouched(kind: str) -> None:
    x = torch.randn(3, 4)
    before = x.clone()
    version = x._version
    with pytest.raises(remat.UnsupportedModel, match="input of its first stage .* is changed in place"):
        remat.Checkpointable(_changes_the_chain_input(kind), "min", measure="frugal")(x)
    assert torch.equal(x, before) and x._version == version


# ------------------------------------------------------------------ bad input
def test_checkpointable_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="Checkpointable wraps an nn.Module, got function"):
        remat.Checkpointable(lambda x: x, 0.5)  # type: ignore[arg-type]


def test_budget_of_one_always_plans_storing_everything() -> None:
    for width in (2, 8):
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh())  # minimum == no recompute
        wrapped = remat.Checkpointable(model, 1.0)
        wrapped.measure(torch.randn(3, width))
        plan = wrapped.plan_for(1.0)
        assert plan.overhead_fraction == 0.0


@pytest.mark.parametrize(
    ("output", "found"),
    [
        (lambda y: y.to(torch.complex64), "complex64"),
        (lambda y: (y > 0).long(), "torch.int64"),
        (lambda y: "text", "no tensor"),
        (lambda y: y.detach(), "requires_grad=False"),
    ],
)
def test_default_loss_that_cannot_be_formed_asks_for_loss_fn(output: Callable[[Any], Any], found: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> Any:
            for block in self.blocks:
                x = block(x)
            return output(x)

    model = Model()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 4)
    rng = torch.get_rng_state()
    with pytest.raises(RematError, match=f"(?s)cannot form a default loss.*{found}.*loss_fn="):
        remat.Checkpointable(model, 0.5)(x)
    # nothing left behind
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert all("_call_impl" not in m.__dict__ and "forward" not in m.__dict__ for m in model.modules())


# ------------------------------------------------------------------ tools
class Tail(nn.Module):
    """Saves nothing for backward (a scalar product) and logs is_recomputing() per call."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(remat.is_recomputing())
        return x * 2.0


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_skips_the_rest_of_the_block(early_stop: bool) -> None:
    tail = Tail()
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), tail)
    x = torch.randn(3, 4, requires_grad=True)
    remat.recompute(block, x, early_stop=early_stop).sum().backward()
    assert tail.log == ([False] if early_stop else [False, True])


@pytest.mark.parametrize("mode", MANUAL)
def test_context_fn_wraps_the_forward_and_each_recompute(mode: str) -> None:
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def context(name: str) -> Any:
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    out = remat.recompute(
        block, x, use_reentrant=mode == "reentrant", context_fn=lambda: (context("forward"), context("recompute"))
    )
    assert events == ["enter forward", "exit forward"]
    out.sum().backward()
    assert events == ["enter forward", "exit forward", "enter recompute", "exit recompute"]


def test_a_nested_block_enters_its_own_contexts() -> None:
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def context(name: str) -> Any:
        events.append(name)
        yield

    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    inner_contexts = lambda: (context("inner forward"), context("inner recompute"))  # noqa: E731

    def outer(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(inner, x.sin(), context_fn=inner_contexts).cos()

    x = torch.randn(3, 4, requires_grad=True)
    out = remat.recompute(outer, x, context_fn=lambda: (context("outer forward"), context("outer recompute")))
    assert events == ["outer forward", "inner forward"]
    out.sum().backward()
    # the outer recompute re-runs the inner block (its recompute context), then backward
    # reaches the inner block, which is recomputed once more on its own
    assert events == ["outer forward", "inner forward", "outer recompute", "inner recompute", "inner recompute"]


@pytest.mark.parametrize("mode", MANUAL)
@pytest.mark.parametrize("segments", [1, 2, 3, 7])
def test_recompute_sequential_matches_plain(mode: str, segments: int) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.BatchNorm1d(8)) for _ in range(5)))
    model = copy.deepcopy(plain)
    x = torch.randn(6, 8)
    inputs = [x.clone().requires_grad_(True) for _ in range(2)]
    torch.manual_seed(1)
    expected = plain(inputs[0])
    expected.square().sum().backward()
    torch.manual_seed(1)
    actual = remat.recompute_sequential(model, segments, inputs[1], use_reentrant=mode == "reentrant")
    actual.square().sum().backward()
    assert torch.equal(expected, actual)
    assert torch.equal(inputs[0].grad, inputs[1].grad)  # type: ignore[arg-type]
    assert_same_tensors(grads_of(plain), grads_of(model), "gradients")
    assert_same_tensors(state_of(plain), state_of(model), "state")  # type: ignore[arg-type]
    with pytest.raises(RematError, match="segments must be a positive int"):
        remat.recompute_sequential(model, 0, x)


# ------------------------------------------------------------------ in place between stages
class WritesBetweenStages(nn.Module):
    """The model's own code changes stage outputs in place between two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(16, 16)) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index == 2:
                x.mul_(1.5)
            if index == 3:
                x[:, 0] = 0.0
        return x


@pytest.mark.parametrize("budget", ["min", 0.85])
def test_the_planner_plans_around_stage_outputs_changed_in_place(budget: Any) -> None:
    torch.manual_seed(0)
    plain = WritesBetweenStages()
    wrapped = remat.Checkpointable(copy.deepcopy(plain), budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planned around: nothing to warn about
        peaks = compare_training(plain, wrapped, [torch.randn(8, 16)], lambda out: out.square().sum(), steps=2)
    plan = wrapped.plan
    assert plan is not None
    profile = plan.schedule.profile
    # the outputs of layers 2 and 3 are changed in place: layers 3 and 4 start groups that are breaks
    starts = [plan.groups[k][0] for k in profile.region_breaks]
    assert [plan.measurement.stages[s].name for s in starts] == ["layers.3.0", "layers.4.0"]
    assert profile.pinned_stages == ()
    assert any(isinstance(item, Region) for item in plan.schedule.items)  # it does recompute
    assert plan.budget_bytes is not None and max(peaks) <= plan.budget_bytes + plan.held_outside_bytes


def test_a_plan_across_a_changed_boundary_replays_the_change() -> None:
    # A plan made without the breaks (from a saved plan, say): the model's in-place changes
    # between stages are glue, recorded and replayed after the stage they follow, so the
    # replay sees the changed values and nothing extra is kept (nothing to warn about).
    torch.manual_seed(0)
    plain = WritesBetweenStages()
    wrapped = remat.Checkpointable(copy.deepcopy(plain), None)
    x = torch.randn(8, 16)
    wrapped(x).sum().backward()
    plan = wrapped.plan
    assert plan is not None and plan.schedule.profile.region_breaks
    unaware = dataclasses.replace(plan.schedule.profile, region_breaks=())
    n = unaware.n_stages
    crossing = Schedule.from_plan(unaware, (Region(0, n - 1, tuple(Store(k) for k in range(n - 1))), Store(n - 1)))
    for model in (plain, wrapped.model):
        model.zero_grad()
    plain(x).square().sum().backward()
    with wrapped.executing(dataclasses.replace(plan, schedule=crossing)), warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(x).square().sum().backward()
    assert_same_tensors(grads_of(plain), grads_of(wrapped.model), "gradients")


class ChangesItsChangedInput(nn.Module):
    """The model changes a stage output in place, and the next stage changes it in place again."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(16, 16)) for _ in range(5))
        self.layers[3] = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index == 3:
                x.mul_(2.0)
            x = layer(x)
        return x


def test_a_stage_changing_its_changed_input_is_pinned() -> None:
    torch.manual_seed(0)
    plain = ChangesItsChangedInput()
    wrapped = remat.Checkpointable(copy.deepcopy(plain), "min")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_training(plain, wrapped, [torch.randn(8, 16)], lambda out: out.square().sum(), steps=2)
    plan = wrapped.plan
    assert plan is not None
    (pinned,) = plan.schedule.profile.pinned_stages
    first, stop = plan.groups[pinned]
    assert "layers.3.0" in [stage.name for stage in plan.measurement.stages[first:stop]]
    assert Store(pinned) in plan.schedule.items


def test_frugal_measurement_breaks_its_segments_at_changed_boundaries() -> None:
    torch.manual_seed(0)
    plain = WritesBetweenStages()
    wrapped = remat.Checkpointable(copy.deepcopy(plain), "min", measure="frugal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_training(plain, wrapped, [torch.randn(8, 16)], lambda out: out.square().sum(), steps=2)
    assert wrapped.plan is not None and len(wrapped.plan.schedule.profile.region_breaks) == 2


def test_frugal_measurement_refuses_a_stage_changing_its_changed_input() -> None:
    model = ChangesItsChangedInput()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 16)
    x_before = x.clone()
    wrapped = remat.Checkpointable(model, "min", measure="frugal")
    with pytest.raises(remat.UnsupportedModel, match="'layers.3.0' modifies in place an input that the model's code"):
        wrapped(x)
    assert torch.equal(x, x_before)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_the_plan_report_says_where_regions_may_not_go() -> None:
    pinned = remat.Checkpointable(ChangesItsChangedInput(), "min")
    pinned(torch.randn(8, 16)).sum().backward()
    assert pinned.plan is not None
    assert "never recomputed: stages 5 'layers.2.1..layers.3.0'" in str(pinned.plan)
    assert pinned.plan.report().to_dict()["pinned_stages"] == [5]
    broken = remat.Checkpointable(WritesBetweenStages(), "min")
    broken(torch.randn(8, 16)).sum().backward()
    assert broken.plan is not None
    breaks = list(broken.plan.schedule.profile.region_breaks)
    assert len(breaks) == 2 and broken.plan.report().to_dict()["region_breaks"] == breaks
    assert f"no region crosses into stages {breaks[0]} 'layers.3.0'" in str(broken.plan)


# ------------------------------------------------------------------ debug=True
class ChangesOnRecompute(nn.Module):
    """A block whose recompute runs other operations (it depends on is_recomputing())."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if remat.is_recomputing():
            h = h.reshape(-1)  # the bug the trace must point at
        return h.sin()


@pytest.mark.parametrize("mode", MANUAL)
def test_debug_shows_where_the_recompute_diverges(mode: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    # without debug: the error names the block, no trace
    out = remat.recompute(ChangesOnRecompute(), x, use_reentrant=mode == "reentrant")
    with pytest.raises(remat.NondeterministicRecompute) as plain_error:
        out.sum().backward()
    assert "debug=True" not in str(plain_error.value)
    out = remat.recompute(ChangesOnRecompute(), x, use_reentrant=mode == "reentrant", debug=True)
    with pytest.raises(remat.NondeterministicRecompute) as raised:
        out.sum().backward()
    text = str(raised.value)
    assert str(plain_error.value) in text
    assert "first differ at operation #1" in text
    original, recomputed = text.split("  recompute:")
    assert "#1 > aten.sin.default -> (4, 3)" in original and "in forward" in original
    assert "#1 > aten.view.default -> (12,)" in recomputed and "h = h.reshape(-1)" not in recomputed
    line = ChangesOnRecompute.forward.__code__.co_firstlineno + 3
    assert f"test_exactness.py:{line} in forward" in recomputed


def test_debug_traces_a_nested_block_from_its_own_first_operation() -> None:
    inner = ChangesOnRecompute()

    def outer(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(inner, x.cos(), debug=True).exp()

    x = torch.randn(4, 3, requires_grad=True)
    out = remat.recompute(outer, x, debug=True)
    with pytest.raises(remat.NondeterministicRecompute, match="first differ at operation") as raised:
        out.sum().backward()
    original, recomputed = str(raised.value).split("  recompute:")
    assert "#0   aten.cos.default" in original and "#2 > aten.sin.default" in original
    assert "#0   aten.cos.default" in recomputed and "#2 > aten.view.default -> (12,)" in recomputed
    assert "detach" not in recomputed  # remat's own operations are not the block's


def test_debug_must_be_a_bool_and_marks_carry_it() -> None:
    with pytest.raises(RematError, match="debug must be True or False"):
        remat.recompute(torch.sin, torch.ones(2), debug="yes")
    module = remat.mark(ChangesOnRecompute(), debug=True)
    out = module(torch.randn(4, 3, requires_grad=True))
    with pytest.raises(remat.NondeterministicRecompute, match="debug=True: the original forward"):
        out.sum().backward()


# ------------------------------------------------------------------ errors leave nothing behind
class FailsOnCall(nn.Module):
    """Raises on its `fail_on`-th call (1-based; -1: on its first call on real data in remat's
    own runs, such as the automatic mode's timing pass); counts its calls."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.fail_on = fail_on
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        real_rehearsal = remat.is_recomputing() and not isinstance(x, FakeTensor)
        if self.calls == self.fail_on or (self.fail_on == -1 and real_rehearsal):
            raise ValueError("the user's forward failed")
        return torch.tanh(self.linear(x))


def _observable(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Everything a user could observe of the model, its input and the process."""
    return {
        "state": {name: value.clone() for name, value in model.state_dict().items()},
        "buffers": [id(b) for b in model.buffers()],
        "attributes": [sorted(vars(m)) for m in model.modules()],
        "plain": [{k: v for k, v in vars(m).items() if isinstance(v, (int, float, str))} for m in model.modules()],
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()],
        "global hooks": len(nn.modules.module._global_forward_hooks) + len(nn.modules.module._global_forward_pre_hooks),
        "grads": [p.grad for p in model.parameters()],
        "rng": torch.get_rng_state(),
        "input": (x.clone(), x._version),
    }


def _assert_same_observable(before: dict[str, Any], after: dict[str, Any]) -> None:
    from conftest import remat_leftovers

    assert remat_leftovers() == []
    for key in before:
        a, b = before[key], after[key]
        if key == "state":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key
        elif key == "rng":
            assert torch.equal(a, b), key
        elif key == "input":
            assert torch.equal(a[0], b[0]) and a[1] == b[1], key
        else:
            assert a == b, key


def _stacked(fail_on: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), FailsOnCall(fail_on), nn.Dropout(0.3), nn.Linear(8, 8))


@pytest.mark.parametrize(
    "case",
    ["loss raises while measuring", "forward raises in the timing step", "budget too small", "not a budget"],
)
def test_an_automatic_mode_error_leaves_nothing_behind(case: str) -> None:
    model = _stacked(fail_on=-1 if case == "forward raises in the timing step" else 0)
    x = torch.randn(6, 8)
    budget: Any = {"budget too small": "100B", "not a budget": "lots", "forward raises in the timing step": 1.0}.get(
        case, 0.5
    )

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        if case == "loss raises while measuring":
            raise ValueError("the user's loss failed")
        return output.sum()

    before = _observable(model, x)
    expected: type[Exception] = ValueError if "raises" in case else RematError
    with pytest.raises(expected):
        remat.Checkpointable(model, budget, loss_fn=loss_fn)(x)
    # remat's own runs are rehearsals: even the user's call counter is as it was
    _assert_same_observable(before, _observable(model, x))


@pytest.mark.parametrize("mode", MANUAL)
def test_a_manual_error_leaves_nothing_behind(mode: str) -> None:
    model = _stacked(fail_on=1)
    x = torch.randn(6, 8)
    before = _observable(model, x)
    with pytest.raises(ValueError, match="the user's forward failed"):
        remat.recompute(model, x, use_reentrant=mode == "reentrant")
    after = _observable(model, x)
    before["plain"][3]["calls"] = 1
    # the BatchNorm before the failing layer ran its forward: its statistics moved, as in plain PyTorch
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        before["state"][key] = after["state"][key]
    _assert_same_observable(before, after)
    # a recompute that fails in backward restores the RNG and closes every frame
    out = remat.recompute(
        ChangesOnRecompute(), torch.randn(4, 3, requires_grad=True), use_reentrant=mode == "reentrant"
    )
    rng = torch.get_rng_state()
    with pytest.raises(remat.NondeterministicRecompute):
        out.sum().backward()
    assert torch.equal(torch.get_rng_state(), rng)
    from conftest import remat_leftovers

    assert remat_leftovers() == []


# ------------------------------------------------------------------ state seen by marked blocks
@pytest.mark.parametrize("how", ["mark", "recompute"])
@pytest.mark.parametrize("norm", ["spectral_norm", "weight_norm", "parametrizations.spectral_norm"])
def test_a_module_called_twice_whose_pre_hook_sets_its_weight_is_exact(norm: str, how: str) -> None:
    # spectral_norm and weight_norm set module.weight in a forward pre-hook, before a
    # marked module's block starts; the replay of the first call must see that call's weight
    wrap = {
        "spectral_norm": nn.utils.spectral_norm,
        "weight_norm": nn.utils.weight_norm,
        "parametrizations.spectral_norm": parametrizations.spectral_norm,
    }[norm]

    def input_grad(recompute: str | None) -> torch.Tensor:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
            shared = wrap(nn.Linear(8, 8))
        model = nn.Sequential(nn.Linear(8, 8), shared, shared)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        if recompute == "mark":
            remat.mark(shared)
            y = model(x)
        elif recompute == "recompute":
            y = remat.recompute(shared, remat.recompute(shared, remat.recompute(model[0], x)))
        else:
            y = model(x)
        y.square().sum().backward()
        assert x.grad is not None
        return x.grad

    assert torch.equal(input_grad(None), input_grad(how))


class StepCounter(nn.Module):
    """Counts its calls in a buffer that scales its output."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return (x @ self.weight) * self.steps.clone()


@pytest.mark.parametrize("inner", MANUAL)
def test_a_marked_module_inside_a_reentrant_block_keeps_the_call_numbering(inner: str) -> None:
    # the reentrant block's first run is under no_grad; the marked module's block must
    # count as one module call there too, or every later state change is replayed off by one
    torch.manual_seed(0)
    counter = StepCounter()
    plain = nn.Sequential(nn.Linear(4, 4), counter, counter, nn.BatchNorm1d(4))
    model = copy.deepcopy(plain)
    remat.mark(model[1], use_reentrant=inner == "reentrant")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    plain(x).square().sum().backward()
    remat.recompute(model, x, use_reentrant=True).square().sum().backward()
    assert_same_tensors(grads_of(plain), grads_of(model), "gradients")
    assert_same_tensors(state_of(plain), state_of(model), "state")  # type: ignore[arg-type]


# ------------------------------------------------------------------ a model that recomputes by itself
class RecomputesItsBody(nn.Module):
    """A model whose body is recomputed by the model itself (marked, or remat.recompute)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.stem = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
        if how == "mark":
            remat.mark(self.body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = remat.recompute(self.body, h) if self.how == "recompute" else self.body(h)
        return self.head(h)


@pytest.mark.parametrize("frugal", [False, True])
@pytest.mark.parametrize("how", ["mark", "recompute"])
def test_checkpointable_leaves_the_models_own_recompute_blocks_alone(how: str, frugal: bool) -> None:
    torch.manual_seed(0)
    plain = RecomputesItsBody(how)
    wrapped = remat.Checkpointable(copy.deepcopy(plain), "min", measure="frugal" if frugal else "sized")
    compare_training(plain, wrapped, [torch.randn(6, 8)], lambda out: out.square().sum(), steps=2)
    assert wrapped.plan is not None
    names = [stage.name for stage in wrapped.plan.measurement.stages]
    assert not any(name.startswith("body") for name in names)  # the body's modules are not stages


@pytest.mark.parametrize("mode", MANUAL)
def test_under_autocast_an_input_used_twice_is_cast_as_in_plain_autograd(mode: str) -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)

    def block(a: torch.Tensor) -> torch.Tensor:
        return first(a) * torch.tanh(second(a))

    def input_grad(recompute: bool) -> torch.Tensor:
        w = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = w * 1.5  # not a leaf: plain autograd casts it once per use
            y = remat.recompute(block, h, use_reentrant=mode == "reentrant") if recompute else block(h)
        y.float().square().sum().backward()
        assert w.grad is not None
        return w.grad

    assert torch.equal(input_grad(False), input_grad(True))


class ReassignedBuffer(nn.Module):
    """Reassigns its buffer in forward (a new tensor each time): replayed state, not a cache."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + 0.1 * self.total
        self.total = self.total + x.detach().sum(0)
        return out


def test_a_reassigned_buffer_is_not_warned_about_as_a_cache() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), ReassignedBuffer(), nn.Tanh(), nn.Linear(8, 8))
    wrapped = remat.Checkpointable(copy.deepcopy(plain), "min")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_training(plain, wrapped, [torch.randn(4, 8)], lambda out: out.square().sum(), steps=2)


# ------------------------------------------------------------------ found in review
def test_a_nested_context_that_swallows_the_blocks_error_is_refused_and_runs_it_once() -> None:
    import contextlib

    class Swallows:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> bool:
            return True

    runs: list[bool] = []

    def failing(h: torch.Tensor) -> torch.Tensor:
        runs.append(remat.is_recomputing())
        raise ValueError("the block failed")

    def outer(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(failing, x * 2, context_fn=lambda: (Swallows(), contextlib.nullcontext()))

    with pytest.raises(RematError, match="context_fn suppressed an exception raised by the block '.*failing'"):
        remat.recompute(outer, torch.randn(3, requires_grad=True))
    assert runs == [False]


@pytest.mark.parametrize("mode", MANUAL)
def test_a_sparse_input_that_is_not_a_leaf_is_exact(mode: str) -> None:
    dense = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    dense[dense < 0.3] = 0
    w = torch.randn(6, 4, requires_grad=True)

    def block(s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(s, weight).tanh()

    grads = []
    for recompute in (False, True):
        w.grad = None
        leaf = dense.clone().requires_grad_()
        s = (leaf * 2).to_sparse()
        out = remat.recompute(block, s, w, use_reentrant=mode == "reentrant") if recompute else block(s, w)
        out.sum().backward()
        grads.append((w.grad, leaf.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])  # type: ignore[arg-type]


class SwitchesDropoutOff(nn.Module):
    """Its forward puts its dropout in eval mode from its second call on."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.drop = nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            self.drop.eval()
        for block in self.blocks:
            x = block(x)
        return self.drop(x)


def test_measurement_puts_back_a_training_mode_the_forward_changed() -> None:
    torch.manual_seed(0)
    plain = SwitchesDropoutOff()
    model = copy.deepcopy(plain)
    x = torch.randn(4, 8)
    plain(x).sum().backward()
    remat.Checkpointable(model, None)(x).sum().backward()
    assert model.calls == plain.calls == 1 and model.drop.training and plain.drop.training


def test_debug_on_a_nested_block_alone_traces_it() -> None:
    def inner(h: torch.Tensor) -> torch.Tensor:
        a = h.sin()
        if remat.is_recomputing():
            a = a.cos()
        return (a * h).exp()

    def outer(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(inner, x.tanh() * 2, debug=True).sigmoid()

    out = remat.recompute(outer, torch.randn(4, requires_grad=True))  # the root has no debug
    with pytest.raises(remat.NondeterministicRecompute) as raised:
        out.sum().backward()
    original, recomputed = str(raised.value).split("  recompute:")
    assert "first differ at operation #1" in original and "#1 > aten.mul.Tensor" in original
    assert "#0   aten.sin.default" in recomputed and "#1 > aten.cos.default" in recomputed


@pytest.mark.parametrize("mode", MANUAL)
def test_a_recompute_context_that_swallows_the_blocks_error_is_refused(mode: str) -> None:
    import contextlib

    class Swallows:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> bool:
            return True

    def fails_when_recomputed(x: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing():
            raise ValueError("the recompute failed")
        return x.sin()

    out = remat.recompute(
        fails_when_recomputed,
        torch.randn(3, requires_grad=True),
        use_reentrant=mode == "reentrant",
        context_fn=lambda: (contextlib.nullcontext(), Swallows()),
    )
    with pytest.raises(RematError, match="context_fn suppressed an exception raised by the block '.*fails_when"):
        out.sum().backward()


@pytest.mark.slow
def test_the_smallest_budget_of_a_long_chain_nests_deeper_than_python_recursion() -> None:
    """At the smallest budget a 400-stage chain's plan nests ~200 regions: each body's
    replay replays the next one within it, past Python's default recursion limit."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(200)])
    x = torch.randn(4, 8, requires_grad=True)
    plain = copy.deepcopy(model)
    wrapped = remat.Checkpointable(copy.deepcopy(model), "min", loss_fn=lambda out: out.sum(), output_kept=False)
    limit = sys.getrecursionlimit()
    wrapped(x).sum().backward()
    expected_x_grad = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    assert torch.equal(x.grad, expected_x_grad)
    for a, b in zip(wrapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    depth, levels = 0, [(wrapped.plan.schedule.items, 1)]
    while levels:
        items, level = levels.pop()
        depth = max(depth, level)
        levels.extend((item.body, level + 1) for item in items if isinstance(item, Region))
    assert depth > 150
    assert sys.getrecursionlimit() == limit
