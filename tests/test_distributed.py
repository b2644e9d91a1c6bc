"""recompute and marked modules under DistributedDataParallel: two gloo processes on the CPU.

The two ranks (tests/_ddp_worker.py) run every scenario in one launch; each test reads
its scenario's result. DDP averages the two ranks' gradients of the mean loss over
their half of a batch; one process computing the mean loss over the whole batch gets
the same gradient, up to the order of the floating-point sums (the allreduce adds the
two halves, then divides by two; one process sums all rows at once). So that
comparison uses a tight tolerance, and the exact comparison is against DDP without
recompute: the same local computations and the same allreduce, bit for bit.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from launch_helpers import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_ddp_worker.py")
WORLD_SIZE = 2


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("_ddp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Runs every scenario on two ranks; returns each rank's results."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("ddp"), WORLD_SIZE, timeout_s=90)  # a hang fails


def single_process_grads(scenario: str) -> dict[str, torch.Tensor]:
    factory, _options = worker.SCENARIOS[scenario]
    model = factory()
    x, y = worker.full_batch()
    worker.loss_of(model, x, y).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_matches(results: list[dict[str, Any]], scenario: str, plain: str = "plain") -> None:
    for rank_results in results:
        result = rank_results[scenario]
        assert result["error"] is None, result["error"]
        grads = result["grads"]
        expected = single_process_grads(scenario)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
        plain_grads = rank_results[plain]["grads"]
        for name, grad in grads.items():
            assert torch.equal(grad, plain_grads[name]), f"{scenario}: {name} differs from DDP without recompute"


@pytest.mark.parametrize(
    "scenario",
    [
        "hooks-marked",
        "hooks-marked-find-unused",
        "hooks-marked-static-graph",
        "hooks-function",
        "hooks-function-find-unused",
    ],
)
def test_hook_mode_under_ddp(results: list[dict[str, Any]], scenario: str) -> None:
    assert_matches(results, scenario, plain="plain-function" if "function" in scenario else "plain")


def test_hook_mode_under_ddp_with_a_block_used_twice(results: list[dict[str, Any]]) -> None:
    assert_matches(results, "hooks-marked-shared", plain="plain-shared")


@pytest.mark.parametrize("scenario", ["reentrant-marked", "reentrant-function", "reentrant-marked-static-graph"])
def test_reentrant_mode_under_ddp_where_torch_allows_it(results: list[dict[str, Any]], scenario: str) -> None:
    assert_matches(results, scenario, plain="plain-function" if "function" in scenario else "plain")


def test_reentrant_mode_with_a_block_used_twice_needs_static_graph(results: list[dict[str, Any]]) -> None:
    assert_matches(results, "reentrant-marked-shared-static-graph", plain="plain-shared")
    # Without static_graph, each of the block's two reentrant backward passes fires the
    # gradient hooks of its parameters: DDP reduces their bucket after the first one and
    # the second partial gradient stays local. No error, but the ranks disagree: the
    # rule in recompute()'s docstring note exists because of this.
    rank0, rank1 = (r["reentrant-marked-shared"] for r in results)
    assert rank0["error"] is None
    assert not torch.equal(rank0["grads"]["blocks.0.0.weight"], rank1["grads"]["blocks.0.0.weight"])


def test_reentrant_mode_with_find_unused_parameters_is_refused_by_ddp(results: list[dict[str, Any]]) -> None:
    # The parameters of a reentrant block are used under no_grad in the forward, so
    # DDP's search for unused parameters marks them ready at the end of the forward;
    # then their gradients arrive in backward and DDP refuses the second mark.
    for rank_results in results:
        error = rank_results["reentrant-marked-find-unused"]["error"]
        assert error is not None and "marked as ready twice" in error


@pytest.mark.parametrize(
    "scenario",
    [
        "checkpointable",
        "checkpointable-find-unused",
        "checkpointable-static-graph",
        "enabled-static-graph",
        "enabled-no-sync",
    ],
)
def test_checkpointable_under_ddp(results: list[dict[str, Any]], scenario: str) -> None:
    # Same local computations as DDP without recompute, under the optimal plan for 60% of
    # the activation memory: the averaged gradients are bit for bit those of plain DDP, at
    # the second step too (the gradients compared are the second step's; the first
    # measured the model inside DDP's forward).
    for rank_results in results:
        result = rank_results[scenario]
        assert result["error"] is None, result["error"]
        grads = {name.removeprefix("model."): grad for name, grad in result["grads"].items()}
        plain = rank_results["plain-no-sync" if "no-sync" in scenario else "plain"]["grads"]
        assert grads.keys() == plain.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, plain[name]), f"{scenario}: {name} differs from DDP without recompute"


def test_no_sync_under_static_graph_fails_in_ddp_itself_and_the_same_with_remat(results: list[dict[str, Any]]) -> None:
    # DDP's reducer asserts when a no_sync step precedes a synchronised one under
    # static_graph=True, without remat too: the automatic mode does not hide or change it
    for rank_results in results:
        plain, checkpointable = (
            rank_results[name]["error"]
            for name in ("plain-no-sync-static-graph", "checkpointable-no-sync-static-graph")
        )
        assert plain is not None and "expect_autograd_hooks_" in plain
        assert checkpointable == plain


_STATIC_GRAPH_AROUND = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import remat
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
ddp = DistributedDataParallel(model, static_graph=True)
remat.enable(ddp, 0.5)
try:
    ddp(torch.randn(8, 16)).sum().backward()
except remat.UnsupportedModel as error:
    print("refused:", error)
dist.destroy_process_group()
"""


def test_enabling_a_static_graph_ddp_itself_is_refused_with_what_to_do(tmp_path: Path) -> None:
    # its reducer records the static graph from measuring's forwards and then averages nothing
    script = tmp_path / "static.py"
    script.write_text(_STATIC_GRAPH_AROUND)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "static_graph=True" in result.stdout
    assert "before DDP(model, static_graph=True)" in result.stdout
