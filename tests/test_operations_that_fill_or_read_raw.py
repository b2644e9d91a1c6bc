"""Operations the recompute must see whole: ones that fill an input they saved, and reads of
a tensor's data that no ATen operation makes.

``F.rrelu`` in training saves an empty noise tensor and then fills it: a recompute that
stops once everything backward needs has been saved would hand backward the empty tensor
(NOTE [an early stop waits for the next save]; torch's non-reentrant checkpoint does).
``Tensor.tolist()`` reads data outside the dispatcher: an output a policy keeps and that is
read only so must not be let go (NOTE [reads outside the dispatcher]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies

pytestmark = pytest.mark.usefixtures("clean_remat_state")


def _rrelu_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rrelu(x @ w, training=True)  # the last operation: nothing saved after it


def _gradients(block: Callable[..., torch.Tensor], run: Callable[..., torch.Tensor] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.manual_seed(1)
    out = block(x, w) if run is None else run(block, x, w)
    out.square().sum().backward()
    assert x.grad is not None and w.grad is not None
    return [out.detach(), x.grad, w.grad]


RUNS: dict[str, Callable[..., torch.Tensor]] = {
    "default": lambda f, *a: remat.recompute(f, *a),
    "reentrant": lambda f, *a: remat.recompute(f, *a, use_reentrant=True),
    "no early stop": lambda f, *a: remat.recompute(f, *a, early_stop=False),
    "save_matmuls": lambda f, *a: remat.recompute(f, *a, policy=policies.save_matmuls),
    "save_all": lambda f, *a: remat.recompute(f, *a, policy=policies.save_all),
    "save_ops(rrelu_with_noise)": lambda f, *a: remat.recompute(f, *a, policy=policies.save_ops("rrelu_with_noise")),
    "save_ops(F.rrelu)": lambda f, *a: remat.recompute(f, *a, policy=policies.save_ops(F.rrelu)),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_rrelu_gradients_are_exact_in_every_mode(name: str) -> None:
    expected = _gradients(_rrelu_block, None)
    got = _gradients(_rrelu_block, RUNS[name])
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


class _RReLUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.RReLU()) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("how", ["mark", "enable"])
def test_rrelu_modules_train_exactly_marked_and_planned(how: str) -> None:
    torch.manual_seed(0)
    model, reference = _RReLUNet(), _RReLUNet()
    reference.load_state_dict(model.state_dict())
    if how == "mark":
        for block in model.blocks:
            remat.mark(block)
    else:
        remat.enable(model, "min")
    x = torch.randn(32, 16)
    for step in range(2):
        torch.manual_seed(10 + step)
        model(x).square().sum().backward()
        torch.manual_seed(10 + step)
        reference(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), (step, name)
        model.zero_grad(), reference.zero_grad()
    torch.manual_seed(5)
    model(x).sum().backward()
    after_remat = torch.rand(4)
    torch.manual_seed(5)
    reference(x).sum().backward()
    assert torch.equal(after_remat, torch.rand(4))


def _scaled_by_its_largest(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1  # kept by save_matmuls, read only through tolist()
    scale = max(abs(v) for row in h.tolist() for v in row)
    return torch.sin((x @ w2) * scale)


def _scaled_through_numpy(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    scale = float(np.abs(np.asarray(h.detach())).max())
    return torch.sin((x @ w2) * scale)


def _split_by_counts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ w)
    sizes = torch.bincount(idx, minlength=4).tolist()  # the split sizes of a mixture of experts
    parts = torch.split(h[torch.argsort(idx)], sizes)
    return torch.cat([p.sin() * (i + 1) for i, p in enumerate(parts)])


CASES: list[tuple[Callable[..., torch.Tensor], Any, Callable[[], tuple[torch.Tensor, ...]]]] = [
    (_scaled_by_its_largest, policies.save_matmuls, lambda: (torch.randn(4, 8, requires_grad=True),
                                                              torch.randn(8, 8, requires_grad=True),
                                                              torch.randn(8, 8, requires_grad=True))),
    (_scaled_through_numpy, policies.save_matmuls, lambda: (torch.randn(4, 8, requires_grad=True),
                                                             torch.randn(8, 8, requires_grad=True),
                                                             torch.randn(8, 8, requires_grad=True))),
    (_split_by_counts, policies.recompute_ops(F.gelu), lambda: (torch.randn(16, 8, requires_grad=True),
                                                                torch.randn(8, 8, requires_grad=True),
                                                                torch.randint(0, 4, (16,)))),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_kept_output_read_outside_the_dispatcher_is_not_let_go(case: int) -> None:
    block, policy, make = CASES[case]

    def run(recomputed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        args = make()
        out = remat.recompute(block, *args, policy=policy) if recomputed else block(*args)
        out.square().sum().backward()
        return [out.detach()] + [a.grad for a in args if a.grad is not None]

    expected, got = run(False), run(True)
    assert len(expected) == len(got) > 1
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


class _DropoutGlue(nn.Module):
    """A loop whose code drops out each block's output before adding it back."""

    def __init__(self, width: int = 64, vocabulary: int = 50) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(4)
        )
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = x + F.dropout(block(x), 0.1, self.training)
        return self.head(x)


def test_a_mask_filled_in_place_does_not_hold_the_stop_and_the_least_budget_holds() -> None:
    # dropout's CPU mask is saved without grad, like rrelu's noise, but it was filled in
    # place (its version says so): waiting for the next save ran the mask's product and the
    # residual sum again, one activation over the least budget
    torch.manual_seed(0)
    model = _DropoutGlue()
    reference = _DropoutGlue()
    reference.load_state_dict(model.state_dict())
    enabled = remat.enable(model, "min")
    ids = torch.randint(0, 50, (4, 16))
    for step in range(2):
        torch.manual_seed(step)
        with enabled.check_step() as check:
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        assert check.within_budget and check.measured_peak_bytes <= check.predicted_peak_bytes, check
        torch.manual_seed(step)
        F.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
