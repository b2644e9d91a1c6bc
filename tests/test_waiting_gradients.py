"""Gradients that wait for a region's replay (NOTE [gradients waiting for a replay]).

The glue after a stage makes an attention's query and key (a split attention block, as
``nested=True`` plans Hugging Face models); the attention after the value projection takes
them. Their gradients wait, alive, for the glue's own backward, which needs what a region
ending at the value projection saved: the region is replayed first. Plans of the chain
are run; the measured peak never exceeds the prediction, and without the waiting
gradients some plan's would.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.schedule import Schedule
from remat.testing import all_plans

pytestmark = pytest.mark.usefixtures("clean_remat_state")

WIDTH = 32
PLANS = 150  # of the 6-stage chain's plans, drawn at random


class SplitAttention(nn.Module):
    """A pre-norm attention block whose query and key are made by its own code (glue)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.query = nn.Linear(WIDTH, 4 * WIDTH)
        self.key = nn.Linear(WIDTH, 4 * WIDTH)
        self.value = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q = F.linear(h, self.query.weight, self.query.bias)  # not a module call: glue
        k = F.linear(h, self.key.weight, self.key.bias)
        v = self.value(h)
        return x + self.out(F.scaled_dot_product_attention(q, k, v))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def test_no_plan_goes_above_its_prediction() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SplitAttention(), SplitAttention()).train()
    x = torch.randn(4, 16, WIDTH)
    control = remat.enable(model, None, nested=True, loss_fn=_loss)
    control.measure(x)
    reference = control.plan_for(1.0)
    profile = reference.schedule.profile
    values = [index for index, name in enumerate(profile.names) if name.endswith("value")]
    waiting = reference.budget.waiting_gradient_bytes
    for value in values:  # the query's and the key's gradients wait at the value projections
        assert waiting[value] >= 2 * x.numel() * 4 * 4
    assert sum(waiting) == sum(waiting[value] for value in values)
    unaware = dataclasses.replace(reference.budget, waiting_gradient_bytes=())
    missed = 0
    plans = all_plans(profile.n_stages)
    for tree in random.Random(0).sample(plans, PLANS):
        plan = dataclasses.replace(reference, schedule=Schedule.from_plan(profile, tree))
        with control.executing(plan):
            model.zero_grad(set_to_none=True)
            with remat.MemoryTracker() as tracker:
                _loss(model(x)).backward()
        assert tracker.peak_bytes <= plan.predicted_peak_bytes, tree
        missed += tracker.peak_bytes > dataclasses.replace(plan, budget=unaware).predicted_peak_bytes
    assert missed, "some plan replays a region with the gradients waiting at its peak"
