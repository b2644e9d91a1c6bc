"""T5's first block makes the position bias, uses it in its own attention and hands it to
the next block: the bias's gradient is whole only in the middle of that block's backward,
which started when the gradient of its hidden states was whole (NOTE [outputs a stage's
own backward completes] in remat.measure.instrument). Taken as the start of its backward,
the bias's hook charged part of the block's backward to the next block's, and the tied
LM head's partial weight gradient was counted as held to the end beside its sum, a
leftover of the decoder block whose embedding's backward frees it: a two-block MT5 plan
at "min" was predicted 39% over its measured peak, and a budget of half the plain peak
was refused though its plans fit."""

from __future__ import annotations

import warnings

import pytest
import torch

import remat

transformers = pytest.importorskip("transformers")


def _model(name: str, layers: int) -> torch.nn.Module:
    config_class = {"mt5": transformers.MT5Config, "t5": transformers.T5Config}[name]
    model_class = {"mt5": transformers.MT5ForConditionalGeneration, "t5": transformers.T5ForConditionalGeneration}
    config = config_class(
        vocab_size=256,
        d_model=64,
        d_ff=128,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=4,
        d_kv=16,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return model_class[name](config).train()


_INPUTS = {
    "input_ids": torch.randint(4, 256, (2, 40), generator=torch.Generator().manual_seed(1)),
    "labels": torch.randint(4, 256, (2, 16), generator=torch.Generator().manual_seed(3)),
}


def _step(model: torch.nn.Module) -> tuple[list[torch.Tensor], int]:
    """One training step (dropout on, the same masks each time): its gradients and peak."""
    torch.manual_seed(0)
    with remat.MemoryTracker() as tracker:
        output = model(**_INPUTS)
        output.loss.backward()
        del output
    gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return gradients, tracker.peak_bytes


@pytest.mark.parametrize(("name", "layers"), [("mt5", 2), ("t5", 3)])
@pytest.mark.parametrize("budget", ["min", 0.5])
def test_a_block_that_makes_and_takes_the_position_bias_is_predicted_closely(
    name: str, layers: int, budget: str | float
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, _ = _step(_model(name, layers))
        model = _model(name, layers)
        control = remat.enable(model, budget)
        _step(model)  # measures and plans (0.5 of the plain peak was refused for MT5)
        gradients, measured = _step(model)
    plan = control.plan
    assert measured <= plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes <= 1.15 * measured, (plan.predicted_peak_bytes, measured)
    assert len(gradients) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(gradients, expected, strict=True))
