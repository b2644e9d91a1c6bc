"""What measuring a model costs in memory, and what its sizes give the planner, by measuring mode.

For each workload, in one process: the workloads of ``benchmarks/planner.py`` (``gpt2``,
``resnet``, ``mlp``) and two Hugging Face models that cannot run on fake tensors (``led``:
LED, whose forward reads values; ``wav2vec2``: wav2vec 2.0 with a CTC loss), all with
random weights:

1. a plain training step, its peak tracked (the memory a step without recompute needs);
2. the model measured with each ``measure=`` mode (``"sized"``, the default; ``"plain"``;
   ``"frugal"``), each on a fresh copy: the peak of the measuring itself, its wall time,
   the least budget the planner finds from those sizes, and whether the sizes are a plain
   measurement's (the memory fields of the profile, byte for byte). A model that cannot
   run on fake tensors is measured frugally under ``"sized"`` (NOTE [measured for real
   when fake tensors fail]);
3. two training steps at a budget of 0.5 with the default mode, from a fresh copy: the
   first one measures and trains; both peaks against the budget.

Peaks come from :class:`remat.MemoryTracker` (parameter gradients left out). One thread.
Run ``python benchmarks/measuring.py [--workloads ...]``; it writes
``results/measuring.json`` and ``results/measuring.md`` (``--render RESULT.json`` rewrites the
table from a result).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import remat

sys.path.insert(0, str(Path(__file__).parent))
from planner import WORKLOADS, Workload  # noqa: E402

MODES = ("sized", "plain", "frugal")
MEMORY_FIELDS = (
    "activation_bytes",
    "gradient_bytes",
    "saved_bytes",
    "saves_input",
    "saves_output",
    "forward_temp_bytes",
    "backward_temp_bytes",
)


def _hugging_face(name: str) -> Workload:
    import transformers

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "led":
        config = transformers.LEDConfig(
            vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, attention_window=8,
            max_encoder_position_embeddings=128, max_decoder_position_embeddings=128, pad_token_id=1,
            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )  # fmt: skip
        model: Any = transformers.LEDForConditionalGeneration(config)
        kwargs = {
            "input_ids": torch.randint(4, 256, (2, 32), generator=generator),
            "labels": torch.randint(4, 256, (2, 16), generator=generator),
            "use_cache": False,
        }
        description = "Hugging Face LED, 2 + 2 layers of width 64, 2 x 32 tokens in, 2 x 16 out"
    else:
        config = transformers.Wav2Vec2Config(
            vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
            ctc_loss_reduction="mean",
        )  # fmt: skip
        model = transformers.Wav2Vec2ForCTC(config)
        kwargs = {
            "input_values": torch.randn(2, 4000, generator=generator),
            "labels": torch.randint(1, 32, (2, 10), generator=generator),
        }
        description = "Hugging Face wav2vec 2.0 with a CTC head, 2 layers of width 64, 2 x 4000 samples"
    return Workload(
        name, description, model.train(), (), kwargs, lambda output: output.loss, lambda _: [], hugging_face=True
    )


def workload_of(name: str) -> Workload:
    return WORKLOADS[name]() if name in WORKLOADS else _hugging_face(name)


def _step(workload: Workload, model: Any) -> int:
    """The peak of one training step of `model` (its gradients dropped after)."""
    with remat.MemoryTracker() as tracker:
        workload.loss_fn(model(*workload.args, **workload.kwargs)).backward()
    for parameter in model.parameters():
        parameter.grad = None
    return tracker.peak_bytes


def run_workload(name: str) -> dict[str, Any]:
    workload = workload_of(name)
    result: dict[str, Any] = {"workload": name, "description": workload.description}
    result["plain_step_bytes"] = _step(workload, copy.deepcopy(workload.model))
    profiles = {}
    for mode in MODES:
        wrapper = remat.Checkpointable(
            copy.deepcopy(workload.model), "min", loss_fn=workload.loss_fn, output_kept=False, measure=mode
        )
        with warnings.catch_warnings(record=True) as caught, remat.MemoryTracker() as tracker:
            warnings.simplefilter("always")
            started = time.perf_counter()
            measurement = wrapper.measure(*workload.args, **workload.kwargs)
            seconds = time.perf_counter() - started
        profiles[mode] = measurement.profile
        result[mode] = {
            "measuring_bytes": tracker.peak_bytes,
            "seconds": seconds,
            "least_budget_bytes": wrapper.minimum_budget_bytes(),
            "fell_back": any("cannot run on fake tensors" in str(w.message) for w in caught),
        }
        print(name, mode, result[mode], flush=True)
    for mode in MODES:
        result[mode]["sizes_of_a_plain_step"] = all(
            getattr(profiles[mode], field) == getattr(profiles["plain"], field) for field in MEMORY_FIELDS
        )
    wrapper = remat.Checkpointable(copy.deepcopy(workload.model), 0.5, loss_fn=workload.loss_fn, output_kept=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peaks = [_step(workload, wrapper) for _ in range(2)]
    assert wrapper.plan is not None
    budget = wrapper.plan.budget_bytes
    result["at_half"] = {"budget_bytes": budget, "first_step_bytes": peaks[0], "next_step_bytes": peaks[1]}
    print(name, result["at_half"], flush=True)
    return result


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "# Measuring, by mode",
        "",
        f"torch {torch.__version__}, {platform.machine()}, CPU, 1 thread. Peaks from remat.MemoryTracker.",
        "",
        "| workload | plain step | measuring: sized | frugal | plain | least budget: sized | frugal | plain "
        "| sizes of a plain step: sized / frugal | at 0.5: budget | first step | next step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in results:
        plain = row["plain_step_bytes"]

        def share(nbytes: int, plain: int = plain) -> str:
            return f"{_mb(nbytes)} ({100 * nbytes / plain:.0f}%)"

        sized = row["sized"]
        sized_note = " (frugal: fake tensors fail)" if sized["fell_back"] else ""
        same = " / ".join("yes" if row[mode]["sizes_of_a_plain_step"] else "no" for mode in ("sized", "frugal"))
        half = row["at_half"]
        lines.append(
            f"| {row['workload']} | {_mb(plain)} | {share(sized['measuring_bytes'])}{sized_note} "
            f"| {share(row['frugal']['measuring_bytes'])} | {share(row['plain']['measuring_bytes'])} "
            f"| {_mb(sized['least_budget_bytes'])} | {_mb(row['frugal']['least_budget_bytes'])} "
            f"| {_mb(row['plain']['least_budget_bytes'])} | {same} | {_mb(half['budget_bytes'])} "
            f"| {_mb(half['first_step_bytes'])} | {_mb(half['next_step_bytes'])} |"
        )
    lines += ["", "Workloads:", ""]
    lines += [f"- `{row['workload']}`: {row['description']}" for row in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*WORKLOADS, "led", "wav2vec2"]
    parser.add_argument("--workloads", nargs="+", default=names, choices=names)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--render", type=Path, default=None, metavar="RESULT.json", help="only rewrite its table")
    args = parser.parse_args()
    if args.render is not None:
        results = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(results))
        return
    torch.set_num_threads(1)
    results = [run_workload(name) for name in args.workloads]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "measuring.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.output_dir / "measuring.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
