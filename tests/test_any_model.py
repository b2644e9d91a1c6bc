"""remat.Checkpointable on models written the usual way: the chain is found in their forward.

The models keep their original structure: a torchvision-style ResNet with its explicit
forward, the reference GPT (a ModuleList loop with a causal mask as a side input) and ViT
from tests/reference_models.py, and Hugging Face GPT-2 and BERT. Each is trained side by
side with plain autograd with its real loss; on the CPU the gradients are bit-for-bit
equal (see tests/chain_helpers.py), so they are compared with torch.equal.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import reference_models as reference
import remat
from chain_helpers import (
    assert_peak_matches_prediction,
    assert_same_tensors,
    clone_inputs,
    compare_training,
    minimum_budget,
    state_of,
)
from remat.discover.chain import discover_chain

pytestmark = pytest.mark.usefixtures("clean_remat_state")

BUDGETS = {"0.5": 0.5, "0.25": 0.25, "minimum": None}


@dataclass
class Case:
    """A model, its inputs, its loss and the chain remat must find in it."""

    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    chain: list[str]
    output_of: Callable[[Any], torch.Tensor] = field(default=lambda output: output)


# ----------------------------------------------------------------------------- the models
def resnet() -> Case:
    """Bottleneck ResNet; a deep first stage makes a quarter of the memory feasible."""
    model = reference.ResNet(reference.Bottleneck, [6, 1, 1, 1], num_classes=10, width=8)
    labels = torch.tensor([3, 7])
    chain = ["conv1", "bn1", "relu", "maxpool"]
    chain += [f"layer1.{i}" for i in range(6)] + ["layer2.0", "layer3.0", "layer4.0", "avgpool", "fc"]
    return Case(model, (torch.randn(2, 3, 32, 32),), lambda logits: F.cross_entropy(logits, labels), chain)


def gpt() -> Case:
    model = reference.GPT(vocab_size=50, n_positions=16, d_model=32, n_heads=4, n_layers=6, dropout=0.1)
    tokens = torch.randint(0, 50, (2, 16))
    targets = torch.roll(tokens, -1, dims=1)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Case(model, (tokens,), loss_fn, ["wpe", "drop"] + [f"h.{i}" for i in range(6)] + ["ln_f", "lm_head"])


def vit() -> Case:
    model = reference.ViT(
        image_size=16, patch_size=4, num_classes=10, d_model=32, n_heads=4, n_layers=6, mlp_dim=64,
        dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    labels = torch.tensor([1, 4])
    chain = ["conv_proj", "dropout"] + [f"layers.{i}" for i in range(6)] + ["ln", "head"]
    return Case(model, (torch.randn(2, 3, 16, 16),), lambda logits: F.cross_entropy(logits, labels), chain)


def hf_gpt2(n_layer: int = 8) -> Case:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=4, vocab_size=100, n_positions=32, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 100, (2, 16))
    chain = ["transformer.wpe", "transformer.drop"] + [f"transformer.h.{i}" for i in range(n_layer)]
    chain += ["transformer.ln_f"]

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return Case(model, (tokens,), loss_fn, chain, output_of=lambda output: output.logits)


def hf_bert(num_hidden_layers: int = 8) -> Case:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=num_hidden_layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.BertModel(config)
    tokens = torch.randint(0, 100, (2, 16))
    # the embeddings' own run comes first: the chain joins it to the layers' (the pooler,
    # whose output the loss does not use, gets no gradient: not a stage)
    chain = ["embeddings.position_embeddings", "embeddings.LayerNorm", "embeddings.dropout"]
    chain += [f"encoder.layer.{i}" for i in range(num_hidden_layers)]
    return Case(
        model,
        (tokens,),
        lambda output: output.last_hidden_state.square().mean(),
        chain,
        output_of=lambda output: output.last_hidden_state,
    )


# With 4 layers (the configurations of the issue) the smallest budget of the Hugging Face
# models is about a third of their memory without recompute; 8 layers bring it under a
# quarter. test_the_issue_configurations runs the 4-layer ones.
CASES: dict[str, Callable[[], Case]] = {
    "resnet": resnet,
    "gpt": gpt,
    "vit": vit,
    "hf_gpt2": hf_gpt2,
    "hf_bert": hf_bert,
}


def build(name: str, **options: Any) -> Case:
    torch.manual_seed(0)
    case = CASES[name](**options)
    case.model.train()
    return case


def chain_names(wrapped: remat.Checkpointable) -> list[str]:
    assert wrapped.plan is not None
    return [stage.name for stage in wrapped.plan.measurement.stages]


def train_and_check(case: Case, budget: float | int | None) -> tuple[remat.PlannedChain, list[int]]:
    """Wraps the model at `budget` (None: the minimum) and checks two training steps."""
    plain = copy.deepcopy(case.model)
    options = {"loss_fn": case.loss_fn}
    if budget is None:
        finder = remat.Checkpointable(copy.deepcopy(case.model), **options)
        budget = minimum_budget(finder, *clone_inputs(case.inputs))
    wrapped = remat.Checkpointable(case.model, budget, **options)
    wrapped.measure(*clone_inputs(case.inputs))
    planned = wrapped.compute_sequence()
    peaks = compare_training(plain, wrapped, case.inputs, case.loss_fn, output_of=case.output_of)
    assert chain_names(wrapped) == case.chain
    for peak in peaks:
        assert_peak_matches_prediction(peak, planned)
    return planned, peaks


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("name", list(CASES))
def test_training_is_exact_and_fits_the_budget(name: str, budget_name: str) -> None:
    planned, _ = train_and_check(build(name), BUDGETS[budget_name])
    assert max(planned.forward_counts) > 1  # something is recomputed at these budgets


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_the_issue_configurations(name: str) -> None:
    """The 4-layer Hugging Face models: exact at 0.5 and at the minimum, which is above 0.25."""
    options = {"n_layer": 4} if name == "hf_gpt2" else {"num_hidden_layers": 4}
    train_and_check(build(name, **options), 0.5)
    case = build(name, **options)
    minimum = minimum_budget(remat.Checkpointable(copy.deepcopy(case.model)), *clone_inputs(case.inputs))
    with pytest.raises(remat.BudgetTooSmall) as error:
        remat.Checkpointable(copy.deepcopy(case.model), 0.25)(*clone_inputs(case.inputs))
    assert error.value.minimum_bytes == minimum > error.value.budget_bytes
    train_and_check(case, None)


def test_resnet18_is_found_whole_and_fits_its_minimum() -> None:
    torch.manual_seed(0)
    model = reference.resnet(18, num_classes=10, width=8)
    case = Case(
        model, (torch.randn(2, 3, 32, 32),), lambda logits: logits.logsumexp(1).mean(),
        ["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0",
         "layer3.1", "layer4.0", "layer4.1", "avgpool", "fc"],
    )  # fmt: skip
    planned, _ = train_and_check(case, None)
    # bn1 and the in-place ReLU after it are one planned stage.
    assert (1, 3) in planned.measurement.groups


def test_the_longest_chain_counts_the_stages_of_nested_sequentials() -> None:
    """layer1 runs 10 blocks, the top level 10 calls: expanded, the top level is longer."""
    torch.manual_seed(0)
    model = reference.ResNet(reference.BasicBlock, [10, 1, 1, 1], num_classes=10, width=8)
    chain = discover_chain(model, (torch.randn(2, 3, 32, 32),), {})
    expected = ["conv1", "bn1", "relu", "maxpool"] + [f"layer1.{i}" for i in range(10)]
    # the head takes the pooled features through a flatten: a stage too
    assert chain.names == expected + ["layer2.0", "layer3.0", "layer4.0", "avgpool", "fc"]


class _Encoder(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(reference.TanhResidual(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return (x,)


class _FlatHead(nn.Module):
    """DistilBERT's masked-LM shape: beside its encoder, the model calls more modules of its
    own (a head) than the encoder has blocks."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.encoder = _Encoder(width, depth)
        self.dense = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(self.act(self.dense(self.encoder(x)[0]))))


def test_a_stage_that_runs_repeated_blocks_is_split_down_to_them() -> None:
    """NOTE [blocks inside a stage]: the head's run is the longest; the encoder is split."""
    torch.manual_seed(0)
    model = _FlatHead()
    x = torch.randn(64, 16)
    chain = discover_chain(model, (x,), {})
    layers = [f"encoder.layers.{i}" for i in range(3)]
    assert chain.names == ["encoder.embed", *layers, "dense", "act", "norm", "project"]
    reference = copy.deepcopy(model)
    reference(x).square().sum().backward()
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: out.square().sum())
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        wrapped(x).square().sum().backward()
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


class _Bottleneck(nn.Module):
    """A Hugging Face ResNet layer's shape: its convolutions, a shortcut called after them,
    the residual added in place, an activation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.shortcut = nn.Identity()
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        hidden = self.layer(x)
        hidden += self.shortcut(residual)
        return self.activation(hidden)


class _Stage(nn.Module):
    def __init__(self, width: int, depth: int, scale: float | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Bottleneck(width) for _ in range(depth))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.scale is None else x * self.scale


class _Staged(nn.Module):
    def __init__(self, depths: tuple[int, ...], width: int = 4, scale: float | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.stages = nn.ModuleList(_Stage(width, depth, scale) for depth in depths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return x


class _FlatLayer(nn.Module):
    """A layer of many distinct submodules, called one after another (a BART layer's)."""

    def __init__(self, width: int, cross: bool) -> None:
        super().__init__()
        self.attention, self.attention_norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.cross = nn.Linear(width, width) if cross else None
        self.cross_norm = nn.LayerNorm(width) if cross else None
        self.fc1, self.activation, self.fc2 = nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        self.final_norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        if self.cross is not None and self.cross_norm is not None and memory is not None:
            x = self.cross_norm(x + self.cross(x + memory.mean(1, keepdim=True)))
        return self.final_norm(x + self.fc2(self.activation(self.fc1(x))))


class _FlatEncoderDecoder(nn.Module):
    def __init__(self, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(_FlatLayer(width, cross=False) for _ in range(layers))
        self.decoder = nn.ModuleList(_FlatLayer(width, cross=True) for _ in range(layers))

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            source = layer(source)
        for layer in self.decoder:
            target = layer(target, memory=source)
        return target


def test_the_insides_of_one_block_do_not_outrank_the_run_of_blocks() -> None:
    # NOTE [runs inside a block]: a decoder layer's eight calls outnumber two layers; the
    # chain is the encoder's and the decoder's layers, not one decoder layer's insides
    torch.manual_seed(0)
    model, source, target = _FlatEncoderDecoder(), torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    chain = discover_chain(model, (source, target), {})
    assert chain.names == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    case = Case(model, (source, target), lambda out: out.square().mean(), chain.names)
    train_and_check(case, None)


def test_runs_joined_before_the_longest_are_whole_blocks_not_their_insides() -> None:
    # The longest run is the last stage's blocks; the runs before it end with the stage
    # before's blocks and, at the same point, with the shortcut and activation inside its
    # last block: the blocks are joined, not the insides (whose convolutions would be left
    # to the code between stages, and whose in-place addition would pin them).
    # The stages scale their output: they do not pass through (see below).
    torch.manual_seed(0)
    chain = discover_chain(_Staged((2, 3, 6), scale=0.5), (torch.randn(2, 3, 8, 8),), {})
    blocks = [f"stages.{i}.layers.{j}" for i, depth in enumerate((2, 3, 6)) for j in range(depth)]
    assert chain.names == blocks  # the stem, a run of one call, runs before the chain


@pytest.mark.parametrize(("depths", "head"), [((2, 2, 2), ["stem"]), ((2, 3, 6), [])])
def test_a_module_that_passes_through_its_blocks_is_its_blocks(depths: tuple[int, ...], head: list[str]) -> None:
    # NOTE [modules that pass through]: a stage that only loops over its blocks is its
    # blocks in the chain, whether the run of stages is the longer (2, 2, 2: four calls with
    # the stem, against two blocks a stage) or a run of blocks (2, 3, 6: the stem, a run of
    # one call before them, runs before the chain)
    torch.manual_seed(0)
    model = _Staged(depths)
    chain = discover_chain(model, (torch.randn(2, 3, 8, 8),), {})
    blocks = [f"stages.{i}.layers.{j}" for i, depth in enumerate(depths) for j in range(depth)]
    assert chain.names == [*head, *blocks]
    case = Case(model, (torch.randn(2, 3, 8, 8),), lambda out: out.square().mean(), [*head, *blocks])
    train_and_check(case, None)


# ----------------------------------------------------------------------------- measure() is clean
def test_measuring_a_model_with_a_forward_leaves_it_untouched() -> None:
    case = build("resnet")
    model = case.model
    model(*case.inputs)  # BatchNorm statistics that are not the initial ones
    grads = {}
    for name, parameter in model.named_parameters():
        parameter.grad = torch.full_like(parameter, -1.5)
        grads[name] = parameter.grad
    before = state_of(model)
    rng = torch.get_rng_state()
    remat.Checkpointable(model, 0.5).measure(*clone_inputs(case.inputs))  # discovery, then measurement
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_tensors(before, state_of(model), "parameters and buffers")
    for name, parameter in model.named_parameters():
        assert parameter.grad is grads[name]
        assert torch.equal(parameter.grad, torch.full_like(parameter, -1.5))


# ----------------------------------------------------------------------------- unsupported models
class SingleLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


class BlocksCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = torch.tanh(block(x))
        return x


class NoLinks(nn.Module):
    """Blocks called once each, but every one on the model's input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x) for block in self.blocks)


@pytest.mark.parametrize("model_type", [SingleLinear, BlocksCalledTwice, NoLinks])
def test_a_model_without_a_chain_is_refused_with_advice(model_type: type[nn.Module]) -> None:
    wrapped = remat.Checkpointable(model_type(), 0.5)
    with pytest.raises(remat.UnsupportedModel, match=r"found no chain in .*remat\.mark"):
        wrapped(torch.randn(4, 8, requires_grad=True))


class Reorderable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(self.blocks)
        if self.swap:
            order[1], order[2] = order[2], order[1]
        for block in order:
            x = block(x)
        return x


def test_a_stage_order_that_changes_between_calls_is_refused() -> None:
    torch.manual_seed(0)
    model = Reorderable()
    x = torch.randn(4, 8, requires_grad=True)
    budget = minimum_budget(remat.Checkpointable(copy.deepcopy(model)), x)
    wrapped = remat.Checkpointable(model, budget)
    wrapped(x).sum().backward()
    assert chain_names(wrapped) == [f"blocks.{i}.{j}" for i in range(4) for j in range(2)]

    model.swap = True
    expected = r"stage 4 \('blocks\.2\.0'\) was called when stage 2 was expected"
    with pytest.raises(remat.UnsupportedModel, match=expected):
        wrapped(x)
    model.swap = False  # nothing was left half done: the next step is exact
    plain = copy.deepcopy(model)
    compare_training(plain, wrapped, (x.detach(),), lambda output: output.sum())


class LayerDropped(nn.Module):
    """Skips the blocks in `dropped` (as layerdrop does at random in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.dropped: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index not in self.dropped:
                x = block(x)
        return x


@pytest.mark.parametrize("nested", [False, True])
def test_a_stage_skipped_in_one_forward_is_refused_with_what_to_do(nested: bool) -> None:
    # NOTE [skipped stages]
    torch.manual_seed(0)
    model = LayerDropped()
    x = torch.randn(4, 8, requires_grad=True)
    wrapped = remat.Checkpointable(model, "min", nested=nested)
    wrapped(x).sum().backward()
    assert max(wrapped.plan.forward_counts) > 1  # a plan that recomputes: its stages are intercepted

    model.dropped = {1}
    skipped = (
        r"stage 4 \('blocks\.2\.0'\) was called when stage 2 was expected: 'blocks\.1\.0', 'blocks\.1\.1' did not run"
    )
    with pytest.raises(remat.UnsupportedModel, match=skipped + r".*layerdrop=0\.0.*remat\.mark"):
        wrapped(x)
    model.dropped = {3}
    with pytest.raises(
        remat.UnsupportedModel, match=r"ran 6 of the chain's 8 stages: 'blocks\.3\.0', 'blocks\.3\.1' did not run\."
    ):
        wrapped(x)
    model.dropped = set()  # nothing was left half done: the next step is exact
    compare_training(copy.deepcopy(model), wrapped, (x.detach(),), lambda output: output.sum())


def test_a_plan_that_recomputes_nothing_runs_the_models_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [nothing to recompute]: no stage is intercepted, so a changed order is the
    # plain step it would be without remat (there is no replay to go wrong)
    import remat.execute

    torch.manual_seed(0)
    model = Reorderable()
    x = torch.randn(4, 8, requires_grad=True)
    wrapped = remat.Checkpointable(model, 1.0)
    wrapped(x).sum().backward()  # measures and plans
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) == 1

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a plan that stores everything intercepts no stage")

    monkeypatch.setattr(remat.execute, "intercept_stages", refused)
    model.swap = True
    compare_training(copy.deepcopy(model), wrapped, (x.detach(),), lambda output: output.sum())


def test_hugging_face_gpt2_trains_with_its_key_value_cache_turned_off() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    assert config.use_cache  # the default
    model = transformers.GPT2LMHeadModel(config).train()
    plain = copy.deepcopy(model)
    # the reference trains without the cache too: GPT-2's own gradients differ in the last
    # bits with it (its attention runs on the concatenated cache)
    plain.config.use_cache = False
    wrapped = remat.Checkpointable(model, 0.5)
    tokens = torch.randint(0, 100, (2, 16))
    # asked for explicitly, a cache in a training call is refused: a recompute would fill it again
    with pytest.raises(remat.UnsupportedModel, match=r"key/value cache.*use_cache=False"):
        wrapped(tokens, use_cache=True)
    assert all(p.grad is None for p in model.parameters())

    def logits_sum(output: Any) -> torch.Tensor:
        return output.logits.sum()

    # by default, training calls turn it off (said once), as Hugging Face's checkpointing does
    with pytest.warns(UserWarning, match="use_cache=False"):
        compare_training(plain, wrapped, (tokens,), logits_sum, output_of=lambda output: output.logits)
    assert model.config.use_cache  # the model's own setting is left alone


class _CacheThroughKwargs(nn.Module):
    """A model that takes use_cache only through **kwargs (as Switch Transformers and GraniteMoE do)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        cache: list[torch.Tensor] | None = [] if kwargs.get("use_cache", self.config.use_cache) else None
        for block in self.blocks:
            x = block(x)
            if cache is not None:
                cache.append(x)
        return x, cache


def test_a_model_taking_use_cache_through_kwargs_trains_with_its_cache_turned_off() -> None:
    torch.manual_seed(0)
    model = _CacheThroughKwargs().train()
    plain = copy.deepcopy(model)
    plain.config.use_cache = False
    wrapped = remat.Checkpointable(model, "min")
    x = torch.randn(8, 16)
    with (
        warnings.catch_warnings()
    ):  # not said: through **kwargs, an encoder's config may turn on a cache it never makes
        warnings.simplefilter("error")
        compare_training(plain, wrapped, (x,), lambda output: output[0].sum(), output_of=lambda output: output[0])
    assert model.config.use_cache
    assert wrapped(x)[1] is None  # the training call ran without its cache


def test_a_module_repeated_in_a_sequential_is_refused_by_name() -> None:
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(remat.UnsupportedModel, match=r"module '2' appears twice"):
        remat.Checkpointable(model, 0.5)(torch.randn(4, 16))
