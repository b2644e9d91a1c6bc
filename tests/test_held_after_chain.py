"""Inputs the model holds into the code after the chain (NOTE [inputs held after the chain]
in ``remat.measure.assemble``).

A Segformer stage's caller holds the stage's input until the stage returns, after the
reshape copy that follows its last norm: code after the chain. The first of the stage's
modules saves that input, so the suffix's peak (charged at the loss) does not count it;
when the schedule replays that module, nothing did, and every step went over the budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Stage(nn.Module):
    """Holds its input (its argument, which `embed` saves) until it returns, after the
    copies that follow its last norm."""

    def __init__(self, width_in: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width_in, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        hidden = self.norm(hidden)
        return hidden.repeat(1, 4).unflatten(1, (4, -1)).mean(1)


class _Stages(nn.Module):
    """Two stages, the second narrower than its input (a Segformer's patch embedding)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stages = nn.ModuleList([_Stage(width, 2 * width, 1), _Stage(2 * width, width, 2)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def _steps_hold(model: nn.Module, budget: Any, run: Callable[[nn.Module], torch.Tensor], **options: Any) -> None:
    """Three steps: each within the plan's prediction and budget, gradients exact."""
    plain = copy.deepcopy(model)
    control = remat.enable(model, budget, **options)
    for step in range(3):
        torch.manual_seed(step)
        with remat.MemoryTracker() as tracker:
            loss = run(model)
            loss.backward()
            del loss
        torch.manual_seed(step)
        run(plain).backward()
        plan = control.plan
        assert plan is not None and plan.budget_bytes is not None
        assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes, (
            f"step {step}: peak {tracker.peak_bytes} B, predicted {plan.predicted_peak_bytes} B, "
            f"budget {plan.budget_bytes} B"
        )
        for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            assert (ours.grad is None) == (theirs.grad is None)
            assert ours.grad is None or torch.equal(ours.grad, theirs.grad)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)


def test_an_input_held_into_the_code_after_the_chain_is_counted_there() -> None:
    # "periodic" replays the second stage's embed (its input discarded by the schedule):
    # the step went 7,424 bytes over the budget, at the copies after the last norm
    model = _Stages().train()
    x = torch.randn(64, 32)
    _steps_hold(
        model, "min", lambda m: m(x).square().mean(), solver="periodic", loss_fn=lambda out: out.square().mean()
    )
    plan = remat.controller(model).plan
    assert plan is not None
    assert [(h.stage, h.until, h.after_chain) for h in plan.budget.held_inputs] == [(3, 6, True)]


def test_a_segformer_with_frozen_first_stages_holds_its_smallest_budget() -> None:
    # the planner replays the frozen first stages, and with them the input of the second
    # Segformer stage: every step went 256 bytes over the budget
    transformers = pytest.importorskip("transformers")
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
        strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3, decoder_hidden_size=32,
    )  # fmt: skip
    model = transformers.SegformerForImageClassification(config).train()
    parameters = list(model.parameters())
    for parameter in parameters[: len(parameters) // 3]:
        parameter.requires_grad_(False)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1])
    _steps_hold(model, "min", lambda m: m(pixel_values=pixels, labels=labels).loss)
