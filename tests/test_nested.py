"""Nested plans (``nested=True``): blocks split into their own submodules, planned as one chain.

Each test trains an unmodified model whose blocks call their submodules with code in
between (residual additions, a shortcut, dropout) and compares it with plain autograd:
gradients bit for bit, the measured peak (first step included) against the budget, and
the prediction against the measured peak.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.discover import discover_chain
from remat.discover.glue import EarlierInputs, GlueRecorder
from remat.errors import RematError
from remat.plan.share import prepared

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(out.transpose(1, 2).reshape(batch, length, width)))


class Block(nn.Module):
    """A pre-norm transformer block: its forward adds the residual stream back twice."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, 4)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, vocabulary: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BasicBlock(nn.Module):
    """A residual block with BatchNorm whose shortcut is a module of its own (a stage)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        inner = channels // stride
        self.conv_1 = nn.Conv2d(inner, channels, 3, stride, 1, bias=False)
        self.norm_1 = nn.BatchNorm2d(channels)
        self.conv_2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm_2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Conv2d(inner, channels, 1, stride, bias=False) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm_1(self.conv_1(x)))
        h = self.norm_2(self.conv_2(h))
        return F.relu(h + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(8, 1), BasicBlock(16, 2), BasicBlock(16, 1), BasicBlock(32, 2))
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(images)).mean((2, 3)))


def decoder_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (4, 64))
    return Decoder(), tokens, torch.randint(0, 64, (4, 64))


def resnet_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return SmallResNet(), torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))


CASES = {"decoder": decoder_case, "resnet": resnet_case}


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def _plain(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    with remat.MemoryTracker() as tracker:
        torch.manual_seed(1)
        _loss(model(inputs), target).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_nested_chains_split_blocks_into_their_submodules(case: str) -> None:
    model, inputs, _ = CASES[case]()
    blocks = discover_chain(model, (inputs,), {})
    nested = discover_chain(model, (inputs,), {}, nested=True)
    assert len(nested) > 2 * len(blocks)
    # every stage of the nested chain lies inside one block of the chain of blocks
    for name in nested.names:
        assert any(name == block or name.startswith(block + ".") for block in blocks.names), name


# The small ResNet's blocks keep their input for the shortcut (NOTE [glue constants]),
# taken from replays or kept: its nested plans need most of the plain peak.
BUDGETS = [("decoder", 0.3), ("decoder", 0.6), ("decoder", "min"), ("resnet", 0.95), ("resnet", "min")]


@pytest.mark.parametrize(("case", "budget"), BUDGETS)
def test_nested_plans_train_exactly_within_the_budget(case: str, budget: float | str) -> None:
    model, inputs, target = CASES[case]()
    model.train()
    plain_peak, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
    )
    peaks = []
    for step in range(2):
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(inputs), target).backward()
        peaks.append(tracker.peak_bytes)
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert len(plan.forward_counts) > 8
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    # the first step (which measures) included; the prediction errs on the safe side
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes
    if budget != "min":
        assert plan.budget_bytes <= budget * plain_peak + 1
    assert sum(count > 1 for count in plan.forward_counts) > 0


def test_nested_plans_of_a_transformer_go_lower_than_plans_over_its_blocks() -> None:
    model, inputs, target = decoder_case()
    minimums = []
    for nested in (False, True):
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=nested
        )
        wrapped.measure(inputs)
        plan = wrapped.plan_for("min")
        minimums.append(plan.budget_bytes)
    assert minimums[1] < minimums[0]


def test_nested_plans_update_batch_norm_statistics_once() -> None:
    model, inputs, target = resnet_case()
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True)
    for _ in range(2):
        torch.manual_seed(1)
        _loss(wrapped(inputs), target).backward()
        torch.manual_seed(1)
        _loss(reference(inputs), target).backward()
    assert sum(count > 1 for count in wrapped.plan.forward_counts) > 0
    for ours, theirs in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


# NOTE [constants an earlier stage takes]: the residual stream a block's inner stages leave
# is what its first stage took; a plan whose regions replay that stage with the glue that
# adds it back takes it from the replay instead of keeping it through the step.
@pytest.mark.parametrize("case", sorted(CASES))
def test_residuals_taken_from_the_replay_lower_the_smallest_budget(case: str) -> None:
    model, inputs, target = CASES[case]()
    model.train()
    plain_peak, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True)
    measurement = wrapped.measure(inputs)
    assert measurement.taken_again  # the residuals (decoder) and the shortcuts' inputs (resnet)
    kept, taken = (
        prepared(measurement, loss_measured=True, output_kept=False, margin=0.0, solver=wrapped._solver(), take_again=t)
        for t in (False, True)
    )
    assert taken.held_outside_bytes < kept.held_outside_bytes
    assert taken.minimum_total_bytes() < kept.minimum_total_bytes()
    plan = wrapped.plan_for("min")
    assert plan.budget_bytes == taken.minimum_total_bytes()
    assert plan.schedule.profile.glue_spans  # the plan takes them from replays
    model.zero_grad(set_to_none=True)
    with remat.MemoryTracker() as tracker:
        torch.manual_seed(1)
        _loss(wrapped(inputs), target).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    assert tracker.peak_bytes < kept.minimum_total_bytes() < plain_peak


@pytest.mark.parametrize("budget", [0.25, 0.4])
def test_replays_holding_a_residual_are_predicted_within_the_budget(budget: float) -> None:
    # a replay holds the block's input from its first stage to the glue that adds it back
    model, inputs, target = decoder_case()
    model.train()
    _, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
    )
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(inputs), target).backward()
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes <= 1.05 * tracker.peak_bytes


def test_a_glue_that_no_longer_takes_an_earlier_input_is_warned_about_and_a_missing_one_refused() -> None:
    # the executor's side of NOTE [constants an earlier stage takes]: a plan counted the
    # input of stage 1 as taken again by the glue after stage 3
    earlier = EarlierInputs(frozenset({(1, 3)}))
    residual, other = torch.randn(4), torch.randn(4)
    earlier.called(1, [residual])
    stage_in, stage_out = torch.randn(4), torch.randn(4)
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    summed = stage_out + other  # takes another tensor, not stage 1's input
    glue = recorder.finish((summed,), {})
    with pytest.warns(RuntimeWarning, match="no longer takes the input of stage"):
        earlier.recorded(3, glue)
    assert glue.constants == [other]
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    summed = stage_out + residual
    glue = recorder.finish((summed,), {})
    earlier.recorded(3, glue)
    assert glue.constants == []  # taken from the replay, not kept
    with pytest.raises(RematError, match="did not run"):
        glue.replay([stage_in, stage_out], earlier.input)
    with earlier.replay():
        earlier.replaying(1, [residual * 1])
        (args, _) = glue.replay([stage_in, stage_out], earlier.input)
        earlier.glue_replayed(3)
    assert torch.equal(args[0], summed)
