"""The budget holds on every step, the first one (which measures) included.

Every step below runs under the exact tracker from before the first call, so the first
step's figure includes measuring: the stages sized on fake tensors, then timed one planned
stage at a time. Measured peaks are compared with the budget (never above) and with the
plan's prediction (never more than 1% above it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reference_models
import remat
from remat.models import CATALOGUE
from remat.plan import Plan

FRACTIONS = tuple(round(0.1 * k, 1) for k in range(1, 11))
ZOO_BATCHES = {"mlp": 16, "convnet": 4, "resnet_small": 4, "vgg11": 2, "gpt2": 2, "vit": 4}


def _precision(precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def train_steps(
    model: nn.Module,
    budget: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    precision: str,
    steps: int = 2,
) -> tuple[list[int], remat.Checkpointable] | None:
    """Each step's exact peak (None when the budget is infeasible)."""
    # the loop drops the output once the loss is computed: output_kept=False is exact
    wrapped = remat.Checkpointable(model, budget, loss_fn=loss_fn, output_kept=False)
    peaks = []
    for _ in range(steps):
        with remat.MemoryTracker() as tracker:
            try:
                with _precision(precision):
                    loss = loss_fn(wrapped(*args, **kwargs))
            except remat.BudgetTooSmall as error:
                assert error.minimum_bytes > error.budget_bytes
                # refused before anything ran, or after a measuring that stayed within the
                # budget found a figure the fake sizes missed (NOTE [suffix on real tensors])
                assert tracker.peak_bytes <= error.budget_bytes
                return None
            loss.backward()
            del loss
        peaks.append(tracker.peak_bytes)
        model.zero_grad(set_to_none=True)
    return peaks, wrapped


#: The least measured / predicted peak: the prediction errs on the safe side by at most
#: 5%, under autocast too (its casts are followed where they live).
LEAST_RATIO = {"fp32": 0.95, "bf16": 0.95}


def fits_its_prediction(
    model: nn.Module, budget: Any, args: tuple[Any, ...], loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[remat.Checkpointable, Plan]:
    """Two fp32 steps: both within the budget, the second at or up to 5% below its prediction."""
    outcome = train_steps(model, budget, args, {}, loss_fn, "fp32")
    assert outcome is not None
    peaks, wrapped = outcome
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes <= peaks[1] * 1.05
    return wrapped, plan


def check_budget_matrix(
    factory: Callable[[], nn.Module],
    args: Any,
    kwargs: Any,
    loss_fn: Any,
    precision: str,
    fractions: tuple[float, ...] = FRACTIONS,
) -> int:
    """Trains at every fraction; returns how many were feasible."""
    feasible = 0
    for fraction in fractions:
        torch.manual_seed(0)
        outcome = train_steps(factory().train(), fraction, args, kwargs, loss_fn, precision)
        if outcome is None:
            continue
        feasible += 1
        peaks, wrapped = outcome
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None
        for step, peak in enumerate(peaks):
            assert peak <= plan.budget_bytes, f"{fraction}: step {step} peaked at {peak} B over {plan.budget_bytes} B"
            # (the first step measures too, which may use the whole budget)
            if step > 0:
                ratio = peak / plan.predicted_peak_bytes
                assert LEAST_RATIO[precision] <= ratio <= 1.01, (
                    f"{fraction}: step {step} at x{ratio:.3f} the prediction"
                )
    return feasible


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ZOO_BATCHES))
def test_the_budget_holds_on_every_step_across_the_zoo(name: str, precision: str) -> None:
    spec = CATALOGUE[name]
    torch.manual_seed(0)
    inputs, target = spec.make_batch(ZOO_BATCHES[name])
    feasible = check_budget_matrix(spec.factory, inputs, {}, lambda output: spec.loss_fn(output, target), precision)
    assert feasible >= 1  # 100% always fits


def hugging_face(
    name: str, smaller: dict[str, int] | None = None
) -> tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any]]:
    """A Hugging Face model with its default configuration (12 layers, tied embeddings), or
    with the ``smaller`` entries changed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(**(smaller or {}))
        tokens = torch.randint(0, config.vocab_size, (2, 128))
        return lambda: transformers.GPT2LMHeadModel(config), (tokens,), {"labels": tokens, "use_cache": False}
    config = transformers.BertConfig(**(smaller or {}))
    tokens = torch.randint(0, config.vocab_size, (4 if smaller is None else 2, 128))
    return lambda: transformers.BertForMaskedLM(config), (tokens,), {"labels": tokens}


#: bf16 runs several times slower than fp32 on CPUs without bf16 units: the bf16 cases keep
#: the default widths and tied embeddings, with half the layers and a smaller vocabulary.
SMALLER_BF16 = {"gpt2": {"n_layer": 6, "vocab_size": 8192}, "bert": {"num_hidden_layers": 6, "vocab_size": 8192}}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "precision", "fractions"), [
    ("gpt2", "fp32", (0.5, 0.7)), ("gpt2", "bf16", (0.9,)), ("bert", "fp32", (0.5,)), ("bert", "bf16", (0.9,)),
])  # fmt: skip
def test_the_budget_holds_for_hugging_face_default_configs(
    name: str, precision: str, fractions: tuple[float, ...]
) -> None:
    # The whole matrix, 10% to 100%, is benchmarks/budget_matrix.py.
    factory, args, kwargs = hugging_face(name, SMALLER_BF16[name] if precision == "bf16" else None)
    feasible = check_budget_matrix(factory, args, kwargs, lambda output: output.loss, precision, fractions)
    assert feasible == len(fractions) or name == "gpt2" and feasible >= 1


def test_the_measuring_step_times_backwards_within_the_budget_the_plan_gets() -> None:
    # Without a loss_fn, the sizing step finds the loss the output carries. The timing pass
    # then decided which backwards fit with a budget counted from a loss allowance the plan
    # does not have (a fraction of a larger reference): the first step went over the plan's
    # budget by 8% (an attention's backward, timed though it did not fit).
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 64))
    model = transformers.BertForMaskedLM(config).train()
    wrapped = remat.Checkpointable(model, 0.3, output_kept=False, nested=True)
    peaks = []
    for _ in range(2):
        with remat.MemoryTracker() as tracker:
            wrapped(input_ids=tokens, labels=tokens).loss.backward()
        peaks.append(tracker.peak_bytes)
        model.zero_grad(set_to_none=True)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes


def test_a_budget_no_schedule_fits_is_refused_before_anything_runs() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=6, width=16)
    x = torch.randn(8, 16)
    with remat.MemoryTracker() as tracker, pytest.raises(remat.BudgetTooSmall) as error:
        remat.Checkpointable(model, "100B")(x).sum().backward()
    assert tracker.peak_bytes == 0
    assert error.value.minimum_bytes > 100 and str(error.value.minimum_bytes) in str(error.value)


def test_the_first_step_fits_where_a_plain_measuring_step_did_not() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=8, width=64)
    x = torch.randn(32, 64)
    plain = remat.Checkpointable(model, 0.3, measure="plain")
    with remat.MemoryTracker() as tracker:
        plain(x).sum().backward()
    assert plain.plan is not None and plain.plan.budget_bytes is not None
    assert tracker.peak_bytes > plain.plan.budget_bytes  # the old way: a plain step first
    model.zero_grad(set_to_none=True)
    sized = remat.Checkpointable(model, 0.3)
    with remat.MemoryTracker() as tracker:
        sized(x).sum().backward()
    assert sized.plan is not None and sized.plan.budget_bytes is not None
    assert tracker.peak_bytes <= sized.plan.budget_bytes
    # the same sizes either way, to the byte
    assert sized.plan.schedule.profile.activation_bytes == plain.plan.schedule.profile.activation_bytes


def test_the_step_check_reports_the_measured_and_predicted_peaks(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=6, width=32)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    wrapped = remat.Checkpointable(model, 0.5, loss_fn=lambda out: torch.nn.functional.mse_loss(out, y))
    with caplog.at_level("INFO", logger="remat"):
        for _ in range(2):
            with wrapped.check_step() as check:
                torch.nn.functional.mse_loss(wrapped(x), y).backward()
            with remat.MemoryTracker() as tracker:  # the same step, tracked independently
                torch.nn.functional.mse_loss(wrapped(x), y).backward()
    assert wrapped.plan is not None
    assert check.predicted_peak_bytes == wrapped.plan.predicted_peak_bytes
    assert check.budget_bytes == wrapped.plan.budget_bytes and check.within_budget
    assert check.measured_peak_bytes == tracker.peak_bytes
    assert check.ratio is not None and 0.95 <= check.ratio <= 1.0
    assert sum("remat step check" in record.message for record in caplog.records) == 2


def test_the_step_check_warns_over_the_budget() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=6, width=32)
    x = torch.randn(16, 32)
    wrapped = remat.Checkpointable(model, 0.5)
    wrapped(x).sum().backward()
    assert wrapped.plan is not None
    with pytest.warns(RuntimeWarning, match="went over its budget"), wrapped.check_step() as check:
        wrapped(x).sum().backward()
        hog = torch.empty(wrapped.plan.budget_bytes // 4 + 1)  # the caller's own memory on top
        del hog
    assert not check.within_budget


def test_one_instance_whose_budget_changes_between_steps_holds_each() -> None:
    spec = CATALOGUE["resnet_small"]
    torch.manual_seed(0)
    inputs, target = spec.make_batch(4)
    model = spec.factory().train()
    wrapped = remat.Checkpointable(model, 1.0, loss_fn=lambda output: spec.loss_fn(output, target))
    for fraction in (1.0, 0.6, 0.8, 0.55, 0.7, 1.0, 0.6):
        wrapped.mem_limit = fraction
        with remat.MemoryTracker() as tracker:
            spec.loss_fn(wrapped(*inputs), target).backward()
        model.zero_grad(set_to_none=True)
        assert wrapped.plan is not None and wrapped.plan.budget_bytes is not None
        assert tracker.peak_bytes <= wrapped.plan.budget_bytes, fraction


def _tracked(wrapped: remat.Checkpointable, step: Callable[[], None]) -> tuple[int, int]:
    """The exact peak of one training step, and the budget of the plan it ran."""
    with remat.MemoryTracker() as tracker:
        step()
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    return tracker.peak_bytes, plan.budget_bytes


def test_a_retained_backward_is_refused_where_the_chain_recomputes() -> None:
    # NOTE [retained graphs]: a retained graph keeps the stored stages' activations
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.2)) for _ in range(8)))
    x = torch.randn(32, 64)
    wrapped = remat.Checkpointable(model, 0.4)
    wrapped(x).sum().backward()  # measures and plans
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
    model.zero_grad(set_to_none=True)
    loss = wrapped(x).square().sum()
    with pytest.raises(remat.RematError, match="retain_graph=True"):
        loss.backward(retain_graph=True)
    assert all(parameter.grad is None for parameter in model.parameters())  # refused before any
    x_penalised = x.clone().requires_grad_(True)  # a gradient penalty keeps the graph too, and is told how
    with pytest.raises(remat.RematError, match=r"create_graph=True\) for a gradient penalty.*remat.mark"):
        torch.autograd.grad(wrapped(x_penalised).square().sum(), x_penalised, create_graph=True)
    # with no recompute planned, a retained graph is plain autograd's: allowed, and exact
    model.zero_grad(set_to_none=True)
    plain_model = copy.deepcopy(model)
    wrapped.mem_limit = 1.0
    for module in (wrapped, plain_model):
        torch.manual_seed(2)
        loss = module(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, expected), actual in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert expected.grad is not None and torch.equal(expected.grad, actual.grad), name


@pytest.mark.parametrize("change", ["unfreeze", "autocast on", "autocast off", "double"])
def test_a_change_after_a_plan_was_cached_is_planned_within_the_budget(change: str) -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=8, width=64)
    x = torch.randn(32, 64)
    if change == "unfreeze":
        model.requires_grad_(False)
        model[-1].requires_grad_(True)
    wrapped = remat.Checkpointable(model, "800KiB")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    before = autocast if change == "autocast off" else contextlib.nullcontext()
    after = autocast if change == "autocast on" else contextlib.nullcontext()

    def step(context: contextlib.AbstractContextManager[Any]) -> None:
        with context:
            out = wrapped(x)
        out.float().sum().backward()

    for _ in range(2):
        peak, budget = _tracked(wrapped, lambda: step(before))
        assert peak <= budget
    if change == "unfreeze":
        model.requires_grad_(True)
    elif change == "double":
        model.double()
        x = x.double()
    first = wrapped.plan
    for _ in range(2):
        peak, budget = _tracked(wrapped, lambda: step(after))
        assert peak <= budget, change
        assert wrapped.plan is not first
        model.zero_grad(set_to_none=True)


class MarkedBlock(nn.Module):
    """A stage whose inner part the user marked for recompute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = remat.mark(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x))


class InPlaceScale(nn.Module):
    """In-place operations that keep nothing for their backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(0.5).add_(1.0)


@pytest.mark.parametrize("case", ["marks inside stages", "in-place chains"])
@pytest.mark.parametrize("budget", ["min", 0.9])
def test_marked_regions_and_in_place_chains_are_planned(case: str, budget: Any) -> None:
    torch.manual_seed(0)
    width = 32
    layers: list[nn.Module] = []
    for _ in range(5):
        if case == "marks inside stages":
            layers.append(MarkedBlock(width))
        else:
            layers += [nn.Linear(width, width), InPlaceScale(), InPlaceScale(), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers)
    plain_model = copy.deepcopy(model)
    x, y = torch.randn(16, width), torch.randn(16, width)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, y)

    wrapped = remat.Checkpointable(model, budget, loss_fn=loss_fn)
    for step in range(2):
        peak, limit = _tracked(wrapped, lambda: loss_fn(wrapped(x)).backward())
        assert peak <= limit, f"step {step}"
        plan = wrapped.plan
        assert plan is not None
        if step > 0:
            assert peak <= plan.predicted_peak_bytes, f"step {step}: above the prediction"
    loss_fn(plain_model(x)).backward()
    loss_fn(plain_model(x)).backward()
    for (name, expected), actual in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(expected.grad, actual.grad), name


def test_the_old_frugal_flag_measures_within_the_budget() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=8, width=64)
    x = torch.randn(32, 64)
    with pytest.warns(DeprecationWarning, match="frugal_measure is deprecated"):
        wrapped = remat.Checkpointable(model, 0.3, frugal_measure=True)
    assert wrapped.measure_mode == "sized" and wrapped.frugal_measure
    peak, budget = _tracked(wrapped, lambda: wrapped(x).sum().backward())
    assert peak <= budget
    # the segment-recompute measurement it used to select is measure="frugal", whose
    # measuring step keeps its spans' inputs and one span's saved tensors, whatever the
    # budget: at the smallest one it goes over
    model.zero_grad(set_to_none=True)
    frugal = remat.Checkpointable(model, "min", measure="frugal")
    peak, budget = _tracked(frugal, lambda: frugal(x).sum().backward())
    assert peak > budget


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nothing in the block saves x itself: a schedule frees it after the block
        return x + torch.tanh(self.linear(x * 0.5))


def _nested_model(width: int, *, nested: bool) -> nn.Module:
    blocks = [ResidualBlock(width) for _ in range(6)]
    body: list[nn.Module] = [nn.Sequential(*blocks)] if nested else blocks
    return nn.Sequential(nn.Linear(width, width), *body, nn.Linear(width, width))


def test_inputs_the_model_holds_are_found() -> None:
    """A container's input stays referenced by its call until its last block returns."""
    width = 64
    x = torch.randn(32, width)
    for nested, expected in ((False, []), (True, [(1, 6)])):
        torch.manual_seed(0)
        wrapped = remat.Checkpointable(_nested_model(width, nested=nested), 0.6, loss_fn=lambda out: out.sum())
        held = wrapped.measure(x).held_inputs()
        assert [(h.stage, h.until) for h in held] == expected
        assert all(h.nbytes == x.numel() * 4 and h.is_stage_input and not h.kept_by_stage for h in held)


def test_inputs_the_model_holds_are_planned_where_they_live() -> None:
    """The zoo's ViT runs its blocks in an nn.Sequential: under autocast, whose casts put the
    step's peak at the end of the forward, a schedule that discards the first block's input
    used to be predicted below the measured peak."""
    spec = CATALOGUE["vit"]
    inputs, target = spec.make_batch(ZOO_BATCHES["vit"] * 2)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return spec.loss_fn(out, target)

    underestimated = 0
    for fraction in (0.4, 0.5):
        torch.manual_seed(0)
        outcome = train_steps(spec.factory().train(), fraction, inputs, {}, loss_fn, "bf16")
        assert outcome is not None
        peaks, wrapped = outcome
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None and plan.measurement is not None
        assert [h.stage for h in plan.measurement.held_inputs()] == [1]
        assert max(peaks) <= plan.budget_bytes
        assert 0.99 <= peaks[1] / plan.predicted_peak_bytes <= 1.001, fraction
        without = dataclasses.replace(plan.budget, held_inputs=()).chain_phase_peak_bytes(plan.schedule.simulation)
        underestimated += without < peaks[1]
    assert underestimated, "no plan discarded the held input: the case tests nothing"


def _blocks_in_a_sequential() -> nn.Module:
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64), nn.LayerNorm(64))

    return nn.Sequential(*(block() for _ in range(4)))


@pytest.mark.parametrize("fraction", [0.3, 0.4, 0.45, 0.9])
def test_blocks_in_a_sequential_are_predicted_to_the_byte(fraction: float) -> None:
    """Blocks in an nn.Sequential are flattened to one stage per layer, and the outer call
    holds each block's input until the block returns. A loop that drops the output once
    the loss is computed is predicted to the byte with ``output_kept=False``; a loop that
    keeps it (``out = model(x)``) holds it through the backward, which only the default
    ``output_kept=True`` counts: with False, such a loop went over the budget by the
    output's bytes, at the budgets whose peak is in the backward."""
    x = torch.randn(128, 64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    torch.manual_seed(0)
    outcome = train_steps(_blocks_in_a_sequential().train(), fraction, (x,), {}, loss_fn, "fp32")
    assert outcome is not None
    peaks, wrapped = outcome
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert len(plan.schedule.profile.names) == 20
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] == plan.predicted_peak_bytes

    torch.manual_seed(0)
    model = _blocks_in_a_sequential().train()
    kept = remat.Checkpointable(model, fraction, loss_fn=loss_fn)  # output_kept=True
    for _ in range(2):

        def step() -> None:
            out = kept(x)
            loss_fn(out).backward()

        peak, budget = _tracked(kept, step)
        model.zero_grad(set_to_none=True)
        assert peak <= budget
    assert kept.plan is not None
    # the prediction counts the kept output during the loss too, where it is the chain's output
    assert 0 <= kept.plan.predicted_peak_bytes - peak <= x.numel() * 4


class _CarriesItsLoss(nn.Module):
    """Returns its loss in a mapping with its output, as a Hugging Face model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _blocks_in_a_sequential()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.blocks(x)
        return {"loss": F.mse_loss(out, target), "logits": out}


@pytest.mark.parametrize("fraction", [0.3, 0.45, 0.9])
def test_the_loss_an_output_carries_is_held_through_the_backward(fraction: float) -> None:
    # the loop drops the output but keeps its loss for the backward: it is predicted from
    # the loss on (it was left out as part of the output, four bytes over the prediction)
    x, target = torch.randn(128, 64), torch.randn(128, 64)
    torch.manual_seed(0)
    # exact for most plans; the plan depends on the measured times, and one of them, which
    # the machine's load can give at 0.45, is predicted 31,744 B (4%) high: the safe side
    fits_its_prediction(_CarriesItsLoss().train(), fraction, (x, target), lambda out: out["loss"])


def test_a_backward_inside_autocast_is_warned_about() -> None:
    torch.manual_seed(0)
    model = remat.models.mlp_chain(depth=6, width=32)
    x = torch.randn(8, 32)
    wrapped = remat.Checkpointable(model, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = wrapped(x).float().sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.backward()  # outside the region: as planned
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = wrapped(x).float().sum()
        with pytest.warns(RuntimeWarning, match="backward runs inside torch.autocast"):
            loss.backward()


def test_measuring_fits_the_smallest_budget() -> None:
    """The timing pass runs on aliases of inputs the model leaves alone (a copy costs an
    input's bytes), after what the loss probe left in reference cycles is collected."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)))
    x = torch.randn(64, 16)
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: out.square().mean(), output_kept=False)
    with remat.MemoryTracker() as tracker:
        wrapped.measure(x)
    assert tracker.peak_bytes <= wrapped.minimum_budget_bytes()
    for _ in range(2):
        peak, limit = _tracked(wrapped, lambda: wrapped(x).square().mean().backward())
        assert peak <= limit
        model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_the_smallest_budget_holds_where_the_loss_sets_it() -> None:
    """HF GPT-2 keeps its token embedding to the end of the forward; it dies in the loss of a
    plain step, but a region that starts the chain keeps it (its glue adds it) through the
    loss, which the smallest budget's plan must count there."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=256, n_head=4, vocab_size=8192, n_positions=512)
    model = transformers.GPT2LMHeadModel(config).train()
    tokens = torch.randint(0, config.vocab_size, (4, 512))
    batch = {"input_ids": tokens, "labels": tokens, "use_cache": False}
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: out.loss, output_kept=False)
    wrapped(**batch).loss.backward()
    wrapped.zero_grad(set_to_none=True)
    with remat.MemoryTracker() as tracker:
        wrapped(**batch).loss.backward()
    assert tracker.peak_bytes <= wrapped.plan.budget_bytes
    assert wrapped.plan.predicted_peak_bytes - tracker.peak_bytes <= 0.01 * tracker.peak_bytes


class _ResidualTanh(nn.Module):
    """`x = x + block(x)` over blocks ending in a tanh (which saves its output), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32), nn.Tanh()) for _ in range(4)
        )
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("nested", [False, True])
def test_an_output_its_own_stage_saves_is_counted_once(nested: bool) -> None:
    # NOTE [outputs their own stage saves]: each block's tanh output escapes to the residual
    # addition and stays alive only because the tanh saved it; it was also counted as held
    # outside the chain, 8 KiB over every prediction
    x, y = torch.randn(16, 32), torch.randn(16, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out - y).pow(2).mean()

    for budget in (1.0, 0.7, "min"):
        torch.manual_seed(0)
        wrapped = remat.Checkpointable(_ResidualTanh(), budget, loss_fn=loss_fn, output_kept=False, nested=nested)
        for _ in range(2):
            loss_fn(wrapped(x)).backward()
        with remat.MemoryTracker() as tracker:
            loss_fn(wrapped(x)).backward()
        assert wrapped.plan is not None
        assert tracker.peak_bytes == wrapped.plan.predicted_peak_bytes <= wrapped.plan.budget_bytes, budget


@pytest.mark.parametrize("kind", ["add after", "post-norm"])
def test_a_gradient_passed_through_inside_a_group_is_held_until_it_dies(kind: str) -> None:
    # NOTE [gradients passed through inside a group]: a dropout at p=0 returns its input, so
    # the residual stream's gradient passes through it and waits for the block's first stage;
    # it was counted nowhere (the step went a block's output over the smallest budget)
    torch.manual_seed(0)
    model = remat.models.ResidualLoop(kind, n=4, width=32, features=16).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    x = torch.randn(4, 16, 16)
    with torch.no_grad():
        target = torch.randn_like(model(x))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    for budget in ("min", 0.8):
        wrapped = remat.Checkpointable(copy.deepcopy(model), budget, loss_fn=loss_fn, output_kept=False, nested=True)
        for _ in range(2):
            loss_fn(wrapped(x)).backward()
        with remat.MemoryTracker() as tracker:
            loss_fn(wrapped(x)).backward()
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None
        assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes, budget


class _BiasedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.fc(hidden)) * bias  # saves the bias for its backward


class _SideInputModel(nn.Module):
    """A BLOOM-shaped model: a bias made once after the embedding's norm (as ALiBi is), given
    to every block, which saves it."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(_BiasedBlock(width) for _ in range(depth))
        self.head = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(x))
        bias = torch.sigmoid(x.mean(-1, keepdim=True)).expand_as(x).contiguous()
        for block in self.blocks:
            hidden = block(hidden, bias)
        return self.head(hidden)


@pytest.mark.parametrize("budget", ["min", 0.5, 0.7])
def test_a_side_input_later_stages_keep_is_counted_with_them(budget: Any) -> None:
    """NOTE [side inputs kept by later stages]: when the first block is recomputed, the bias
    it took lives on in the blocks after it that are stored (they save it), past the forward."""
    torch.manual_seed(0)
    model = _SideInputModel().train()
    reference = copy.deepcopy(model)
    x = torch.randn(128, 64)
    reference(x).square().mean().backward()
    wrapped, plan = fits_its_prediction(model, budget, (x,), lambda out: out.square().mean())
    (held,) = [h for h in plan.budget.held_inputs if h.later_takers]
    assert held.later_bytes == x.numel() * 4 and held.later_savers == held.later_takers
    wrapped(x).square().mean().backward()  # (the steps' gradients were zeroed: once more, planned)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("nested", [False, True])
def test_the_minimum_a_budget_is_refused_with_is_planned_within(nested: bool) -> None:
    """The minimum named when a budget is refused (before anything runs) counts what the
    model holds between stages and the timing pass's own peak, as the plan does: asking for
    it plans, and "min" plans within it."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return _SideInputModel()

    x = torch.randn(128, 64)

    def plan(budget: Any) -> int:
        wrapped = remat.Checkpointable(model(), budget, loss_fn=lambda out: out.square().mean(), nested=nested)
        wrapped(x).square().mean().backward()
        assert wrapped.plan is not None and wrapped.plan.budget_bytes is not None
        return wrapped.plan.budget_bytes

    with pytest.raises(remat.BudgetTooSmall) as error:
        plan(0.05)
    assert plan(error.value.minimum_bytes) == error.value.minimum_bytes == plan("min")


class _LossModuleLast(nn.Module):
    """A head whose loss module is called among its layers (the chain's last stage), its loss
    returned with the logits, as DistilBERT's masked-LM head does."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.second = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.project = nn.Linear(256, 64)
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.project(self.norm(self.second(self.act(self.first(x)))))
        return {"loss": self.loss_fct(logits, target), "logits": logits}


@pytest.mark.parametrize("loss", ["cross entropy", "mean square"])
def test_a_loss_computed_by_the_last_stage_is_held_through_the_backward(loss: str) -> None:
    """And a mean square loss holds its elementwise buffer (NOTE [losses that keep
    their buffer] in remat.storages), which its fake counterpart does not."""
    x = torch.randn(128, 64)
    target = torch.randint(0, 64, (128,)) if loss == "cross entropy" else torch.randn(128, 64)
    torch.manual_seed(0)
    model = _LossModuleLast().train()
    if loss == "mean square":
        model.loss_fct = nn.MSELoss()
    _, plan = fits_its_prediction(model, "min", (x, target), lambda out: out["loss"])
    assert plan.schedule.profile.names[-1] == "loss_fct" and max(plan.forward_counts) > 1


class _InPlaceDropoutHead(nn.Module):
    """MobileNetV2's head: its pooled features flattened (a view), then an in-place dropout
    (which gives the view a new autograd node) before the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.expand = nn.Linear(64, 512)
        self.act = nn.ReLU6()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.dropout = nn.Dropout(0.2, inplace=True)
        self.classifier = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        pooled = torch.flatten(self.pool(self.act(self.expand(x)).transpose(1, 2)), 1)
        return self.classifier(self.dropout(pooled))


@pytest.mark.parametrize("budget", ["min", 0.9])
def test_the_backward_of_a_group_ending_in_an_in_place_stage_is_sized(budget: Any) -> None:
    """The in-place dropout's input is a view whose gradient hook never fires: the group's
    backward window still runs from its last stage's to its first stage's."""
    x = torch.randn(8, 32, 64)
    torch.manual_seed(0)
    fits_its_prediction(_InPlaceDropoutHead().train(), budget, (x,), lambda out: out.square().mean())


@pytest.mark.parametrize("name", ["mpt", "t5", "cvt"])
def test_every_step_fits_the_least_nested_budget(name: str) -> None:
    """NOTE [a mix of timed groups]: MPT's timing pass timed the backward of some groups and
    not of others, and that mix peaked above the pass with every backward timed and the one
    with none. NOTE [the least budget's timing pass]: a T5 v1.1's least budget came out lower
    once its stages were timed than the budget its timing pass had run within. NOTE [glue
    released after its last replay]: a CvT's attention runs its query and value projections
    as glue, which keeps each block's input for its replays; kept to the end of the step,
    those went 5% over every step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "cvt":
        config = transformers.CvtConfig(num_labels=10, embed_dim=[16, 32, 64], num_heads=[1, 2, 4], depth=[1, 2, 3])
        model = transformers.CvtForImageClassification(config).train()
        kwargs: dict[str, Any] = {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 10, (2,))}
    elif name == "mpt":
        config = transformers.MptConfig(
            d_model=64, n_heads=4, n_layers=3, expansion_ratio=2, max_seq_len=64, vocab_size=128
        )
        model = transformers.MptForCausalLM(config)
        tokens = torch.randint(0, 128, (2, 64))
    else:
        config = transformers.T5Config(
            d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=128,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
        tokens = torch.randint(0, 128, (2, 32))
    if name != "cvt":
        model.train()
        kwargs = {"input_ids": tokens, "labels": tokens, "use_cache": False}
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    reference(**kwargs).loss.backward()
    wrapped = remat.Checkpointable(model, "min", output_kept=False, nested=True)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(5)
            wrapped(**kwargs).loss.backward()
        assert wrapped.plan is not None and wrapped.plan.budget_bytes is not None
        assert tracker.peak_bytes <= wrapped.plan.budget_bytes, step
    assert max(wrapped.plan.forward_counts) > 1
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


class _Shuffle(nn.Module):
    """A masked autoencoder's patch shuffle: its order is returned with the hidden states."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(torch.rand(x.shape[:2]), dim=1)
        return torch.tanh(self.fc(x)), order


class _ShuffledAutoencoder(nn.Module):
    """ViT-MAE's layout: the order drawn by the first stage is the model's output too, and
    the code before the decoder takes it as it is (to undo the shuffle)."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.shuffle = _Shuffle(width)
        self.encoder = nn.ModuleList(reference_models.TanhResidual(width) for _ in range(depth))
        self.decoder = nn.ModuleList(reference_models.TanhResidual(width) for _ in range(depth))
        self.head = nn.Linear(width, 8 * width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, order = self.shuffle(x)
        for block in self.encoder:
            hidden = block(hidden)
        hidden = torch.gather(hidden, 1, order.unsqueeze(-1).repeat(1, 1, hidden.shape[-1]))
        for block in self.decoder:
            hidden = block(hidden)
        return self.head(hidden), order


@pytest.mark.parametrize("nested", [False, True])
def test_what_the_model_returns_and_a_glue_keeps_is_held_through_the_loss(nested: bool) -> None:
    """NOTE [returned and kept for a replay]: the order is part of the output, which the loop
    drops at the loss, so a plain step frees it there; the glue before the decoder keeps it
    for its replay, through the loss's backward, where the least budget peaks (it went
    over by the order's 512 bytes)."""
    torch.manual_seed(0)
    model = _ShuffledAutoencoder().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, 32)

    def loss_fn(out: Any) -> torch.Tensor:
        return out[0].square().mean()

    torch.manual_seed(5)
    loss_fn(reference(x)).backward()
    wrapped = remat.Checkpointable(model, "min", loss_fn=loss_fn, output_kept=False, nested=nested)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(5)
            loss_fn(wrapped(x)).backward()
        assert wrapped.plan is not None and wrapped.plan.budget_bytes is not None
        assert tracker.peak_bytes <= wrapped.plan.budget_bytes
    assert tracker.peak_bytes == wrapped.plan.predicted_peak_bytes
    assert wrapped.plan.forward_counts[0] == 2  # the shuffle is recomputed: its glue keeps the order
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("fraction", [0.34, 0.36])
def test_gradients_waiting_for_a_region_own_backward_are_counted(fraction: float) -> None:
    """NOTE [gradients a region's own backward takes]: LeViT's subsampling attention takes
    the keys and values from the stage that ends with the queries' subsample; their
    gradients wait, through that stage's replay, for its backward. Uncounted, the steps
    went over the prediction by 4.5% at 0.34 and over the budget at 0.36."""
    pytest.importorskip("transformers")
    model, kwargs = reference_models.small_levit()
    reference = copy.deepcopy(model)
    reference(**kwargs).loss.backward()
    wrapped = remat.Checkpointable(model, fraction, output_kept=False, nested=True)
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            wrapped(**kwargs).loss.backward()
        peaks.append(tracker.peak_bytes)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes
    assert any(plan.budget.waiting_gradient_bytes)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
