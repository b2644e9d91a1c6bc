"""Selective recompute: remat's policies against torch's selective activation checkpointing.

Two models are built here from plain torch (random weights, synthetic data, seeded): a
GPT-style stack of pre-norm transformer blocks, with attention written out (``q @ kᵀ``,
scaling, causal mask, softmax, dropout, ``@ v``) so that its pointwise parts are operations
of their own, and a ResNet-style stack of basic residual blocks (conv, BatchNorm, ReLU).
Every block is recomputed on its own, under three policies:

* ``save_nothing``: whole-block recompute;
* ``save_matmuls``: keep matrix products and convolutions, recompute the rest;
* a Megatron-style ``recompute_ops(...)``: recompute only the pointwise operations named
  (softmax, dropout, GELU, masking and scaling for GPT; BatchNorm and ReLU for ResNet) and
  keep every other output.

Each policy runs twice: as ``remat.recompute(block, x, policy=P)``, and as
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=...)`` with a
``create_selective_checkpoint_contexts`` policy making the same decisions (a remat policy
is called as ``P(op, *args)``; views and in-place operations, which remat never keeps, are
recomputed; ``save_nothing`` is plain ``checkpoint``). Plain autograd is the reference.

For each configuration it measures: the exact activation peak of one training step
(forward, loss, backward) with :class:`remat.MemoryTracker`, which counts only storages
allocated during the step, so parameters, their gradients and the inputs are left out;
the median step time over interleaved rounds on one thread, after a warm-up; how many
matrix products and convolutions (``mm``, ``addmm``, ``bmm``, ``convolution``) ran in
backward, beyond the gradients' own; and whether its parameter gradients are bitwise equal
to plain autograd's (same seed, so dropout draws the same masks).

Run ``python benchmarks/selective.py [--model gpt|resnet|both] [--rounds 9]``; it writes
``results/selective.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat import policies
from remat.manual._selective import unnumbered
from remat.units import MIB

RESULTS = Path(__file__).parent / "results"
WARMUP_STEPS = 2
#: Operations counted as matrix products (their every overload).
MATMUL_PACKETS = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.convolution})

#: Runs one block of a model: ``wrap(block, x) -> block's output``.
Wrap = Callable[[nn.Module, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------- models
@dataclass(frozen=True)
class GptSizes:
    """Sizes of the GPT-style model and its batch."""

    blocks: int = 6
    width: int = 256
    heads: int = 4
    batch: int = 2
    length: int = 256
    vocabulary: int = 512
    dropout: float = 0.1


@dataclass(frozen=True)
class ResnetSizes:
    """Sizes of the ResNet-style model and its batch."""

    blocks: int = 6
    channels: int = 48
    batch: int = 8
    image_side: int = 32
    classes: int = 10


class GptBlock(nn.Module):
    """Pre-norm transformer block with attention written out operation by operation."""

    future: torch.Tensor  # the causal mask: True above the diagonal

    def __init__(self, sizes: GptSizes) -> None:
        super().__init__()
        self.heads = sizes.heads
        self.attention_norm = nn.LayerNorm(sizes.width)
        self.qkv = nn.Linear(sizes.width, 3 * sizes.width)
        self.projection = nn.Linear(sizes.width, sizes.width)
        self.mlp_norm = nn.LayerNorm(sizes.width)
        self.expand = nn.Linear(sizes.width, 4 * sizes.width)
        self.contract = nn.Linear(4 * sizes.width, sizes.width)
        self.dropout = nn.Dropout(sizes.dropout)
        future = torch.ones(sizes.length, sizes.length, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.view(batch, length, self.heads, -1).transpose(1, 2)
            for part in self.qkv(self.attention_norm(x)).split(width, dim=-1)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
        weights = self.dropout(torch.softmax(scores, dim=-1))
        attended = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.dropout(self.projection(attended))
        return x + self.dropout(self.contract(functional.gelu(self.expand(self.mlp_norm(x)))))


class Gpt(nn.Module):
    """Token and position embeddings, the blocks, a final norm and a language-model head."""

    def __init__(self, sizes: GptSizes) -> None:
        super().__init__()
        self.embedding = nn.Embedding(sizes.vocabulary, sizes.width)
        self.positions = nn.Parameter(torch.randn(sizes.length, sizes.width) * 0.02)
        self.blocks = nn.ModuleList(GptBlock(sizes) for _ in range(sizes.blocks))
        self.norm = nn.LayerNorm(sizes.width)
        self.head = nn.Linear(sizes.width, sizes.vocabulary)

    def forward(self, tokens: torch.Tensor, wrap: Wrap) -> torch.Tensor:
        x = self.embedding(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            x = wrap(block, x)
        return self.head(self.norm(x))


class ResidualBlock(nn.Module):
    """conv3x3 -> BatchNorm -> ReLU -> conv3x3 -> BatchNorm, plus the identity, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.first_norm = nn.BatchNorm2d(channels)
        self.second = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.second_norm = nn.BatchNorm2d(channels)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.activation(self.first_norm(self.first(x)))
        return self.activation(self.second_norm(self.second(y)) + x)


class Resnet(nn.Module):
    """A stem (conv, BatchNorm, ReLU), the residual blocks, global average pooling, a classifier."""

    def __init__(self, sizes: ResnetSizes) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, sizes.channels, 3, padding=1, bias=False), nn.BatchNorm2d(sizes.channels), nn.ReLU()
        )
        self.blocks = nn.ModuleList(ResidualBlock(sizes.channels) for _ in range(sizes.blocks))
        self.head = nn.Linear(sizes.channels, sizes.classes)

    def forward(self, images: torch.Tensor, wrap: Wrap) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = wrap(block, x)
        return self.head(x.mean(dim=(2, 3)))


@dataclass
class Case:
    """One model, its batch, and the policies it is run under."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    sizes: dict[str, Any]
    #: configuration name -> policy
    policy_by_name: dict[str, policies.Policy]

    def loss(self, wrap: Wrap) -> torch.Tensor:
        logits = self.model(self.inputs, wrap)
        return functional.cross_entropy(logits.flatten(0, -2), self.targets.flatten())


# The Megatron-style policies: recompute the cheap pointwise operations, keep the rest.
# Dropout on the CPU is empty_like (the mask), bernoulli_ and div_ (filling it in place:
# named here, so the mask is drawn again) and mul (the mask applied); native_dropout is its
# fused form on CUDA. In these blocks
# div is only the scaling of the attention scores and mul only dropout's.
GPT_POINTWISE = policies.recompute_ops(
    torch.ops.aten.div,
    torch.ops.aten.masked_fill,
    torch.ops.aten._softmax,
    torch.ops.aten.native_dropout,
    torch.ops.aten.empty_like,
    torch.ops.aten.bernoulli_,
    torch.ops.aten.mul,
    torch.ops.aten.gelu,
)
RESNET_POINTWISE = policies.recompute_ops(torch.ops.aten.native_batch_norm, torch.ops.aten.relu)


def gpt_case() -> Case:
    sizes = GptSizes()
    torch.manual_seed(0)
    model = Gpt(sizes).train()
    tokens = torch.randint(0, sizes.vocabulary, (sizes.batch, sizes.length))
    targets = torch.randint(0, sizes.vocabulary, (sizes.batch, sizes.length))
    chosen = {
        "save_nothing": policies.save_nothing,
        "save_matmuls": policies.save_matmuls,
        "recompute_ops(div, masked_fill, softmax, dropout, gelu)": GPT_POINTWISE,
    }
    return Case("gpt", model, tokens, targets, asdict(sizes), chosen)


def resnet_case() -> Case:
    sizes = ResnetSizes()
    torch.manual_seed(0)
    model = Resnet(sizes).train()
    images = torch.randn(sizes.batch, 3, sizes.image_side, sizes.image_side)
    labels = torch.randint(0, sizes.classes, (sizes.batch,))
    chosen = {
        "save_nothing": policies.save_nothing,
        "save_matmuls": policies.save_matmuls,
        "recompute_ops(batch_norm, relu)": RESNET_POINTWISE,
    }
    return Case("resnet", model, images, labels, asdict(sizes), chosen)


# ---------------------------------------------------------------------------- configurations
def plain(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def remat_wrap(policy: policies.Policy) -> Wrap:
    def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(block, x, policy=policy)

    return wrap


def torch_policy(policy: policies.Policy) -> Callable[..., CheckpointPolicy]:
    """A policy for ``create_selective_checkpoint_contexts`` making `policy`'s decisions.

    Views and in-place operations, whose outputs remat never keeps, are recomputed.
    """

    def decide(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if unnumbered(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy[policy(op, *args, **kwargs).name]

    return decide


def torch_wrap(policy: policies.Policy) -> Wrap:
    if policy.recomputes_everything:

        def whole(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(block, x, use_reentrant=False)

        return whole
    context_fn = functools.partial(create_selective_checkpoint_contexts, torch_policy(policy))

    def selective(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)

    return selective


@dataclass(frozen=True)
class Configuration:
    """How the blocks of a model run: ``policy`` (None: plain autograd) under ``implementation``."""

    policy_name: str
    implementation: str
    wrap: Wrap

    @property
    def key(self) -> str:
        return f"{self.policy_name} / {self.implementation}"


def configurations(case: Case) -> list[Configuration]:
    found = [Configuration("none", "autograd", plain)]
    for name, policy in case.policy_by_name.items():
        found.append(Configuration(name, "remat", remat_wrap(policy)))
        found.append(Configuration(name, "torch", torch_wrap(policy)))
    return found


# ---------------------------------------------------------------------------- measurements
class MatmulCounter(TorchDispatchMode):
    """Counts the matrix products and convolutions that run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in MATMUL_PACKETS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def clear_gradients(model: nn.Module) -> None:
    for parameter in model.parameters():
        parameter.grad = None


def train_step(case: Case, configuration: Configuration) -> None:
    """One step: forward, loss and backward, with the same random draws every time."""
    torch.manual_seed(1)
    case.loss(configuration.wrap).backward()
    clear_gradients(case.model)


def activation_peak_bytes(case: Case, configuration: Configuration) -> int:
    """Exact peak of the bytes allocated during one step and alive at once."""
    with remat.MemoryTracker() as tracker:
        train_step(case, configuration)
    return tracker.peak_bytes


def backward_matmuls(case: Case, configuration: Configuration) -> int:
    """How many matrix products and convolutions one step's backward runs."""
    torch.manual_seed(1)
    loss = case.loss(configuration.wrap)
    counter = MatmulCounter()
    with counter:
        loss.backward()
    clear_gradients(case.model)
    return counter.count


def gradients(case: Case, configuration: Configuration) -> list[torch.Tensor]:
    torch.manual_seed(1)
    case.loss(configuration.wrap).backward()
    found = [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in case.model.parameters()]
    clear_gradients(case.model)
    return found


def median_step_seconds(case: Case, found: list[Configuration], rounds: int) -> dict[str, list[float]]:
    """Step times in interleaved rounds after a warm-up; each round starts one configuration later."""
    for configuration in found:
        for _ in range(WARMUP_STEPS):
            train_step(case, configuration)
    times: dict[str, list[float]] = {c.key: [] for c in found}
    for round_index in range(rounds):
        shift = round_index % len(found)
        for configuration in found[shift:] + found[:shift]:
            started = time.perf_counter()
            train_step(case, configuration)
            times[configuration.key].append(time.perf_counter() - started)
    return times


def measure(case: Case, rounds: int) -> dict[str, Any]:
    found = configurations(case)
    reference = gradients(case, found[0])
    rows: list[dict[str, Any]] = []
    for configuration in found:
        equal = all(torch.equal(a, b) for a, b in zip(gradients(case, configuration), reference, strict=True))
        if not equal:
            print(f"FAILURE: {case.name} {configuration.key}: gradients differ from plain autograd's")
        rows.append(
            {
                "configuration": configuration.policy_name,
                "implementation": configuration.implementation,
                "policy": repr(case.policy_by_name.get(configuration.policy_name)),
                "gradients_equal": equal,
                "activation_peak_bytes": activation_peak_bytes(case, configuration),
                "backward_matmuls": backward_matmuls(case, configuration),
            }
        )
    times = median_step_seconds(case, found, rounds)
    none = rows[0]
    none_s = statistics.median(times[found[0].key])
    for configuration, row in zip(found, rows, strict=True):
        row["step_s"] = times[configuration.key]
        row["median_step_s"] = statistics.median(row["step_s"])
        row["time_vs_none"] = row["median_step_s"] / none_s
        row["peak_vs_none"] = row["activation_peak_bytes"] / none["activation_peak_bytes"]
        row["matmuls_recomputed"] = row["backward_matmuls"] - none["backward_matmuls"]
    remat_vs_torch = []
    for name in case.policy_by_name:
        by_implementation = {r["implementation"]: r for r in rows if r["configuration"] == name}
        remat_row, torch_row = by_implementation["remat"], by_implementation["torch"]
        remat_vs_torch.append(
            {
                "configuration": name,
                "peak_difference_bytes": remat_row["activation_peak_bytes"] - torch_row["activation_peak_bytes"],
                "peak_ratio": remat_row["activation_peak_bytes"] / torch_row["activation_peak_bytes"],
                "time_ratio": remat_row["median_step_s"] / torch_row["median_step_s"],
            }
        )
    remat_rows_equal = all(r["gradients_equal"] for r in rows if r["implementation"] == "remat")
    return {
        "model": case.name,
        "sizes": case.sizes,
        "parameters": sum(p.numel() for p in case.model.parameters()),
        "remat_gradients_equal": remat_rows_equal,
        "rows": rows,
        "remat_vs_torch": remat_vs_torch,
    }


# ---------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> list[str]:
    sizes = ", ".join(f"{name} {value}" for name, value in result["sizes"].items())
    lines = [
        f"**{result['model']}** ({sizes}; {result['parameters'] / 1e6:.2f} M parameters)",
        "",
        "| configuration | implementation | activation peak (MiB) | peak vs none | step time (s, median) "
        "| time vs none | matmul-like ops recomputed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['configuration']} | {row['implementation']} | {row['activation_peak_bytes'] / MIB:.2f} "
            f"| x{row['peak_vs_none']:.2f} | {row['median_step_s']:.3f} | x{row['time_vs_none']:.2f} "
            f"| {row['matmuls_recomputed']} |"
        )
    lines += ["", "| configuration | remat peak - torch peak | remat / torch peak | remat / torch time |"]
    lines.append("|---|---:|---:|---:|")
    for row in result["remat_vs_torch"]:
        lines.append(
            f"| {row['configuration']} | {row['peak_difference_bytes'] / 1024:+.1f} KiB | x{row['peak_ratio']:.3f} "
            f"| x{row['time_ratio']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "resnet", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args()
    torch.set_num_threads(1)
    factories = {"gpt": gpt_case, "resnet": resnet_case}
    names = list(factories) if options.model == "both" else [options.model]
    results = [measure(factories[name](), options.rounds) for name in names]
    summary = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "warmup_steps": WARMUP_STEPS,
        "rounds": options.rounds,
        "models": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "selective.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"torch {torch.__version__}, CPU, {summary['threads']} thread; activation peak: exact tracker "
        f"(bytes allocated during the step); step time: median of {options.rounds} interleaved rounds; "
        "matmul-like ops recomputed: mm/addmm/bmm/convolution run in backward beyond plain autograd's.",
    ]
    lines.append(
        "recompute_ops lists ATen operations: for gpt aten.div (the scores' scaling), masked_fill, _softmax, "
        "dropout (empty_like, bernoulli_ and mul on the CPU; native_dropout on CUDA) and gelu; for resnet "
        "native_batch_norm and relu. Every other output is kept."
    )
    for result in results:
        lines += ["", *markdown(result)]
    text = "\n".join(lines) + "\n"
    (RESULTS / "selective.md").write_text(text)
    print(text)
    failures = [
        f"{r['model']} {row['configuration']} / {row['implementation']}"
        for r in results
        for row in r["rows"]
        if not row["gradients_equal"]
    ]
    if failures:
        print("FAILURE: gradients differ from plain autograd's for: " + "; ".join(failures))


if __name__ == "__main__":
    main()
