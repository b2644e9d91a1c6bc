"""A backward inside a block, run on a thread of its own as autograd runs it on a GPU.

On a GPU autograd runs each backward on the device's thread, handing it a copy of torch's
per-thread state and nothing else (NOTE [state a backward's threads inherit]). A CPU
backward runs on the calling thread, so these tests hand the backwards over to another
thread the same way (`tests/device_thread.py`). The gradients must be those of plain
autograd, bit for bit.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from device_thread import grad_on_another_thread, on_the_device_thread
from remat import policies
from remat.manual import _frames, _selective

pytestmark = pytest.mark.usefixtures("clean_remat_state")


def test_the_stand_in_hands_over_what_it_should() -> None:
    # the emulation itself: remat's stacks are seen on the other thread as on this one
    x = torch.randn(3, requires_grad=True)
    seen: list[Any] = []

    def block(t: torch.Tensor) -> torch.Tensor:
        y = t.sin()
        here = _frames._STACK.top()

        def note(grad: torch.Tensor) -> torch.Tensor:
            seen.append((here, _frames._STACK.top()))
            return grad

        handle = y.register_hook(note)
        grad_on_another_thread(y.sum(), t, create_graph=True)
        handle.remove()
        return y

    remat.recompute(block, x).sum().backward()
    # the first forward's inner backward saw the block's frame (the recompute stops before its own)
    assert seen and all(here is not None and here is there for here, there in seen)


class GradientPenalty(nn.Module):
    """Its output plus the squared norm of the output's gradient with respect to its input."""

    def __init__(self, width: int, grad: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)
        self.grad = grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        y = self.drop(torch.tanh(self.linear(x)))
        (g,) = self.grad(y.square().sum(), x, create_graph=True)
        return y + g.square().sum(dim=-1, keepdim=True)


def _marked(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    remat.mark(blocks[0])
    try:
        return blocks[0](x)
    finally:
        remat.unmark(blocks[0])


LAYOUTS: dict[str, Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]] = {
    "marked": _marked,
    "alone": lambda blocks, x: remat.recompute(blocks[0], x),
    "nested": lambda blocks, x: remat.recompute(lambda a: remat.recompute(blocks[0], a) * 2, x) / 2,
    "two_blocks": lambda blocks, x: remat.recompute(blocks[1], remat.recompute(blocks[0], x)),
    "policy": lambda blocks, x: remat.recompute(blocks[0], x, policy=policies.save_matmuls),
    # NOTE [replaying a block still in its first forward]
    "policy_inside_whole": lambda blocks, x: remat.recompute(
        lambda a: remat.recompute(blocks[0], a, policy=policies.recompute_ops("tanh")), x
    ),
    # an operation after the inner block that saves a tensor: the enclosing block's
    # recompute during the inner backward stops where its first forward has got to
    "nested_then_saves": lambda blocks, x: remat.recompute(lambda a: remat.recompute(blocks[0], a).sin(), x),
    "policies_nested_then_save": lambda blocks, x: remat.recompute(
        lambda a: remat.recompute(blocks[0], a, policy=policies.save_matmuls).sin(), x, policy=policies.save_matmuls
    ),
    "policy_inside_policy": lambda blocks, x: remat.recompute(
        lambda a: remat.recompute(blocks[0], a, policy=policies.save_matmuls), x, policy=policies.save_matmuls
    ),
}
GRADS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {
    "same_thread": torch.autograd.grad,
    "device_thread": grad_on_another_thread,
}


@pytest.mark.parametrize("thread", sorted(GRADS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_backward_inside_a_block_is_exact(layout: str, thread: str) -> None:
    torch.manual_seed(0)
    grad = GRADS[thread]
    # every tensor of the same shape: an off-by-some filling is not caught by a shape check
    blocks = nn.ModuleList(GradientPenalty(5, grad) for _ in range(2))
    x = torch.randn(4, 5, requires_grad=True)
    used = [x, *blocks.parameters()]
    torch.manual_seed(1)
    plain = blocks[1](blocks[0](x)) if layout == "two_blocks" else blocks[0](x)
    plain = plain.sin() if layout.endswith(("then_saves", "then_save")) else plain
    expected = torch.autograd.grad(plain.sin().sum(), used, allow_unused=True)
    torch.manual_seed(1)
    # the whole step's backward on the device's thread too: recomputes run there
    actual = grad(LAYOUTS[layout](blocks, x).sin().sum(), used, allow_unused=True)
    for e, a in zip(expected, actual, strict=True):
        assert (e is None and a is None) or torch.equal(e, a)


@pytest.mark.parametrize("thread", sorted(GRADS))
def test_a_policy_block_with_a_backward_inside_and_a_nested_policy_block_is_exact(thread: str) -> None:
    grad = GRADS[thread]
    w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4, requires_grad=True)

    def outer(t: torch.Tensor, recomputed: bool) -> torch.Tensor:
        h = (t @ w1).sin()
        inner = lambda u: (u @ w2).tanh()  # noqa: E731
        h2 = remat.recompute(inner, h, policy=policies.save_matmuls) if recomputed else inner(h)
        (g,) = grad(h2.sum(), t, create_graph=True)
        return h2 + g.pow(2).sum()

    expected = torch.autograd.grad(outer(x, False).sum(), [x, w1, w2])
    for policy in (policies.save_matmuls, policies.recompute_ops("sin")):
        got = grad(remat.recompute(outer, x, True, policy=policy).sum(), [x, w1, w2])
        assert all(torch.equal(e, a) for e, a in zip(expected, got, strict=True))
    assert not _selective._SCOPES


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_backward_inside_a_block_leaves_nothing_alive_after_the_step(layout: str) -> None:
    # the recompute's own graph keeps what it saves for the inner backward as detached
    # aliases: a tensor kept as itself by the node that made it would be a reference
    # cycle through autograd's C++ nodes, which the garbage collector cannot see
    torch.manual_seed(0)
    blocks = nn.ModuleList(GradientPenalty(16, torch.autograd.grad) for _ in range(2))
    x = torch.randn(8, 16, requires_grad=True)
    live = []
    with remat.MemoryTracker() as tracker:
        for _ in range(3):
            out = LAYOUTS[layout](blocks, x)
            out.sum().backward()
            del out
            x.grad = None
            blocks.zero_grad(set_to_none=True)
            gc.collect()
            live.append(tracker.live_bytes)
    assert live == [0, 0, 0]


def test_a_thread_leaves_nothing_in_torchs_store_when_its_blocks_are_done() -> None:
    # NOTE [what torch's per-thread store may hold]: a value left there when a thread ends
    # can abort a process that exits then
    from remat._inherited import KEYS

    left: list[list[str]] = []

    def train() -> None:
        x = torch.randn(8, 8, requires_grad=True)
        block = GradientPenalty(8, torch.autograd.grad)
        remat.recompute(block, x, policy=policies.save_matmuls).sum().backward()
        remat.recompute(lambda t: remat.recompute(block, t), x).sum().backward()
        left.append([key for key in KEYS if torch._C._is_key_in_tls(key)])

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert left == [[]]


def test_hooks_that_cannot_be_entered_leave_no_frame_behind() -> None:
    x = torch.randn(3, requires_grad=True)
    with (
        pytest.raises(RuntimeError, match="no hooks here"),
        torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"),
    ):
        remat.recompute(torch.sin, x)
    assert _frames._STACK.items == []
    remat.recompute(torch.cos, x).sum().backward()  # a later block is a root of its own
    assert x.grad is not None and torch.equal(x.grad, -x.sin())


def test_explain_sees_the_recompute_when_the_backward_runs_on_the_device_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # remat.explain's observer is inherited by a backward's thread as the stacks are
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 16), nn.LayerNorm(16))
    x = torch.randn(4, 16, requires_grad=True)

    def table() -> list[tuple[str, str, str, int]]:
        torch.manual_seed(1)
        explanation = remat.explain(model, x, policy=policies.save_matmuls)
        return [(o.phase, o.op, o.status, o.reruns) for o in explanation.ops]

    here = table()
    for name in ("backward", "grad"):
        monkeypatch.setattr(
            torch.autograd, name, functools.partial(on_the_device_thread, getattr(torch.autograd, name))
        )
    there = table()
    gelu = [row for row in there if row[0] == "forward" and row[1] == "aten.gelu.default"]
    assert gelu and gelu[0][3] == 1  # run again once in the recompute, which runs on the other thread
    assert there == here
