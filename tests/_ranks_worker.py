"""One rank of the tests of one plan for all ranks (tests/test_ranks.py), on gloo.

Run as ``python _ranks_worker.py OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set. It runs every scenario and saves what it saw in
``OUT_DIR/rank<r>.pt``: by scenario, for each training step, the plan's schedule and
budget (to be compared across ranks), the gradients, and the error raised if any.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from launch_helpers import worker_main
from remat.plan import plan_to_data

WIDTH = 32


class Slow(nn.Module):
    """A block that takes `delay_s` longer on `slow_ranks`: its timings differ between ranks."""

    def __init__(self, slow_ranks: tuple[int, ...], delay_s: float) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))
        self.slow_ranks, self.delay_s = slow_ranks, delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() in self.slow_ranks:
            time.sleep(self.delay_s)
        return self.block(x)


def make_net(depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)

    # each rank has one slow block of its own, which is the fastest block on the other rank
    # (the others take a little time on both): planned alone, each rank would recompute
    # the other's slow block first, whatever the noise of the timings
    def block(index: int) -> Slow:
        if index in (2, 5):
            return Slow(slow_ranks=(index % 2,), delay_s=0.02)
        return Slow(slow_ranks=(0, 1), delay_s=0.002)

    return nn.Sequential(*[block(index) for index in range(depth)])


def batch(size: int, step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of its own for `rank` (this one by default) at `step`."""
    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(100 * step + size + 7 * rank)
    return torch.randn(size, WIDTH, generator=generator), torch.randn(size, WIDTH, generator=generator)


def train(
    model: nn.Module, control: Any, sizes: list[int], ddp: bool, reference: nn.Module | None
) -> list[dict[str, Any]]:
    """A step per batch size; for each, the plan, the gradients (and the reference's), or the error."""
    wrapped = DistributedDataParallel(model) if ddp else model
    plain = DistributedDataParallel(reference) if ddp and reference is not None else reference
    steps: list[dict[str, Any]] = []
    for step, size in enumerate(sizes):
        x, y = batch(size, step)
        record: dict[str, Any] = {"error": None}
        try:
            wrapped.zero_grad(set_to_none=True)
            (wrapped(x) - y).pow(2).mean().backward()
            plan = control.plan
            record["items"] = plan_to_data(plan.schedule.items)
            record["budget_bytes"] = plan.budget_bytes
            record["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if plain is not None:
                plain.zero_grad(set_to_none=True)
                (plain(x) - y).pow(2).mean().backward()
                record["expected"] = {n: p.grad.clone() for n, p in reference.named_parameters()}
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            record["error"] = f"{type(error).__name__}: {error}"
            steps.append(record)
            break
        steps.append(record)
    return steps


def agreed(agree: bool) -> list[dict[str, Any]]:
    model, reference = make_net(), make_net()
    return train(model, remat.enable(model, 0.7, agree_ranks=agree), [16, 16], True, reference)


def agreed_with_a_policy() -> list[dict[str, Any]]:
    # stages may be stored under the policy: its figures are combined across ranks too
    model, reference = make_net(), make_net()
    control = remat.enable(model, 0.7, policy=remat.policies.save_matmuls)
    return train(model, control, [16, 16], True, reference)


def new_shape_on_one_rank() -> list[dict[str, Any]]:
    model, reference = make_net(), make_net()
    # rank 1 sees a new batch size at the second step, and its first one again at the third
    sizes = [16, 12, 16] if dist.get_rank() == 1 else [16, 16, 16]
    return train(model, remat.enable(model, 0.4), sizes, True, reference)


def too_large_on_one_rank() -> list[dict[str, Any]]:
    model = make_net()
    probe = make_net()
    control = remat.enable(probe, "min")
    (probe(batch(16, 0)[0]).sum()).backward()
    # the smallest budget of a batch of 16: a batch of 64, on rank 1, cannot be planned in it
    budget = control.minimum_budget_bytes()
    sizes = [64] if dist.get_rank() == 1 else [16]
    return train(model, remat.enable(model, budget), sizes, True, None)


def different_models() -> list[dict[str, Any]]:
    model = make_net(depth=8 if dist.get_rank() == 0 else 6)
    return train(model, remat.enable(model, 0.5), [16], False, None)


class _Collectives(TorchDispatchMode):
    """Counts the collectives dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "c10d" in str(func):
            self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def fsdp2_marked() -> list[dict[str, Any]]:
    """Manual recompute of FSDP2-sharded blocks: gradients and backward collectives, with and without."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = batch(8, 0)
    record: dict[str, Any] = {"error": None}
    for marked in (False, True):
        model = make_net(depth=4)
        for block in model:
            if marked:
                remat.mark(block)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = (model(x) - y).pow(2).mean()
        with _Collectives() as collectives:
            loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        record["grads" if marked else "expected"] = grads
        record["collectives" if marked else "expected_collectives"] = collectives.counts
    return [record]


def tensor_parallel_comm() -> list[dict[str, Any]]:
    """Tensor-parallel blocks (column- then row-parallel) recomputed with each ``comm`` option."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = batch(8, 0)
    record: dict[str, Any] = {"error": None, "collectives": {}}
    for comm in (None, "recompute", "save"):
        torch.manual_seed(0)
        # the row-parallel output goes on through the block: a recompute needs it again
        model = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(WIDTH, 64), nn.Tanh(), nn.Linear(64, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
                for _ in range(3)
            ]
        )
        for block in model:
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            if comm is not None:
                remat.mark(block, comm=comm)
        loss = (model(x) - y).pow(2).mean()
        with _Collectives() as collectives:
            loss.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        record["collectives"][comm] = collectives.counts
        if comm is None:
            record["expected"] = grads
        else:
            record[f"grads-{comm}"] = grads
    return [record]


def sharded_alone() -> list[dict[str, Any]]:
    """The automatic mode on sharded models whose ranks would plan alone (agree_ranks=False):
    FSDP2 and tensor parallelism. Each training call is refused on every rank before anything
    runs; the parameters are left as they were and the model trains once disabled."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = batch(8, 0)
    records: list[dict[str, Any]] = []
    for setup in ("fsdp2", "tensor-parallel"):
        model = make_net(depth=4)
        if setup == "fsdp2":
            for block in model:
                fully_shard(block.block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            for block in model:
                parallelize_module(block.block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        remat.enable(model, 0.5, agree_ranks=False)
        before = {n: _full(p).clone() for n, p in model.named_parameters()}
        record: dict[str, Any] = {"setup": setup, "error": None}
        try:
            (model(x) - y).pow(2).mean().backward()
        except NotImplementedError as error:
            record["error"] = str(error)
        record["unchanged"] = all(torch.equal(_full(p), before[n]) for n, p in model.named_parameters())
        record["no_gradients"] = all(p.grad is None for p in model.parameters())
        remat.disable(model)
        (model(x) - y).pow(2).mean().backward()
        record["trains_disabled"] = all(p.grad is not None for p in model.parameters())
        records.append(record)
    return records


class _ScaledBlock(nn.Module):
    """A block whose first stage has no parameter and whose code after it reads the block's own."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.up, self.down = nn.Tanh(), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.tanh(self.up(self.act(x) * self.scale))))


class _Residual(nn.Module):
    """Blocks added to their input (the glue between them), then a head the root unit holds."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH), nn.Tanh())


# (model, where enable is applied, reshard_after_forward, budget, bf16 parameters)
FSDP2_SETUPS = (
    ("sequential", "inside", True, 0.5, False),
    ("sequential", "inside", True, "min", False),
    ("sequential", "outside", False, "min", False),
    ("sequential", "outside", True, 0.5, False),
    ("residual", "inside", True, "min", False),
    ("residual", "outside", False, 0.8, False),
    ("sequential", "inside", True, "min", True),
)


def _unsharded_net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_block() for _ in range(4)]) if kind == "sequential" else _Residual(4)


def _single_process_gradients(
    kind: str, x: torch.Tensor | None = None, y: torch.Tensor | None = None
) -> dict[str, Any]:
    """The first step's gradients of the unsharded model in one process: on (x, y), or on every
    rank's batch at once (FSDP2 averages the ranks' gradients of their own means: the mean
    over all of them)."""
    model = _unsharded_net(kind)
    if x is None or y is None:
        batches = [batch(16, 0, rank) for rank in range(dist.get_world_size())]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    (model(x) - y).pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _fsdp2_net(kind: str, enable_at: str | None, reshard: bool, budget: Any, bf16: bool) -> tuple[nn.Module, Any]:
    model = _unsharded_net(kind)
    nested = kind == "residual"
    control = remat.enable(model, budget, nested=nested) if enable_at == "outside" else None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if policy is not None:
        options["mp_policy"] = policy
    for block in model if kind == "sequential" else model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **options)
    fully_shard(model, **options)
    if enable_at == "inside":
        control = remat.enable(model, budget, nested=nested)
    return model, control


def _steps_against_plain(
    record: dict[str, Any], model: nn.Module, control: Any, reference: nn.Module, batch_of: Callable[[int], Any]
) -> None:
    """Three SGD steps of `model` and of `reference` (no recompute) on the same batches: in
    ``record["steps"]``, both models' gradients (full tensors) and the collectives of their
    backward; with a plan (`control`), the exact peak of the third step and the plan."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        x, y = batch_of(step)
        seen: dict[str, Any] = {}
        for label, net, optimizer in zip(("remat", "plain"), (model, reference), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            if step == 2 and label == "remat" and control is not None:
                with control.check_step() as check:
                    (net(x) - y).float().pow(2).mean().backward()
                record["check"] = (check.measured_peak_bytes, check.predicted_peak_bytes)
                record["budget_bytes"] = control.plan.budget_bytes
            else:
                loss = (net(x) - y).float().pow(2).mean()
                with _Collectives() as collectives:
                    loss.backward()
                seen[f"{label}-collectives"] = collectives.counts
            seen[label] = {n: p.grad.full_tensor().clone() for n, p in net.named_parameters()}
            optimizer.step()
        record["steps"].append(seen)
    if control is not None:
        record["items"] = plan_to_data(control.plan.schedule.items)
        record["forward_counts"] = list(control.plan.forward_counts)


def fsdp2_automatic() -> list[dict[str, Any]]:
    """The automatic mode on FSDP2 models (NOTE [FSDP2 units] in remat.sharded), for each
    setup against the same sharded model without remat: three SGD steps (the gradients of
    every step), the exact peak of the third step against the budget, the plan, and the
    collectives of the first two steps' backward."""
    records: list[dict[str, Any]] = []
    for kind, enable_at, reshard, budget, bf16 in FSDP2_SETUPS:
        record: dict[str, Any] = {"setup": (kind, enable_at, reshard, budget, bf16), "error": None, "steps": []}
        try:
            model, control = _fsdp2_net(kind, enable_at, reshard, budget, bf16)
            reference, _ = _fsdp2_net(kind, None, reshard, budget, bf16)
            _steps_against_plain(record, model, control, reference, lambda step: batch(16, step))
            record["single_process"] = _single_process_gradients(kind)
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            record["error"] = f"{type(error).__name__}: {error}"
        records.append(record)
    return records


def fsdp2_tensor_parallel() -> list[dict[str, Any]]:
    """FSDP2 + tensor parallelism (4 ranks: 2 data-parallel groups of 2 tensor-parallel ranks):
    the automatic mode at 0.5 and at the smallest budget, and every block marked with each
    ``comm``, against the same model without recompute: three SGD steps, the collectives of
    the second step's backward, the exact peak of the third (automatic mode), the plan."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(how: tuple[str, Any] | None) -> tuple[nn.Module, Any]:
        model = _tensor_parallel_net(mesh["tp"])
        for block in model:
            if how is not None and how[0] == "mark":
                remat.mark(block, comm=how[1])
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, (remat.enable(model, how[1]) if how is not None and how[0] == "enable" else None)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the same batch on the ranks of a tensor-parallel group, another on each group
        return _tensor_parallel_batch(10 * step + mesh["dp"].get_local_rank())

    records: list[dict[str, Any]] = []
    for how in (("enable", 0.5), ("enable", "min"), ("mark", "recompute"), ("mark", "save")):
        record: dict[str, Any] = {"how": how, "error": None, "steps": []}
        try:
            (model, control), (reference, _) = build(how), build(None)
            _steps_against_plain(record, model, control, reference, batch_of)
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            record["error"] = f"{type(error).__name__}: {error}"
        records.append(record)
    return records


def _tensor_parallel_net(mesh: Any) -> nn.Module:
    """Blocks of a column- then a row-parallel layer; the row-parallel output feeds a tanh."""
    model = _unsharded_net("sequential")
    for block in model:  # type: ignore[union-attr]
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _tensor_parallel_batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)  # the same on every rank, as TP needs
    return torch.randn(size, WIDTH, generator=generator), torch.randn(size, WIDTH, generator=generator)


def tensor_parallel_automatic() -> list[dict[str, Any]]:
    """The automatic mode on a tensor-parallel model, at each budget and ``comm`` option:
    three SGD steps against the same model without remat (gradients of every step), the
    exact peak of the third step against the budget, the plan, and the backward's
    collectives."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    records: list[dict[str, Any]] = []
    for comm, budget in (("recompute", 0.5), ("recompute", "min"), ("auto", 0.5), ("auto", "min"), (None, None)):
        model = _tensor_parallel_net(mesh)
        control = remat.enable(model, budget, comm=comm) if comm is not None else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        record: dict[str, Any] = {"comm": comm, "budget": budget, "error": None, "grads": []}
        try:
            for step in range(3):
                x, y = _tensor_parallel_batch(step)
                optimizer.zero_grad(set_to_none=True)
                loss = (model(x) - y).pow(2).mean()
                if step == 1:
                    with _Collectives() as collectives:
                        loss.backward()
                    record["collectives"] = collectives.counts
                elif step == 2 and control is not None:
                    with control.check_step() as check:
                        (model(x) - y).pow(2).mean().backward()  # (the loss above is dropped unused)
                    record["check"] = (check.measured_peak_bytes, check.predicted_peak_bytes, check.within_budget)
                    record["budget_bytes"] = control.plan.budget_bytes
                else:
                    loss.backward()
                record["grads"].append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
                optimizer.step()
            if control is not None:
                plan = control.plan
                record["items"] = plan_to_data(plan.schedule.items)
                record["forward_counts"] = list(plan.forward_counts)
                record["options"] = sorted({op.option for op in plan.schedule.operations if op.option})
                record["offered"] = sorted(control._policies)
            else:  # the same blocks, seeded alike, unsplit
                record["single_process"] = _single_process_gradients("sequential", *_tensor_parallel_batch(0))
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            record["error"] = f"{type(error).__name__}: {error}"
        records.append(record)
    return records


def tensor_parallel_new_shape() -> list[dict[str, Any]]:
    """A tensor-parallel model whose rank 1 alone sees a new batch size at the second step:
    every rank raises the same error (no hang), and the third step, with one shape again,
    trains with the plan every rank holds."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, reference = _tensor_parallel_net(mesh), _tensor_parallel_net(mesh)
    remat.enable(model, 0.5)
    steps: list[dict[str, Any]] = []
    for step, size in enumerate([64, 48 if dist.get_rank() == 1 else 64, 64]):
        x, y = _tensor_parallel_batch(step, size)
        record: dict[str, Any] = {"error": None}
        try:
            model.zero_grad(set_to_none=True)
            (model(x) - y).pow(2).mean().backward()
            record["grads"] = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
            reference.zero_grad(set_to_none=True)
            (reference(x) - y).pow(2).mean().backward()
            record["expected"] = {n: _full(p.grad).clone() for n, p in reference.named_parameters()}
        except Exception as error:  # noqa: BLE001 - reported to the test, which decides
            record["error"] = f"{type(error).__name__}: {error}"
        steps.append(record)
    return steps


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


SCENARIOS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "agreed": lambda: agreed(True),
    "alone": lambda: agreed(False),
    "agreed-with-a-policy": agreed_with_a_policy,
    "new-shape-on-one-rank": new_shape_on_one_rank,
    "too-large-on-one-rank": too_large_on_one_rank,
    "different-models": different_models,
    "fsdp2-marked": fsdp2_marked,
    "tensor-parallel-comm": tensor_parallel_comm,
    "sharded-alone": sharded_alone,
    "fsdp2-automatic": fsdp2_automatic,
    "fsdp2-tensor-parallel": fsdp2_tensor_parallel,
    "tensor-parallel-automatic": tensor_parallel_automatic,
    "tensor-parallel-new-shape": tensor_parallel_new_shape,
}


FOUR_RANKS = {"fsdp2-tensor-parallel"}  # scenarios of a 2 x 2 mesh


def scenarios(rank: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    torch.set_num_threads(1)
    wanted = os.environ.get("RANKS_SCENARIOS")  # comma-separated names; all by default
    for name, scenario in SCENARIOS.items():
        if name in FOUR_RANKS and dist.get_world_size() != 4:
            continue
        if wanted is None or name in wanted.split(","):
            yield name, scenario()
            dist.barrier()


if __name__ == "__main__":
    sys.exit(worker_main(scenarios))
