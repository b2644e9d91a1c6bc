"""Blocks whose inputs or weights are not what they were, and torch's transforms around them.

Each case runs plainly and with remat, in both implementations where they apply, and
compares outputs and gradients bit for bit (``torch.equal``); where remat must refuse,
the test checks the error's type and what it says to do. The cases come from peers' test
suites: torch's ``checkpoint_sequential`` over VGG-style features with in-place ReLUs,
its forward-AD and double-backward checks, the composable checkpoint's parity under
``torch.func.functional_call``, and Hugging Face's gradient-checkpointing tests (a layer
called with its key/value cache).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn
from torch.func import functional_call

import remat
from remat import RecomputeInputModified, RematError

MODES = [False, True]


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [t.grad for t in tensors]


def _equal(expected: list[torch.Tensor | None], actual: list[torch.Tensor | None]) -> bool:
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(expected, actual, strict=True)
    )


# NOTE [inputs a block changes itself]
@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("block", [torch.relu_, nn.ReLU(inplace=True)], ids=["relu_", "ReLU(inplace=True)"])
def test_a_block_that_changes_its_input_in_place_is_refused_in_its_forward(
    use_reentrant: bool, block: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    # the reentrant implementation used to hand the input back as itself: ReLU's values
    # with an identity's gradient, silently
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    h = linear(torch.randn(3, 4))
    with pytest.raises(
        RecomputeInputModified, match=r"changed its input 0 in place during its own forward.*inplace=False"
    ):
        remat.recompute(block, h, use_reentrant=use_reentrant)
    assert h._version == 1  # the block ran once; nothing was run again


def _features() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(4, 4), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(4, 4))


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("segments", [2, 3, 4, 7])
def test_sequential_segments_never_start_at_a_module_that_changes_its_input(use_reentrant: bool, segments: int) -> None:
    x0 = torch.randn(3, 4)
    plain = _features()
    x = x0.clone().requires_grad_()
    plain(x).pow(2).sum().backward()
    expected = [*_grads(list(plain.parameters())), x.grad]
    model = _features()
    y = x0.clone().requires_grad_()
    remat.recompute_sequential(model, segments, y, use_reentrant=use_reentrant).pow(2).sum().backward()
    assert _equal(expected, [*_grads(list(model.parameters())), y.grad])


# NOTE [parameters swapped in for a call]
class _First(nn.Module):
    """A linear layer, recomputed from inside the model's forward when `inside` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.inside = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(self.linear, x) if self.inside else self.linear(x)


@pytest.mark.parametrize("how", ["mark", "mark reentrant", "recompute inside"])
def test_functional_call_recomputes_with_the_tensors_it_was_given(how: str) -> None:
    # MAML's fast weights, torch.func ensembles: the module's own tensors are back in their
    # places before the backward, and a recompute used to run with them
    torch.manual_seed(0)
    base = nn.Sequential(_First(), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    names = [name for name, _ in base.named_parameters()]
    given0 = {name: value.detach() * 3 + 0.5 for name, value in base.named_parameters()}
    given0.update({"3.running_mean": torch.full((4,), 0.5), "3.running_var": torch.full((4,), 2.0)})
    x0 = torch.randn(5, 4)

    def step(model: nn.Module) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
        given = {name: value.clone().requires_grad_(name in names) for name, value in given0.items()}
        x = x0.clone().requires_grad_()
        functional_call(model, given, (x,)).pow(3).sum().backward()
        return [x.grad, *(given[name].grad for name in names)], given

    plain = copy.deepcopy(base)
    expected, given_plain = step(plain)
    model = copy.deepcopy(base)
    if how == "recompute inside":
        model[0].inside = True
    else:
        remat.mark(model, use_reentrant=how == "mark reentrant")
    actual, given = step(model)
    assert _equal(expected, actual)
    assert all(p.grad is None for p in model.parameters())  # the module's own weights were not used
    for name in ("3.running_mean", "3.running_var"):  # the statistics given were updated once
        assert torch.equal(given[name], given_plain[name])
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the module's own tensors are back, as plainly


# NOTE [forward-mode tangents of inputs]
@pytest.mark.parametrize("policy", [None, remat.policies.save_matmuls], ids=["whole", "save_matmuls"])
@pytest.mark.parametrize("backward_inside_the_level", [True, False])
def test_dual_inputs_and_a_backward_through_the_same_block(policy: Any, backward_inside_the_level: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)
    x0, tangent0 = torch.randn(3, 4), torch.randn(3, 4)

    def block(v: torch.Tensor) -> torch.Tensor:
        return (v @ weight).sin().exp()

    def run(call: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor | None]:
        weight.grad = None
        x = x0.clone().requires_grad_()
        with forward_ad.dual_level():
            primal, tangent = forward_ad.unpack_dual(call(forward_ad.make_dual(x, tangent0)))
            if backward_inside_the_level:
                primal.sum().backward()
        if not backward_inside_the_level:
            primal.sum().backward()
        return [tangent, weight.grad, x.grad]

    assert _equal(run(block), run(lambda v: remat.recompute(block, v, policy=policy)))


def test_the_reentrant_mode_refuses_a_backward_that_creates_a_graph() -> None:
    # its gradients would have no graph: a gradient penalty through them silently wrong
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    remat.mark(model[2], use_reentrant=True)
    loss = model(torch.randn(3, 4)).pow(2).sum()
    with pytest.raises(RematError, match=r"create_graph=True.*use_reentrant=False"):
        loss.backward(create_graph=True)
    for p in model.parameters():
        p.grad = None
    model(torch.randn(3, 4)).pow(2).sum().backward()  # a plain backward still works
    assert all(p.grad is not None for p in model.parameters())


# NOTE [a layer's key/value cache]
@pytest.mark.parametrize("use_reentrant", MODES)
def test_hugging_face_layers_called_with_their_cache_recompute_without_it(use_reentrant: bool) -> None:
    pytest.importorskip("transformers")
    from remat.models import hugging_face_model

    recompute_module = importlib.import_module("remat.manual.recompute")
    factory, kwargs = hugging_face_model("llama")
    torch.manual_seed(0)
    base = factory().train()
    assert base.config.use_cache
    ids = kwargs["input_ids"]
    plain = copy.deepcopy(base)
    expected = plain(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    model = copy.deepcopy(base)
    remat.apply(model, type(base.model.layers[0]), use_reentrant=use_reentrant)
    recompute_module._LAYER_CACHE_WARNED[0] = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = model(input_ids=ids, labels=ids).loss  # use_cache=True, the config's
        actual.backward()
    assert torch.equal(expected, actual)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert sum("key/value cache" in str(w.message) for w in caught) == 1
    with torch.no_grad():  # without grad nothing is recomputed: the cache is filled as usual
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values is not None or getattr(out, "cache", None) is not None


@pytest.mark.parametrize("options", [{}, {"nested": True}], ids=["stages", "nested"])
def test_functional_call_on_an_enabled_model_recomputes_with_the_tensors_it_was_given(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(5)])
    given0 = {name: value.detach() * 2 + 0.1 for name, value in base.named_parameters()}
    x0 = torch.randn(4, 8)

    def step(model: nn.Module) -> list[torch.Tensor | None]:
        given = {name: value.clone().requires_grad_() for name, value in given0.items()}
        x = x0.clone().requires_grad_()
        functional_call(model, given, (x,)).pow(2).sum().backward()
        return [x.grad, *(given[name].grad for name in given0)]

    expected = step(copy.deepcopy(base))
    model = copy.deepcopy(base)
    control = remat.enable(model, "min", **options)
    for _ in range(2):
        assert _equal(expected, step(model))
    assert control.plan is not None and any(count > 1 for count in control.plan.forward_counts)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("nested", [False, True])
def test_an_optimizer_stepped_in_backward_is_not_refused(nested: bool) -> None:
    # torch's recipe: one optimizer per parameter, stepped from its post-accumulate-grad
    # hook. A replay that stops before the stages whose backward ran (and whose weights
    # were stepped) does not read them: NOTE [parameters changed before the recompute]
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])
    model = copy.deepcopy(plain)
    control = remat.enable(model, "min", nested=nested)
    for net in (plain, model):
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in net.parameters()}
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(lambda p, optimizers=optimizers: optimizers[p].step())
    x = torch.randn(4, 16)
    for _ in range(2):
        plain(x).square().mean().backward()
        model(x).square().mean().backward()
    assert control.plan is not None and max(control.plan.forward_counts) > 2
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_parameter_stepped_before_the_recompute_reads_it_is_still_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    remat.enable(model, "min")
    x = torch.randn(4, 16)
    model(x).square().mean().backward()  # measured and planned
    loss = model(x).square().mean()
    with torch.no_grad():
        model[2][0].weight.add_(1.0)  # a GAN's step between the forward and the backward (a weight it saves)
    with pytest.raises(RecomputeInputModified, match="between its forward and its backward"):
        loss.backward()


class _FrozenBackbone(nn.Module):
    """A feature extractor the forward runs under no_grad, then trainable blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.backbone(x)
        return self.blocks(x)


def test_stages_the_forward_runs_without_grad_are_replayed_without_grad() -> None:
    torch.manual_seed(0)
    plain = _FrozenBackbone()
    model = copy.deepcopy(plain)
    control = remat.enable(model, "min")
    x = torch.randn(8, 16)
    for _ in range(2):
        plain(x).square().mean().backward()
        model(x).square().mean().backward()
    assert control.plan is not None and control.plan.forward_counts[0] > 1  # the backbone is replayed
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


class _Reshaping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x.reshape(x.shape[0] * x.shape[1], -1))  # a copy when x is not contiguous


def test_an_input_of_the_same_shape_with_other_strides_is_planned_for_itself() -> None:
    torch.manual_seed(0)
    model = _Reshaping()
    control = remat.enable(model, "min", loss_fn=lambda out: out.square().mean(), output_kept=False)
    for x in (torch.randn(8, 32, 16), torch.randn(32, 8, 16).transpose(0, 1), torch.randn(8, 32, 16)):
        with remat.MemoryTracker() as tracker:
            model(x).square().mean().backward()
        assert control.plan is not None
        assert tracker.peak_bytes <= control.plan.budget_bytes, x.is_contiguous()
    assert control.measure_counts["timed"] == 2  # the transposed input was measured


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    note: str = "plain dataclass"


class _DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.blocks(x))


@pytest.mark.parametrize("with_loss_fn", [False, True])
def test_a_model_returning_a_plain_dataclass_is_measured_and_trained(with_loss_fn: bool) -> None:
    # measuring used to see no tensor in it (no default loss), and to probe the loss on the
    # very output of its run (autograd: "backward through the graph a second time")
    torch.manual_seed(0)
    plain = _DataclassModel()
    model = copy.deepcopy(plain)
    options = {"loss_fn": lambda out: out.logits.square().mean()} if with_loss_fn else {}
    control = remat.enable(model, 0.5, **options)
    x = torch.randn(32, 16)
    for _ in range(2):
        expected = plain(x).logits.square().mean()
        expected.backward()
        with remat.MemoryTracker() as tracker:
            actual = model(x).logits.square().mean()
            actual.backward()
        assert torch.equal(expected, actual)
        assert control.plan is not None and tracker.peak_bytes <= control.plan.budget_bytes
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _Logging(nn.Module):
    """A block that keeps its hidden activation for a plot: held past the step."""

    def __init__(self, where: str = "public") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 128), nn.Linear(128, 16)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(x))
        if self.where == "public":
            self.last = h.detach()
        elif self.where == "private":
            self._last = h.detach()
        else:
            self.stats = {"hidden": (h.detach(),)}
        return x + self.b(h)


def _legacy_spectral() -> nn.Module:
    return nn.Sequential(
        *[
            nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(64, 64)), nn.Tanh())  # noqa: TID251
            for _ in range(6)
        ]
    )


# NOTE [tensors kept in attributes]
@pytest.mark.parametrize("measure", ["sized", "estimated"])
@pytest.mark.parametrize("budget", ["min", 0.8])
@pytest.mark.parametrize("make", ["public", "private", "in a dict", "legacy spectral_norm"])
def test_tensors_a_forward_keeps_in_attributes_are_planned_for(measure: str, budget: Any, make: str) -> None:
    torch.manual_seed(0)
    logging = make != "legacy spectral_norm"
    plain = nn.Sequential(*[_Logging(make) for _ in range(6)]) if logging else _legacy_spectral()
    model = copy.deepcopy(plain)
    control = remat.enable(model, budget, measure=measure)
    width = 16 if logging else 64
    for _ in range(3):
        x = torch.randn(64, width)
        torch.manual_seed(1)
        plain(x).square().mean().backward()
        torch.manual_seed(1)
        with remat.MemoryTracker() as tracker:
            model(x).square().mean().backward()
        assert control.plan is not None and tracker.peak_bytes <= control.plan.budget_bytes
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain.buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b)


def test_a_budget_of_one_fits_a_model_that_trains_its_head_only() -> None:
    # linear probing: the frozen part saves nothing, and measuring's pass over it holds more
    # than the plain step; a fraction is of the larger of the two, so 1.0 always fits
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)],
        nn.Linear(64, 1),
    )
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("4."))
    plain = copy.deepcopy(model)
    control = remat.enable(model, 1.0)
    x = torch.randn(256, 64)
    for _ in range(2):
        plain(x).square().mean().backward()
        with remat.MemoryTracker() as tracker:
            model(x).square().mean().backward()
        assert control.plan is not None and tracker.peak_bytes <= control.plan.budget_bytes
        assert max(control.plan.forward_counts) == 1
    assert torch.equal(plain[4].weight.grad, model[4].weight.grad)


class _Sequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remat.recompute_sequential(self.layers, 2, x)


def test_functional_call_reaches_the_segments_of_recompute_sequential() -> None:
    torch.manual_seed(0)
    model = _Sequential()
    given = {name: (value.detach() * 2 + 0.3).requires_grad_() for name, value in model.named_parameters()}
    x0 = torch.randn(3, 4)
    expected_x = x0.clone().requires_grad_()
    functional_call(model.layers, given_plain := {k[len("layers.") :]: v for k, v in given.items()}, (expected_x,))
    plain_given = {k: v.detach().clone().requires_grad_() for k, v in given_plain.items()}
    xp = x0.clone().requires_grad_()
    functional_call(model.layers, plain_given, (xp,)).pow(3).sum().backward()
    x = x0.clone().requires_grad_()
    functional_call(model, given, (x,)).pow(3).sum().backward()
    assert torch.equal(x.grad, xp.grad)
    for name, value in given.items():
        assert torch.equal(value.grad, plain_given[name[len("layers.") :]].grad), name
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("training", [True, False])
def test_a_gpt2_block_gets_its_cache_by_position_and_runs_without_it(use_reentrant: bool, training: bool) -> None:
    # GPT-2's model passes the cache second, by position; in eval mode with grad on remat
    # recomputes too, where Hugging Face never checkpoints
    pytest.importorskip("transformers")
    from remat.models import hugging_face_model

    factory, kwargs = hugging_face_model("gpt2")
    torch.manual_seed(0)
    base = factory().train(training)
    ids = kwargs["input_ids"]
    plain = copy.deepcopy(base)
    torch.manual_seed(1)
    expected = plain(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    model = copy.deepcopy(base)
    remat.apply(model, type(base.transformer.h[0]), use_reentrant=use_reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        actual = model(input_ids=ids, labels=ids).loss  # the config's use_cache=True
        actual.backward()
    assert torch.equal(expected, actual)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _InferenceBackbone(_FrozenBackbone):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            x = self.backbone(x)
        return self.blocks(x.clone())


def test_a_stage_run_under_inference_mode_is_refused_with_what_to_do() -> None:
    model = _InferenceBackbone()
    remat.enable(model, "min")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(remat.UnsupportedModel, match=r"inference_mode.*torch.no_grad\(\)"):
        model(torch.randn(8, 16))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("budget", ["min", 0.5])
def test_a_dataclass_inside_a_tuple_is_sized_with_its_tensors(budget: Any) -> None:
    # the loss allowance and the default loss used to see only the tensors beside it
    class Model(_DataclassModel):
        def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
            out = super().forward(x)
            return (out, out.logits.sum(-1))

    torch.manual_seed(0)
    plain = Model()
    model = copy.deepcopy(plain)
    control = remat.enable(model, budget)
    x = torch.randn(64, 16)
    for _ in range(2):
        out, aux = plain(x)
        (out.logits.pow(2).mean() + aux.mean()).backward()
        with remat.MemoryTracker() as tracker:
            out, aux = model(x)
            (out.logits.pow(2).mean() + aux.mean()).backward()
            del out, aux
        assert control.plan is not None and tracker.peak_bytes <= control.plan.budget_bytes
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _ClippedBlock(nn.Module):
    """A block whose forward hooks an activation's gradient (clipping it, counting calls)."""

    calls = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        h.register_hook(self._clipped)
        return x + h

    @classmethod
    def _clipped(cls, grad: torch.Tensor) -> torch.Tensor:
        cls.calls += 1
        return grad.clamp(-1e-3, 1e-3)


@pytest.mark.parametrize("budget", [0.5, "min"])
def test_a_forward_that_hooks_an_activations_gradient_is_measured_and_trains_exactly(budget: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(_ClippedBlock(32) for _ in range(5)), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    own = torch.Tensor.register_hook
    enabled = remat.enable(model, budget)
    x = torch.randn(16, 8, 32)
    for _ in range(2):
        with enabled.check_step() as check:
            model(x).square().mean().backward()
        assert check.within_budget, check
        _ClippedBlock.calls = 0
        reference(x).square().mean().backward()
        assert _ClippedBlock.calls == 5
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
        model.zero_grad(), reference.zero_grad()
    _ClippedBlock.calls = 0
    model(x).square().mean().backward()  # planned: each hook runs once, on the first forward's activation
    assert _ClippedBlock.calls == 5
    assert torch.Tensor.register_hook is own
    with torch.no_grad(), pytest.raises(RuntimeError, match="doesn't require gradient"):
        torch.ones(1).register_hook(lambda g: g)  # torch's own behaviour is back
