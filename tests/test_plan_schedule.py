"""Plan trees, their operations, validation, and the simulator checked by hand."""

from __future__ import annotations

import gc
import json

import pytest

from remat.plan import (
    ChainProfile,
    InvalidPlan,
    Operation,
    OperationKind,
    Region,
    Schedule,
    Store,
    operations,
    plan_from_data,
    plan_to_data,
    simulate,
    validate_plan,
)
from remat.testing import all_plans, random_chain

FORWARD_STORE = OperationKind.FORWARD_STORE
FORWARD_CHECKPOINT = OperationKind.FORWARD_CHECKPOINT
FORWARD_DISCARD = OperationKind.FORWARD_DISCARD
BACKWARD = OperationKind.BACKWARD
LOSS = OperationKind.LOSS


def names(plan: tuple[Store | Region, ...]) -> list[str]:
    return [str(operation) for operation in operations(plan)]


def chain_a() -> ChainProfile:
    """Two stages; both save their input, neither its output; no temporaries."""
    return ChainProfile(
        names=("first", "second"),
        forward_time_s=(1.0, 2.0),
        backward_time_s=(3.0, 4.0),
        activation_bytes=(100, 10, 20),  # x_0 is the caller's: never counted
        gradient_bytes=(0, 1, 2),
        saved_bytes=(5, 7),
        saves_input=(True, True),
        saves_output=(False, False),
        forward_temp_bytes=(0, 0),
        backward_temp_bytes=(0, 0),
    )


def test_operations_of_nested_plans() -> None:
    plan = (
        Region(
            0,
            3,
            (
                Store(0),
                Region(1, 3, (Store(1), Store(2))),
            ),
        ),
        Store(3),
    )
    assert names(plan) == [
        "forward_checkpoint(0)", "forward_discard(1)", "forward_discard(2)",
        "forward_store(3)", "loss", "backward(3)",
        # body of [0, 3): Store(0), then the region [1, 3), then its body
        "forward_store(0)", "forward_checkpoint(1)", "forward_discard(2)",
        "forward_store(1)", "forward_store(2)", "backward(2)", "backward(1)",
        "backward(0)",
    ]  # fmt: skip
    assert operations((Store(0),)) == [
        Operation(FORWARD_STORE, 0), Operation(LOSS), Operation(BACKWARD, 0)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("plan", "n_stages", "fragment"),
    [
        ((), 1, "non-empty tuple"),
        ([Store(0)], 1, "a plan is a tuple"),
        ((Store(1),), 2, "stage 0 comes next"),
        ((Store(0),), 2, "covers stages [0, 1) but must cover [0, 2)"),
        ((Store(0), Store(1)), 1, "past the end"),
        ((Region(0, 0, ()),), 1, "empty region"),
        ((Region(0, 2, (Store(0),)),), 2, "plan[0].body covers stages [0, 1)"),
        ((Region(0, 1, (Region(0, 1, (Store(0),)),)),), 1, "strictly shorter"),
        ((Region(0, 2, (Region(0, 2, (Store(0), Store(1))),)),), 2, "strictly shorter"),
        ((Region(0, 2, (Store(0), Store(2))),), 2, "Store(2) but stage 1 comes next"),
        (("store 0",), 1, "not a Store, an Offload or a Region"),
    ],
)
def test_invalid_plans(plan: tuple, n_stages: int, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidPlan) as raised:
        validate_plan(plan, n_stages)
    assert fragment in str(raised.value)


def test_every_enumerated_plan_is_valid_and_executable() -> None:
    profile = random_chain(0, 4)
    plans = all_plans(4)
    assert len(plans) == 352 and len(set(plans)) == 352
    for plan in plans:
        validate_plan(plan, 4)
        result = simulate(profile, plan)
        assert sum(result.forward_counts) >= 4
        assert [entry.operation.kind for entry in result.timeline].count(BACKWARD) == 4


def test_simulate_store_everything_by_hand() -> None:
    # fs(0): peak 0 + x1 10 + S0 5 = 15; live x1 + S0 = 15 (x_0 is free)
    # fs(1): peak 15 + x2 20 + S1 7 = 42; x1 now held by "stored 1": live 42
    # loss : peak 42 + G2 2 = 44; x2's frontier ends: live 10 + 5 + 7 + 2 = 24
    # b(1) : peak 24 + G1 1 = 25; frees G2, S1, x1: live S0 5 + G1 1 = 6
    # b(0) : peak 6 + G0 0 = 6; frees G1, S0: live 0
    result = simulate(chain_a(), (Store(0), Store(1)))
    assert [(str(e.operation), e.live_after_bytes, e.peak_during_bytes) for e in result.timeline] == [
        ("forward_store(0)", 15, 15),
        ("forward_store(1)", 42, 42),
        ("loss", 24, 44),
        ("backward(1)", 6, 25),
        ("backward(0)", 0, 6),
    ]
    assert result.peak_bytes == 44
    assert result.forward_counts == (1, 1)
    assert result.time_s == 10.0 and result.overhead_s == 0.0


def test_simulate_recompute_first_stage_by_hand() -> None:
    # fc(0): peak 0 + x1 10 + S0 5 = 15 (S0 materialised, then dropped); live x1 10
    # fs(1): peak 10 + x2 20 + S1 7 = 37; live 37 (x1 held by "stored 1")
    # loss : peak 37 + 2 = 39; live 37 - x2 20 + G2 2 = 19
    # b(1) : peak 19 + 1 = 20; live G1 1
    # fs(0): peak 1 + 10 + 5 = 16; live 16 (recomputed x1 with its frontier, S0)
    # b(0) : the recomputed x1 feeds nothing and stage 0 does not save it: its frontier
    #        ends first, 16 - 10 = 6; peak 6 + 0 = 6; frees G1, S0: live 0
    plan = (Region(0, 1, (Store(0),)), Store(1))
    result = simulate(chain_a(), plan)
    assert [(e.live_after_bytes, e.peak_during_bytes) for e in result.timeline] == [
        (10, 15), (37, 37), (19, 39), (1, 20), (16, 16), (0, 6)
    ]  # fmt: skip
    assert result.peak_bytes == 39
    assert result.forward_counts == (2, 1)
    assert result.time_s == 1.0 + 2.0 + 4.0 + 1.0 + 3.0
    assert result.overhead_s == 1.0


def test_simulate_coexisting_copies_by_hand() -> None:
    # A body ending with a region: its discarding forward makes an x2 whose frontier lasts
    # until the next operation, which recomputes x2 again: both copies are live.
    # fc(0) 15 -> 10; fd(1) 10 + 20 + 7 = 37 -> x2 20; loss 22 -> G2 2;
    # fs(0) 2 + 10 + 5 = 17 -> 17; fc(1) 17 + 27 = 44 -> 2 + 10 + 5 + 20 = 37;
    # fs(1) 37 + 27 = 64 -> 2 + 10 + 5 + 20 + 7 = 44 (first copy of x2 freed after it);
    # b(1) the recomputed x2's frontier ends first: 44 - 20 = 24, peak 24 + 1 = 25
    #      -> G1 1 + S0 5 = 6; b(0) 6 -> 0
    plan = (Region(0, 2, (Store(0), Region(1, 2, (Store(1),)))),)
    result = simulate(chain_a(), plan)
    assert [(e.live_after_bytes, e.peak_during_bytes) for e in result.timeline] == [
        (10, 15), (20, 37), (2, 22), (17, 17), (37, 44), (44, 64), (6, 25), (0, 6)
    ]  # fmt: skip
    assert result.peak_bytes == 64
    assert result.forward_counts == (2, 3)


def test_simulate_saves_output_and_temporaries_by_hand() -> None:
    profile = ChainProfile(
        names=("only",),
        forward_time_s=(1.0,),
        backward_time_s=(2.0,),
        activation_bytes=(0, 8),
        gradient_bytes=(3, 4),
        saved_bytes=(2,),
        saves_input=(True,),
        saves_output=(True,),
        forward_temp_bytes=(5,),
        backward_temp_bytes=(6,),
    )
    # fs(0): peak 8 + 2 + 5 = 15; live x1 8 + S0 2 = 10
    # loss : peak 10 + 4 = 14; x1 stays (kept as output): live 14
    # b(0) : peak 14 + G0 3 + 6 = 23; frees G1, S0, x1: live G0 3
    result = simulate(profile, (Store(0),))
    assert [(e.live_after_bytes, e.peak_during_bytes) for e in result.timeline] == [
        (10, 15), (14, 14), (3, 23)
    ]  # fmt: skip
    assert result.peak_bytes == 23


def test_simulate_accepts_schedules_and_operation_lists() -> None:
    profile = chain_a()
    plan = (Region(0, 1, (Store(0),)), Store(1))
    schedule = Schedule.from_plan(profile, plan, budget_bytes=50, solver_name="test")
    assert simulate(profile, schedule) == schedule.simulation
    assert simulate(profile, operations(plan)) == schedule.simulation
    assert schedule.operations == operations(plan)
    assert schedule.predicted_peak_bytes == 39
    assert schedule.forward_counts == (2, 1)
    assert schedule.overhead_s == 1.0
    assert schedule.stored_stages == (1,)


@pytest.mark.parametrize(
    ("ops", "fragment"),
    [
        ([Operation(FORWARD_STORE, 1)], "its input x_1 is not live"),
        ([Operation(FORWARD_STORE, 0), Operation(BACKWARD, 0)], "gradient of x_1 does not exist"),
        (
            [
                Operation(FORWARD_DISCARD, 0),
                Operation(FORWARD_DISCARD, 1),
                Operation(LOSS),
                Operation(BACKWARD, 1),
            ],
            "stage 1 was not stored",
        ),
        (
            [Operation(FORWARD_STORE, 0), Operation(FORWARD_STORE, 1), Operation(LOSS)],
            "never runs the backward of stages [0, 1]",
        ),
        ([Operation(FORWARD_STORE, 0), Operation(FORWARD_STORE, 1)], "no loss marker"),
        ([Operation(LOSS)], "chain output has not been computed"),
        ([Operation(FORWARD_STORE, 5)], "stage must be in [0, 2)"),
        (["forward"], "expected a plan tree"),
    ],
)
def test_simulate_rejects_operations_that_cannot_run(ops: list, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidPlan) as raised:
        simulate(chain_a(), ops)
    assert fragment in str(raised.value)


def test_simulate_validates_plans() -> None:
    with pytest.raises(InvalidPlan, match="must cover"):
        simulate(chain_a(), (Store(0),))


def test_plan_data_round_trip() -> None:
    for plan in all_plans(3):
        data = plan_to_data(plan)
        assert plan_from_data(data) == plan
    assert plan_to_data((Region(0, 1, (Store(0),)), Store(1))) == [
        {"region": [0, 1]},
        {"store": 0},
        {"end": [0, 1]},
        {"store": 1},
    ]
    # the nested form of earlier versions is read too
    nested = [{"region": [0, 2], "body": [{"region": [0, 1], "body": [{"store": 0}]}, {"store": 1}]}, {"store": 2}]
    assert plan_from_data(nested) == (Region(0, 2, (Region(0, 1, (Store(0),)), Store(1))), Store(2))
    with pytest.raises(InvalidPlan, match="plan entry 0"):
        plan_from_data([{"keep": 0}])
    with pytest.raises(InvalidPlan, match="plan entry 2"):
        plan_from_data([{"region": [0, 2]}, {"store": 0}, {"end": [0, 1]}])
    with pytest.raises(InvalidPlan, match="has no end"):
        plan_from_data([{"region": [0, 1]}, {"store": 0}])


def test_a_plan_nested_as_deep_as_a_long_chain_needs_no_recursion() -> None:
    """The smallest budget of a long chain nests a region in every body: 1,500 levels here,
    past Python's default recursion limit (1,000) with room for the frames below."""
    n = 1500
    body: tuple[Store | Region, ...] = (Store(0),)
    for stop in range(2, n):
        body = (Region(0, stop - 1, body), Store(stop - 1))
    plan = (Region(0, n - 1, body), Store(n - 1))
    validate_plan(plan, n)
    data = plan_to_data(plan)
    copy = plan_from_data(json.loads(json.dumps(data)))
    assert copy == plan and hash(copy) == hash(plan) and copy is not plan
    ops = operations(plan)
    assert ops[0] == Operation(OperationKind.FORWARD_CHECKPOINT, 0) and ops[-1] == Operation(OperationKind.BACKWARD, 0)
    assert sum(op.kind is OperationKind.BACKWARD for op in ops) == n
    assert simulate(random_chain(0, n), plan).peak_bytes > 0


@pytest.mark.parametrize("enabled", [True, False])
def test_simulate_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    """simulate() pauses the cyclic collector while it runs (long timelines), errors included."""
    profile = random_chain(0, 4)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        simulate(profile, (Store(0), Store(1), Store(2), Store(3)))
        assert gc.isenabled() is enabled
        with pytest.raises(InvalidPlan):
            simulate(profile, (Store(0), Store(2), Store(1), Store(3)))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
