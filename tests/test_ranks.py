"""One plan for all ranks (NOTE [one plan for all ranks] in remat.ranks): two gloo processes.

Each rank's timings differ (a block sleeps on one rank), one rank sees a new input shape,
one cannot be planned in the budget, the ranks run different models. Every rank must run
the same schedule at every step, with the gradients of DDP without recompute, and an
error on one rank must be raised on every rank: no hang (the launch has a timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from _ranks_worker import FSDP2_SETUPS
from launch_helpers import free_port, kill_launch, run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_ranks_worker.py")
GATHER = "c10d._allgather_base_.default"  # FSDP2's all-gather
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario on two ranks; each rank's results by scenario."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("ranks"), WORLD_SIZE, timeout_s=120)  # a hang fails


def _schedules(results: list[dict[str, Any]], scenario: str) -> list[list[Any]]:
    """Each rank's schedule at each step (every step must have trained)."""
    schedules = []
    for rank_results in results:
        steps = rank_results[scenario]
        for step in steps:
            assert step["error"] is None, step["error"]
        schedules.append([(step["items"], step["budget_bytes"]) for step in steps])
    return schedules


def _assert_plain_gradients(results: list[dict[str, Any]], scenario: str) -> None:
    for rank_results in results:
        for step in rank_results[scenario]:
            assert step["grads"].keys() == step["expected"].keys()
            for name, grad in step["grads"].items():
                assert torch.equal(grad, step["expected"][name]), f"{scenario}: {name}"


def _recomputed(items: list[dict[str, Any]]) -> set[int]:
    """The stages a schedule runs inside a region (forward more than once)."""
    depth, stages = 0, set()
    for item in items:
        if "region" in item:
            depth += 1
        elif "end" in item:
            depth -= 1
        elif depth:
            stages.add(item["store"])
    return stages


# the worker's slow blocks: stage 2 on rank 0, stage 5 on rank 1
SLOW = (2, 5)


def test_ranks_whose_timings_differ_run_one_plan(results: list[dict[str, Any]]) -> None:
    first, second = _schedules(results, "agreed")
    assert first == second
    for items, _ in first:
        recomputed = _recomputed(items)
        assert recomputed, "0.7 must recompute something"
        assert not recomputed & set(SLOW), "planned with the longest time of any rank"
    _assert_plain_gradients(results, "agreed")


def test_ranks_storing_stages_under_a_policy_run_one_plan(results: list[dict[str, Any]]) -> None:
    first, second = _schedules(results, "agreed-with-a-policy")
    assert first == second
    _assert_plain_gradients(results, "agreed-with-a-policy")


def test_planned_alone_the_same_ranks_pick_different_plans(results: list[dict[str, Any]]) -> None:
    # what the agreement prevents: each rank avoids recomputing its own slow block only
    # (with collectives in the stages, this would pair a collective with the wrong one)
    schedules = _schedules(results, "alone")
    recomputed = [_recomputed(steps[0][0]) for steps in schedules]
    assert recomputed[0] != recomputed[1]
    for rank, slow in enumerate(SLOW):
        assert slow not in recomputed[rank]
        assert SLOW[1 - rank] in recomputed[rank], "the other rank's slow block is the fastest here"
    _assert_plain_gradients(results, "alone")  # no collective in these stages: DDP is exact still


def test_a_new_shape_on_one_rank_plans_again_on_all(results: list[dict[str, Any]]) -> None:
    first, second = _schedules(results, "new-shape-on-one-rank")
    assert first == second and len(first) == 3
    _assert_plain_gradients(results, "new-shape-on-one-rank")


def test_a_rank_that_cannot_be_planned_stops_every_rank(results: list[dict[str, Any]]) -> None:
    (rank0,), (rank1,) = (r["too-large-on-one-rank"] for r in results)
    assert rank1["error"].startswith("BudgetTooSmall: no recompute schedule fits a budget of")
    assert rank0["error"].startswith("RematError: another rank failed while remat measured")


@pytest.fixture(scope="module")
def results_of_four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The agreement's scenarios on four ranks: a maximum over more than a pair, one rank
    apart from three."""
    env = {"RANKS_SCENARIOS": "agreed,new-shape-on-one-rank,too-large-on-one-rank,fsdp2-tensor-parallel"}
    return run_ranks(WORKER, tmp_path_factory.mktemp("ranks4"), 4, timeout_s=240, env=env)


@pytest.mark.slow
def test_four_ranks_run_one_plan_and_stop_together(results_of_four: list[dict[str, Any]]) -> None:
    for scenario in ("agreed", "new-shape-on-one-rank"):
        schedules = _schedules(results_of_four, scenario)
        assert all(schedule == schedules[0] for schedule in schedules[1:]), scenario
        _assert_plain_gradients(results_of_four, scenario)
    for items, _ in _schedules(results_of_four, "agreed")[0]:
        assert _recomputed(items) and not _recomputed(items) & set(SLOW)
    errors = [rank_results["too-large-on-one-rank"][0]["error"] for rank_results in results_of_four]
    assert errors[1].startswith("BudgetTooSmall: no recompute schedule fits a budget of")
    assert all(error.startswith("RematError: another rank failed") for i, error in enumerate(errors) if i != 1)


@pytest.mark.slow
def test_fsdp2_with_tensor_parallelism_is_exact_in_both_modes_with_counted_collectives(
    results_of_four: list[dict[str, Any]],
) -> None:
    # 2 data-parallel groups (FSDP2) of 2 tensor-parallel ranks: DTensor parameters on a 2-D mesh
    gather, reduce, scatter = (
        "c10d._allgather_base_.default",
        "_c10d_functional.all_reduce.default",
        "c10d._reduce_scatter_base_.default",
    )
    wanted = [("enable", 0.5), ("enable", "min"), ("mark", "recompute"), ("mark", "save")]
    for rank_results in results_of_four:
        records = {tuple(record["how"]): record for record in rank_results["fsdp2-tensor-parallel"]}
        assert list(records) == wanted
        for how, record in records.items():
            assert record["error"] is None, (how, record["error"])
            for step, seen in enumerate(record["steps"]):
                for name, grad in seen["remat"].items():
                    assert torch.equal(grad, seen["plain"][name]), (how, step, name)
            for seen in record["steps"][:2]:
                ours, plain = seen["remat-collectives"], seen["plain-collectives"]
                extra = {kind: ours.get(kind, 0) - plain.get(kind, 0) for kind in (gather, reduce, scatter)}
                assert extra[scatter] == 0, (how, extra)
                if how == ("mark", "recompute"):  # each of the 4 blocks runs its all-reduce again
                    assert extra == {gather: 0, reduce: 4, scatter: 0}, (how, extra)
                elif how == ("mark", "save"):  # kept from the forward
                    assert extra == {gather: 0, reduce: 0, scatter: 0}, (how, extra)
                else:  # a replay's all-reduces run again (once per extra forward at most); its gathers stand
                    # for the units' own in backward
                    bound = sum(count - 1 for count in record["forward_counts"])
                    assert extra[gather] == 0 and 0 < extra[reduce] <= bound, (how, extra)
            if how[0] == "enable":
                measured, predicted = record["check"]
                assert measured <= predicted <= record["budget_bytes"], (how, record["check"])
                assert predicted <= 1.25 * measured, (how, record["check"])
    for index in range(2):
        plans = [rank_results["fsdp2-tensor-parallel"][index]["items"] for rank_results in results_of_four]
        assert all(plan == plans[0] for plan in plans[1:])  # one plan on every rank


def test_ranks_with_different_chains_refuse_together(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        (step,) = rank_results["different-models"]
        assert step["error"].startswith("RematError: the ranks measured chains of different structure")


def test_manual_recompute_of_fsdp2_blocks_is_exact_with_the_same_collectives(results: list[dict[str, Any]]) -> None:
    # the blocks' parameters are gathered again for their backward (reshard_after_forward),
    # before remat's recompute runs: recompute adds no gather
    _assert_plain_gradients(results, "fsdp2-marked")
    for rank_results in results:
        (step,) = rank_results["fsdp2-marked"]
        assert step["collectives"] == step["expected_collectives"]
        assert sum(step["collectives"].values()) > 0, "the backward gathers and reduce-scatters"


def test_comm_options_under_tensor_parallelism(results: list[dict[str, Any]]) -> None:
    # each block's row-parallel all-reduce feeds a tanh whose output backward needs: the
    # default recompute runs the all-reduce again, comm="save" keeps its output
    all_reduce = "_c10d_functional.all_reduce.default"
    for rank_results in results:
        (step,) = rank_results["tensor-parallel-comm"]
        plain = step["collectives"][None].get(all_reduce, 0)
        assert step["collectives"]["recompute"].get(all_reduce, 0) == plain + 3
        assert step["collectives"]["save"].get(all_reduce, 0) == plain
        for comm in ("recompute", "save"):
            grads = step[f"grads-{comm}"]
            assert grads.keys() == step["expected"].keys()
            for name, grad in grads.items():
                assert torch.equal(grad, step["expected"][name]), f"comm={comm}: {name}"


def test_the_automatic_mode_refuses_sharded_models_planned_alone_on_every_rank_and_leaves_them_intact(
    results: list[dict[str, Any]],
) -> None:
    for rank_results in results:
        records = rank_results["sharded-alone"]
        assert [record["setup"] for record in records] == ["fsdp2", "tensor-parallel"]
        for record in records:
            assert record["error"] is not None, record["setup"]
            assert "agree_ranks=False" in record["error"] and "remat.mark(block" in record["error"]
            assert record["unchanged"] and record["no_gradients"] and record["trains_disabled"], record


def test_the_automatic_mode_plans_fsdp2_models_exactly_within_the_budget(results: list[dict[str, Any]]) -> None:
    # NOTE [FSDP2 units]: measured with the units gathered and their hooks as in a recompute,
    # replayed with the units gathered as needed; NOTE [parameter traffic]: FSDP2's buffers
    # are not activations (counted, the peaks below are three to five times the budget)
    by_rank = [{r["setup"]: r for r in rank_results["fsdp2-automatic"]} for rank_results in results]
    for records in by_rank:
        assert [tuple(key) for key in records] == list(FSDP2_SETUPS)
        for setup, record in records.items():
            assert record["error"] is None, (setup, record["error"])
            for step, seen in enumerate(record["steps"]):
                assert seen["remat"].keys() == seen["plain"].keys()
                for name, grad in seen["remat"].items():
                    assert torch.equal(grad, seen["plain"][name]), (setup, step, name)
            # and equal to the unsharded model's on every rank's batch at once, up to the
            # order of FSDP2's sums (bf16 parameters round differently: not compared)
            if not setup[4]:
                for name, grad in record["steps"][0]["remat"].items():
                    torch.testing.assert_close(grad, record["single_process"][name], rtol=1e-5, atol=1e-6)
            measured, predicted = record["check"]
            assert measured <= predicted <= record["budget_bytes"] and predicted <= 1.25 * measured, (setup, record)
            kind, _, reshard, _, _ = setup
            for seen in record["steps"][:2]:
                # a replay gathers the units it reaches back into, which then stay gathered until
                # their backward (as FSDP2 keeps units torch's checkpoint recomputes): the backward
                # gathers as often as without remat (never, when units stay gathered from the forward)
                ours, plain = (seen[f"{label}-collectives"].get(GATHER, 0) for label in ("remat", "plain"))
                assert ours == plain == (4 if kind == "sequential" else 5) * reshard, (setup, seen)
    for setup in by_rank[0]:
        assert by_rank[0][setup]["items"] == by_rank[1][setup]["items"], setup  # one plan on every rank


def test_the_automatic_mode_plans_tensor_parallel_models_exactly_within_the_budget(
    results: list[dict[str, Any]],
) -> None:
    # NOTE [measuring together], NOTE [wrapper tensors]: every rank measures, the tracker
    # counts each DTensor's local shard, and one plan runs everywhere
    all_reduce = "_c10d_functional.all_reduce.default"
    by_rank = [
        {(r["comm"], r["budget"]): r for r in rank_results["tensor-parallel-automatic"]} for rank_results in results
    ]
    for records in by_rank:
        plain = records[(None, None)]
        assert plain["error"] is None, plain["error"]
        for name, grad in plain["grads"][0].items():  # up to the order of the all-reduces' sums
            torch.testing.assert_close(grad, plain["single_process"][name], rtol=1e-5, atol=1e-6)
        for (comm, budget), record in records.items():
            if comm is None:
                continue
            assert record["error"] is None, (comm, budget, record["error"])
            for step, (grads, expected) in enumerate(zip(record["grads"], plain["grads"], strict=True)):
                for name, grad in grads.items():
                    assert torch.equal(grad, expected[name]), (comm, budget, step, name)
            measured, predicted, within = record["check"]
            assert within and measured <= record["budget_bytes"], (comm, budget, record["check"])
            assert measured <= predicted <= 1.25 * measured, (comm, budget, record["check"])
            assert ("save_collectives" in record["offered"]) == (comm == "auto")
            # each stage recomputed whole runs its block's all-reduce again at most once per
            # extra forward, and the smallest budget recomputes some: more than plain's
            extra = record["collectives"].get(all_reduce, 0) - plain["collectives"].get(all_reduce, 0)
            assert 0 <= extra <= sum(count - 1 for count in record["forward_counts"]), (comm, budget, extra)
            if budget == "min" and not record["options"]:
                assert extra > 0, (comm, budget, record["collectives"])
    for key in by_rank[0]:
        if key[0] is not None:
            assert by_rank[0][key]["items"] == by_rank[1][key]["items"], key  # one plan on every rank


def test_a_new_shape_on_one_tensor_parallel_rank_stops_every_rank_alike(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        first, second, third = rank_results["tensor-parallel-new-shape"]
        assert first["error"] is None and third["error"] is None, (first["error"], third["error"])
        assert second["error"] is not None and "different signatures" in second["error"], second["error"]
        for step in (first, third):
            for name, grad in step["grads"].items():
                assert torch.equal(grad, step["expected"][name]), name


def _torchrun(
    tmp_path: Path, arguments: list[str], timeout_s: float = 180, finished: Callable[[str], bool] | None = None
) -> tuple[int | None, str, str]:
    """``torchrun --nproc-per-node 2 ARGUMENTS`` on gloo: (exit code, None if it hung; stdout; stderr).

    Once ``finished(stdout)`` is true, the processes have a short while left to exit."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), *arguments]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the output goes to files, not pipes: a rank left running cannot hold the test open
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=err, text=True, cwd=tmp_path, start_new_session=True
        )
        code: int | None = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                code = process.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if finished is not None and finished(out_path.read_text()):
                    # done: left a short while to exit (gloo's teardown can hang on this machine)
                    deadline = min(deadline, time.monotonic() + _EXIT_GRACE_S)
                    finished = None
        if code is None:
            kill_launch(process, port)
            process.wait()
    return code, out_path.read_text(), err_path.read_text()


_EXIT_GRACE_S = 20


@pytest.mark.slow
def test_the_torchrun_example_trains_with_one_plan_on_every_rank(tmp_path: Path) -> None:
    # README's launch: torchrun, two processes on gloo; the script itself checks that the
    # ranks run the same schedule and hold the same weights after every step
    example = Path(__file__).parents[1] / "examples" / "train_distributed.py"
    arguments = [str(example), "--steps", "2", "--tokens", "32", "--budget", "0.5", "--device", "cpu"]

    def verified(stdout: str) -> bool:
        lines = [line for line in stdout.splitlines() if line.startswith("step ")]
        return len(lines) == 2 and all("same plan on every rank: True, same weights: True" in x for x in lines)

    code, stdout, stderr = _torchrun(tmp_path, arguments, finished=verified)
    if code is None:
        assert verified(stdout), f"the example hung before it finished training:\n{stdout}\n{stderr}"
        # Both steps ran and were checked on every rank; the processes then did not exit
        # (seen on a 2-core machine running the suite in two processes: gloo's teardown).
        pytest.skip("the torchrun example trained and checked both steps, then hung at process exit")
    assert code == 0, stdout + stderr
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    assert all("same plan on every rank: True, same weights: True" in line for line in lines)


@pytest.mark.slow
def test_the_bench_command_under_torchrun_trains_through_ddp_with_one_plan(tmp_path: Path) -> None:
    # NOTE [the benchmark on several ranks]: rank 0 alone reports; the run itself checks
    # that every rank planned each budget to the same schedule
    result_path = tmp_path / "bench.json"
    arguments = ["-m", "remat", "bench", "mlp", "--budgets", "0.5,min", "--steps", "1", "--warmup", "0"]
    arguments += ["--batch", "8", "--threads", "1", "--json", str(result_path)]
    code, stdout, stderr = _torchrun(tmp_path, arguments)
    assert code == 0, stdout + stderr
    result = json.loads(result_path.read_text())
    metadata = result["metadata"]
    assert metadata["world_size"] == 2 and "DistributedDataParallel" in metadata["distributed"]
    assert metadata["same_plan_on_every_rank"] is True
    remat_rows = [row for row in result["rows"] if row["kind"] == "remat"]
    assert len(remat_rows) == 3 and all(row["error"] is None and row["fits_budget"] for row in remat_rows)
    shown = " ".join(stdout.split())  # (rich wraps to the terminal's width)
    assert shown.count("remat @ min") == 1 and "DistributedDataParallel on 2 ranks (gloo)" in shown


def test_the_figures_combined_across_ranks_are_the_bytes_and_times_only() -> None:
    # what RankAgreement.combined takes the largest of: every byte count and every time,
    # and nothing of the chain's structure (names, flags, stage indices), which must agree
    import dataclasses

    from remat.plan.lifetimes import HeldInput
    from remat.plan.step import BudgetSplit
    from remat.ranks import _rebuild, _walk
    from remat.testing import random_chain

    profile = dataclasses.replace(random_chain(3, 6), region_breaks=(2,), pinned_stages=(4,))
    outside = BudgetSplit(
        None,
        None,
        held_outside_bytes=10,
        cast_bytes=(1, 2, 3, 4, 5, 6),
        leftover_freed=((3, 40),),
        held_inputs=(HeldInput(1, 3, 50, True, False, True),),
    )

    def doubled(kind: str, value: Any) -> Any:
        return 2 * value

    combined_profile = _rebuild(profile, "profile", doubled)
    assert combined_profile.names == profile.names and combined_profile.saves_input == profile.saves_input
    assert combined_profile.region_breaks == (2,) and combined_profile.pinned_stages == (4,)
    assert combined_profile.activation_bytes == tuple(2 * b for b in profile.activation_bytes)
    assert combined_profile.forward_time_s == tuple(2 * t for t in profile.forward_time_s)
    assert combined_profile.metadata == profile.metadata
    combined_outside = _rebuild(outside, "outside", doubled)
    assert combined_outside.held_outside_bytes == 20 and combined_outside.cast_bytes == (2, 4, 6, 8, 10, 12)
    assert combined_outside.leftover_freed == ((3, 80),)  # (stage, bytes)
    assert combined_outside.held_inputs == (HeldInput(1, 3, 100, True, False, True),)
    leaves = list(_walk(outside, "outside"))
    assert ("same", 3) in leaves and ("int", 40) in leaves  # a stage index, its bytes


def test_a_hung_launch_is_killed_with_the_ranks_in_their_own_sessions(tmp_path: Path) -> None:
    # what the torchrun test does on a hang: torchrun's group, and a rank that left it
    port = free_port()
    rank = "import os, time; os.setsid(); open(os.environ['PID_FILE'], 'w').write(str(os.getpid())); time.sleep(600)"
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); time.sleep(600)"
    pid_file = tmp_path / "rank.pid"
    env = dict(os.environ, MASTER_PORT=str(port), PID_FILE=str(pid_file))
    process = subprocess.Popen([sys.executable, "-c", launcher], env=env, start_new_session=True)
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        rank_pid = int(pid_file.read_text())
        kill_launch(process, port)
        assert process.wait(timeout=10) == -9
        for _ in range(200):  # the rank is not our child: wait until /proc no longer runs it
            state = Path(f"/proc/{rank_pid}/stat")
            if not state.exists() or state.read_text().split(")")[-1].split()[0] == "Z":
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the rank in a session of its own survived")
    finally:
        if process.poll() is None:
            process.kill()


def test_store_options_combine_their_bytes_up_and_their_shared_bytes_down() -> None:
    # a store option's shared bytes are taken off a peak: the smallest of any rank is safe
    import dataclasses

    from remat.ranks import _rebuild, _walk
    from remat.testing import random_chain

    profile = random_chain(5, 6, store_options=1)
    option = profile.store_options[0]
    shared = tuple(min(kept or 0, whole) // 2 for kept, whole in zip(option.saved_bytes, profile.saved_bytes))
    option = dataclasses.replace(option, shared_bytes=shared)
    profile = dataclasses.replace(profile, store_options=(option,))
    assert any(shared)
    kinds = {kind for kind, _ in _walk(profile, "profile")}
    assert "min" in kinds

    def marked(kind: str, value: Any) -> Any:
        return {"int": 2 * value, "float": 2 * value, "min": value // 2}[kind]

    combined = _rebuild(profile, "profile", marked).store_options[0]
    assert combined.name == option.name and combined.saves_output == option.saves_output
    assert combined.saved_bytes == tuple(None if b is None else 2 * b for b in option.saved_bytes)
    assert combined.extra_time_s == tuple(2 * t for t in option.extra_time_s)
    assert combined.shared_bytes == tuple(b // 2 for b in option.shared_bytes)
