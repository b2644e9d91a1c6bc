"""remat.enable on real Hugging Face architectures with their default settings.

Each model is built from a small config with random weights (no download), with every
setting left at its default (``use_cache=True`` for the causal LMs, dropout on). An
ordinary training loop (AdamW, ``zero_grad``, several steps, the loss the model computes
from ``labels``) runs on a plain copy and on the enabled model: losses, gradients,
parameters and buffers must be equal bit for bit, and every step's exact peak within the
budget. The model keeps its type, its attributes and its ``state_dict`` keys; the causal
LMs still generate. Where 0.5 is infeasible, remat's refusal names the minimum, and the
same checks run at that minimum.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.models import CAUSAL_LMS, hugging_face_architectures

transformers = pytest.importorskip("transformers")


CASES = hugging_face_architectures()
CAUSAL = CAUSAL_LMS


def _loop(
    model: nn.Module, kwargs: dict[str, Any], steps: int, track: bool
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """An ordinary training loop; returns each step's loss and gradients, and (tracked) its peak."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[list[torch.Tensor]] = []
    peaks: list[int] = []
    for _ in range(steps):
        optimizer.zero_grad()
        with remat.MemoryTracker() if track else contextlib.nullcontext() as tracker:
            output = model(**kwargs)
            output.loss.backward()
            loss = output.loss.detach()
            del output
        if track:
            peaks.append(tracker.peak_bytes)
        losses.append([loss, *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
        optimizer.step()
    return losses, peaks


# nested=True: the blocks split into their submodules (a decoder, an encoder, an
# encoder-decoder, a vision transformer, a CNN whose blocks add their input back)
NESTED = ["gpt2", "llama", "bert", "t5", "vit", "resnet"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "nested"), [(name, False) for name in CASES] + [(name, True) for name in NESTED if name in CASES]
)
def test_enable_trains_hugging_face_models_with_default_settings(name: str, nested: bool) -> None:
    factory, kwargs = CASES[name]()
    torch.manual_seed(0)
    plain = factory().train()
    model = copy.deepcopy(plain)
    keys, attributes = list(model.state_dict()), sorted(vars(model))
    # the reference trains without a key/value cache, as remat's training calls do (and
    # Hugging Face's own checkpointing): some models' kernels differ in the last bits with it
    if getattr(plain.config, "use_cache", False):
        plain.config.use_cache = False
    control = remat.enable(model, 0.5, nested=nested)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            control.measure(**kwargs)
            control.plan_for()
        except remat.BudgetTooSmall as error:
            # the message names the minimum in bytes; the same checks run there
            assert error.minimum_bytes > error.budget_bytes and str(error.minimum_bytes) in str(error)
            control.mem_limit = "min"
        torch.manual_seed(1)
        found, peaks = _loop(model, kwargs, steps=3, track=True)
    torch.manual_seed(1)
    expected, _ = _loop(plain, kwargs, steps=3, track=False)
    for step, (a, b) in enumerate(zip(expected, found, strict=True)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    for (key, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # parameters after the updates, and buffers
    plan = control.plan
    assert plan is not None and plan.budget_bytes is not None
    assert max(peaks) <= plan.budget_bytes
    assert sum(count > 1 for count in plan.forward_counts) > 0, "the plan recomputes nothing"
    assert type(model) is type(plain) and list(model.state_dict()) == keys
    assert sorted(k for k in vars(model) if k != "_call_impl") == attributes
    cache_warnings = [w for w in caught if "use_cache" in str(w.message)]
    # said once, for the models whose forward takes use_cache and whose config turns it on
    assert len(cache_warnings) == (1 if name in CAUSAL | {"t5", "bart"} else 0)
    if name in CAUSAL:
        model.eval()
        prompt = kwargs["input_ids"][:, :5]
        with torch.no_grad():
            generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
        assert generated.shape == (2, 8)
        assert model.config.use_cache  # the model's own setting is left alone


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_loss_the_output_carries_is_the_measured_loss(name: str) -> None:
    factory, kwargs = CASES[name]()
    torch.manual_seed(0)
    model = factory().train()
    control = remat.enable(model, 0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        model(**kwargs).loss.backward()
    plan = control.plan
    assert plan is not None and plan.measurement is not None and plan.measurement.loss_from_output
    assert plan.budget.loss_allowance_bytes == 0 and control.margin == 0.0


def test_a_bottleneck_resnet_whose_code_adds_into_an_earlier_stage_output_trains_exactly() -> None:
    """HF's bottleneck block: ``h = layer(x); r = shortcut(x); h += r``. The code after
    ``shortcut`` changes ``layer``'s output in place, so that stage cannot be replayed: it
    is pinned (never recomputed), and the smallest budget trains with plain gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 32], depths=[1, 5], layer_type="bottleneck", num_labels=5
    )
    model = transformers.ResNetForImageClassification(config).train()
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 3])}
    plain = copy.deepcopy(model)
    enabled = copy.deepcopy(model)
    remat.enable(enabled, "min")
    expected = plain(**batch).loss
    expected.backward()
    actual = enabled(**batch).loss
    actual.backward()
    assert torch.equal(expected, actual)
    for (name, a), b in zip(plain.named_parameters(), enabled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for a, b in zip(plain.buffers(), enabled.buffers(), strict=True):
        assert torch.equal(a, b)
    plan = remat.controller(enabled).plan
    assert plan.schedule.profile.pinned_stages
    assert any(count > 1 for count in plan.forward_counts)
    assert "never recomputed" in str(plan.report())


def test_the_insides_of_blocks_that_cover_the_model_stay_the_chain() -> None:
    # NOTE [runs inside a block]: a Swin's blocks' insides, joined, cover nearly all of the
    # model, finer than its two stages: they stay the chain (where a BART's left its
    # encoder out, and the run of its layers is taken)
    from remat.discover.chain import discover_chain

    config = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(config).train()
    kwargs = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])}
    names = discover_chain(model, (), kwargs).names
    assert "swin.encoder.layers.1.blocks.1.attention" in names and "swin.encoder.layers.0.blocks.0.mlp.fc1" in names
    factory, bart_kwargs = CASES["bart"]()
    bart = discover_chain(factory().train(), (), bart_kwargs).names
    assert [n for n in bart if ".layers." in n] == [
        f"model.{part}.layers.{i}" for part in ("encoder", "decoder") for i in range(3)
    ]


def test_a_model_with_its_own_gradient_checkpointing_on_is_refused_until_it_is_off() -> None:
    """Hugging Face's checkpointing runs the blocks again in the backward, outside any plan,
    and measuring would size its step: refused before anything runs, with what to do."""
    factory, kwargs = CASES["gpt2"]()
    torch.manual_seed(0)
    model = factory().train()
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = {name: value.clone() for name, value in model.state_dict().items()}
    remat.enable(model, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        with pytest.raises(remat.UnsupportedModel, match=r"gradient_checkpointing_disable\(\)"):
            model(**kwargs)
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
        model.gradient_checkpointing_disable()
        torch.manual_seed(1)
        actual = model(**kwargs).loss
        actual.backward()
    torch.manual_seed(1)
    expected = plain(**kwargs).loss
    expected.backward()
    assert torch.equal(expected, actual)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
