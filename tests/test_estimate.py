"""Planning from sizes alone: the work the tracker counts, the cost model, measure="estimated"
and models built on the meta device.

Only times are estimated: every byte figure must be the one a timed measurement gives, and a
plan from an estimate must train with exact gradients within its budget.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from torch import nn

import remat.measure.step as measure_step
from remat import UnsupportedModel, cli, track_memory
from remat.automatic import Checkpointable
from remat.measure.estimate import CostModel, _calibrate, calibrated_cost_model, dominant_dtype, estimated_times
from remat.measure.instrument import Work

WIDTH, BATCH, DEPTH = 64, 128, 8


def _mlp(depth: int = DEPTH, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH)


STAND_IN = CostModel("stand-in", "float32", call_s=1e-5, flops_per_s=1e9, bytes_per_s=1e8)


# ---------------------------------------------------------------------- work
def test_the_tracker_counts_each_stages_work_forward_and_backward() -> None:
    wrapper = Checkpointable(_mlp(depth=2), None, loss_fn=_loss)
    stages = wrapper.measure(_inputs()).stages
    product = 2 * BATCH * WIDTH * WIDTH  # flops of one (BATCH x WIDTH) @ (WIDTH x WIDTH)
    first, tanh, second = stages[0], stages[1], stages[2]
    assert first.forward_work.flops == product and second.forward_work.flops == product
    # the chain input needs no gradient: the first Linear computes only its weight's gradient
    assert first.backward_work.flops == product
    assert second.backward_work.flops == 2 * product  # its input's gradient and its weight's
    assert tanh.forward_work.flops == 0 and tanh.backward_work.flops == 0
    activation_bytes = BATCH * WIDTH * 4
    for stage in stages:
        assert stage.forward_work.operations > 0 and stage.backward_work.operations > 0
        assert stage.forward_work.allocated_bytes >= activation_bytes
    # each backward makes its input's gradient, the first one's excepted
    assert second.backward_work.allocated_bytes >= activation_bytes


def test_a_timing_step_counts_no_work_and_cannot_be_estimated() -> None:
    measurement = Checkpointable(_mlp(), None, loss_fn=_loss).measure(_inputs())
    timing_only = dataclasses.replace(
        measurement,
        stages=[dataclasses.replace(s, forward_work=Work(), backward_work=Work()) for s in measurement.stages],
    )
    with pytest.raises(ValueError, match="counted no work"):
        estimated_times(timing_only, STAND_IN)


# ---------------------------------------------------------------------- the cost model
def test_the_cost_model_charges_calls_flops_and_bytes() -> None:
    work = Work(flops=3_000_000, operations=4, allocated_bytes=200_000)
    assert STAND_IN.seconds(work) == pytest.approx(4e-5 + 3e-3 + 2e-3)
    measurement = Checkpointable(_mlp(), None, loss_fn=_loss).measure(_inputs())
    times = estimated_times(measurement, STAND_IN)
    assert times == [(STAND_IN.seconds(s.forward_work), STAND_IN.seconds(s.backward_work)) for s in measurement.stages]


@pytest.mark.parametrize("name", ["call_s", "flops_per_s", "bytes_per_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_cost_model_refuses_rates_that_are_not_positive_and_finite(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        dataclasses.replace(STAND_IN, **{name: value})


def test_the_calibrated_cost_model_is_measured_once_per_device_and_dtype() -> None:
    cost = calibrated_cost_model("cpu", torch.float32)
    assert cost.device == "cpu" and cost.dtype == "float32"
    assert calibrated_cost_model("cpu", torch.float32) is cost
    assert "GFLOP/s" in cost.describe()
    with pytest.raises(ValueError, match="meta"):
        calibrated_cost_model("meta")


def test_calibrating_holds_no_more_than_it_is_allowed() -> None:
    _calibrate.cache_clear()
    with track_memory() as tracker:
        cost = calibrated_cost_model("cpu", torch.float32, max_bytes=2**20)
    assert 0 < tracker.peak_bytes <= 2**20
    assert calibrated_cost_model("cpu", torch.float32, max_bytes=2**20) is cost


def test_the_dtype_of_most_parameters_sets_the_cost_models_dtype() -> None:
    model = nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16), nn.Linear(4, 4))
    assert dominant_dtype(list(model.parameters())) == torch.bfloat16
    assert dominant_dtype([]) == torch.float32


# ---------------------------------------------------------------------- measure="estimated"
def _no_timing_pass(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records the timing passes that ran for real (a rehearsal on fake tensors is allowed)."""
    real_passes: list[bool] = []
    original = measure_step.time_groups

    def watched(*args: object, **kwargs: object) -> object:
        if not kwargs.get("rehearsal", False):
            real_passes.append(True)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(measure_step, "time_groups", watched)
    return real_passes


def test_the_first_step_trains_on_estimated_times_and_the_next_one_times_the_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_passes = _no_timing_pass(monkeypatch)
    _calibrate.cache_clear()  # measured in the first step: within its budget too
    model, reference = _mlp(), _mlp()
    wrapper = Checkpointable(model, 0.7, measure="estimated", loss_fn=_loss)
    x = _inputs()
    with track_memory(exclude_grads_of=model.parameters()) as tracker:
        _loss(wrapper(x)).backward()
    _loss(reference(x)).backward()
    first_plan = wrapper.plan
    assert first_plan is not None
    assert real_passes == [] and wrapper.measure_counts == {"timed": 0, "scaled": 0, "estimated": 1}
    assert first_plan.schedule.profile.metadata["times"].startswith("estimated from the sizes")
    # a training step's cost model holds no more than the step's largest stage
    # (every stage here saves or outputs one activation: three tensors fit in it)
    elements = int(re.search(r"additions of (\d+) elements", first_plan.schedule.profile.metadata["times"])[1])
    assert 3 * elements <= BATCH * WIDTH < 6 * elements
    assert max(first_plan.forward_counts) > 1, "a budget of 0.7 must make something recompute"
    assert tracker.peak_bytes <= first_plan.budget_bytes
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)

    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = None
    _loss(wrapper(x)).backward()
    _loss(reference(x)).backward()
    assert real_passes == [True] and wrapper.measure_counts == {"timed": 1, "scaled": 0, "estimated": 1}
    second_plan = wrapper.plan
    assert second_plan is not None and second_plan is not first_plan
    assert "times" not in second_plan.schedule.profile.metadata
    # the same sizes: the same budget and the same memory figures per stage
    assert second_plan.budget_bytes == first_plan.budget_bytes
    assert second_plan.schedule.profile.saved_bytes == first_plan.schedule.profile.saved_bytes
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)
    # and no third measurement
    _loss(wrapper(x)).backward()
    assert wrapper.measure_counts == {"timed": 1, "scaled": 0, "estimated": 1}


def _without_times(profile: object) -> object:
    return dataclasses.replace(
        profile,  # type: ignore[type-var]
        forward_time_s=(0.0,) * profile.n_stages,  # type: ignore[attr-defined]
        backward_time_s=(0.0,) * profile.n_stages,  # type: ignore[attr-defined]
        metadata={},
    )


def test_a_model_on_the_meta_device_is_planned_with_the_bytes_of_the_real_one() -> None:
    with torch.device("meta"):
        on_meta = _mlp()
    real = _mlp()
    x = _inputs()
    estimated = Checkpointable(on_meta, 0.7, measure="estimated", loss_fn=_loss)
    timed = Checkpointable(real, 0.7, loss_fn=_loss)
    sized = estimated.measure(x).profile
    assert sized.metadata["device"] == "cpu" and "times" in sized.metadata
    assert _without_times(sized) == _without_times(timed.measure(x).profile)
    plan, real_plan = estimated.plan_for(), timed.plan_for()
    assert plan.budget_bytes == real_plan.budget_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert estimated.minimum_budget_bytes() == timed.minimum_budget_bytes()
    assert all(p.is_meta for p in on_meta.parameters()), "measuring leaves the model on the meta device"
    # planning only: the cost model is calibrated at its full sizes, out of the caches
    assert f"additions of {8 * 2**20} elements" in sized.metadata["times"]
    with pytest.raises(UnsupportedModel, match="meta device"):
        estimated(x)


def test_a_meta_model_with_buffers_and_a_counter_is_sized_like_the_real_one() -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))

    with torch.device("meta"):
        on_meta = build()
    x = _inputs()
    sized = Checkpointable(on_meta, None, measure="estimated", loss_fn=_loss).measure(x).profile
    timed = Checkpointable(build(), None, loss_fn=_loss).measure(x).profile
    assert _without_times(sized) == _without_times(timed)
    assert on_meta[1].num_batches_tracked.is_meta


# ---------------------------------------------------------------------- the command line
def test_remat_plan_estimate_builds_on_meta_and_labels_the_times(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "mlp", "--batch", "8", "--budget", "0.5", "--json"]
    assert cli.main([*argv, "--estimate"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert cli.main(argv) == 0
    timed = json.loads(capsys.readouterr().out)
    assert estimated["schedule"]["times"].startswith("estimated from the sizes by a cost model calibrated on cpu")
    assert timed["schedule"]["times"] == "measured"
    for key in ("budget_bytes", "no_recompute_peak_bytes"):
        assert estimated[key] == timed[key]
    assert estimated["predicted_peak_bytes"] <= estimated["budget_bytes"]


def test_remat_plan_estimate_plans_a_hugging_face_model_from_its_config(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["plan", "--hf", "gpt2", "--hf-config", "n_layer=3,n_embd=32", "--budget", "0.5", "--estimate"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "estimated times" in out and "stage times:" in out


def test_the_command_lines_meta_models_hold_no_memory() -> None:
    from remat.cli.loading import load_workload

    workload = load_workload("mlp", batch=8, input_shape=None, device=torch.device("cpu"), meta=True)
    assert all(p.is_meta for p in workload.model.parameters())
    inputs, _ = workload.make_batch()
    assert not any(t.is_meta for t in inputs)


def test_remat_plan_estimate_takes_a_factorys_sample_input_made_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    # the factory runs under the meta device, so its sample input is made there too: the
    # command gives zeros of its shape on the device instead
    assert cli.main(["plan", "cli_factories:tiny_mlp_with_input", "--estimate", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["input_shapes"] == [[8, 16]]
    assert document["schedule"]["times"].startswith("estimated")
