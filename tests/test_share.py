"""The budget shared out: what is held only part of the step is counted where it lives."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.models import CATALOGUE

pytestmark = pytest.mark.usefixtures("clean_remat_state")

SPEC = CATALOGUE["gpt2"]  # its embedding is tied to its head: a leftover after the head's backward


def wrapped_gpt2(budget: float) -> tuple[remat.Checkpointable, tuple[torch.Tensor, ...], torch.Tensor]:
    """The zoo's GPT-2 wrapped with its loss (its output kept: the default), and a batch."""
    torch.manual_seed(0)
    inputs, target = SPEC.make_batch(2)
    wrapped = remat.Checkpointable(SPEC.factory().train(), budget, loss_fn=lambda output: SPEC.loss_fn(output, target))
    return wrapped, inputs, target


def test_a_kept_output_counted_from_the_loss_on_buys_faster_plans_that_still_fit() -> None:
    wrapped, inputs, _ = wrapped_gpt2(1.0)
    wrapped.measure(*inputs)
    faster = 0
    for fraction in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        plan = wrapped.plan_for(fraction)
        split = plan.budget
        assert split.total_bytes is not None and split.chain_bytes is not None
        assert split.kept_output_bytes > 0 and split.part_time_bytes >= split.kept_output_bytes
        # the whole step, each part counted where it lives, fits the budget less its margin
        assert plan.predicted_peak_bytes <= split.total_bytes - split.margin_bytes
        # the plan made as if everything held outside lived through the step
        held_through = split.total_bytes - split.margin_bytes - split.held_outside_bytes
        solver = wrapped._solver(plan.schedule.profile.n_stages)  # the solver the plan was made with
        conservative = solver(plan.schedule.profile, held_through)
        assert plan.predicted_time_s <= conservative.predicted_time_s
        faster += plan.predicted_time_s < conservative.predicted_time_s
        if split.chain_bytes > held_through:
            assert "what lives only part of the step counted where it lives" in str(plan)
    assert faster >= 1


def test_training_with_such_a_plan_stays_within_the_budget_and_keeps_its_output() -> None:
    wrapped, inputs, target = wrapped_gpt2(0.5)
    for _ in range(2):
        with wrapped.check_step() as check:
            output = wrapped(*inputs)  # kept through the backward, as output_kept=True says
            SPEC.loss_fn(output, target).backward()
        wrapped.model.zero_grad(set_to_none=True)
        assert check.within_budget, str(check)
        assert check.ratio is not None and check.ratio <= 1.0


@pytest.mark.parametrize("name", ["residual", "unet"])
def test_what_the_glue_keeps_for_replays_is_not_charged_to_a_plan_that_stores_everything(name: str) -> None:
    """``x = x + block(x)`` and a U-Net's skips: the glue after a recomputed block keeps its
    input for the replay. Storing everything replays nothing: budget 1.0 is the plain peak."""
    spec = CATALOGUE[name]
    inputs, target = spec.make_batch(2)
    model = spec.factory().train()
    wrapped = remat.Checkpointable(model, 1.0, loss_fn=lambda out: spec.loss_fn(out, target), output_kept=False)
    peaks = []
    for _ in range(2):
        with remat.MemoryTracker() as tracker:
            spec.loss_fn(wrapped(*inputs), target).backward()
        peaks.append(tracker.peak_bytes)
        model.zero_grad(set_to_none=True)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert sum(constant.nbytes for constant in plan.budget.glue_constants) > 0
    assert plan.forward_counts == (1,) * len(plan.forward_counts)
    assert max(peaks) <= plan.budget_bytes == plan.predicted_peak_bytes
    # the prediction is exact but for what the U-Net's stages hold past their next stage
    assert plan.predicted_peak_bytes <= 1.04 * peaks[1]
    # a recomputing plan is charged for them
    half = wrapped.plan_for(0.9)
    assert any(count > 1 for count in half.forward_counts)
    assert half.predicted_peak_bytes <= half.budget_bytes
