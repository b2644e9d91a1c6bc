"""remat.enable on the forwards people write in plain PyTorch.

Residual loops (``x = x + block(x)``, ``x = block(x) + x``, with norms and scalings),
loops that pass side inputs (a mask, positions, rotary tables) as keywords, ``enumerate``
/ ``zip`` / indexing over a ``ModuleList``, an encoder-decoder (two loops, the decoder's
blocks taking the encoder's output) and a U-Net (skips kept across the stages, BatchNorm)
are each found as one chain that covers their blocks, and trained with
``remat.enable(model, 0.5)`` in an ordinary loop: losses, gradients, parameters and
buffers equal to plain training bit for bit, every step's exact peak within the budget.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.discover import discover_chain
from remat.discover.glue import GlueRecorder
from remat.models import EncoderDecoder, ResidualLoop, SideInputs, UNet

Factory = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]]


def _residual(kind: str) -> Factory:
    def make() -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
        return ResidualLoop(kind), (torch.randn(8, 24, 16),), [f"blocks.{i}" for i in range(6)]

    return make


def _side(style: str) -> Factory:
    def make() -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
        return SideInputs(style), (torch.randn(8, 24, 16),), [f"blocks.{i}" for i in range(6)]

    return make


def _encoder_decoder() -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
    blocks = [f"encoder.{i}" for i in range(4)] + [f"decoder.{i}" for i in range(4)]
    return EncoderDecoder(), (torch.randn(8, 24, 16), torch.randn(8, 20, 8)), blocks


def _unet() -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]:
    blocks = [f"downs.{i}.0" for i in range(3)] + ["middle.0"] + [f"ups.{i}.0" for i in range(3)]
    return UNet(), (torch.randn(4, 3, 32, 32),), blocks


CASES: dict[str, Factory] = {
    "x + block(x)": _residual("add after"),
    "block(x) + x": _residual("add before"),
    "pre-norm, scaled": _residual("pre-norm, scaled"),
    "post-norm": _residual("post-norm"),
    "side inputs, zip": _side("zip"),
    "side inputs, indexing": _side("indexing"),
    "encoder-decoder": _encoder_decoder,
    "u-net": _unet,
}


def _loop(model: nn.Module, inputs: tuple[torch.Tensor, ...], steps: int, track: bool) -> tuple[list[Any], list[int]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: list[Any] = []
    peaks: list[int] = []
    for step in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(step)
        tracker = remat.MemoryTracker()
        with tracker:
            loss = model(*inputs).square().mean()
            loss.backward()
        peaks.append(tracker.peak_bytes)
        seen.append([loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
        optimizer.step()
    return seen, peaks


@pytest.mark.parametrize("name", list(CASES))
def test_the_forwards_people_write_train_exactly_within_the_budget(name: str) -> None:
    torch.manual_seed(0)
    plain, inputs, blocks = CASES[name]()
    plain.train()
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    control = remat.enable(model, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # full coverage: nothing to warn about
        try:
            control.measure(*inputs)
            control.plan_for()
        except remat.BudgetTooSmall as error:
            assert error.minimum_bytes > error.budget_bytes
            control.mem_limit = "min"
        found, peaks = _loop(model, inputs, steps=3, track=True)
    expected, _ = _loop(plain, inputs, steps=3, track=False)
    for step, (a, b) in enumerate(zip(expected, found, strict=True)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    for (key, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # parameters after the updates, and buffers (BatchNorm once)
    plan = control.plan
    assert plan is not None and plan.budget_bytes is not None and plan.measurement is not None
    assert max(peaks) <= plan.budget_bytes
    names = [stage.name for stage in plan.measurement.stages]
    assert all(block in names for block in blocks), names
    assert plan.measurement.coverage > 0.85
    assert sum(count > 1 for count in plan.forward_counts) > 0, "the plan recomputes nothing"
    assert type(model) is type(plain) and list(model.state_dict()) == keys


def test_a_residual_loop_is_one_chain_of_its_blocks() -> None:
    chain = discover_chain(ResidualLoop("add after"), (torch.randn(2, 4, 16),), {})
    assert chain.names == ["embed", *(f"blocks.{i}" for i in range(6)), "head"]


def test_the_encoder_and_the_decoder_are_one_chain() -> None:
    # the target's embedding takes no encoder output: it is code between the two loops
    chain = discover_chain(EncoderDecoder(), (torch.randn(2, 4, 16), torch.randn(2, 3, 8)), {})
    encoder, decoder = [f"encoder.{i}" for i in range(4)], [f"decoder.{i}" for i in range(4)]
    assert chain.names == ["source", *encoder, "encoder_norm", *decoder, "head"]


def test_a_branch_the_loss_ignores_is_not_a_stage() -> None:
    class WithProbe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.probe = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            for block in self.blocks:
                x = block(x).relu()
            return {"out": x, "probe": self.probe(x)}

    model = WithProbe()
    args = (torch.randn(2, 8),)
    with_probe = discover_chain(model, args, {})
    assert with_probe.names[-2:] == ["probe.0", "probe.1"]
    without = discover_chain(model, args, {}, loss_fn=lambda output: output["out"].sum())
    assert without.names == [f"blocks.{i}" for i in range(4)]


# ------------------------------------------------------------------------------ the glue
def test_glue_replays_the_calls_between_two_stages() -> None:
    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    gamma = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    h = block(x)
    recorder = GlueRecorder([x], [h])
    recorder.start()
    y = x + gamma * h
    y[:, 0] = 0.0  # in place, on a tensor the glue made
    z = torch.cat([y, x], dim=1).relu()
    glue = recorder.finish((z,), {"scale": 2.0})
    again = block(x)
    args, kwargs = glue.replay([x, again])
    assert torch.equal(args[0], z) and kwargs == {"scale": 2.0}
    assert glue.made((z,), {"scale": 2.0}) == [z]
    assert glue.constants == [gamma]


def test_glue_refuses_a_constant_changed_since() -> None:
    x = torch.randn(3)
    scale = torch.ones(3)
    recorder = GlueRecorder([x], [x * 2])
    recorder.start()
    y = x * scale
    glue = recorder.finish((y,), {})
    scale.add_(1.0)
    with pytest.raises(remat.RecomputeInputModified, match="changed in place after the forward"):
        glue.replay([x, x * 2])


def test_glue_that_changes_a_constant_replays_on_a_copy() -> None:
    # NOTE [constants the glue changes]: the replay changes a copy; what the glue reads of
    # the constant afterwards is the constant as the forward left it
    x = torch.randn(3)
    counter = torch.zeros(1)
    recorder = GlueRecorder([x], [x])
    recorder.start()
    counter.add_(1.0)
    y = x * counter
    glue = recorder.finish((y,), {})
    args, _ = glue.replay([x, x])
    assert torch.equal(args[0], y) and counter.item() == 1.0


class SharedNormBetweenBlocks(nn.Module):
    """A BatchNorm called after every block: shared, it is the glue's, and a replay of the
    glue must not update its statistics again."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.norm(block(x)).relu()
        return x


@pytest.mark.parametrize("measure", ["sized", "frugal"])
def test_glue_that_updates_statistics_updates_them_once(measure: str) -> None:
    torch.manual_seed(0)
    plain = SharedNormBetweenBlocks()
    model = copy.deepcopy(plain)
    control = remat.enable(model, "min", measure=measure)
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for net in (plain, model):
            net.zero_grad()
            net(x).square().sum().backward()
        for (key, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(a, b), key  # the statistics, updated once
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    plan = control.plan
    assert plan is not None and sum(count > 1 for count in plan.forward_counts) > 0


def test_glue_under_autocast_is_replayed_in_its_own_autocast_state() -> None:
    # The glue runs in the forward's autocast region (its calls cast as autocast says), and
    # a call made with autocast turned off inside it is replayed so.
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
            self.scale = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                h = block(x)
                with torch.autocast("cpu", enabled=False):
                    gate = torch.sigmoid(self.scale(h.float()))
                x = x + h * gate
            return x

    torch.manual_seed(0)
    plain = Mixed()
    model = copy.deepcopy(plain)
    remat.enable(model, "min")
    x = torch.randn(8, 16)
    for net in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
        out.float().square().sum().backward()
    plan = remat.controller(model).plan
    assert plan is not None and sum(count > 1 for count in plan.forward_counts) > 0
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
