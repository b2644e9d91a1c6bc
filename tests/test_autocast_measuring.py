"""The measuring step under autocast leaves autocast's cache as it found it (NOTE
[autocast's cache after measuring] in ``remat.measure.step``).

Under CPU bf16 autocast, a CLIP's first step (the one that measures) went 141,056 bytes
over its budget: the casts of the parameters the measuring made were still in autocast's
cache through the step that followed it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class _TwoBranches(nn.Module):
    """A chain of blocks and a wide side branch that is not part of it."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)))
        self.side = nn.Linear(width, 4 * width)
        self.head = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) + self.head(self.side(y))


def _steps(model: nn.Module, control: object, *inputs: torch.Tensor, steps: int = 3) -> list[tuple[int, int]]:
    figures = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(*inputs)
            loss = output.float().square().mean() if isinstance(output, torch.Tensor) else output.loss
            loss.backward()
        del output, loss
        plan = control.plan  # type: ignore[attr-defined]
        figures.append((tracker.peak_bytes, plan.budget_bytes))
    return figures


@pytest.mark.parametrize("budget", ["min", 1.0])
def test_every_step_under_autocast_keeps_its_budget_the_first_included(budget: object) -> None:
    torch.manual_seed(0)
    model = _TwoBranches()
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    plain = copy.deepcopy(model)
    control = remat.enable(model, budget, loss_fn=lambda out: out.float().square().mean())
    figures = _steps(model, control, x, y)
    assert all(peak <= limit for peak, limit in figures), figures
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = plain(x, y)
    out.float().square().mean().backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_clip_under_autocast_keeps_its_budget_at_the_first_step() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4),
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).train()
    ids = torch.randint(4, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    control = remat.enable(model, "min")

    class _Call(nn.Module):
        def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> object:
            return model(input_ids=ids, pixel_values=pixels, return_loss=True)

    figures = _steps(_Call(), control, ids, pixels)
    assert all(peak <= limit for peak, limit in figures), figures


def test_a_frugal_measuring_step_is_refused_under_autocast_and_nothing_is_left_behind() -> None:
    torch.manual_seed(0)
    model = _TwoBranches()
    reference = copy.deepcopy(model)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    control = remat.enable(model, "min", loss_fn=lambda out: out.float().square().mean(), measure="frugal")
    with pytest.raises(NotImplementedError, match="under autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, y)
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(reference.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # without autocast the frugal step measures, and the steps after it keep the budget
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            model(x, y).square().mean().backward()
    plan = control.plan
    assert plan is not None and tracker.peak_bytes <= plan.budget_bytes


class _DataDependent(_TwoBranches):
    """Reads a value in its forward (``.item()``): it cannot run on fake tensors."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if y.sum().item() > 0 else 0.5
        return super().forward(x, y) * scale


def test_a_model_that_cannot_run_on_fake_tensors_is_measured_plainly_under_autocast() -> None:
    torch.manual_seed(0)
    model = _DataDependent()
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    control = remat.enable(model, "min", loss_fn=lambda out: out.float().square().mean())
    with pytest.warns(RuntimeWarning, match="a plain step, since a frugal one cannot run .under autocast"):
        figures = _steps(model, control, x, y)
    # the measuring step is a plain one, not bounded by the budget; the steps after it are
    assert all(peak <= limit for peak, limit in figures[1:]), figures
