"""Launching a test worker on several gloo ranks, one process each."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_launch(process: subprocess.Popen[Any], port: int) -> None:
    """Kills a torchrun launch started in a session of its own: torchrun's process group,
    and every rank it started (torchrun may give each a session of its own), found by the
    ``MASTER_PORT`` in its environment."""
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)
    marker = f"MASTER_PORT={port}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # a process that ended meanwhile, or one of another user
            continue
        if marker in environment:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def run_ranks(
    worker: Path, out_dir: Path, world_size: int, timeout_s: float, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Runs ``worker OUT_DIR`` on `world_size` ranks; returns what each saved in ``rank<r>.pt``.

    A rank that fails, crashes (``"__crash__"`` in its results) or runs past `timeout_s`
    (a hang) fails the caller, with the rank's output. `env` is added to each rank's environment.
    """
    env = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["WORLD_SIZE"] = str(world_size)
    env["OMP_NUM_THREADS"] = "1"
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(out_dir)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    for rank_results in ranks:
        assert "__crash__" not in rank_results, rank_results.get("__crash__")
    return ranks


def worker_main(scenarios: Callable[[int], Iterator[tuple[str, Any]]]) -> int:
    """The main of a worker that :func:`run_ranks` launches: runs ``scenarios(rank)`` on gloo.

    Saves ``{name: result}`` to ``OUT_DIR/rank<r>.pt`` (``"__crash__"``: the traceback of
    an error that escaped a scenario).
    """
    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    results: dict[str, Any] = {}
    try:
        for name, result in scenarios(rank):
            results[name] = result
    except Exception:  # pragma: no cover - reported through the output file
        results["__crash__"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    gc.collect()  # NOTE [freeing the group's users before the group]
    dist.destroy_process_group()
    return 0
