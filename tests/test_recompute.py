"""remat.recompute: exactness against plain autograd, in both implementations, and its errors.

Every comparison is bit for bit (``torch.equal``): a recompute runs the very same
operations on the very same values, so anything short of identical is a defect.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import remat
from remat import (
    MemoryTracker,
    NondeterministicRecompute,
    NotCallableBlock,
    RecomputeInputModified,
    RematError,
)

pytestmark = pytest.mark.usefixtures("clean_remat_state")


# ----------------------------------------------------------------------------- helpers
class Counted(nn.Module):
    """Wraps a module; counts its forward calls and records is_recomputing() in each.

    The record is a list: remat replays plain attributes as module state, not containers.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recomputing: list[bool] = []

    @property
    def calls(self) -> int:
        return len(self.recomputing)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.recomputing.append(remat.is_recomputing())
        return self.inner(*args, **kwargs)


def weighted_loss(out: Any) -> torch.Tensor:
    """A loss whose gradient differs per element, over every floating tensor in `out`."""
    total = torch.zeros(())
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            weights = torch.linspace(-1.0, 2.0, leaf.numel()).reshape(leaf.shape)
            total = total + (leaf.float() * weights).sum() + leaf.float().pow(2).sum()
    return total


def train_step(
    model: nn.Module,
    forward: Callable[[nn.Module, Any], Any],
    inputs: Any,
    *,
    seed: int = 1,
) -> dict[str, Any]:
    """Runs forward + backward from a fixed RNG state; returns everything that must match."""
    inputs = tree_map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), inputs)
    torch.manual_seed(seed)
    out = forward(model, inputs)
    weighted_loss(out).backward()
    return {
        "outputs": [t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor)],
        "param_grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "input_grads": [
            None if t.grad is None else t.grad.clone()
            for t in tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ],
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng_after": torch.get_rng_state(),
    }


def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, tree)


def assert_identical(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert len(expected["outputs"]) == len(actual["outputs"])
    for a, b in zip(expected["outputs"], actual["outputs"]):
        assert a.dtype == b.dtype and torch.equal(a, b), "outputs differ"
    assert expected["param_grads"].keys() == actual["param_grads"].keys()
    for name, grad in expected["param_grads"].items():
        other = actual["param_grads"][name]
        assert (grad is None) == (other is None), f"grad of {name}: {grad} vs {other}"
        if grad is not None:
            assert torch.equal(grad, other), f"grad of {name} differs"
    assert len(expected["input_grads"]) == len(actual["input_grads"])
    for a, b in zip(expected["input_grads"], actual["input_grads"]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), "input grads differ"
    for name, buf in expected["buffers"].items():
        assert torch.equal(buf, actual["buffers"][name]), f"buffer {name} differs"
    assert torch.equal(expected["rng_after"], actual["rng_after"]), "global RNG state differs"


def compare(
    make: Callable[[], nn.Module],
    plain: Callable[[nn.Module, Any], Any],
    rematerialised: Callable[[nn.Module, Any], Any],
    inputs: Any,
    *,
    steps: int = 1,
) -> None:
    """Trains two copies of a model for `steps` steps, plainly and with recompute."""
    model_a = make()
    model_b = copy.deepcopy(model_a)
    for step in range(steps):
        expected = train_step(model_a, plain, inputs, seed=step)
        actual = train_step(model_b, rematerialised, inputs, seed=step)
        assert_identical(expected, actual)
        for model in (model_a, model_b):  # a step of plain SGD, so later steps differ
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None


def call(model: nn.Module, x: Any) -> Any:
    return model(x)


# ----------------------------------------------------------------------------- models
def mlp_with_dropout() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(16, 4),
    )


def conv_net_with_batchnorm() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 3),
    )


def transformer_block() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)


class HandWrittenBlock(nn.Module):
    """A pre-norm transformer block written out: attention, MLP, dropout, LayerNorm."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = (q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5).softmax(-1)
        attention = self.drop(attention)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.drop(self.proj(mixed))
        return x + self.drop(self.mlp(self.norm2(x)))


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
def test_mlp_with_dropout_matches_plain_autograd(use_reentrant: bool, per_block: bool) -> None:
    def rematerialised(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        if not per_block:
            return remat.recompute(model, x, use_reentrant=use_reentrant)
        x = remat.recompute(model[:3], x, use_reentrant=use_reentrant)
        x = remat.recompute(model[3:6], x, use_reentrant=use_reentrant)
        return model[6](x)

    compare(mlp_with_dropout, call, rematerialised, torch.randn(5, 8, requires_grad=True), steps=2)


def test_conv_net_with_batchnorm_matches_plain_autograd(use_reentrant: bool) -> None:
    def rematerialised(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        x = remat.recompute(model[:3], x, use_reentrant=use_reentrant)
        x = remat.recompute(model[3:6], x, use_reentrant=use_reentrant)
        return model[6:](x)

    compare(conv_net_with_batchnorm, call, rematerialised, torch.randn(4, 3, 6, 6), steps=3)


@pytest.mark.parametrize("make", [transformer_block, HandWrittenBlock], ids=["torch-layer", "hand-written"])
def test_transformer_block_matches_plain_autograd(use_reentrant: bool, make: Callable[[], nn.Module]) -> None:
    def rematerialised(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(model, x, use_reentrant=use_reentrant)

    compare(make, call, rematerialised, torch.randn(2, 5, 16, requires_grad=True), steps=2)


class Structured(nn.Module):
    """Takes nested structures, a kwarg and a non-tensor argument; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(
        self, pair: tuple[torch.Tensor, list[torch.Tensor]], scale: float, *, extra: dict[str, Any]
    ) -> dict[str, Any]:
        a, (b, c) = pair
        hidden = torch.tanh(self.linear(a) * scale + b * c)
        return {
            "hidden": hidden,
            "pair": (hidden * extra["weight"], extra["bias"].exp()),
            "note": extra["note"],
        }


def test_nested_structures_kwargs_and_constants(use_reentrant: bool) -> None:
    inputs = {
        "pair": (torch.randn(3, 4, requires_grad=True), [torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)]),
        "extra": {
            "weight": torch.randn(4, requires_grad=True),
            "bias": torch.randn(2, requires_grad=True),
            "note": "x",
        },
    }

    def plain(model: nn.Module, i: dict[str, Any]) -> Any:
        out = model(i["pair"], 0.5, extra=i["extra"])
        assert out["note"] == "x"
        return out

    def rematerialised(model: nn.Module, i: dict[str, Any]) -> Any:
        out = remat.recompute(model, i["pair"], 0.5, extra=i["extra"], use_reentrant=use_reentrant)
        assert isinstance(out, dict) and out["note"] == "x" and isinstance(out["pair"], tuple)
        return out

    compare(Structured, plain, rematerialised, inputs)


def test_tuple_output(use_reentrant: bool) -> None:
    def plain(model: nn.Module, x: torch.Tensor) -> Any:
        y = model(x)
        return y, y.sin(), 3

    def rematerialised(model: nn.Module, x: torch.Tensor) -> Any:
        out = remat.recompute(plain, model, x, use_reentrant=use_reentrant)
        assert isinstance(out, tuple) and out[2] == 3
        return out

    compare(lambda: nn.Linear(3, 3), plain, rematerialised, torch.randn(2, 3, requires_grad=True))


def test_inputs_without_grad_still_give_parameter_grads(use_reentrant: bool) -> None:
    x = torch.randn(4, 8)  # requires_grad=False, as a first layer's input is
    compare(mlp_with_dropout, call, lambda m, x: remat.recompute(m, x, use_reentrant=use_reentrant), x)
    model = mlp_with_dropout()
    remat.recompute(model, x, use_reentrant=use_reentrant).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_plain_function_and_bound_method(use_reentrant: bool) -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)

    def function(x: torch.Tensor, *, power: int) -> torch.Tensor:
        return (x @ weight).pow(power)

    out = remat.recompute(function, x, power=3, use_reentrant=use_reentrant)
    out.sum().backward()
    expected_w, expected_x = torch.autograd.grad(function(x, power=3).sum(), (weight, x))
    assert torch.equal(weight.grad, expected_w) and torch.equal(x.grad, expected_x)
    linear = nn.Linear(3, 3)
    y = remat.recompute(linear.forward, x, use_reentrant=use_reentrant)
    assert torch.equal(y, linear(x))


def test_no_grad_mode_just_calls(use_reentrant: bool) -> None:
    block = Counted(nn.Linear(3, 3))
    with torch.no_grad():
        out = remat.recompute(block, torch.randn(2, 3), use_reentrant=use_reentrant)
    assert not out.requires_grad and block.calls == 1


def test_no_warning_in_default_use(use_reentrant: bool) -> None:
    model = conv_net_with_batchnorm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(2, 3, 6, 6)  # an input that does not require grad
        out = remat.recompute(model[:3], x, use_reentrant=use_reentrant)
        out = remat.recompute(model[3:6], out, use_reentrant=use_reentrant)
        model[6:](out).sum().backward()
        marked = remat.mark(nn.Sequential(nn.Linear(3, 3), nn.GELU()), use_reentrant=use_reentrant)
        marked(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert [str(w.message) for w in caught] == []


# ----------------------------------------------------------------------------- RNG
def test_dropout_is_replayed_bit_for_bit(use_reentrant: bool) -> None:
    def rematerialised(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # the RNG is drawn from between and inside the blocks
        x = remat.recompute(model[:3], x, use_reentrant=use_reentrant)
        x = x + torch.rand_like(x)
        return remat.recompute(model[3:], x, use_reentrant=use_reentrant)

    def plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = model[:3](x)
        x = x + torch.rand_like(x)
        return model[3:](x)

    compare(mlp_with_dropout, plain, rematerialised, torch.randn(16, 8, requires_grad=True), steps=2)


def test_without_preserved_rng_state_dropout_masks_differ() -> None:
    # The counter-test of the one above: the replay is what makes it exact. (Only the
    # hook-based mode: it checks shapes, not values, so a wrong mask goes unnoticed.)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    x = torch.randn(32, 8)
    torch.manual_seed(3)
    model(x).sum().backward()
    expected = model[0].weight.grad.clone()
    model.zero_grad()
    torch.manual_seed(3)
    remat.recompute(model, x, preserve_rng_state=False).sum().backward()
    assert not torch.equal(model[0].weight.grad, expected)


class HostRandom(nn.Module):
    """Scales its product by numbers drawn from NumPy's and Python's global generators."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(np.random.randn()) + random.random()
        return torch.tanh(self.linear(x) * scale)


def _host_random_step(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The input's gradient, and the generators' next draws after the step."""
    np.random.seed(0)
    random.seed(1)
    x = x.detach().requires_grad_(True)
    step(x).sum().backward()
    assert x.grad is not None
    return x.grad, (np.random.rand(), random.random())


def test_python_and_numpy_draws_are_replayed(use_reentrant: bool) -> None:
    # NOTE [host random numbers]: the saved tanh output is made from the drawn scale
    block = HostRandom()
    x = torch.randn(4, 8)
    expected, after = _host_random_step(block, x)
    grad, ours_after = _host_random_step(lambda t: remat.recompute(block, t, use_reentrant=use_reentrant), x)
    assert torch.equal(grad, expected)
    assert ours_after == after  # the recompute left the generators where the plain step did
    unpreserved, _ = _host_random_step(
        lambda t: remat.recompute(block, t, use_reentrant=use_reentrant, preserve_rng_state=False), x
    )
    assert not torch.equal(unpreserved, expected)  # the counter-test: the replay is what makes it exact


def test_python_and_numpy_draws_are_replayed_by_a_plan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(HostRandom() for _ in range(4)))
    x = torch.randn(4, 8)
    expected, after = _host_random_step(model, x)
    wrapped = remat.Checkpointable(copy.deepcopy(model), "min")
    for _ in range(2):  # the measuring step, then the planned one
        grad, ours_after = _host_random_step(wrapped, x)
        assert torch.equal(grad, expected)
        assert ours_after == after
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1


class _NumpyGaussian(nn.Module):
    """Scales by one draw of NumPy's legacy standard normal."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * float(np.random.standard_normal()))


def _step_with_draws_between(
    step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, prime: Callable[[], None], draws: bool = True
) -> tuple[torch.Tensor, Any]:
    """Like _host_random_step, with `prime` before the forward and (`draws`) draws between forward and backward."""
    np.random.seed(3)
    random.seed(4)
    prime()
    x = x.detach().requires_grad_(True)
    loss = step(x).sum()
    between = (np.random.rand(), random.random(), np.random.standard_normal()) if draws else ()
    loss.backward()
    assert x.grad is not None
    return x.grad, (between, np.random.rand(), np.random.standard_normal(), random.random())


@pytest.mark.parametrize("draws", [False, True], ids=["nothing_between", "draws_between"])
@pytest.mark.parametrize("prime", ["none", "cached_gaussian"])
def test_host_draws_are_replayed_whatever_the_loop_draws_before_backward(
    use_reentrant: bool, prime: str, draws: bool
) -> None:
    # NOTE [replaying host generators cheaply]. "cached_gaussian": NumPy's legacy normal
    # draws two at a time and caches the second, so the block's draw takes the cached one
    # without moving the generator's words; the replay must bring the cache back.
    def primer() -> None:
        if prime == "cached_gaussian":
            np.random.standard_normal(3)

    block = _NumpyGaussian()
    x = torch.randn(4, 8)
    expected, after = _step_with_draws_between(block, x, primer, draws)
    grad, ours_after = _step_with_draws_between(
        lambda t: remat.recompute(block, t, use_reentrant=use_reentrant), x, primer, draws
    )
    assert torch.equal(grad, expected)
    assert ours_after == after
    unpreserved, _ = _step_with_draws_between(
        lambda t: remat.recompute(block, t, use_reentrant=use_reentrant, preserve_rng_state=False), x, primer, draws
    )
    assert not torch.equal(unpreserved, expected)


def test_a_replay_sets_the_host_generators_only_when_they_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [replaying host generators cheaply]: setting NumPy's state costs more than a
    # small block; a replay of a block that drew nothing, with nothing drawn since, sets none.
    sets: list[int] = []
    set_state = np.random.set_state

    def counted(state: Any, *args: Any, **kwargs: Any) -> Any:
        sets.append(1)
        return set_state(state, *args, **kwargs)

    monkeypatch.setattr(np.random, "set_state", counted)
    np.random.seed(0)  # no Gaussian cached: the block's draw moves the words
    quiet = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    remat.recompute(quiet, x).sum().backward()
    assert sets == []
    remat.recompute(_NumpyGaussian(), x).sum().backward()
    assert len(sets) == 2  # the captured state for the replay, then the loop's back


def test_host_generator_states_read_directly_are_their_public_states() -> None:
    # NOTE [reading host generators directly]: on CPython with NumPy's default generator,
    # the states are read as bytes, equal to what the public APIs give, and set back exactly.
    from remat.manual import _host_generators as host

    np.random.seed(11)
    random.seed(12)
    np.random.standard_normal()  # a Gaussian cached
    state = host.capture()
    assert isinstance(state.python, host._Raw) and isinstance(state.numpy, host._Raw)
    assert state.python == host._raw_of_python(random.getstate())
    assert state.numpy == host._raw_of_numpy(np, np.random.get_state(legacy=False))
    expected = (np.random.standard_normal(), np.random.rand(), random.random(), random.gauss(0, 1))
    assert not host.stands_at(state)
    host.restore(state)
    assert host.stands_at(state)
    assert (np.random.standard_normal(), np.random.rand(), random.random(), random.gauss(0, 1)) == expected


def test_a_generator_whose_position_came_back_after_a_full_turn_has_moved() -> None:
    # NOTE [comparing heads]: the position alone repeats after 624 words drawn; the head's
    # words, regenerated on the way, tell the states apart. So does a Gaussian taken
    # from NumPy's cache, which moves no position at all.
    from remat.manual import _host_generators as host

    random.seed(3)
    np.random.seed(4)
    state = host.capture()
    assert host.stands_at(state)
    for _ in range(624):
        random.getrandbits(32)
    assert host._python_state(head=True).memory[:4] == state.python.memory[:4]  # the same index
    assert not host.stands_at(state)
    host.restore(state)
    np.random.bytes(624 * 4)
    assert host._numpy_state(np).memory[-4:] == state.numpy.memory[-4:]  # the same position
    assert not host.stands_at(state)
    host.restore(state)
    assert host.stands_at(state)
    np.random.standard_normal()  # two drawn, one cached
    cached = host.capture()
    np.random.standard_normal()  # the cached one: the words and the position stay
    assert host._numpy_state(np).memory == cached.numpy.memory
    assert not host.stands_at(cached)


def test_a_replay_that_fails_to_set_the_generators_puts_every_one_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.manual import _host_generators as host
    from remat.manual._rng import capture_forward_state, replay_forward_state

    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    state = capture_forward_state((), preserve_rng_state=True)
    random.random(), np.random.rand(), torch.rand(1)  # all three moved since the capture
    before = (random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state())

    def broken(numpy: Any, state: Any) -> None:
        raise RuntimeError("cannot set NumPy's state")

    monkeypatch.setattr(host, "_set_numpy", broken)
    with pytest.raises(RuntimeError, match="cannot set NumPy"), replay_forward_state(state):
        pass  # pragma: no cover - entering fails
    monkeypatch.undo()
    after = (random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state())
    assert after[0] == before[0]
    assert after[1]["state"]["pos"] == before[1]["state"]["pos"]
    assert np.array_equal(after[1]["state"]["key"], before[1]["state"]["key"])
    assert torch.equal(after[2], before[2])


def test_host_draws_are_replayed_when_the_generators_are_read_through_their_apis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the states cannot be read directly (another layout, another interpreter), the
    # public APIs capture and compare them.
    from remat.manual import _host_generators as host

    monkeypatch.setattr(host, "_python_offset", lambda: None)
    monkeypatch.setattr(host, "_numpy_offsets", lambda numpy: None)
    state = host.capture()
    assert isinstance(state.python, tuple) and isinstance(state.numpy, dict)
    block = HostRandom()
    x = torch.randn(4, 8)
    for prime in (lambda: None, lambda: np.random.standard_normal(3)):
        for draws in (False, True):
            expected, after = _step_with_draws_between(block, x, prime, draws)
            grad, ours_after = _step_with_draws_between(lambda t: remat.recompute(block, t), x, prime, draws)
            assert torch.equal(grad, expected)
            assert ours_after == after


def test_host_draws_are_replayed_from_a_global_generator_other_than_mt19937() -> None:
    from remat.manual import _host_generators as host

    previous = np.random.get_bit_generator()

    def pcg64() -> None:  # np.random.seed() reseeds MT19937 only
        np.random.set_bit_generator(np.random.PCG64(7))

    try:
        pcg64()
        assert isinstance(host.capture().numpy, dict)  # through NumPy's API
        block = _NumpyGaussian()
        x = torch.randn(4, 8)
        expected, after = _step_with_draws_between(block, x, pcg64)
        grad, ours_after = _step_with_draws_between(lambda t: remat.recompute(block, t), x, pcg64)
        assert torch.equal(grad, expected)
        assert ours_after == after
    finally:
        np.random.set_bit_generator(previous)


# ----------------------------------------------------------------------------- grad APIs
def test_autograd_grad_and_backward_inputs_in_hook_mode() -> None:
    model = mlp_with_dropout()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    plain = weighted_loss(model(x))
    expected = torch.autograd.grad(plain, [x, *model.parameters()])

    torch.manual_seed(5)
    loss = weighted_loss(remat.recompute(model, x))
    actual = torch.autograd.grad(loss, [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))

    torch.manual_seed(5)
    loss = weighted_loss(remat.recompute(model, x))
    loss.backward(inputs=[x, model[0].weight])
    assert torch.equal(x.grad, expected[0]) and torch.equal(model[0].weight.grad, expected[1])
    assert model[0].bias.grad is None and model[3].weight.grad is None


def test_double_backward_through_recompute() -> None:
    linear = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def grad_norm(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(torch.tanh(block(x)).sum(), x, create_graph=True)
        return g.pow(2).sum()

    (expected,) = torch.autograd.grad(grad_norm(linear, x), x)
    (actual,) = torch.autograd.grad(grad_norm(lambda t: remat.recompute(linear, t), x), x)
    assert torch.equal(expected, actual)


@pytest.mark.parametrize("api", ["grad", "backward-inputs"])
def test_reentrant_mode_refuses_grad_apis_naming_the_other_mode(api: str) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    linear = nn.Linear(3, 3)
    loss = remat.recompute(linear, x, use_reentrant=True).sum()
    with pytest.raises(RematError, match="use_reentrant=False"):
        if api == "grad":
            torch.autograd.grad(loss, x)
        else:
            loss.backward(inputs=[x])
    # the failed backward left nothing behind: a plain step works
    linear(x).sum().backward()
    assert x.grad is not None


def test_reentrant_refuses_output_recompute() -> None:
    with pytest.raises(RematError, match="use_reentrant=False"):
        remat.recompute(nn.Linear(2, 2), torch.randn(1, 2), use_reentrant=True, output_recompute=True)


# ----------------------------------------------------------------------------- autocast
def test_autocast_is_reentered_during_recompute(use_reentrant: bool) -> None:
    def with_autocast(inner: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
        def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = inner(model, x)
            assert out.dtype == torch.bfloat16
            return out

        return forward

    make = lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))  # noqa: E731
    compare(
        make,
        with_autocast(call),
        with_autocast(lambda m, x: remat.recompute(m, x, use_reentrant=use_reentrant)),
        torch.randn(4, 8, requires_grad=True),
    )


# ----------------------------------------------------------------------------- is_recomputing
def test_is_recomputing_only_during_recompute(use_reentrant: bool) -> None:
    block = Counted(nn.Linear(3, 3))
    assert not remat.is_recomputing()
    out = remat.recompute(block, torch.randn(2, 3, requires_grad=True), use_reentrant=use_reentrant)
    assert block.recomputing == [False] and not remat.is_recomputing()
    out.sum().backward()
    assert block.recomputing == [False, True] and not remat.is_recomputing()


def test_is_recomputing_is_thread_local(use_reentrant: bool) -> None:
    inside = threading.Event()
    other_done = threading.Event()
    seen_by_other: list[bool] = []

    class Waits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if remat.is_recomputing():
                inside.set()
                assert other_done.wait(10)
            return torch.tanh(x)  # saves its output: backward needs a recompute

    other_bn = nn.BatchNorm1d(3)
    reference_bn = copy.deepcopy(other_bn)
    batch = torch.randn(4, 3)

    def other_thread() -> None:
        assert inside.wait(10)
        seen_by_other.append(remat.is_recomputing())
        other_bn(batch)  # the running-statistics guard must not touch this thread
        seen_by_other.append(remat.is_recomputing())
        other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    x = torch.randn(4, 3, requires_grad=True)
    remat.recompute(Waits(), x, use_reentrant=use_reentrant).sum().backward()
    thread.join(10)
    assert seen_by_other == [False, False]
    reference_bn(batch)
    for name, buf in reference_bn.named_buffers():
        assert torch.equal(buf, dict(other_bn.named_buffers())[name])


# ----------------------------------------------------------------------------- normalisation
def norm_layers() -> list[Callable[[], nn.Module]]:
    return [
        lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU()),
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Tanh()),
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, momentum=None), nn.Tanh()),
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.InstanceNorm2d(3, track_running_stats=True), nn.Tanh()),
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Tanh(), nn.BatchNorm2d(3, affine=False)),
    ]


@pytest.mark.parametrize("make", norm_layers(), ids=["bn1d", "bn2d", "bn2d-cumulative", "instancenorm", "bn-last"])
def test_running_statistics_equal_plain_training(use_reentrant: bool, make: Callable[[], nn.Module]) -> None:
    x = torch.randn(5, 4) if isinstance(make()[0], nn.Linear) else torch.randn(3, 2, 4, 4)
    compare(make, call, lambda m, x: remat.recompute(m, x, use_reentrant=use_reentrant), x, steps=4)
    model = make()
    for _ in range(4):
        remat.recompute(model, x, use_reentrant=use_reentrant).sum().backward()
    norm = next(m for m in model if isinstance(m, nn.modules.batchnorm._NormBase))
    assert not torch.equal(norm.running_var, torch.ones_like(norm.running_var))  # they were updated
    if not isinstance(norm, nn.InstanceNorm2d):  # instance norm does not count batches
        assert int(norm.num_batches_tracked) == 4


def test_running_statistics_with_nested_recompute(use_reentrant: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6))

    def rematerialised(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def outer(x: torch.Tensor) -> torch.Tensor:
            x = remat.recompute(model[:3], x, use_reentrant=use_reentrant)
            return remat.recompute(model[3:], x, use_reentrant=use_reentrant)

        return remat.recompute(outer, x, use_reentrant=use_reentrant)

    compare(make, call, rematerialised, torch.randn(5, 4), steps=3)


# ----------------------------------------------------------------------------- nesting
def make_sub_blocks(n: int, width: int = 8) -> list[Counted]:
    return [Counted(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1))) for _ in range(n)]


def test_nested_recompute_counts_and_exactness() -> None:
    subs = make_sub_blocks(3)
    plain_subs = copy.deepcopy(subs)

    def outer(x: torch.Tensor, blocks: list[nn.Module], nested: bool) -> torch.Tensor:
        for block in blocks:
            x = remat.recompute(block, x) if nested else block(x)
        return x

    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(2)
    expected = weighted_loss(outer(x, plain_subs, nested=False))
    expected_grads = torch.autograd.grad(expected, [x, *[p for s in plain_subs for p in s.parameters()]])

    torch.manual_seed(2)
    loss = weighted_loss(remat.recompute(outer, x, subs, nested=True))
    assert [s.calls for s in subs] == [1, 1, 1]
    grads = torch.autograd.grad(loss, [x, *[p for s in subs for p in s.parameters()]])
    assert torch.equal(loss, expected)
    assert all(torch.equal(a, b) for a, b in zip(expected_grads, grads))
    # Backward reaches sub 3 first: the outer block is recomputed up to sub 3's input
    # (subs 1 and 2 run without keeping anything; sub 3, whose output the outer block no
    # longer needs, does not run), then sub 3, 2 and 1 are each recomputed from the
    # inputs the outer recompute left them.
    assert [s.calls for s in subs] == [3, 3, 2]
    assert [s.recomputing for s in subs] == [[False, True, True]] * 2 + [[False, True]]


def test_deeper_nesting_counts_and_exactness() -> None:
    leaves = make_sub_blocks(4)

    def mid(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = remat.recompute(block, x)
        return x

    def top(x: torch.Tensor) -> torch.Tensor:
        x = remat.recompute(mid, leaves[:2], x)
        return remat.recompute(mid, leaves[2:], x)

    plain_leaves = copy.deepcopy(leaves)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(4)
    h = x
    for leaf in plain_leaves:
        h = leaf(h)
    expected = torch.autograd.grad(weighted_loss(h), [x, *[p for s in plain_leaves for p in s.parameters()]])

    torch.manual_seed(4)
    loss = weighted_loss(remat.recompute(top, x))
    actual = torch.autograd.grad(loss, [x, *[p for s in leaves for p in s.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    # Each level recomputes everything it nests except its last block: leaf 4 runs in the
    # forward and in its own recompute; leaf 1 in the forward and once at every level.
    assert [s.calls for s in leaves] == [4, 3, 3, 2]


def test_nested_recompute_in_reentrant_mode_is_exact() -> None:
    subs = make_sub_blocks(3)
    plain_subs = copy.deepcopy(subs)
    x = torch.randn(4, 8, requires_grad=True)

    def outer(x: torch.Tensor) -> torch.Tensor:
        for block in subs:
            x = remat.recompute(block, x, use_reentrant=True)
        return x

    torch.manual_seed(2)
    h = x
    for block in plain_subs:
        h = block(h)
    weighted_loss(h).backward()
    expected = [p.grad for s in plain_subs for p in s.parameters()]
    x.grad = None

    torch.manual_seed(2)
    weighted_loss(remat.recompute(outer, x, use_reentrant=True)).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(expected, [p for s in subs for p in s.parameters()]))
    # the outer recompute runs every sub once (no grad kept), then each sub once more
    assert [s.calls for s in subs] == [3, 3, 3]


def test_nested_recompute_with_operations_between_blocks() -> None:
    # The outer block's own operations after the last nested block make the outer
    # recompute run that block too (skipping what it saves), to get at what follows.
    subs = make_sub_blocks(2)
    plain_subs = copy.deepcopy(subs)

    def outer(x: torch.Tensor, blocks: list[nn.Module], nested: bool) -> torch.Tensor:
        x = (remat.recompute(blocks[0], x) if nested else blocks[0](x)).sin()
        return (remat.recompute(blocks[1], x) if nested else blocks[1](x)).exp()

    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(2)
    expected = torch.autograd.grad(
        weighted_loss(outer(x, plain_subs, False)), [x, *[p for s in plain_subs for p in s.parameters()]]
    )
    torch.manual_seed(2)
    loss = weighted_loss(remat.recompute(outer, x, subs, True))
    actual = torch.autograd.grad(loss, [x, *[p for s in subs for p in s.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert [s.calls for s in subs] == [3, 3]


@pytest.mark.parametrize(("outer_reentrant", "inner_reentrant"), [(False, True), (True, False)])
def test_nesting_one_mode_in_the_other(outer_reentrant: bool, inner_reentrant: bool) -> None:
    subs = make_sub_blocks(3)
    plain_subs = copy.deepcopy(subs)

    def outer(x: torch.Tensor, blocks: list[nn.Module], nested: bool) -> torch.Tensor:
        for i, block in enumerate(blocks):
            x = remat.recompute(block, x, use_reentrant=inner_reentrant) if nested else block(x)
            x = x.exp() if i % 2 else x.sin()
        return x

    x = torch.randn(4, 8, requires_grad=True)
    compare_params = [x, *[p for s in subs for p in s.parameters()]]
    torch.manual_seed(2)
    weighted_loss(outer(x, plain_subs, False)).backward()
    expected = [x.grad.clone(), *[p.grad for s in plain_subs for p in s.parameters()]]
    x.grad = None
    torch.manual_seed(2)
    weighted_loss(remat.recompute(outer, x, subs, True, use_reentrant=outer_reentrant)).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(expected, compare_params))


def test_nested_recompute_lowers_the_peak() -> None:
    # Three wide sub-blocks inside one recomputed block. Without nesting, recomputing
    # the outer block materialises the internals of all three at once; with nesting,
    # only one sub-block's internals are alive at a time.
    width, hidden = 16, 256
    subs = [nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(3)]
    x = torch.randn(32, width, requires_grad=True)

    def outer(x: torch.Tensor, nested: bool) -> torch.Tensor:
        for block in subs:
            x = remat.recompute(block, x) if nested else block(x)
        return x

    peaks = {}
    for nested in (False, True):
        x.grad = None
        for p in [p for block in subs for p in block.parameters()]:
            p.grad = None  # so that no gradient is accumulated (a transient buffer)
        with MemoryTracker() as tracker:
            remat.recompute(outer, x, nested).sum().backward()
        peaks[nested] = tracker.peak_bytes
    hidden_bytes = 32 * hidden * 4
    # two of the three sub-blocks' hidden activations (2 x 2 tensors) are not kept
    assert peaks[True] <= peaks[False] - 4 * hidden_bytes


# ----------------------------------------------------------------------------- output_recompute
def test_output_recompute_chained_blocks_free_the_output() -> None:
    batch, width = 64, 32
    first = Counted(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)))
    second = Counted(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)))
    x = torch.randn(batch, width, requires_grad=True)
    output_bytes = batch * width * 4

    def step(output_recompute: bool) -> tuple[int, list[torch.Tensor]]:
        for p in [*first.parameters(), *second.parameters(), x]:
            p.grad = None
        with MemoryTracker() as tracker:
            out = remat.recompute(
                second, remat.recompute(first, x, output_recompute=output_recompute), output_recompute=output_recompute
            )
            kept = tracker.live_bytes
            out.sum().backward()
        return kept, [x.grad, *[p.grad for p in [*first.parameters(), *second.parameters()]]]

    kept_plain, grads_plain = step(False)
    assert [first.calls, second.calls] == [2, 2]
    kept_lazy, grads_lazy = step(True)
    # The first block's output is dropped after the forward, recomputed (once) when the
    # second block's recompute needs it, and its activations are filled on the way.
    assert [first.calls, second.calls] == [4, 4]
    assert kept_lazy <= kept_plain - output_bytes
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_lazy))


def test_output_recompute_with_marked_blocks_matches_plain() -> None:
    def make() -> nn.Sequential:
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2)) for _ in range(4)])

    def rematerialised(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for block in model:
            x = remat.recompute(block, x, output_recompute=True)
        return x

    compare(make, call, rematerialised, torch.randn(4, 8, requires_grad=True), steps=2)


# ----------------------------------------------------------------------------- errors
def test_not_callable_block() -> None:
    with pytest.raises(NotCallableBlock, match="callable"):
        remat.recompute(torch.randn(2), torch.randn(2))
    assert issubclass(NotCallableBlock, RematError) and issubclass(NotCallableBlock, TypeError)


class ShapeChangesEveryCall(nn.Module):
    """Its shapes depend on a count kept in a list (outside the state remat replays)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.runs: list[None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(None)
        calls = len(self.runs)
        return torch.tanh(self.linear(x[: x.shape[0] - calls + 1]))


class DtypeChangesEveryCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.runs: list[None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(None)
        calls = len(self.runs)
        dtype = torch.float32 if calls == 1 else torch.float64
        return torch.tanh(x.to(dtype))


class SavesFewerWhenRecomputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.runs: list[None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(None)
        calls = len(self.runs)
        y = torch.tanh(x)
        return y.exp() if calls == 1 else y + 1


def assert_nothing_left_behind(rng_before: torch.Tensor, bn: nn.BatchNorm1d, bn_state: dict[str, torch.Tensor]) -> None:
    from conftest import remat_leftovers

    assert remat_leftovers() == []
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name, buf in bn.named_buffers():
        assert torch.equal(buf, bn_state[name])
    # a later plain step works
    linear = nn.Linear(3, 3)
    linear(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert linear.weight.grad is not None


@pytest.mark.parametrize("block_type", [ShapeChangesEveryCall, DtypeChangesEveryCall, SavesFewerWhenRecomputed])
def test_nondeterministic_recompute(use_reentrant: bool, block_type: type[nn.Module]) -> None:
    if block_type is SavesFewerWhenRecomputed and use_reentrant:
        pytest.skip("the reentrant mode checks outputs only; this block's outputs agree")
    bn = nn.BatchNorm1d(4)
    block = nn.Sequential(bn, block_type())
    x = torch.randn(3, 4, requires_grad=True)
    out = remat.recompute(block, x, use_reentrant=use_reentrant)
    bn_state = {n: b.clone() for n, b in bn.named_buffers()}
    rng_before = torch.get_rng_state()
    with pytest.raises(NondeterministicRecompute, match="same"):
        out.sum().backward()
    assert_nothing_left_behind(rng_before, bn, bn_state)


def test_determinism_check_can_be_turned_off(use_reentrant: bool) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(NondeterministicRecompute, match="ShapeChangesEveryCall"):
        remat.recompute(ShapeChangesEveryCall(), x, use_reentrant=use_reentrant).sum().backward()
    x.grad = None
    try:  # whatever happens then is autograd's doing, not remat's check
        remat.recompute(
            ShapeChangesEveryCall(), x, use_reentrant=use_reentrant, determinism_check="none"
        ).sum().backward()
    except NondeterministicRecompute:
        pytest.fail("determinism_check='none' still checked the recomputed tensors")
    except RuntimeError:
        pass
    with pytest.raises(RematError, match=r"determinism_check must be one of \['default', 'none'\]"):
        remat.recompute(ShapeChangesEveryCall(), x, determinism_check="strict")


def test_input_modified_in_place(use_reentrant: bool) -> None:
    bn = nn.BatchNorm1d(4)
    block = nn.Sequential(nn.Linear(4, 4), bn, nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 2
    out = remat.recompute(block, h, use_reentrant=use_reentrant)
    h.add_(1)
    bn_state = {n: b.clone() for n, b in bn.named_buffers()}
    rng_before = torch.get_rng_state()
    with pytest.raises(RecomputeInputModified, match="[Cc]lone"):
        out.sum().backward()
    assert_nothing_left_behind(rng_before, bn, bn_state)


def test_input_modified_in_place_through_a_view(use_reentrant: bool) -> None:
    base = torch.randn(6, 4, requires_grad=True).clone()
    out = remat.recompute(nn.Linear(4, 4), base[:3], use_reentrant=use_reentrant)
    base[3:].mul_(2)  # same storage, same version counter
    with pytest.raises(RecomputeInputModified):
        out.sum().backward()


@dataclasses.dataclass
class _Extra:
    scale: torch.Tensor
    shifts: list[torch.Tensor]


def _scaled(linear: nn.Module) -> Callable[..., torch.Tensor]:
    def block(x: torch.Tensor, extra: _Extra) -> torch.Tensor:
        return linear(x).tanh() * extra.scale + extra.shifts[0]

    return block


@pytest.mark.parametrize("change", ["in place", "in place, in a list", "replaced", "untouched"])
def test_tensors_inside_a_dataclass_input_are_checked_before_the_recompute(use_reentrant: bool, change: str) -> None:
    # NOTE [tensors inside other inputs]: the pytree keeps the dataclass whole
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    extra = _Extra(torch.randn(3, 4), [torch.randn(3, 4)])
    plain_block = _scaled(linear)
    plain_block(x, extra).sum().backward()
    expected = [x.grad.clone(), linear.weight.grad.clone()]
    x.grad, linear.weight.grad, linear.bias.grad = None, None, None
    out = remat.recompute(_scaled(linear), x, extra, use_reentrant=use_reentrant)
    with torch.no_grad():
        if change == "in place":
            extra.scale.mul_(3.0)
        elif change == "in place, in a list":
            extra.shifts[0].add_(1.0)
        elif change == "replaced":
            extra.scale = torch.ones(3, 4)
    if change == "untouched":
        out.sum().backward()
        assert torch.equal(x.grad, expected[0]) and torch.equal(linear.weight.grad, expected[1])
        return
    where = "Extra.shifts[0]" if "list" in change else "Extra.scale"
    with pytest.raises(RecomputeInputModified, match=re.escape(where)):
        out.sum().backward()


@dataclasses.dataclass
class _Context:
    steps: torch.Tensor
    cached: torch.Tensor | None = None
    again: list[Any] = dataclasses.field(default_factory=list)


def test_what_a_block_changes_in_its_own_input_object_is_its_own_doing(use_reentrant: bool) -> None:
    # NOTE [tensors inside other inputs]: noted as the first forward leaves it (a cached field, a counter)
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)

    def block(x: torch.Tensor, context: _Context) -> torch.Tensor:
        if context.cached is None:
            context.cached = torch.ones(3, 4) * 0.5
        if not remat.is_recomputing():
            context.steps.add_(1)
        return linear(x).tanh() * context.cached

    grads = []
    for recomputed in (False, True):
        linear.zero_grad()
        x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(1))
        context = _Context(torch.zeros(()))
        context.again.append(context)  # a structure that holds itself is walked once
        out = remat.recompute(block, x, context, use_reentrant=use_reentrant) if recomputed else block(x, context)
        out.sum().backward()
        assert context.steps.item() == 1
        grads.append([x.grad, linear.weight.grad.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_the_reentrant_mode_refuses_an_output_it_would_hand_back_without_gradient() -> None:
    # NOTE [outputs of the reentrant Function]: only the pytree's tensors go through the Function
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)

    def block(x: torch.Tensor) -> tuple[torch.Tensor, _Extra]:
        h = linear(x)
        return h.tanh(), _Extra(h.exp(), [h.sin()])

    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RematError, match=r"Extra\.scale .*use_reentrant=False"):
        remat.recompute(block, x, use_reentrant=True)
    out, extra = remat.recompute(block, x)  # the default implementation returns them as plain autograd does
    (out.sum() + extra.scale.sum() + extra.shifts[0].sum()).backward()
    got = [x.grad.clone(), linear.weight.grad.clone()]
    x.grad, linear.weight.grad = None, None
    out, extra = block(x)
    (out.sum() + extra.scale.sum() + extra.shifts[0].sum()).backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], linear.weight.grad)


@pytest.mark.parametrize("changed", [0, 1, None])
def test_outputs_sharing_memory_changed_in_place(use_reentrant: bool, changed: int | None) -> None:
    # NOTE [outputs of the reentrant Function]: autograd takes them for tensors of their own
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)

    def block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = linear(x) + 1.0  # nothing keeps h: plain autograd lets it change in place
        return h, h[0]

    def step(recomputed: bool) -> list[torch.Tensor]:
        x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(1))
        linear.zero_grad()
        h, row = remat.recompute(block, x, use_reentrant=use_reentrant) if recomputed else block(x)
        if changed is not None:
            (h, row)[changed].mul_(2.0)
        ((h * h).sum() + (row * 3.0).sum()).backward()
        return [x.grad, linear.weight.grad.clone()]

    expected = step(False)
    if use_reentrant and changed is not None:
        with pytest.raises(RematError, match="share memory"):
            step(True)
    else:
        assert all(torch.equal(a, b) for a, b in zip(expected, step(True), strict=True))


class _ClampsItsWeight(nn.Module):
    """Clamps its own weight in place in its forward (weight clipping): a recompute clamps it again."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.clamp_(-0.3, 0.3)
        return self.linear(x).tanh()


def test_a_parameter_changed_between_forward_and_backward_raises_as_autograd_does() -> None:
    # NOTE [parameters changed before the recompute]: a GAN steps one network between another's forward and backward
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    reference = copy.deepcopy(block)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    x = torch.randn(3, 4, requires_grad=True)
    out = remat.recompute(block, x)
    plain_out = reference(x)
    block(torch.randn(3, 4)).sum().backward()  # another loss, and its step, before this one's backward
    optimizer.step()
    with torch.no_grad():
        reference[0].weight.add_(0.0)  # plain autograd sees a change too
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain_out.sum().backward()
    with pytest.raises(RecomputeInputModified, match=r"parameter of shape \(4, 4\).*Step after the backward"):
        out.sum().backward()


def _clamping_step(recomputed: bool, use_reentrant: bool, layout: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    inner = _ClampsItsWeight()
    if layout == "embedding with max_norm":  # renormalises its rows in place when it looks them up
        embed = nn.Embedding(10, 4, max_norm=0.5)
        blocks = nn.Sequential(embed, nn.Linear(4, 4))
        tokens = torch.tensor([[1, 2, 3], [3, 4, 1]])
        run = (
            (lambda: remat.recompute(blocks, tokens, use_reentrant=use_reentrant))
            if recomputed
            else lambda: blocks(tokens)
        )
        out = run()
        out.square().sum().backward()
        return [p.grad.clone() for p in blocks.parameters()]
    x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(1))

    def outer(h: torch.Tensor) -> torch.Tensor:
        return remat.recompute(inner, h, use_reentrant=use_reentrant) * 2.0 if recomputed else inner(h) * 2.0

    out = remat.recompute(outer, x, use_reentrant=use_reentrant) if recomputed and layout == "nested" else outer(x)
    loss = out.square().sum()
    if layout == "retained graph":
        loss.backward(retain_graph=True)
    loss.backward()
    return [x.grad, *(p.grad.clone() for p in inner.parameters())]


@pytest.mark.parametrize("layout", ["nested", "retained graph", "embedding with max_norm"])
def test_a_block_changing_its_own_parameter_in_place_trains_as_plain_autograd(use_reentrant: bool, layout: str) -> None:
    # NOTE [parameters changed before the recompute]: each recompute's own change is taken as the new normal
    plain, ours = _clamping_step(False, use_reentrant, layout), _clamping_step(True, use_reentrant, layout)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))


def test_a_planned_model_stepped_before_its_backward_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)))
    planned = remat.Checkpointable(model, "min")
    x = torch.randn(8, 16)
    planned(x).sum().backward()  # measures and plans
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = planned(x)
    optimizer.step()
    with pytest.raises(RecomputeInputModified, match="parameter"):
        out.sum().backward()
    optimizer.zero_grad()
    planned(x).sum().backward()  # the next step trains as usual


def test_backward_twice_needs_retain_graph(use_reentrant: bool) -> None:
    linear = Counted(nn.Linear(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    out = remat.recompute(linear, x, use_reentrant=use_reentrant).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    assert torch.equal(x.grad, 2 * first)
    with pytest.raises(RuntimeError):
        out.backward()


def test_under_autocast_a_block_shares_casts_as_plain_autograd_and_frees_them_after(use_reentrant: bool) -> None:
    # NOTE [autocast casts]: a weight used twice shares one cached cast, as in plain
    # autograd (its gradient is summed in bfloat16 first); a discarded block's casts are
    # freed when the autocast region ends, where plain autograd keeps them for backward.
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(4))
    shared = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)

    def block(index: int, h: torch.Tensor) -> torch.Tensor:
        return shared(blocks[index](h)) + shared(h)  # the shared weight twice in the block

    def step(recomputed: bool) -> tuple[int, list[torch.Tensor]]:
        for p in [*blocks.parameters(), *shared.parameters(), x]:
            p.grad = None
        with remat.MemoryTracker() as tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = x
                for index in range(4):
                    h = remat.recompute(block, index, h, use_reentrant=use_reentrant) if recomputed else block(index, h)
            held = tracker.live_bytes  # the autocast region has ended
            h.float().square().sum().backward()
        return held, [p.grad.clone() for p in [*blocks.parameters(), *shared.parameters(), x]]  # type: ignore[union-attr]

    (plain_bytes, plain_grads), (remat_bytes, remat_grads) = step(False), step(True)
    if use_reentrant:
        # each block's backward of its own sums the shared weight's gradient apart
        # (README: differences from torch.utils.checkpoint)
        # (bfloat16 rounding: within 2% of the gradient's norm)
        assert all((a - b).norm() <= 0.02 * a.norm() for a, b in zip(plain_grads, remat_grads, strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(plain_grads, remat_grads, strict=True))
    weight_casts = 4 * 2 * 64 * 64 * 2  # bf16 copies of the blocks' eight weights
    assert remat_bytes < plain_bytes - weight_casts
