"""The model zoo: every chain computes what the hand-written original computes."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import reference_models as reference
from remat import models
from remat.discover import discover_chain


def _stages(chain: nn.Sequential) -> Iterator[nn.Module]:
    """The chain's stages, nested sequentials flattened (as the planner sees them)."""
    for module in chain:
        if isinstance(module, nn.Sequential):
            yield from _stages(module)
        else:
            yield module


def _assert_same_layout(chain: nn.Module, original: nn.Module) -> None:
    assert [p.shape for p in chain.parameters()] == [p.shape for p in original.parameters()]
    assert [b.shape for b in chain.buffers()] == [b.shape for b in original.buffers()]
    assert models.count_parameters(chain) == models.count_parameters(original)


def _assert_same_function(
    chain: nn.Module,
    original: nn.Module,
    make_input: Callable[[], Tensor],
    *,
    train: bool,
) -> None:
    """Same outputs (bit for bit) and same gradients after copying the weights over."""
    models.copy_weights(original, chain)
    chain.train(train)
    original.train(train)
    inputs = make_input()
    outputs = []
    for model in (original, chain):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)  # same dropout masks in both
        output = model(inputs)
        weights = torch.linspace(-1.0, 1.0, output.numel()).reshape(output.shape)
        (output * weights).sum().backward()
        outputs.append(output.detach())
    assert torch.equal(outputs[0], outputs[1])
    for (name, p), q in zip(chain.named_parameters(), original.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(chain.named_buffers(), original.buffers(), strict=True):
        assert torch.equal(b, c), name


def _images(batch: int = 2, size: int = 32) -> Callable[[], Tensor]:
    def make() -> Tensor:
        torch.manual_seed(0)
        return torch.randn(batch, 3, size, size)

    return make


# ----------------------------------------------------------------------------- ResNet


@pytest.mark.parametrize("depth", [18, 50])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_resnet_matches_reference(depth: int, train: bool) -> None:
    torch.manual_seed(0)
    original = reference.resnet(depth, num_classes=7, width=8)
    chain = models.resnet(depth, 7, width=8)
    _assert_same_layout(chain, original)
    _assert_same_function(chain, original, _images(), train=train)


@pytest.mark.parametrize("depth", [18, 34, 50, 101, 152])
def test_resnet_layout_and_names_match_the_original(depth: int) -> None:
    original = reference.resnet(depth, num_classes=5, width=8)
    chain = getattr(models, f"resnet{depth}")(5, width=8)
    _assert_same_layout(chain, original)
    # The chain keeps the original names, so an original state dict loads as is.
    assert list(chain.state_dict()) == list(original.state_dict())
    chain.load_state_dict(original.state_dict())


@pytest.mark.parametrize("depth", [34, 101, 152])
def test_deep_resnet_matches_reference_in_eval(depth: int) -> None:
    original = reference.resnet(depth, num_classes=5, width=8)
    chain = models.resnet(depth, 5, width=8)
    models.copy_weights(original, chain)
    x = _images(batch=1)()
    with torch.no_grad():
        assert torch.equal(chain.eval()(x), original.eval()(x))


def test_resnet_stages_are_stem_blocks_and_head() -> None:
    chain = models.resnet50(width=8)
    kinds = [type(stage) for stage in _stages(chain)]
    assert kinds[:4] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d]
    assert kinds[4:-3] == [models.Bottleneck] * 16
    assert kinds[-3:] == [nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    assert [type(s) for s in _stages(models.resnet18(width=8))][4:-3] == [models.BasicBlock] * 8


def test_resnet_zero_init_residual_starts_blocks_at_zero() -> None:
    chain = models.resnet18(width=8, zero_init_residual=True)
    blocks = [module for module in chain.modules() if isinstance(module, models.BasicBlock)]
    assert len(blocks) == 8
    assert all(block.bn2.weight.abs().sum() == 0 for block in blocks)


def test_resnet_rejects_an_unknown_depth() -> None:
    with pytest.raises(ValueError, match="18, 34, 50, 101, 152"):
        models.resnet(42)


def test_resnet_small_is_small_and_classifies_32x32_images() -> None:
    chain = models.resnet_small()
    assert models.count_parameters(chain) < 300_000
    assert chain(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="blocks_per_stage"):
        models.resnet_small(blocks_per_stage=())


# ----------------------------------------------------------------------------- VGG


@pytest.mark.parametrize("depth", [11, 16, 19])
@pytest.mark.parametrize("batch_norm", [False, True], ids=["plain", "bn"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_vgg_matches_reference(depth: int, batch_norm: bool, train: bool) -> None:
    options = dict(batch_norm=batch_norm, width=8, hidden_features=32, image_size=32)
    torch.manual_seed(0)
    original = reference.vgg(depth, 6, **options)
    chain = models.vgg(depth, 6, **options)  # type: ignore[arg-type]
    _assert_same_layout(chain, original)
    _assert_same_function(chain, original, _images(), train=train)


def test_vgg_pools_to_seven_for_imagenet_inputs() -> None:
    chain = models.vgg11(width=8, hidden_features=16)
    avgpool = chain.get_submodule("avgpool")
    first = chain.get_submodule("classifier.0")
    assert isinstance(avgpool, nn.AdaptiveAvgPool2d) and avgpool.output_size == (7, 7)
    assert isinstance(first, models.LinearBlock) and first.linear.in_features == 64 * 7 * 7


def test_vgg_rejects_an_unknown_depth() -> None:
    with pytest.raises(ValueError, match="11, 13, 16, 19"):
        models.vgg(12)


# ----------------------------------------------------------------------------- GPT-2

_GPT = models.GPTConfig(vocab_size=50, n_positions=16, d_model=32, n_heads=4, n_layers=2, dropout=0.1)


def _token_ids() -> Tensor:
    torch.manual_seed(0)
    return torch.randint(0, _GPT.vocab_size, (2, 12))


def _is_tied(chain: nn.Sequential) -> bool:
    head = chain.get_submodule("head")
    embedding = chain.get_submodule("embedding")
    assert isinstance(head, models.LMHead) and isinstance(embedding, models.GPTEmbedding)
    return head.weight is embedding.token.weight


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_gpt2_matches_reference(tie_weights: bool, train: bool) -> None:
    config = dataclasses.replace(_GPT, tie_weights=tie_weights)
    original = reference.GPT(**dataclasses.asdict(config))
    chain = models.gpt2(config)
    _assert_same_layout(chain, original)
    _assert_same_function(chain, original, _token_ids, train=train)


def test_gpt2_tied_head_shares_the_embedding_and_counts_it_once() -> None:
    tied = models.gpt2(_GPT)
    untied = models.gpt2(_GPT, tie_weights=False)
    assert _is_tied(tied) and not _is_tied(untied)
    extra = _GPT.vocab_size * _GPT.d_model
    assert models.count_parameters(untied) - models.count_parameters(tied) == extra
    moved = copy.deepcopy(tied)
    assert _is_tied(moved)


def test_gpt2_stages_and_output_shape() -> None:
    chain = models.gpt2(_GPT, n_layers=3)
    kinds = [type(stage) for stage in _stages(chain)]
    assert kinds == [models.GPTEmbedding] + [models.TransformerBlock] * 3 + [
        nn.LayerNorm,
        models.LMHead,
    ]
    assert chain(_token_ids()).shape == (2, 12, _GPT.vocab_size)


def test_gpt2_rejects_a_sequence_longer_than_its_positions() -> None:
    chain = models.gpt2(_GPT)
    with pytest.raises(ValueError, match="n_positions=16"):
        chain(torch.zeros(1, 17, dtype=torch.long))


def test_gpt2_is_causal() -> None:
    chain = models.gpt2(_GPT).eval()
    ids = _token_ids()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % _GPT.vocab_size
    with torch.no_grad():
        assert torch.equal(chain(ids)[:, :-1], chain(changed)[:, :-1])


def test_gpt2_default_is_gpt2_small() -> None:
    with torch.device("meta"):
        chain = models.gpt2()
    assert models.count_parameters(chain) == 124_439_808


# ----------------------------------------------------------------------------- ViT

_VIT = models.ViTConfig(
    image_size=16,
    patch_size=4,
    num_classes=5,
    d_model=32,
    n_heads=4,
    n_layers=2,
    mlp_dim=64,
    dropout=0.1,
    attention_dropout=0.2,
)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_vit_matches_reference(train: bool) -> None:
    original = reference.ViT(**dataclasses.asdict(_VIT))
    chain = models.vit(_VIT)
    _assert_same_layout(chain, original)
    _assert_same_function(chain, original, _images(size=16), train=train)


def test_vit_default_is_vit_b16() -> None:
    with torch.device("meta"):
        chain = models.vit()
    assert models.count_parameters(chain) == 86_567_656


def test_vit_rejects_a_patch_size_that_does_not_divide_the_image() -> None:
    with pytest.raises(ValueError, match="patch_size"):
        models.vit(_VIT, patch_size=5)


# ----------------------------------------------------------------------------- the rest


def test_mlp_chain_is_uniform() -> None:
    chain = models.mlp_chain(5, 16)
    assert len(chain) == 5
    assert all(type(stage) is models.MLPBlock for stage in chain)
    assert len({tuple(p.shape for p in stage.parameters()) for stage in chain}) == 1
    assert chain(torch.randn(3, 16)).shape == (3, 16)
    with pytest.raises(ValueError):
        models.mlp_chain(0, 16)


def test_convnet_stages_differ_in_shape() -> None:
    chain = models.convnet(width=4)
    x = torch.randn(2, 3, 32, 32)
    shapes = []
    for stage in _stages(chain):
        x = stage(x)
        shapes.append(tuple(x.shape))
    assert len(set(shapes)) >= 5
    assert shapes[-1] == (2, 10)


def test_copy_weights_checks_before_writing() -> None:
    source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    too_few = nn.Sequential(nn.Linear(3, 4))
    wrong_shape = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3))
    before = [p.clone() for p in wrong_shape.parameters()]
    with pytest.raises(ValueError, match="4 parameters"):
        models.copy_weights(source, too_few)
    with pytest.raises(ValueError, match=r"parameter 2 differs: source '1.weight'"):
        models.copy_weights(source, wrong_shape)
    assert all(torch.equal(p, q) for p, q in zip(wrong_shape.parameters(), before, strict=True))


def test_count_parameters_can_skip_frozen_ones() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    assert models.count_parameters(model) == 16 + 10
    assert models.count_parameters(model, trainable_only=True) == 10


# ----------------------------------------------------------------------------- catalogue

_EXPECTED = {
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg16", "vgg19", "gpt2", "vit", "mlp", "convnet", "resnet_small",
    "residual", "encoder_decoder", "unet",
}  # fmt: skip


def test_catalogue_has_the_expected_entries() -> None:
    assert _EXPECTED <= set(models.CATALOGUE)
    for name, spec in models.CATALOGUE.items():
        assert spec.name == name
        assert spec.description
    with pytest.raises(ValueError, match="resnet_small"):
        models.model_spec("resnet1000")
    assert models.model_spec("mlp") is models.CATALOGUE["mlp"]


@pytest.mark.parametrize("name", sorted(models.CATALOGUE))
def test_catalogue_entry_builds_runs_and_trains(name: str) -> None:
    spec = models.CATALOGUE[name]
    torch.manual_seed(0)
    chain = spec.factory()
    inputs, target = spec.make_batch(2, torch.device("cpu"))
    assert all(isinstance(t, Tensor) and t.shape[0] == 2 for t in inputs)
    if not isinstance(chain, nn.Sequential):  # a model with a forward of its own
        loss = spec.loss_fn(chain(*inputs), target)
        loss.backward()
        assert loss.ndim == 0 and torch.isfinite(loss)
        assert all(p.grad is not None for p in chain.parameters())
        assert len(discover_chain(chain, inputs, {})) >= 8
        return
    # Stage by stage, as the planner runs them: one tensor in, one tensor out,
    # and no stage writes to its input.
    x = inputs[0]
    for index, stage in enumerate(_stages(chain)):
        version = x._version
        y = stage(x)
        assert isinstance(y, Tensor), (index, stage)
        assert x._version == version, f"stage {index} ({type(stage).__name__}) wrote its input"
        x = y
    loss = spec.loss_fn(x, target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in chain.parameters())


def test_a_batch_is_made_where_the_model_is_built_unless_told_otherwise() -> None:
    spec = models.CATALOGUE["mlp"]
    with torch.device("meta"):  # stands in for torch.set_default_device("cuda")
        model = spec.factory()
        inputs, target = spec.make_batch(2)
        cpu_inputs, cpu_target = spec.make_batch(2, "cpu")
    assert next(model.parameters()).device.type == "meta"
    assert [t.device.type for t in (*inputs, target)] == ["meta"] * (len(inputs) + 1)
    assert [t.device.type for t in (*cpu_inputs, cpu_target)] == ["cpu"] * (len(cpu_inputs) + 1)


def test_language_model_target_is_the_next_token() -> None:
    spec = models.CATALOGUE["gpt2"]
    (ids,), target = spec.make_batch(3)
    assert torch.equal(target[:, :-1], ids[:, 1:])
    assert (target[:, -1] == -100).all()
