"""MemoryTracker against byte counts worked out by hand, the 16-block MLP, and parse_budget."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import remat
import remat.budget
from remat import InvalidBudget, MemoryTracker, RematError, format_bytes, parse_budget
from remat.budget import FREE_MEMORY_MARGIN as SAFETY_MARGIN
from remat.budget import available_memory_bytes

pytestmark = pytest.mark.usefixtures("clean_remat_state")

FLOAT = 4  # bytes of a float32


# ----------------------------------------------------------------------------- the tracker
def test_a_fresh_tensor_counts_its_storage() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(100)
        b = torch.ones(3, 5, dtype=torch.float64)
    assert tracker.peak_bytes == 100 * FLOAT + 15 * 8
    assert tracker.live_bytes == 100 * FLOAT + 15 * 8
    del a, b


def test_views_are_not_counted_twice() -> None:
    with MemoryTracker() as tracker:
        a = torch.zeros(10, 10)
        views = [a.view(100), a.t(), a[::2], a[3], a.unsqueeze(0).expand(4, 10, 10), a.detach()]
        assert tracker.live_bytes == 100 * FLOAT
        del a  # the views keep the storage alive
        assert tracker.live_bytes == 100 * FLOAT
        del views
        assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 100 * FLOAT


def test_in_place_operations_are_not_counted() -> None:
    with MemoryTracker() as tracker:
        a = torch.zeros(50)
        a.add_(1).mul_(3)
        a[10:20].fill_(2)
        torch.sin(a, out=a)
    assert tracker.peak_bytes == tracker.live_bytes == 50 * FLOAT
    del a


def test_freed_then_reallocated_is_counted_once() -> None:
    with MemoryTracker() as tracker:
        for _ in range(5):
            a = torch.ones(64)  # the allocator hands back the same block every time
            del a
        b = torch.ones(64)
        c = torch.ones(32)
        del b
        d = torch.ones(16)
    assert tracker.peak_bytes == (64 + 32) * FLOAT
    assert tracker.live_bytes == (32 + 16) * FLOAT
    del c, d


def test_tensors_from_before_the_run_are_not_counted() -> None:
    before = torch.zeros(1000)
    with MemoryTracker() as tracker:
        view = before[:10]
        before.add_(1)
        copy = before * 2
    assert tracker.peak_bytes == 1000 * FLOAT  # only the product
    del view, copy


def test_resize_changes_the_count() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(10)
        a.resize_(100)  # a larger storage
        assert tracker.live_bytes == 100 * FLOAT
        a.resize_(5)  # shrinking keeps the storage's capacity
        assert tracker.live_bytes == 100 * FLOAT
    assert tracker.peak_bytes == 100 * FLOAT
    del a


def test_parameter_gradients_are_excluded() -> None:
    weight = torch.randn(1000, requires_grad=True)
    other = torch.randn(1000)
    with MemoryTracker() as tracker:
        loss = weight.dot(other)  # 4 bytes; dot saves its inputs, which exist already
        loss.backward()  # the seed gradient: 4 bytes; weight.grad: 4000 bytes, excluded
    assert weight.grad is not None
    assert tracker.peak_bytes == 2 * FLOAT
    assert tracker.live_bytes == FLOAT  # the loss

    # A leaf no operator saw is excluded when passed in exclude_grads_of.
    unseen = torch.zeros(500, requires_grad=True)
    for exclude, expected in ((None, 500 * FLOAT), ([unseen], 0)):
        unseen.grad = None
        with MemoryTracker(exclude_grads_of=exclude) as tracker:
            unseen.grad = torch.ones(500)
        assert tracker.peak_bytes == expected


def test_a_gradient_accumulated_into_grad_is_excluded() -> None:
    # A weight whose .grad exists gets its new gradient added into .grad and freed:
    # parameter-gradient memory too, left out like .grad itself.
    weight = torch.randn(1000, requires_grad=True)
    weight.dot(torch.ones(1000)).backward()
    with MemoryTracker() as tracker:
        loss = weight.dot(torch.full((1000,), 2.0))  # the filled tensor (4000, saved) and 4 bytes
        loss.backward()  # seed: 4 bytes; the new gradient (4000): excluded
    assert tracker.peak_bytes == 1000 * FLOAT + 2 * FLOAT
    assert torch.equal(weight.grad, torch.full((1000,), 3.0))


def test_timeline_and_sections() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(10)
        with tracker.section("middle"):
            b = torch.empty(20)
            del b
            c = torch.empty(5)
        del a
    assert tracker.timeline() == [40, 120, 40, 60, 20]
    assert tracker.section_peak_bytes("middle") == (40, 120, 60)
    assert [s.name for s in tracker.sections("middle")] == ["middle"]
    with pytest.raises(KeyError):
        tracker.section_peak_bytes("nothing")
    assert remat.track_memory().__class__ is MemoryTracker
    del c


def test_figures_end_at_exit() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(10)
    del a
    gc.collect()
    assert tracker.live_bytes == 40  # what was alive when the run ended
    assert tracker.peak_bytes == 40


# ----------------------------------------------------------------------------- the 16-block MLP
WIDTH, BATCH, N_BLOCKS = 32, 16, 16
ACTIVATION = BATCH * WIDTH * FLOAT  # one block input or output: 2048 bytes
HIDDEN = 4 * ACTIVATION  # the output of Linear(d, 4d) or of GELU: 8192 bytes


def sixteen_block_mlp() -> nn.Sequential:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(N_BLOCKS)]
    )


def training_step_peak(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)  # no gradient accumulation: see the test above
    with MemoryTracker() as tracker:
        out = model(x)
        out.backward(grad)
        del out
    return tracker.peak_bytes


# Without recompute, every block keeps its input (saved by its first Linear), the output
# of its first Linear (saved by GELU) and the GELU output (saved by the second Linear):
# blocks 2..16 get as input the previous block's output, the caller holds the last
# output; x was allocated before the step. So after the forward:
#     16 x (HIDDEN + HIDDEN + ACTIVATION) = 144 ACTIVATION,
# and the backward of block 16 adds the gradient of the GELU output (HIDDEN) before it
# frees anything (the second Linear's gradient for its input):
UNMARKED_PEAK = N_BLOCKS * (2 * HIDDEN + ACTIVATION) + HIDDEN  # 148 x 2048 = 303104 bytes

# With every block marked (hook-based mode), each block keeps only its input, so after
# the forward the 15 block inputs that are block outputs, and the last output held by
# the caller, are alive: 16 ACTIVATION (during the forward, block 16 never has more
# than 15 ACTIVATION + two HIDDEN alive). The backward starts at block 16, and its
# recompute fills the activations its backward needs: the first Linear's output
# (HIDDEN) and the GELU output (HIDDEN); it stops there, since the second Linear saves
# its inputs before it computes its output. The second Linear's backward then adds the
# gradient of the GELU output (HIDDEN) (the weight and bias gradients are parameter
# gradients: excluded). That is the peak, reached again when GELU's backward swaps the
# GELU output for its own input gradient. Later blocks keep fewer block inputs alive.
MARKED_PEAK = N_BLOCKS * ACTIVATION + 2 * HIDDEN + HIDDEN  # 28 x 2048 = 57344 bytes

# The reentrant mode runs the block under no_grad in the forward, and in backward runs
# it again in full (its output too: ACTIVATION) before it calls backward on it; each
# call also keeps a 0-d float anchor (4 bytes) so that parameters get gradients even
# when no input requires grad.
MARKED_PEAK_REENTRANT = N_BLOCKS * (ACTIVATION + FLOAT) + 2 * HIDDEN + ACTIVATION + HIDDEN


def test_sixteen_block_mlp_unmarked_peak_by_hand() -> None:
    model = sixteen_block_mlp()
    x, grad = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    assert training_step_peak(model, x, grad) == UNMARKED_PEAK


@pytest.mark.parametrize(
    ("use_reentrant", "expected"),
    [(False, MARKED_PEAK), (True, MARKED_PEAK_REENTRANT)],
    ids=["hooks", "reentrant"],
)
def test_sixteen_block_mlp_marked_peak_by_hand(use_reentrant: bool, expected: int) -> None:
    model = sixteen_block_mlp()
    x, grad = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    plain_grads = None
    model.zero_grad(set_to_none=True)
    model(x).backward(grad)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    remat.apply(model, lambda name, m: name.count(".") == 0 and name != "", use_reentrant=use_reentrant)
    assert sum(remat.is_marked(m) for m in model.modules()) == N_BLOCKS
    peak = training_step_peak(model, x, grad)
    assert peak == expected
    assert peak < 0.3 * UNMARKED_PEAK
    assert all(torch.equal(a, p.grad) for a, p in zip(plain_grads, model.parameters()))


# ----------------------------------------------------------------------------- budgets
@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (268435456, 268435456),
        ("512MiB", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("300kB", 300_000),
        ("300k", 300_000),
        ("2GiB", 2 * 2**30),
        ("  7 b ", 7),
        ("1e3B", 1000),
        ("64B", 64),
        ("1TiB", 2**40),
        (0.5, 500),
        (1.0, 1000),
        ("0.25", 250),
        (1e-9, 1),  # a fraction never rounds to zero bytes
    ],
)
def test_parse_budget_forms(budget: object, expected: int) -> None:
    assert parse_budget(budget, reference_bytes=1000) == expected


@pytest.mark.parametrize(
    ("budget", "reference", "message"),
    [
        (0, None, "positive"),
        (-5, None, "positive"),
        (True, None, "bool"),
        (0.0, 1000, r"\(0, 1\]"),
        (1.5, 1000, r"\(0, 1\]"),
        (float("nan"), 1000, r"\(0, 1\]"),
        (float("inf"), 1000, r"\(0, 1\]"),
        (0.5, None, "measure the model"),
        ("12 parsecs", None, "cannot read"),
        ("lots", None, "cannot read"),
        ("", None, "cannot read"),
        ("-3MB", None, "cannot read"),
        ("0MB", None, "positive"),
        ("1.5", 1000, r"no unit: write '1.5B' for bytes"),  # not one byte
        ("512", 1000, r"no unit: write '512B'"),
        ("1e3", 1000, "no unit"),
        ("0", 1000, "no unit"),
        ([512], None, "list"),
    ],
)
def test_parse_budget_errors(budget: object, reference: int | None, message: str) -> None:
    with pytest.raises(InvalidBudget, match=message) as info:
        parse_budget(budget, reference_bytes=reference)  # type: ignore[arg-type]
    assert isinstance(info.value, RematError) and isinstance(info.value, ValueError)
    assert "512MiB" in str(info.value) or "measure" in str(info.value)  # says what to write


@pytest.mark.parametrize("budget", [None, "none", "auto", "free"])
def test_parse_budget_free_memory(budget: object, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def free_bytes(device: object = "cpu") -> int:
        asked.append(str(device))
        return 10_000

    monkeypatch.setattr(remat.budget, "available_memory_bytes", free_bytes)
    assert parse_budget(budget, device="cpu") == int(10_000 * (1 - SAFETY_MARGIN))
    assert asked == ["cpu"]


def test_available_memory_on_the_cpu() -> None:
    assert 0 < available_memory_bytes("cpu") < 2**50


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**40) == "5120.00 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"


def test_gradients_of_leaves_made_and_freed_during_the_run_are_all_excluded() -> None:
    # A freed leaf leaves its id to the next tensor: the next leaf must be hooked too
    # (remat's measuring steps make aliases of the parameters and free them)
    rows = torch.randn(20, 1024)
    with MemoryTracker() as tracker:
        for row in rows:
            weight = row.detach().requires_grad_()  # a new leaf on storage from before the run
            (weight[:16] * 2).sum().backward()
            del weight
    # a product of 16 floats and a sum; never a leaf's gradient (4 KiB)
    assert tracker.peak_bytes < 1024
    ids = []
    for _ in range(20):
        leaf = torch.randn(1024, requires_grad=True)
        ids.append(id(leaf))
        del leaf
    assert len(set(ids)) < len(ids), "ids are reused (what the test relies on)"


def test_a_gradient_copied_into_grad_is_excluded_after_its_leaf_is_gone() -> None:
    # A gradient of another layout than its leaf's (a sum's expanded gradient, a CPU
    # convolution's weight gradient) is copied into .grad: that copy is the gradient. The
    # leaf may die before the run ends (remat's measuring steps run on parameter aliases).
    weight = torch.randn(64, 64).t().requires_grad_()  # a leaf of transposed strides
    with MemoryTracker() as tracker:
        (weight.sum() * 2).backward()
        assert weight.grad is not None and weight.grad.stride() == weight.stride()
        del weight
    assert tracker.peak_bytes < 64 * 64 * 4


def test_a_wrapper_tensor_counts_its_inner_tensors_once() -> None:
    # NOTE [wrapper tensors]: a wrapper subclass (DTensor, TwoTensor) reports a storage of
    # its own that holds nothing; the tracker counts the inner tensors' storages instead
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(64, 32), torch.randn(64, 32)
    pair = TwoTensor(a, b)
    with remat.track_memory() as tracker:
        doubled = pair * 2  # two inner products of 8 KiB each, one wrapper
        inner = doubled.a.view(-1)  # a view of one inner tensor: no new memory
        del inner
    assert tracker.peak_bytes == 2 * 64 * 32 * 4, tracker.peak_bytes
    del doubled


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_fake_reduced_loss_is_counted_with_its_elementwise_buffer(device: str) -> None:
    # NOTE [losses that keep their buffer]: the real loss's scalar lives in its elementwise
    # buffer (measured on the CPU and on a GPU); its fake counterpart is sized the same,
    # on any device, and a loss that is not reduced is counted once, as it is
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.storages import buffered_loss_bytes

    mse = torch.ops.aten.mse_loss.default
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        x, t = torch.empty(128, 64, device=device), torch.empty(128, 64, device=device)
        reduced, unreduced = mse(x, t, 1), mse(x, t, 0)
    assert buffered_loss_bytes(mse, (x, t, 1), reduced) == 128 * 64 * 4
    assert buffered_loss_bytes(mse, (x, t, 0), unreduced) == 0
    real = torch.nn.functional.mse_loss(torch.randn(128, 64), torch.randn(128, 64))
    assert real.untyped_storage().nbytes() == 128 * 64 * 4  # what the rule stands for, on this machine
