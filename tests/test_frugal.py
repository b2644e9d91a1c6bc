"""The frugal measurement: a step with every stage recomputed, sized as a plain step.

NOTE [frugal measurement] (remat.measure.instrument), NOTE [frugal spans] (remat.measure.step),
NOTE [a frugal step's forward as a plain one] and NOTE [replays inside a frugal backward]
(remat.measure.costs), NOTE [first uses in a frugal step] (remat.measure.outside), and the
fallback for models that cannot run on fake tensors (NOTE [measured for real when fake
tensors fail], remat.measure.real).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from chain_helpers import compare_training
from remat.discover.chain import discover_chain
from remat.discover.intercept import intercept_stages
from remat.measure import ChainMeasurement
from remat.measure.instrument import InPlaceProbe
from remat.measure.spans import frugal_spans
from remat.models import gpt2, mlp_chain
from test_checkpointable import conv_bn_relu, mlp_with_dropout
from test_waiting_gradients import SplitAttention

pytestmark = pytest.mark.usefixtures("clean_remat_state")

Case = tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]


class Block(nn.Module):
    """A residual MLP block: it saves several times its input."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class HoldsHidden(nn.Module):
    """Its code holds the blocks' output to the end of its forward, as Hugging Face's output
    tuples do, while the stages after it (a dropout, a head) do not save it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = (self.blocks(x),)
        return self.head(self.drop(outputs[0]))


class DataDependent(nn.Module):
    """A decoder whose forward reads a value (``.item()``): it cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = gpt2(n_layers=4, d_model=16, n_heads=2, vocab_size=32, n_positions=8, dropout=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.max().item() >= 32:
            raise ValueError("a token outside the vocabulary")
        return self.decoder(tokens)


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _tiny_gpt2(n_layers: int = 4) -> Case:
    model = gpt2(n_layers=n_layers, d_model=16, n_heads=2, vocab_size=32, n_positions=8, dropout=0.1)
    tokens = torch.randint(0, 32, (2, 8))
    return model, (tokens,), _square_mean


CASES: dict[str, Callable[[], Case]] = {
    "mlp_dropout": mlp_with_dropout,
    "conv_bn_relu": conv_bn_relu,
    "gpt2": _tiny_gpt2,
    "holds_hidden": lambda: (HoldsHidden(), (torch.randn(4, 6, 16),), _square_mean),
    "split_attention": lambda: (
        nn.Sequential(SplitAttention(), SplitAttention()),
        (torch.randn(4, 16, 32),),
        _square_mean,
    ),
}


def _measured(
    case: Case, frugal: bool, nested: bool = False, kwargs: dict[str, Any] | None = None
) -> tuple[ChainMeasurement, int]:
    """The measurement of a copy of the case's model, and the peak of the measuring step."""
    model, inputs, loss_fn = case
    how = "frugal" if frugal else "plain"
    wrapped = remat.Checkpointable(copy.deepcopy(model).train(), None, loss_fn=loss_fn, nested=nested, measure=how)
    with remat.MemoryTracker() as tracker:
        measurement = wrapped.measure(*inputs, **(kwargs or {}))
    return measurement, tracker.peak_bytes


MEMORY_FIELDS = (
    "activation_bytes",
    "gradient_bytes",
    "saved_bytes",
    "saves_input",
    "saves_output",
    "forward_temp_bytes",
)


def _at_least(frugal: tuple[int, ...], plain: tuple[int, ...]) -> bool:
    return all(f >= p for f, p in zip(frugal, plain, strict=True))


def _same_sizes(frugal: Any, plain: Any) -> None:
    """The frugal profile's sizes are the plain one's; its backward transients are at least
    theirs (NOTE [replays inside a frugal backward]: on the safe side by a boundary)."""
    for field in MEMORY_FIELDS:
        assert getattr(frugal, field) == getattr(plain, field), field
    assert _at_least(frugal.backward_temp_bytes, plain.backward_temp_bytes)


EXACT = ["mlp_dropout", "conv_bn_relu", "gpt2", "holds_hidden"]


@pytest.mark.parametrize("name", EXACT)
def test_a_frugal_step_measures_the_sizes_of_a_plain_step(name: str) -> None:
    torch.manual_seed(0)
    case = CASES[name]()
    plain, plain_peak = _measured(case, frugal=False)
    frugal, frugal_peak = _measured(case, frugal=True)
    assert frugal.groups == plain.groups
    _same_sizes(frugal.profile, plain.profile)
    for field in dataclasses.fields(ChainMeasurement):
        if field.name not in ("stages", "profile", "measured_peak_bytes", "end_peak_bytes"):
            assert getattr(frugal, field.name) == getattr(plain, field.name), field.name
    assert frugal.end_peak_bytes >= plain.end_peak_bytes
    # in less memory than a plain step
    assert frugal_peak < plain_peak


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_what_a_frugal_step_does_not_see_as_a_plain_one_is_on_the_safe_side(name: str, nested: bool) -> None:
    # The regions' copies of module buffers (NOTE [a frugal step's forward as a plain one]),
    # and in nested plans the constants the executor keeps for the glue's replays, count
    # as more memory, never less
    torch.manual_seed(0)
    case = CASES[name]()
    plain, _ = _measured(case, frugal=False, nested=nested)
    frugal, _ = _measured(case, frugal=True, nested=nested)
    for field in ("activation_bytes", "saved_bytes", "saves_input", "saves_output"):
        assert getattr(frugal.profile, field) == getattr(plain.profile, field), field
    for field in ("gradient_bytes", "forward_temp_bytes", "backward_temp_bytes"):
        pairs = zip(getattr(frugal.profile, field), getattr(plain.profile, field), strict=True)
        assert all(f >= p for f, p in pairs), field
    pairs = zip(frugal.waiting_gradient_bytes, plain.waiting_gradient_bytes, strict=True)
    assert all(f >= p for f, p in pairs)
    assert frugal.suffix_peak_bytes >= plain.suffix_peak_bytes


def _hugging_face_measured(model: nn.Module, kwargs: dict[str, Any]) -> tuple[ChainMeasurement, ChainMeasurement]:
    """A Hugging Face model that computes its own loss, measured plainly and frugally."""
    case: Case = (model, (), lambda output: output.loss)
    return _measured(case, frugal=False, kwargs=kwargs)[0], _measured(case, frugal=True, kwargs=kwargs)[0]


def test_a_replay_inside_a_backward_is_read_as_a_plain_steps_saved_tensors() -> None:
    # NOTE [replays inside a frugal backward]: in Hugging Face's LED, the backward of a
    # stage reaches what an earlier span saved, whose replay runs inside that backward
    # (counted as the step's own transient without the NOTE: 195,904 bytes where a plain
    # step shows none)
    transformers = pytest.importorskip("transformers")
    config = transformers.LEDConfig(
        vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, attention_window=8,
        max_encoder_position_embeddings=128, max_decoder_position_embeddings=128, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LEDForConditionalGeneration(config).train()
    generator = torch.Generator().manual_seed(1)
    kwargs = {
        "input_ids": torch.randint(4, 256, (2, 32), generator=generator),
        "labels": torch.randint(4, 256, (2, 16), generator=generator),
        "use_cache": False,
    }
    plain, frugal = _hugging_face_measured(model, kwargs)
    assert frugal.profile.backward_temp_bytes == plain.profile.backward_temp_bytes
    assert frugal.waiting_gradient_bytes == plain.waiting_gradient_bytes


def test_a_stage_backward_counts_the_gradients_it_came_with() -> None:
    # NOTE [a frugal stage's backward]: CLIP's second vision layer starts its backward with
    # gradients made before its span's replay; read from the replay's end, its transient was
    # 8 KiB under the plain step's, and its plans at the smallest budget went over it
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 32},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 4},
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).train()
    generator = torch.Generator().manual_seed(1)
    kwargs = {
        "input_ids": torch.randint(4, 256, (2, 16), generator=generator),
        "pixel_values": torch.randn(2, 3, 32, 32, generator=generator),
        "return_loss": True,
    }
    plain, frugal = _hugging_face_measured(model, kwargs)
    assert _at_least(frugal.profile.backward_temp_bytes, plain.profile.backward_temp_bytes)


def _spans(model: nn.Module, inputs: tuple[Any, ...]) -> list[tuple[int, int]]:
    chain = discover_chain(model, inputs, {})
    return frugal_spans(model, chain, inputs, {})


def test_frugal_spans_follow_what_the_stages_save() -> None:
    torch.manual_seed(0)
    # blocks that save four times their input or more: a span each (the embedding's
    # position lookup, which saves nothing, rides with the block after it)
    model, inputs, _ = _tiny_gpt2()
    spans = _spans(model, inputs)
    chain = discover_chain(model, inputs, {})
    blocks = [index for index, name in enumerate(chain.names) if name.startswith("blocks.")]
    for index in blocks:
        assert sum(start <= index < stop for start, stop in spans) == 1
        assert not any(start < index < stop and start in blocks for start, stop in spans), spans
    # single layers that save what they take: spans of several, as checkpoint_sequential's
    layers = nn.Sequential(*[nn.Linear(32, 32) if index % 2 else nn.Tanh() for index in range(16)])
    spans = _spans(layers, (torch.randn(8, 32),))
    assert 2 < len(spans) < 8
    # blocks that save nine times what they take: a span each
    assert len(_spans(mlp_chain(depth=16, width=32), (torch.randn(8, 32),))) == 16


class SavesOneSize(nn.Module):
    """Saves eight tensors of one size, each freed before the next is made."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum()
        for _ in range(8):
            total = total + x.exp().sum()  # exp saves its output, let go once summed
        return x + total


def test_the_probe_counts_a_storage_made_where_a_freed_one_was() -> None:
    model = nn.Sequential(SavesOneSize(), SavesOneSize())
    x = torch.randn(64, 64, requires_grad=True)
    chain = discover_chain(model, (x,), {})
    probe = InPlaceProbe(chain)
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda _: None), intercept_stages(chain, probe):
        model(x)
    assert probe.saved_bytes == [8 * x.numel() * 4] * 2


class AddsToIdentity(nn.Module):
    """Adds in place to what an ``nn.Identity`` stage returned, its input, then lets go of it
    (a RegNet layer's last activation): that stage modifies its input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 4) for _ in range(4)])
        self.identities = nn.ModuleList([nn.Identity() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, identity in zip(self.blocks, self.identities, strict=True):
            hidden = identity(block(x))
            hidden += x[..., :4]
            hidden = torch.tanh(hidden)
            x = hidden.repeat(1, 4).exp().sin().cos()
        return x


def test_a_stage_whose_input_is_changed_in_place_after_it_ran_starts_no_span() -> None:
    torch.manual_seed(0)
    model, x = AddsToIdentity(), torch.randn(8, 16)
    chain = discover_chain(model, (x,), {})
    identities = {index for index, name in enumerate(chain.names) if name.startswith("identities.")}
    assert not identities & {start for start, _ in _spans(model, (x,))}
    wrapped = remat.Checkpointable(copy.deepcopy(model), None, loss_fn=_square_mean, measure="frugal")
    with pytest.warns(UserWarning, match="no budget given"):
        compare_training(copy.deepcopy(model), wrapped, (x,), _square_mean)


def test_the_measuring_step_of_a_decoder_keeps_far_less_than_a_plain_step() -> None:
    torch.manual_seed(0)
    case = _tiny_gpt2(n_layers=8)
    _, plain_peak = _measured(case, frugal=False)
    _, frugal_peak = _measured(case, frugal=True)
    assert frugal_peak < 0.3 * plain_peak


def test_a_model_that_cannot_run_on_fake_tensors_is_measured_frugally_and_trains_exactly() -> None:
    torch.manual_seed(0)
    model = DataDependent().train()
    tokens = torch.randint(0, 32, (2, 8))
    with remat.MemoryTracker() as tracker:
        _square_mean(copy.deepcopy(model)(tokens)).backward()
    plain_peak = tracker.peak_bytes
    wrapped = remat.Checkpointable(copy.deepcopy(model), 0.5, loss_fn=_square_mean)
    with pytest.warns(RuntimeWarning, match=r"cannot run on fake tensors .*measure='frugal'"):
        with remat.MemoryTracker() as tracker:
            wrapped.measure(tokens)
    assert tracker.peak_bytes < 0.5 * plain_peak
    # its sizes are those a plain measurement finds
    plain = remat.Checkpointable(copy.deepcopy(model), 0.5, loss_fn=_square_mean, measure="plain")
    expected = plain.measure(tokens).profile
    actual = wrapped.measure(tokens).profile
    _same_sizes(actual, expected)
    peaks = compare_training(copy.deepcopy(model), wrapped, (tokens,), _square_mean)
    assert wrapped.plan is not None
    assert max(peaks) <= wrapped.plan.budget_bytes


class ChangesItsInput(nn.Module):
    """Reads a value, then its first stage changes its input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max().item() > 1e6:
            raise ValueError("out of range")
        return self.blocks(self.act(2 * x))


def test_a_model_the_frugal_step_refuses_is_measured_with_a_plain_step() -> None:
    torch.manual_seed(0)
    model = ChangesItsInput().train()
    x = torch.randn(4, 6, 16)
    wrapped = remat.Checkpointable(copy.deepcopy(model), 0.9, loss_fn=_square_mean)
    with pytest.warns(RuntimeWarning, match="measured with a plain step, since a frugal one cannot run"):
        wrapped.measure(x.clone())
    compare_training(copy.deepcopy(model), wrapped, (x,), _square_mean)
