"""New input shapes: sized exactly on fake tensors, timed only when needed.

A training run whose inputs change size (a varying sequence length, a last short batch)
must stay within its budget at every shape, and must not time every shape it meets.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat
import remat.plan.key
from remat.discover import discover_chain
from remat.measure import measure_chain
from remat.measure.assemble import ChainMeasurement, with_times
from remat.measure.scale import SCALING_RANGE, ShapeTimings, scaled_times, work_ratio
from remat.models import CATALOGUE
from remat.plan.key import Setups, _modules_and_parameters, shape_family, signature, what_changed

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class Attention(nn.Module):
    """Scores of every position against every other: work grows with the length squared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ x.transpose(-1, -2)).softmax(-1)
        return scores @ x


def sized(model: nn.Sequential, x: torch.Tensor) -> ChainMeasurement:
    chain = discover_chain(model, (x,), {})
    return measure_chain(model, chain, (x,), {}, sized=True)


def test_work_scales_linearly_for_projections_and_squarely_for_attention() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attention(), nn.Tanh(), nn.Linear(16, 16))
    short, long = sized(model, torch.randn(2, 32, 16)), sized(model, torch.randn(2, 64, 16))
    flops = [(a.forward_work.flops, b.forward_work.flops) for a, b in zip(short.stages, long.stages, strict=True)]
    assert flops[0][1] == 2 * flops[0][0] > 0  # the projection: twice the tokens
    assert flops[1][1] == 4 * flops[1][0] > 0  # attention: the square
    assert flops[2] == (0, 0)  # elementwise: no flops counted, scaled by its bytes
    assert 2 < work_ratio(short, long) < 4


def test_times_are_scaled_stage_by_stage_from_the_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attention(), nn.Tanh(), nn.Linear(16, 16))
    short, long = sized(model, torch.randn(2, 32, 16)), sized(model, torch.randn(2, 64, 16))
    reference = with_times(short, [(1.0, 2.0)] * len(short.stages))
    times = scaled_times(reference, long)
    if short.groups == long.groups == [(i, i + 1) for i in range(4)]:
        assert times[0] == (2.0, 4.0) and times[1] == (4.0, 8.0) and times[2] == (2.0, 4.0)
    assert all(f > 1.0 and b > 2.0 for f, b in times)
    other = sized(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), torch.randn(2, 32, 16))
    with pytest.raises(ValueError, match="same chain"):
        scaled_times(reference, other)


def test_shape_families_leave_out_sizes_only() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    a = signature(model, (torch.randn(2, 8, 4),), {})
    b = signature(model, (torch.randn(3, 5, 4),), {})
    assert a != b and shape_family(a) == shape_family(b)
    assert shape_family(signature(model, (torch.randn(2, 8, 4).double(),), {})) != shape_family(a)
    assert shape_family(signature(model, (torch.randn(2, 4),), {})) != shape_family(a)  # fewer dimensions
    model[0].requires_grad_(False)
    assert shape_family(signature(model, (torch.randn(2, 8, 4),), {})) != shape_family(a)


class _Shared(nn.Module):
    """Modules and parameters reached twice, a None child and a None parameter."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(3, 3)
        self.a = shared
        self.b = nn.Sequential(shared, nn.ReLU(), nn.Linear(3, 3))
        self.c = nn.Linear(3, 3)
        self.c.weight = self.b[2].weight
        self.d: nn.Module | None = None
        self.register_parameter("p", None)
        self.q = nn.Parameter(torch.ones(1))


def test_the_key_sees_the_modules_and_parameters_torch_lists() -> None:
    model = _Shared()
    modules, parameters = _modules_and_parameters(model)
    assert [id(m) for m in modules] == [id(m) for m in model.modules()]
    assert [id(p) for p in parameters] == [id(p) for p in model.parameters()]
    key = signature(model, (torch.randn(2, 3),), {})
    model.b[2].weight.requires_grad_(False)  # shared with c
    frozen = signature(model, (torch.randn(2, 3),), {})
    assert frozen != key
    del model.b[1]  # a module without parameters
    smaller = signature(model, (torch.randn(2, 3),), {})
    assert smaller != frozen
    model.b[0].train(False)  # the shared one
    assert signature(model, (torch.randn(2, 3),), {}) != smaller


def test_a_scaled_shape_whose_forward_is_off_is_timed_at_its_next_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    timings = ShapeTimings(limit=2)
    keys = [signature(model, (torch.randn(n, 16),), {}) for n in (8, 12)]
    first, second = sized(model, torch.randn(8, 16)), sized(model, torch.randn(12, 16))
    first = with_times(first, [(1.0, 2.0)] * len(first.stages))
    assert timings.known_times(keys[0], first) is None  # nothing timed yet
    timings.record(keys[0], first, scaled=False)
    found = timings.known_times(keys[1], second)
    assert found is not None and found[1] == pytest.approx(1.5)
    timings.record(keys[1], with_times(second, found[0]), scaled=True)
    assert timings.unverified(keys[1]) and timings.counts == {"timed": 1, "scaled": 1, "estimated": 0}
    ratio, retime = timings.verify(keys[1], 100.0)  # far slower than the estimate
    assert ratio > SCALING_RANGE and retime and timings.must_retime(keys[1])
    assert timings.known_times(keys[1], second) is None  # timed now
    timings.record(keys[1], second, scaled=False)
    assert not timings.must_retime(keys[1]) and timings.counts == {"timed": 2, "scaled": 1, "estimated": 0}
    with pytest.raises(ValueError, match="at least 1"):
        ShapeTimings(limit=0)


def test_a_shape_far_from_every_timed_one_is_timed_while_timings_are_left() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=6, width=32)
    wrapped = remat.Checkpointable(model, 0.8, timed_shapes=2)
    for rows in (8, 12, 64, 80, 256, 300):
        wrapped(torch.randn(rows, 32)).sum().backward()
    # 8 timed; 12 within 2x of it: scaled; 64 far: timed (the second and last timing);
    # 80 within range of 64; 256 and 300 far from both, but no timings are left
    assert wrapped.measure_counts == {"timed": 2, "scaled": 4, "estimated": 0}


@pytest.mark.slow
def test_twenty_sequence_lengths_are_timed_at_most_three_times_and_each_step_fits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = CATALOGUE["gpt2"]
    torch.manual_seed(0)
    model = spec.factory(n_layers=2).train()
    wrapped = remat.Checkpointable(model, "7MiB")  # fixed, as a device is
    lengths = [16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 20, 36, 60, 100, 8]
    recomputes: list[bool] = []
    with caplog.at_level(logging.INFO, logger="remat"):
        for length in lengths:
            ids = torch.randint(0, 1024, (2, length))
            with wrapped.check_step() as check:
                output = wrapped(ids)
                loss = spec.loss_fn(output, ids)
                del output
                loss.backward()
            assert check.within_budget, f"length {length}: {check}"
            assert wrapped.plan is not None
            recomputes.append(any(count > 1 for count in wrapped.plan.forward_counts))
            model.zero_grad(set_to_none=True)
    assert recomputes[lengths.index(128)] and not recomputes[lengths.index(8)]  # the budget binds at length
    counts = wrapped.measure_counts
    assert counts["timed"] <= 3 and counts["timed"] + counts["scaled"] == len(lengths), counts
    assert sum(record.message.startswith("remat measured") for record in caplog.records) == len(lengths)
    assert sum("checked the scaled times" in record.message for record in caplog.records) == counts["scaled"]


class _Scaled(nn.Module):
    """Blocks that take a Python number from the model's call (a temperature, a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6))

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, flag: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * scale + x
        return -x if flag else x


def test_python_numbers_are_values_in_a_family_and_flags_are_not() -> None:
    model = _Scaled()
    x = torch.randn(2, 32)
    a, b = signature(model, (x, 1.0), {}), signature(model, (x, 2.5), {})
    assert a != b and shape_family(a) == shape_family(b)
    assert "a Python number argument" in what_changed(a, b)
    assert shape_family(signature(model, (x, 1.0), {"flag": True})) != shape_family(
        signature(model, (x, 1.0), {"flag": False})
    )
    assert shape_family(signature(model, (x, 1), {})) == shape_family(a)  # an int is a number too
    assert what_changed(a, signature(model, (torch.randn(3, 32), 2.5), {})).endswith("shapes, dtypes or devices")
    # the first leaf too (a number passed first: the key's head ends before it)
    first = [signature(model, (value, x), {}) for value in (1.0, 2.0)]
    assert "a Python number argument" in what_changed(*first)


def test_setups_keep_the_most_recently_used() -> None:
    setups = Setups(limit=2)
    assert setups.entered("a", (), {}) == [] and setups.entered("b", (), {}) == []
    assert setups.entered("a", (), {}) == []  # used again: now the most recent
    assert setups.entered("c", (), {}) == ["b"]
    assert setups.entered("b", (), {}) == ["a"]


def test_a_python_number_that_changes_each_step_is_said_once_scaled_and_kept_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remat.plan.key, "MAX_SETUPS", 3)
    torch.manual_seed(0)
    model = _Scaled()
    reference = _Scaled()
    reference.load_state_dict(model.state_dict())
    wrapped = remat.Checkpointable(model, 0.6)
    x = torch.randn(64, 32)
    scales = [1.0, 1.1, 1.2, 1.3, 1.4, 1.0]
    with pytest.warns(UserWarning, match=r"each new value of the argument scale, a Python number \(3 values") as said:
        for scale in scales:
            with wrapped.check_step() as check:
                wrapped(x, scale=scale).square().sum().backward()
            assert check.within_budget, check
            reference(x, scale=scale).square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert p.grad is not None and torch.equal(p.grad, q.grad), name
            model.zero_grad(), reference.zero_grad()
    assert sum("Python number" in str(w.message) for w in said) == 1
    assert [w.filename for w in said if "Python number" in str(w.message)] == [__file__]  # the user's line
    # one value timed, the others scaled from it; 1.0 came back after it was forgotten
    assert wrapped.measure_counts == {"timed": 1, "scaled": 5, "estimated": 0}
    assert len(wrapped._measurements) == len(wrapped._chains) == 3
    assert len({key for key, _ in wrapped._plans}) <= 3 and len(wrapped._setups._recent) == 3
