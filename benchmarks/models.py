"""Benchmark: remat on unmodified models of the ecosystem, at 50% and 25% budgets.

Models (random weights from a config, synthetic data, no download): a torchvision-style
ResNet-18 with its usual explicit forward, Hugging Face GPT-2 and BERT (when transformers
is installed), and remat's own Sequential ResNet-50 and ViT. For each: the stages remat
found, the activation memory without recompute, and the measured peak and step-time
overhead at 50% and 25% of it (exact bytes; median step times in the same run).

Writes ``benchmarks/results/models.json`` and ``benchmarks/results/models.md``.

    python benchmarks/models.py [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat.bench import BASELINE, run_benchmark
from remat.models import resnet50, vit
from remat.units import format_bytes

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import reference_models  # noqa: E402  (the original-structure models of the tests)

Case = tuple[Callable[[], nn.Module], Callable[[], Any], Callable[..., torch.Tensor]]


def _images(batch: int, size: int, classes: int) -> Callable[[], Any]:
    def make() -> Any:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 3, size, size, generator=generator)
        return (x,), torch.randint(0, classes, (batch,), generator=generator)

    return make


def torchvision_resnet18() -> Case:
    return (lambda: reference_models.resnet(18, num_classes=10, width=32)), _images(16, 64, 10), F.cross_entropy


def torchvision_resnet50() -> Case:
    return (lambda: reference_models.resnet(50, num_classes=10, width=16)), _images(8, 64, 10), F.cross_entropy


def sequential_resnet50() -> Case:
    return (lambda: resnet50(num_classes=10, width=16)), _images(8, 64, 10), F.cross_entropy


def sequential_vit() -> Case:
    def factory() -> nn.Module:
        return vit(image_size=32, patch_size=4, num_classes=10, d_model=128, n_heads=4, n_layers=6, mlp_dim=512)

    return factory, _images(16, 32, 10), F.cross_entropy


def hf_gpt2() -> Case:
    import transformers

    config = transformers.GPT2Config(
        n_layer=6,
        n_embd=128,
        n_head=4,
        vocab_size=1024,
        n_positions=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )

    def make() -> Any:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 1024, (8, 128), generator=generator)
        return (ids,), ids

    def loss(output: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return (lambda: transformers.GPT2LMHeadModel(config)), make, loss


def hf_bert() -> Case:
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=6,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=128,
    )

    def make() -> Any:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 1024, (8, 128), generator=generator)
        return (ids,), None

    def loss(output: Any, _target: Any) -> torch.Tensor:
        return output.last_hidden_state.pow(2).mean()

    return (lambda: transformers.BertModel(config)), make, loss


CASES: dict[str, Callable[[], Case]] = {
    "torchvision-style ResNet-18 (explicit forward)": torchvision_resnet18,
    "torchvision-style ResNet-50 (explicit forward)": torchvision_resnet50,
    "Hugging Face GPT2LMHeadModel": hf_gpt2,
    "Hugging Face BertModel": hf_bert,
    "remat.models.resnet50 (Sequential)": sequential_resnet50,
    "remat.models.vit (Sequential)": sequential_vit,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    report: dict[str, Any] = {}
    lines = [
        "| model | stages found | planned stages | no recompute | smallest budget | peak @ 50% | overhead @ 50% "
        "| peak @ 25% | overhead @ 25% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, make in CASES.items():
        try:
            factory, make_batch, loss_fn = make()
            torch.manual_seed(0)
            model = factory()
        except ImportError as error:
            print(f"{title}: skipped ({error})", flush=True)
            continue
        model.train()
        result = run_benchmark(
            model,
            make_batch,
            loss_fn,
            budgets=(0.5, 0.25, "min"),
            steps=args.steps,
            threads=args.threads,
            include_checkpoint_sequential=False,
            model_name=title,
        )
        report[title] = result.to_dict()
        base = result.row(BASELINE)
        minimum = result.row("remat @ min").budget_bytes or 0
        no_recompute = base.measured_peak_bytes or 0
        cells = [
            title,
            str(result.metadata["n_stages"]),
            str(result.metadata["n_planned_stages"]),
            format_bytes(no_recompute),
            f"{format_bytes(minimum)} ({100 * minimum / no_recompute:.0f}%)",
        ]
        for label in ("remat @ 0.5", "remat @ 0.25"):
            row = result.row(label)
            if row.error is not None or row.measured_peak_bytes is None:
                cells += ["infeasible", "-"]
            else:
                fits = "" if row.fits_budget else " (over budget!)"
                cells += [f"{format_bytes(row.measured_peak_bytes)}{fits}", f"x{row.overhead_ratio:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
        print(f"{title}: done", flush=True)
    lines.append("")
    lines.append(
        f"Peaks: exact live activation bytes of one training step (parameter gradients excluded); overhead: median "
        f"step time over no recompute's, same run, {args.threads} thread(s), median of {args.steps} steps."
    )
    (RESULTS / "models.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "models.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
