"""A side input made between two stage calls of one planned stage (NOTE [side inputs kept by
later stages] in ``remat.plan.lifetimes``).

A model makes a table once (rotary tables, a mask) after its embedding and gives it to every
block. With the embedding and the first block frozen, neither saves anything, and the
planner puts them in one planned stage: the table passes between its two calls. The later
blocks save the table for their backward, so it lives until the last of those backwards.
It used to be counted only where the model's own code holds it: a partly frozen Falcon
measured 4076 bytes (its two rotary tables) over its prediction on every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("clean_remat_state")

WIDTH, TOKENS = 32, 64


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # (h * table saves the table, four times the size of h, when h requires grad)
        return h + self.linear(torch.tanh((h * table).sum(0)))


class _TableModel(nn.Module):
    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        positions = torch.arange(TOKENS, dtype=h.dtype).unsqueeze(1)
        angles = positions * torch.arange(1, WIDTH + 1, dtype=h.dtype) / WIDTH
        table = torch.stack([torch.cos(angles), torch.sin(angles), torch.cos(2 * angles), torch.sin(2 * angles)])
        for block in self.blocks:
            h = block(h, table)
        return h


def _model(frozen: int) -> nn.Module:
    torch.manual_seed(0)
    model = _TableModel()
    for module in [model.embed, *model.blocks][:frozen]:
        module.requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", [0, 2])
@pytest.mark.parametrize("budget", ["min", 1.0])
def test_a_table_made_inside_a_planned_stage_is_counted_while_later_blocks_keep_it(frozen: int, budget: object) -> None:
    model = _model(frozen)
    plain = copy.deepcopy(model)
    x = torch.randn(TOKENS, WIDTH)
    plain(x).square().mean().backward()
    wrapped = remat.Checkpointable(model, budget, loss_fn=lambda out: out.square().mean())
    for _ in range(2):
        wrapped.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            wrapped(x).square().mean().backward()
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None
        assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    if frozen:
        # the case itself: the embedding and the first block are one planned stage
        assert plan.groups[0] == (0, 2)


def test_a_partly_frozen_falcon_keeps_within_its_prediction() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).train()
    parameters = list(model.parameters())
    for parameter in parameters[: len(parameters) // 3]:  # the embeddings and the first layer
        parameter.requires_grad_(False)
    plain = copy.deepcopy(model)
    plain.config.use_cache = False
    ids = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    control = remat.enable(model, "min")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with remat.MemoryTracker() as tracker:
            output = model(input_ids=ids, labels=ids)  # held through the backward (its logits too)
            output.loss.backward()
        del output
        plan = control.plan
        assert plan is not None
        assert tracker.peak_bytes <= plan.predicted_peak_bytes
    torch.manual_seed(0)
    plain(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
