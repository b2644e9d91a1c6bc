"""A group's input through its forward (NOTE [a group's input through its forward] in
``remat.measure.costs``).

LeViT's first stage ends with a residual MLP layer and the subsampling attention, whose
key and value projection runs before the queries' subsample: the layer and the subsample
plan as one stage, the projection as its glue. The model drops the layer's input once the
layer returns, so the measured forward's peak, at the projection, had it gone; a replay of
a region that starts at that stage holds it (its checkpoint) through the projection. A
plan captured at 0.36 of the budget that stores everything (the solver's pick depends on
the stages' times) went 2304 B over its prediction on every step (119304 B against 117000 B).
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from reference_models import small_levit
from remat.plan import Plan, Schedule, get_solver, plan_from_data
from remat.plan.share import prepared

pytestmark = pytest.mark.usefixtures("clean_remat_state")

# the captured plan's schedule (39 planned stages; the solver's pick at 0.36 depends on the times)
_SCHEDULE = [
    {"region": [0, 10]}, {"region": [0, 3]}, {"region": [0, 2]}, {"store": 0}, {"store": 1}, {"end": [0, 2]},
    {"store": 2}, {"end": [0, 3]}, {"store": 3}, {"region": [4, 6]}, {"store": 4}, {"store": 5}, {"end": [4, 6]},
    {"store": 6}, {"store": 7}, {"store": 8}, {"store": 9}, {"end": [0, 10]}, {"store": 10}, {"region": [11, 12]},
    {"store": 11}, {"end": [11, 12]}, {"region": [12, 14]}, {"store": 12}, {"store": 13}, {"end": [12, 14]},
    {"store": 14}, {"store": 15}, {"store": 16}, {"store": 17}, {"region": [18, 19]}, {"store": 18},
    {"end": [18, 19]}, {"store": 19}, {"store": 20}, {"store": 21}, {"store": 22}, {"region": [23, 25]},
    {"store": 23}, {"store": 24}, {"end": [23, 25]}, {"store": 25}, {"store": 26}, {"store": 27}, {"store": 28},
    {"store": 29}, {"store": 30}, {"store": 31}, {"store": 32}, {"store": 33}, {"store": 34}, {"store": 35},
    {"store": 36}, {"store": 37}, {"store": 38}
]  # fmt: skip


def test_a_replay_holding_a_group_input_through_its_glue_fits_its_prediction() -> None:
    pytest.importorskip("transformers")
    model, kwargs = small_levit()
    reference = copy.deepcopy(model)
    reference(**kwargs).loss.backward()
    wrapped = remat.Checkpointable(model, 0.36, output_kept=False, nested=True)
    wrapped(**kwargs).loss.backward()  # measures
    planned = wrapped.plan
    assert planned is not None and planned.budget_bytes is not None
    measurement = planned.measurement
    # the captured schedule on this measurement, planned as it was (glue constants taken
    # from replays), within the same budget: its prediction does not depend on the times
    planning = prepared(
        measurement, loss_measured=True, output_kept=False, margin=0.0, solver=get_solver("optimal"), take_again=True
    )
    schedule = Schedule.from_plan(planning.profile, plan_from_data(_SCHEDULE))
    split = planning.split(planned.budget_bytes)
    plan = Plan(schedule, split, tuple(measurement.groups), measurement.measured_peak_bytes, measurement)
    peaks = []
    with wrapped.executing(plan):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with remat.MemoryTracker() as tracker:
                wrapped(**kwargs).loss.backward()
            peaks.append(tracker.peak_bytes)
    assert max(peaks) <= plan.predicted_peak_bytes <= plan.budget_bytes
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
