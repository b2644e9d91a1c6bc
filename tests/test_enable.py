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


def _step_within(model: nn.Module, control: remat.Checkpointable) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(1)
    x = torch.randn(16, 32)
    with remat.MemoryTracker() as tracker:
        loss = model(x).square().mean()
        loss.backward()
    assert control.plan is not None and tracker.peak_bytes <= control.plan.budget_bytes
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("change", ["a new head", "a wider block", "a new layer inside a block"])
def test_a_model_changed_after_enabling_is_measured_and_planned_again(change: str) -> None:
    # NOTE [what a plan depends on]: the modules and the parameters' shapes are in the plan's key
    torch.manual_seed(0)
    model = Net()
    control = remat.enable(model, "min")
    _step_within(model, control)
    first = control.plan
    if change == "a new head":  # fine-tuning: the stage is another module
        model.head = nn.Linear(32, 4)
    elif change == "a wider block":
        model.blocks[2] = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Linear(256, 32))
    else:  # a stage's child replaced by one of the same shapes: the plan still holds
        model.blocks[2][0] = nn.Linear(32, 32)
    plain = copy.deepcopy(model)
    remat.disable(plain)
    loss, grads = _step_within(model, control)
    torch.manual_seed(1)
    plain_loss = plain(torch.randn(16, 32)).square().mean()
    plain_loss.backward()
    assert torch.equal(loss, plain_loss.detach())
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, plain.parameters(), strict=True))
    if change == "a wider block":
        assert control.plan.budget_bytes > first.budget_bytes  # "min" of the new model


def test_a_saved_plan_for_another_chain_is_refused_with_both_lengths() -> None:
    torch.manual_seed(0)
    model = Net(depth=6)
    control = remat.enable(model, 0.6)
    _step_within(model, control)
    saved = control.plan.to_json()
    other = Net(depth=4)
    remat.enable(other, plan=remat.Plan.from_json(saved))
    with pytest.raises(remat.RematError, match=r"a chain of 26 stage calls, and this model.s forward makes 18"):
        other(torch.randn(16, 32)).sum().backward()


class _WithTable(Net):
    """Net with a large boolean mask its forward only reads (GPT-BigCode's causal mask), and a
    counter of integers it updates."""

    def __init__(self, positions: int = 1024, writes_mask: bool = False) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(positions, positions, dtype=torch.bool)), persistent=False)
        self.register_buffer("counts", torch.zeros(positions, dtype=torch.int64), persistent=False)
        self.writes_mask = writes_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not remat.is_recomputing():
            self.counts[: x.shape[0]] += 1
        if self.writes_mask:
            self.mask[0, 1] = True
        return super().forward(x) * self.mask[: x.shape[0], :4].float()


@pytest.mark.parametrize("budget", [1.0, 0.5, "min"])
def test_a_large_table_the_model_reads_is_not_copied_by_measuring(budget: object) -> None:
    # NOTE [buffers measuring puts back]: a copy of the 1 MiB mask would be most of the first step
    torch.manual_seed(0)
    model = _WithTable()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 32)
    with remat.MemoryTracker() as tracker:
        plain(x).square().mean().backward()
    control = remat.enable(model, budget)
    for _ in range(2):  # the first (measuring) step within the budget too
        _step_within(model, control)
    assert control.minimum_budget_bytes() < tracker.peak_bytes  # the mask is no part of it
    assert torch.equal(model.mask, plain.mask)
    assert model.counts[0] == plain.counts[0] + 1  # the counter put back after measuring: one per step


def test_a_large_mask_changed_in_place_by_the_forward_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = _WithTable(writes_mask=True)
    remat.enable(model, 0.5)
    with pytest.raises(remat.RematError, match=r"mask"):
        model(torch.randn(16, 32)).square().mean().backward()


def test_a_second_call_before_the_backward_is_said_once_and_a_usual_loop_says_nothing() -> None:
    # NOTE [one call per step]: each call keeps what its plan stores until its own backward
    torch.manual_seed(0)
    model = Net()
    control = remat.enable(model, 0.5)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usual loop, gradient accumulation and eval calls: no warning
        for _ in range(2):
            model(a).square().mean().backward()
            out = model(b)  # kept by the caller until after its backward, as a loop does
            out.square().mean().backward()
        model.eval()
        with torch.no_grad():
            model(a)
        model.train()
    with pytest.warns(UserWarning, match=r"called for training again before the backward of its previous call"):
        (model(a) - model(b)).square().mean().backward()  # a siamese step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        (model(a) - model(b)).square().mean().backward()
    assert control.plan is not None
