"""Data-parallel training of a GPT-style decoder under remat's automatic mode, with torchrun.

Usage (two processes on the CPU, gloo; on GPUs, nccl and one device per rank)::

    .venv/bin/torchrun --nproc-per-node 2 examples/train_distributed.py [--budget 0.5] [--steps 4]

Each rank builds the same model with random weights, enables remat with the budget (a
fraction of the step without recompute, or bytes such as "64MiB"), wraps it in
DistributedDataParallel and trains on synthetic tokens of its own. remat plans once for
all ranks (NOTE [one plan for all ranks] in ``remat.ranks``); the script checks that every
rank runs the same schedule and holds the same parameters after each step, and rank 0
prints the plan and, for each step, the loss, the exact peak (remat's tracker; parameter
gradients left out) against the activation budget, and the step time.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import remat
from remat.models import GPTConfig, gpt2
from remat.plan import plan_to_data


def _same_on_every_rank(value: torch.Tensor) -> bool:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.5", help="fraction of the plain step, or bytes ('64MiB')")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda (nccl): one GPU per process; auto: cuda where each process has a GPU, else cpu (gloo)",
    )
    args = parser.parse_args()
    budget: float | str = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget

    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= processes_here)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights on every rank
    config = GPTConfig(vocab_size=512, n_positions=args.tokens, d_model=128, n_heads=4, n_layers=6)
    model = gpt2(config).to(device)
    criterion = torch.nn.CrossEntropyLoss()
    vocab = config.vocab_size

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return criterion(logits.reshape(-1, vocab), targets.reshape(-1))

    control = remat.enable(model, budget, output_kept=False)
    ddp = DistributedDataParallel(model)
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data

    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.tokens + 1), generator=generator).to(device)
        started = time.perf_counter()
        with remat.MemoryTracker(device=device.type) as tracker:
            loss = loss_fn(ddp(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed_s = time.perf_counter() - started
        plan = control.plan
        assert plan is not None
        schedule = torch.tensor([zlib.crc32(str(plan_to_data(plan.schedule.items)).encode())], device=device)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        same_plan, same_weights = _same_on_every_rank(schedule), _same_on_every_rank(weights)
        if rank == 0:
            if step == 0:
                print(plan.report())
            note = {
                0: " (measured and planned first)",
                # DDP's own memory, not activations: the tracker sees it allocated in this step
                1: f" (DDP rebuilds its gradient buckets in its second step: {remat.format_bytes(buckets)})",
            }.get(step, "")
            print(
                f"step {step}: loss {loss.item():.4f}, peak {remat.format_bytes(tracker.peak_bytes)} "
                f"(activation budget {remat.format_bytes(plan.budget_bytes or 0)}), {elapsed_s * 1e3:.0f} ms"
                f"{note}; same plan on every rank: {same_plan}, same weights: {same_weights}"
            )
        if not (same_plan and same_weights):
            raise SystemExit(f"rank {rank}: the ranks disagree after step {step}")
    dist.barrier()  # every rank done before the group goes
    # and the DDP freed while the interpreter runs: it sits in reference cycles, and gloo can
    # abort a process that frees it at shutdown
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
