"""remat.enable: the automatic mode on a model in place, and the wrapper that stands for it."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import remat


class Net(nn.Module):
    """A model with attributes, a method and a buffer, whose forward runs a chain of blocks."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.config = {"width": width}
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.1))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def describe(self) -> str:
        return f"Net of width {self.config['width']}"


def _train(model: nn.Module, steps: int = 3, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(16, 32)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(data).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_enable_trains_in_place_exactly_as_plain_training() -> None:
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    parameters = list(model.parameters())
    keys = list(model.state_dict())
    control = remat.enable(model, 0.4)
    assert type(model) is Net and model.describe() == "Net of width 32" and model.config == {"width": 32}
    assert list(model.parameters()) == parameters and list(model.state_dict()) == keys
    assert remat.is_enabled(model) and remat.controller(model) is control
    assert [name for name, _ in model.named_modules()] == [name for name, _ in plain.named_modules()]
    expected, found = _train(plain), _train(model)
    for a, b in zip(expected, found, strict=True):
        assert torch.equal(a, b)
    _same_state(plain, model)  # parameters after the updates, BatchNorm statistics
    plan = control.plan
    assert plan is not None and max(plan.forward_counts) > 1, "0.4 must recompute something"
    remat.disable(model)
    assert not remat.is_enabled(model) and "_call_impl" not in model.__dict__
    remat.disable(model)  # nothing to do


def test_enabled_model_stays_within_its_budget() -> None:
    torch.manual_seed(0)
    model = Net()
    control = remat.enable(model, 0.4, loss_fn=lambda out: out.square().mean(), output_kept=False)
    data = torch.randn(16, 32)
    for _ in range(2):
        with remat.MemoryTracker() as tracker:
            model(data).square().mean().backward()
        plan = control.plan
        assert plan is not None and plan.budget_bytes is not None
        assert tracker.peak_bytes <= plan.budget_bytes
        model.zero_grad(set_to_none=True)


def test_eval_and_no_grad_calls_are_the_models_own() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    data = torch.randn(4, 32)
    expected = model(data)
    control = remat.enable(model, 0.5)
    assert torch.equal(model(data), expected)
    with torch.no_grad():
        assert torch.equal(model(data), expected)
    assert control.plan is None  # nothing measured or planned


def test_hooks_run_once_per_call() -> None:
    torch.manual_seed(0)
    model = Net()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append("model"))
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append("block"))
    remat.enable(model, 0.4)
    data = torch.randn(16, 32)
    model(data).sum().backward()  # measures first: its own runs show remat.is_recomputing()
    for _ in range(2):
        calls.clear()
        model(data).sum().backward()
        assert calls.count("model") == 1
        assert 1 <= calls.count("block") <= 2  # and once more if the block is recomputed


@pytest.mark.parametrize("measure", ["sized", "plain"])
def test_measuring_fires_no_gradient_hook_of_the_parameters(measure: str) -> None:
    # remat's measuring steps run backward passes; the hooks on the parameters (an
    # optimizer stepping in backward, DDP's reducer) must see the training step's
    # gradients alone, once per step, and the same gradients as without remat
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.grad.clone()))
    shared = model.blocks[0][0].weight
    shared.register_hook(lambda grad: seen["blocks.0.0.weight"].append(grad))
    remat.enable(model, 0.4, measure=measure)
    data = torch.randn(16, 32)
    torch.manual_seed(1)
    plain(data).square().mean().backward()
    torch.manual_seed(1)
    model(data).square().mean().backward()
    for name, parameter in plain.named_parameters():
        expected = 2 if name == "blocks.0.0.weight" else 1  # the tensor hook saw it too
        assert len(seen[name]) == expected, name
        assert torch.equal(seen[name][-1], parameter.grad), name
    _same_state(plain, model)


def test_enabling_twice_is_refused_and_controller_needs_enable() -> None:
    model = Net()
    with pytest.raises(remat.RematError, match="not enabled"):
        remat.controller(model)
    remat.enable(model, 0.5)
    with pytest.raises(remat.RematError, match="enabled already"):
        remat.enable(model, 0.3)
    with pytest.raises(TypeError, match="nn.Module"):
        remat.enable(lambda x: x, 0.5)  # type: ignore[arg-type]


def test_an_error_leaves_the_model_enabled_and_its_call_restored() -> None:
    model = Net()
    remat.enable(model, "100B")
    with pytest.raises(remat.BudgetTooSmall):
        model(torch.randn(16, 32)).sum().backward()
    assert remat.is_enabled(model)
    remat.disable(model)
    model(torch.randn(16, 32)).sum().backward()  # a plain call again


def test_deepcopy_and_torch_save_keep_it_enabled() -> None:
    torch.manual_seed(0)
    model = Net()
    remat.enable(model, 0.4, preserve_rng_state=True)
    _train(model, steps=1)
    twin = copy.deepcopy(model)
    assert remat.is_enabled(twin) and remat.controller(twin).model is twin
    assert remat.controller(twin).mem_limit == 0.4 and remat.controller(twin).plan is None
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is Net and remat.is_enabled(loaded) and remat.controller(loaded).model is loaded
    _same_state(model, loaded)
    plain = copy.deepcopy(model)
    remat.disable(plain)
    for copied in (twin, loaded):
        torch.manual_seed(1)
        a = _train(copied, steps=2, seed=1)
        torch.manual_seed(1)
        b = _train(copy.deepcopy(plain), steps=2, seed=1)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_state_dicts_move_between_model_and_enabled_model() -> None:
    torch.manual_seed(0)
    model, other = Net(), Net()
    remat.enable(model, 0.5)
    other.load_state_dict(model.state_dict())
    model.load_state_dict(Net().state_dict())


def test_the_wrapper_stands_for_the_model() -> None:
    torch.manual_seed(0)
    model = Net()
    wrapped = remat.Checkpointable(model, 0.4)
    assert wrapped.config == {"width": 32} and wrapped.describe() == "Net of width 32"
    assert wrapped.blocks is model.blocks
    assert list(wrapped.state_dict()) == list(model.state_dict())
    fresh = Net()
    fresh.load_state_dict(wrapped.state_dict())
    _same_state(fresh, model)
    wrapped.load_state_dict(Net().state_dict())  # the model's own keys
    wrapped.load_state_dict({f"model.{k}": v for k, v in fresh.state_dict().items()})  # or prefixed
    _same_state(wrapped.model, fresh)
    outer = nn.Sequential(wrapped, nn.ReLU())
    assert list(outer.state_dict()) == [f"0.{k}" for k in model.state_dict()]
    outer.load_state_dict(outer.state_dict())
    with pytest.raises(AttributeError):
        wrapped.not_an_attribute  # noqa: B018


class SharedBlockFirst(nn.Module):
    """One block applied again and again (shared weights) before two small layers: the
    block's calls cannot be stages, and they run before the chain the layers make."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.depth = depth
        self.block = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.out1 = nn.Linear(width, width)
        self.out2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = x + self.block(x)
        return self.out2(self.out1(x))


def test_a_chain_that_holds_little_of_the_step_is_said_once() -> None:
    torch.manual_seed(0)
    model = SharedBlockFirst()
    control = remat.enable(model, 1.0)
    x = torch.randn(64, 32, 32)
    with pytest.warns(UserWarning, match=r"holds \d+% of the step's activation memory") as caught:
        model(x).sum().backward()
    message = next(str(w.message) for w in caught if "activation memory" in str(w.message))
    assert "remat.mark" in message and "out1 .. out2" in message
    plan = control.plan
    assert plan is not None and plan.measurement is not None and plan.measurement.coverage < 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # said once
    torch.manual_seed(0)
    covered = remat.enable(Net(), 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        covered.model(torch.randn(16, 32)).sum().backward()
