"""``remat bench`` under ``torchrun``: the process group the launch describes.

torchrun starts one process per rank with ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its
environment. The command then joins the group (gloo on the CPU; nccl on CUDA, each rank on
the GPU of its local rank), the benchmark trains through DistributedDataParallel (NOTE [the
benchmark on several ranks] in :mod:`remat.bench.data_parallel`), and rank 0 alone shows and
writes the results.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

import torch

from remat.cli.codes import EXIT_USAGE, fail

__all__ = ["torchrun_group"]


@contextlib.contextmanager
def torchrun_group(device: str) -> Iterator[int | None]:
    """Within this block, the process is in the launch's group; yields its rank (None: not
    launched on several ranks)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.get_rank() if dist.get_world_size() > 1 else None
        return
    if world_size <= 1:
        yield None
        return
    cuda = device.startswith("cuda")
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            fail(
                EXIT_USAGE,
                f"rank {os.environ.get('RANK')} runs on GPU {local_rank}, but this machine has "
                f"{torch.cuda.device_count()}: give torchrun at most one process per GPU, or use --device cpu",
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield dist.get_rank()
    finally:
        # NOTE [freeing the group's users before the group]: a DistributedDataParallel lives in
        # reference cycles, so it would outlast the block and be freed (with the gloo work it
        # holds) while the interpreter shuts down, where gloo sometimes aborts the process
        # ("terminate called without an active exception") after a run that succeeded
        gc.collect()
        dist.destroy_process_group()
