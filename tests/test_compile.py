"""remat's manual recompute inside torch.compile: exact training, no graph break, no recompile.

Every entry point of the manual mode runs inside a model compiled with ``fullgraph=True``
(a graph break would raise), for two training steps, against the same model without
remat and without torch.compile. Gradients, losses and buffers are compared with
``torch.equal`` for the ``eager`` and ``aot_eager`` backends; inductor generates its own
kernels (fused, summed in another order), compared within ``INDUCTOR_TOLERANCE``, with
``torch._inductor.config.fallback_random`` so that its dropout draws what eager draws.
(NOTE [recompute under torch.compile] in remat.manual._compiled.)
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import remat
from remat.plan import Region

pytestmark = pytest.mark.usefixtures("clean_remat_state")

INDUCTOR_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""Inductor against eager: its kernels sum in another order (float32, values of order 1)."""


class Residual(nn.Module):
    def __init__(self, bn: bool, dropout: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, 32)]
        layers += [nn.BatchNorm1d(32)] if bn else []
        layers += [nn.GELU()]
        layers += [nn.Dropout(0.3)] if dropout else []
        layers += [nn.Linear(32, 8)]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Net(nn.Module):
    """Three residual blocks; `call` runs one (or the list of them, for `sequential`)."""

    def __init__(self, bn: bool, dropout: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(bn, dropout) for _ in range(3))
        self.call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
        self.sequential = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            x = remat.recompute_sequential(list(self.blocks), 2, x)
        else:
            for block in self.blocks:
                x = self.call(block, x) if self.call is not None else block(x)
        return x.pow(2).mean()


def _calling(**options: Any) -> Callable[[Net], None]:
    def prepare(net: Net) -> None:
        net.call = lambda block, x: remat.recompute(block, x, **options)

    return prepare


def _sequential(net: Net) -> None:
    net.sequential = True


def _marked(net: Net) -> None:
    for block in net.blocks:
        remat.mark(block)


def _applied(net: Net) -> None:
    remat.apply(net, Residual)


ENTRY_POINTS: dict[str, Callable[[Net], None]] = {
    "recompute": _calling(),
    "recompute_reentrant": _calling(use_reentrant=True),
    "recompute_no_rng_state": _calling(preserve_rng_state=False),
    "output_recompute": _calling(output_recompute=True),
    "policy_save_matmuls": _calling(policy=remat.policies.save_matmuls),
    "policy_recompute_gelu": _calling(policy=remat.policies.recompute_ops("aten.gelu")),
    "recompute_sequential": _sequential,
    "mark": _marked,
    "apply": _applied,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        yield
    torch._dynamo.reset()


def train_both(entry: str, backend: str, bn: bool, dropout: bool, steps: int = 2) -> int:
    """Trains the plain model eagerly and the remat one compiled; asserts they agree.

    Returns:
        How many frames were compiled (1: no recompile, no graph break).
    """
    torch.manual_seed(0)
    reference = Net(bn, dropout)
    model = copy.deepcopy(reference)
    ENTRY_POINTS[entry](model)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(6, 8)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(steps):
        losses = []
        for run, optimizer in zip((reference, compiled), optimizers, strict=True):
            torch.manual_seed(100 + step)
            optimizer.zero_grad()
            loss = run(x)
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
        _assert_same(backend, losses[0], losses[1], "loss")
        for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
            _assert_same(backend, expected.grad, actual.grad, f"step {step}: gradient of {name}")
        for (name, expected), actual in zip(reference.named_buffers(), model.buffers(), strict=True):
            _assert_same(backend, expected, actual, f"step {step}: buffer {name}")
    return counter.frame_count


def _assert_same(backend: str, expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    if backend == "inductor" and expected.is_floating_point():
        torch.testing.assert_close(actual, expected, **INDUCTOR_TOLERANCE, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: max difference {(actual - expected).abs().max()}"


@pytest.mark.parametrize("layers", ["dropout+bn", "plain"])
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_manual_recompute_compiles_and_is_exact(entry: str, backend: str, layers: str) -> None:
    bn = dropout = layers == "dropout+bn"
    if backend == "eager" and bn:
        pytest.skip("test_the_eager_backend_fails_loudly_on_running_statistics covers it")
    assert train_both(entry, backend, bn, dropout) == 1


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["recompute", "policy_save_matmuls", "mark", "recompute_sequential"])
def test_manual_recompute_under_inductor(entry: str) -> None:
    assert train_both(entry, "inductor", bn=True, dropout=True) == 1


def test_dropout_alone_under_the_eager_backend_is_exact() -> None:
    # torch's checkpoint operation, run as it is, does not preserve the RNG state (it leaves
    # that to AOTAutograd); remat's contexts replay it (NOTE [the checkpoint operation run
    # eagerly]). Without them this test fails: other dropout masks in the recompute.
    assert train_both("recompute", "eager", bn=False, dropout=True) == 1


def test_the_eager_backend_fails_loudly_on_running_statistics() -> None:
    # The eager backend runs torch's checkpoint operation on the lifted buffers: the
    # forward's update of num_batches_tracked then fails torch's check of the saved
    # inputs, loudly (README, torch.compile). aot_eager and inductor handle it (above).
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_both("recompute", "eager", bn=True, dropout=False)


def _saved_bytes(model: nn.Module, x: torch.Tensor, loss_of: Callable[[Any], Any] = lambda out: out) -> int:
    """Bytes the compiled forward saves for its backward (parameters aside)."""
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model(x))
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_graph_keeps_what_remat_keeps(backend: str) -> None:
    # The partitioner honours the recompute: the compiled forward of the recomputed model
    # saves the blocks' inputs only (6 x 8 floats each), not the 6 x 32
    # activations inside; with save_matmuls it keeps the matmuls' outputs besides.
    torch.manual_seed(0)
    plain = Net(bn=False, dropout=False)
    kept: dict[str, int] = {}
    for name, entry in (("plain", None), ("recompute", "recompute"), ("save_matmuls", "policy_save_matmuls")):
        torch._dynamo.reset()
        model = copy.deepcopy(plain)
        if entry is not None:
            ENTRY_POINTS[entry](model)
        kept[name] = _saved_bytes(torch.compile(model, backend=backend, fullgraph=True), torch.randn(6, 8))
    inputs = 3 * 6 * 8 * 4
    assert kept["recompute"] == inputs < kept["save_matmuls"] < kept["plain"], kept


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"policy": remat.policies.save_names("attention")}, "remat.tag"),
        ({"debug": True}, "debug=True"),
    ],
)
def test_what_the_compiler_cannot_do_is_refused_when_traced(options: dict[str, Any], message: str) -> None:
    net = Net(bn=False, dropout=False)
    _calling(**options)(net)
    with pytest.raises(Exception, match=message):  # raised while tracing; Dynamo may wrap it
        torch.compile(net, backend="eager", fullgraph=True)(torch.randn(6, 8))
    assert remat.is_recomputing() is False


# ---------------------------------------------------------------- the automatic mode


class Block(nn.Module):
    """A residual MLP block with dropout (a class of its own: its calls are the stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down, self.drop = (
            nn.LayerNorm(16),
            nn.Linear(16, 64),
            nn.Linear(64, 16),
            nn.Dropout(0.2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(6)))


def _train_against_plain(run: nn.Module, model: nn.Module, reference: nn.Module, backend: str = "aot_eager") -> int:
    """Two steps of `run` (which trains `model`) against `reference`, then the peak of a
    third, tracked. (Dynamo compiles nothing while a dispatch mode such as the tracker is
    active: the tracked step runs the same plan eagerly.)"""
    x = torch.randn(32, 16)
    for step in range(3):
        torch.manual_seed(step)
        reference(x).pow(2).mean().backward()
        torch.manual_seed(step)
        with remat.MemoryTracker() if step == 2 else contextlib.nullcontext() as tracker:
            run(x).pow(2).mean().backward()
        for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
            _assert_same(backend, expected.grad, actual.grad, f"step {step}: gradient of {name}")
    return tracker.peak_bytes


@pytest.mark.parametrize("how", ["Checkpointable", "enable"])
def test_a_compiled_automatic_model_trains_exactly_with_one_reported_graph_break(how: str) -> None:
    model, reference = _blocks(), _blocks()
    torch._dynamo.utils.counters.clear()
    loss_fn = {"loss_fn": lambda out: out.pow(2).mean()}
    wrapped = (
        remat.Checkpointable(model, 0.5, **loss_fn) if how == "Checkpointable" else remat.enable(model, 0.5, **loss_fn)
    )
    compiled = torch.compile(wrapped if how == "Checkpointable" else model, backend="aot_eager")
    with pytest.warns(UserWarning, match="runs eagerly under torch.compile") as caught:
        peak = _train_against_plain(compiled, model, reference)
    assert sum("runs eagerly under torch.compile" in str(w.message) for w in caught) == 1  # said once
    plan = remat.controller(model).plan if how == "enable" else wrapped.plan
    assert plan is not None and max(plan.forward_counts) > 1
    assert peak <= plan.budget_bytes
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("remat's automatic mode" in reason for reason in breaks), dict(breaks)


def test_a_compiled_automatic_model_refuses_fullgraph_in_training_naming_the_ways() -> None:
    model = _blocks()
    remat.enable(model, 0.5)
    with pytest.raises(Exception, match=r"fullgraph=True cannot hold.*block\.compile\(\)"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(32, 16)).sum().backward()
    assert remat.controller(model).plan is None  # refused while tracing: nothing measured
    model(torch.randn(32, 16)).sum().backward()  # and it trains uncompiled
    assert remat.controller(model).plan is not None


def _compiled_steps(
    run: Any, model: nn.Module, reference: nn.Module, steps: range, backend: str, x: torch.Tensor | None = None
) -> None:
    """Training steps of `run` (which trains `model`) against `reference`, gradient for
    gradient and buffer for buffer (running statistics)."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)) if x is None else x
    for step in steps:
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        reference(x).pow(2).mean().backward()
        torch.manual_seed(step)
        run(x).pow(2).mean().backward()
        for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
            _assert_same(backend, expected.grad, actual.grad, f"step {step}: gradient of {name}")
        for (name, expected), actual in zip(reference.named_buffers(), model.buffers(), strict=True):
            _assert_same(backend, expected, actual, f"step {step}: buffer {name}")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_automatic_model_runs_a_plan_in_the_graph_from_its_second_call(backend: str) -> None:
    # NOTE [a plan in the compiled graph]: the first call measures at a graph break and
    # plans stage by stage; from the second on, Dynamo traces the plan (one frame, no break,
    # no recompile after it), the partitioner recomputes the planned stages, and the
    # gradients (dropout included) are those of the plain model
    model, reference = _blocks(), _blocks()
    remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    with pytest.warns(UserWarning, match="run a plan in the graph from the next call on"):
        _compiled_steps(compiled, model, reference, range(1), backend)
    (traced,) = remat.controller(model)._traced.plans.values()
    assert traced.plan.predicted_peak_bytes <= traced.plan.budget_bytes
    recomputed = [stage for stage, count in enumerate(traced.plan.forward_counts) if count > 1]
    assert recomputed and traced.names == {str(stage) for stage in recomputed}
    assert all(not isinstance(item, Region) or item.stop - item.start == 1 for item in traced.plan.schedule.items)
    torch._dynamo.utils.counters.clear()
    frames = counter.frame_count
    _compiled_steps(compiled, model, reference, range(1, 4), backend)
    assert counter.frame_count == frames + 1  # one recompile, for the plan, then none
    assert not torch._dynamo.utils.counters["graph_break"]
    # what the compiled forward keeps: less than compiled without remat, and it does not
    # keep the activations of the recomputed stages (their inputs at most)
    squared = lambda out: out.pow(2).mean()  # noqa: E731
    plain_saved = _saved_bytes(torch.compile(_blocks(), backend=backend), torch.randn(32, 16), squared)
    traced_saved = _saved_bytes(compiled, torch.randn(32, 16), squared)
    assert traced_saved < plain_saved
    remat.disable(model)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_a_plan_in_the_graph_holds_under_fullgraph_and_follows_the_input_and_the_budget() -> None:
    model, reference = _blocks(), _blocks()
    remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    _compiled_steps(model, model, reference, range(1), "aot_eager")  # measured eagerly, uncompiled
    controller = remat.controller(model)
    assert not controller._traced.plans  # only a compiled call plans for compiled calls
    with pytest.warns(UserWarning, match="run a plan in the graph"):
        _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(1, 2), "aot_eager")
    counter = CompileCounterWithBackend("aot_eager")
    fullgraph = torch.compile(model, backend=counter, fullgraph=True)
    _compiled_steps(fullgraph, model, reference, range(2, 4), "aot_eager")
    assert counter.frame_count == 1
    # another budget: the plan in the graph is not that budget's, so the call breaks and plans again
    controller.mem_limit = 0.8
    with pytest.raises(Exception, match="fullgraph=True cannot hold"):
        fullgraph(torch.randn(32, 16)).sum().backward()
    with pytest.warns(UserWarning, match="run a plan in the graph"):
        _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(4, 5), "aot_eager")
    assert {traced.mem_limit for traced in controller._traced.plans.values()} == {0.5, 0.8}


class ConvBlock(nn.Module):
    """A residual convolution with BatchNorm and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.drop = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


def test_a_plan_in_the_graph_updates_batchnorm_statistics_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(ConvBlock() for _ in range(6)))
    reference = copy.deepcopy(model)
    remat.enable(model, 0.6, loss_fn=lambda out: out.pow(2).mean())
    compiled = torch.compile(model, backend="aot_eager")
    _compiled_steps(compiled, model, reference, range(3), "aot_eager", torch.randn(2, 4, 8, 8))
    (traced,) = remat.controller(model)._traced.plans.values()
    assert traced.names  # BatchNorm blocks recomputed in the graph


def test_a_copy_of_a_model_with_a_plan_in_the_graph_plans_anew_and_trains_exactly() -> None:
    # the stand-ins travel with a copy (torch.save, deepcopy) without the plans: the copy's
    # controller plans for its own compiled calls, over them, not on top of them
    model, reference = _blocks(), _blocks()
    remat.enable(model, 0.5)
    _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(2), "aot_eager")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert not remat.controller(copied)._traced.plans
        twin = copy.deepcopy(reference)
        with pytest.warns(UserWarning, match="run a plan in the graph"):
            _compiled_steps(torch.compile(copied, backend="aot_eager"), copied, twin, range(2, 5), "aot_eager")
        stand_ins = [module.__dict__["forward"] for module in copied if "forward" in module.__dict__]
        assert stand_ins and all(stand_in.original is None for stand_in in stand_ins)  # none stacked


def test_plans_in_the_graph_for_two_input_shapes_live_side_by_side() -> None:
    # a batch of another size plans for itself; going back and forth then compiles nothing more
    model = _blocks()
    remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    frames = []
    for size in (32, 32, 48, 48, 32, 48, 32, 48):
        compiled(torch.randn(size, 16)).pow(2).mean().backward()
        frames.append(counter.frame_count)
    assert len(remat.controller(model)._traced.plans) == 2
    # the first size traces once more when it comes back (the plans changed), then nothing does
    assert frames[4:] == [frames[4]] * 4, frames


def test_unfreezing_layers_of_a_compiled_model_plans_again_for_the_graph() -> None:
    # the plan in the graph was looked up by input shapes alone: after unfreezing, the
    # compiled calls kept the frozen model's plan (1.5 times the budget on inductor)
    model, reference = _blocks(), _blocks()
    for module in (model, reference):
        module[:3].requires_grad_(False)
    control = remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(32, 16)

    def steps(count: int) -> None:
        for step in range(count):
            for module in (model, reference):
                module.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # (the blocks' dropout)
            reference(x).pow(2).mean().backward()
            torch.manual_seed(step)
            compiled(x).pow(2).mean().backward()
            for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
                if expected.requires_grad:
                    _assert_same("aot_eager", expected.grad, actual.grad, f"gradient of {name}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps(3)
        frozen = {plan.setup for plan in control._traced.plans.values()}
        for module in (model, reference):
            module[:3].requires_grad_(True)
        steps(3)
    setups = {plan.setup for plan in control._traced.plans.values()}
    assert len(frozen) == 1 and len(setups) == 2 and frozen < setups
    (unfrozen,) = [plan for plan in control._traced.plans.values() if plan.setup not in frozen]
    assert unfrozen.plan.schedule.profile.n_stages == control.plan.schedule.profile.n_stages
    assert unfrozen.plan.predicted_peak_bytes <= unfrozen.plan.budget_bytes


def test_ranks_that_agree_on_one_plan_keep_it_eager_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # a plan for compiled calls would be one rank's own (NOTE [one plan for all ranks]); the
    # agreement itself is not run here: only whether a group is active is asked
    monkeypatch.setattr(remat.traced, "agreement_group_active", lambda: True)
    model, reference = _blocks(), _blocks()
    control = remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    with pytest.warns(UserWarning, match="under torch.distributed, every training call runs the plan all ranks"):
        _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(2), "aot_eager")
    assert not control._traced.plans


def test_a_budget_too_small_for_a_plan_in_the_graph_keeps_the_eager_plan_and_says_why() -> None:
    model, reference = _blocks(), _blocks()
    remat.enable(model, "min", loss_fn=lambda out: out.pow(2).mean())
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match=r"keep running the plan eagerly .*recomputing stages one by one needs"):
        _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(3), "aot_eager")
    assert not remat.controller(model)._traced.plans
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert torch._dynamo.utils.counters["graph_break"]  # the eager plan, at a break, every call


def test_a_compiled_automatic_model_evaluates_in_one_graph() -> None:
    model = _blocks().eval()
    reference = copy.deepcopy(model)
    remat.enable(model, 0.5)
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(32, 16)
    assert torch.equal(torch.compile(model, backend=counter, fullgraph=True)(x), reference(x))
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_automatic_mode_runs_blocks_compiled_one_by_one(backend: str) -> None:
    # The recipe for compiled large models: each block compiled, remat planning over them.
    # The model is not a Sequential: its chain is found on fake tensors, where the blocks
    # run uncompiled (inductor's kernels would read the fake tensors' absent data).
    model, reference = Stack(_blocks()), Stack(_blocks())
    counter = CompileCounterWithBackend(backend)
    for block in model.blocks:
        block.compile(backend=counter)
    wrapped = remat.Checkpointable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    peak = _train_against_plain(wrapped, model, reference, backend)
    assert counter.frame_count >= 1  # the blocks ran compiled (not under the tracker: Dynamo skips them there)
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
    assert peak <= wrapped.plan.budget_bytes


class Widening(nn.Module):
    """A block whose widths differ from its neighbours' (each shape compiles its own graph)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, out), nn.LayerNorm(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.nn.functional.gelu(self.linear(x)))


def test_compiled_blocks_of_many_shapes_train_exactly_without_recompiling_every_step() -> None:
    # Blocks of four widths, compiled one by one, in copies of one model planned at three
    # budgets one after the other (their compiled code is shared by code object). The
    # compiled code guards on the global module hooks it was traced with: remat keeps its
    # guard hooks installed while an executor of compiled stages lives (hold_hooks), so a
    # block runs the same graph in its forward and in its recompute, step after step.
    widths = [64, 256, 128, 512] * 6
    torch.manual_seed(0)
    reference = nn.Sequential(*(Widening(widths[i], widths[(i + 1) % len(widths)]) for i in range(len(widths))))
    x = torch.randn(16, 64)
    for budget in (0.5, "min", 0.375):
        model = copy.deepcopy(reference)
        counter = CompileCounterWithBackend("aot_eager")
        for block in model:
            block.compile(backend=counter, dynamic=False)
        wrapped = remat.Checkpointable(model, budget, loss_fn=lambda out: out.pow(2).mean())
        frames = []
        for _ in range(4):
            for module in (reference, model):
                module.zero_grad()
            reference(x).pow(2).mean().backward()
            wrapped(x).pow(2).mean().backward()
            for expected, actual in zip(reference.parameters(), model.parameters(), strict=True):
                assert torch.equal(actual.grad, expected.grad)
            frames.append(counter.frame_count)
        assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
        assert frames[-1] == frames[1], frames  # nothing compiled again after the first steps


def test_a_recomputed_compiled_block_with_running_statistics_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Residual(bn=True, dropout=False) for _ in range(6)))
    for block in model:
        block.compile(backend="aot_eager")
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: out.pow(2).mean())
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(NotImplementedError, match="running statistics"):
        wrapped(torch.randn(6, 8)).pow(2).mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


class _WrittenOutBlock(Block):
    """The block with its GELU written out: what it saves leaves cheap products to backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(self.drop(0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * h * h * h)))))


class _NormLastBlock(Block):
    """The block with its norm last, where nothing keeps its output (a norm's output that a
    product keeps is made again: NOTE [layer norms made again]). Its GELU is one operation, and
    its dropout's output is made from the GELU's, which is not kept: it makes no recipe."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.down(self.drop(torch.nn.functional.gelu(self.up(x)))))


@pytest.mark.parametrize("written_out", [False, True])
def test_elementwise_saves_keep_a_compiled_plan_eager_only_where_a_stage_makes_them(written_out: bool) -> None:
    # NOTE [stages that make no recipe]: blocks whose saves no cheap operation made run as
    # without elementwise=True, in the graph; blocks that leave products run the plan eagerly
    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*((_WrittenOutBlock if written_out else _NormLastBlock)() for _ in range(6)))

    model, reference = blocks(), blocks()
    control = remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean(), elementwise=True)
    told = "keep running the plan eagerly .*elementwise saves" if written_out else "run a plan in the graph"
    with pytest.warns(UserWarning, match=told):
        _compiled_steps(torch.compile(model, backend="aot_eager"), model, reference, range(2), "aot_eager")
    assert bool(control.plan.schedule.profile.metadata["elementwise_stages"]) is written_out
    assert bool(control._traced.plans) is not written_out


def test_compiled_code_reads_remat_state_as_eager_code_does() -> None:
    # NOTE [what torch's per-thread store may hold]: remat.tag and remat.offload read the
    # stacks of running blocks; in code Dynamo traces they are read as thread-locals
    from remat.manual._frames import active_mode

    def tagged(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        remat.tag(y, "a")
        return y.cos()

    x = torch.randn(4)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(tagged, backend="eager", fullgraph=fullgraph)(x), tagged(x))

    def mode_code(t: torch.Tensor) -> torch.Tensor:
        return t + (1 if active_mode() is None else 100)

    torch._dynamo.reset()
    compiled = torch.compile(mode_code, backend="eager")
    c = torch.zeros(1)
    assert compiled(c).item() == 1
    seen: list[tuple[float, float]] = []

    def block(t: torch.Tensor) -> torch.Tensor:
        seen.append((compiled(c).item(), mode_code(c).item()))
        return t * 2

    remat.recompute(block, torch.randn(2, requires_grad=True)).sum().backward()
    assert seen and all(pair == (100, 100) for pair in seen)

    lin = nn.Linear(4, 4)
    torch._dynamo.reset()
    x = torch.randn(2, 4, requires_grad=True)
    torch.compile(lambda t: remat.offload(lin, t).sum(), backend="eager")(x).backward()
    assert x.grad is not None


def test_a_recompute_on_a_backward_thread_runs_compiled_blocks_as_the_forward_did() -> None:
    # NOTE [compiled code in a recompute]: under a dispatch mode (the tracker here) the
    # forward runs the compiled blocks eagerly; a GPU's backward thread would run their
    # compiled code in the recompute, which saves other tensors
    from device_thread import on_the_device_thread

    model, reference = Stack(_blocks()), Stack(_blocks())
    for block in model.blocks:
        block.compile(backend="aot_eager")
    wrapped = remat.Checkpointable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    x = torch.randn(32, 16)
    for step in range(3):
        torch.manual_seed(step)
        reference(x).pow(2).mean().backward()
        torch.manual_seed(step)
        with remat.MemoryTracker() if step == 2 else contextlib.nullcontext():
            loss = wrapped(x).pow(2).mean()
            on_the_device_thread(torch.autograd.backward, loss)
        for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
            _assert_same("aot_eager", expected.grad, actual.grad, f"step {step}: gradient of {name}")
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1


def test_a_model_compiled_in_place_after_enabling_runs_its_plan_in_the_graph() -> None:
    # NOTE [compiled in place]: model.compile() compiles the stand-in; the model's own call,
    # which the controller runs, must not go through that compiled call again
    model, reference = _blocks(), _blocks()
    remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    model.compile(backend="aot_eager")
    with pytest.warns(UserWarning, match="run a plan in the graph from the next call on"):
        _compiled_steps(model, model, reference, range(1), "aot_eager")
    _compiled_steps(model, model, reference, range(1, 3), "aot_eager")
    assert remat.controller(model)._traced.plans
    assert model._compiled_call_impl is not None  # put back after each call


def test_a_model_compiled_in_place_after_enabling_trains_plainly_once_disabled() -> None:
    # torch keeps the compiled call it made of the stand-in: after disable, that call runs
    # the model's own (it used to run into itself without end)
    model, reference = _blocks(), _blocks()
    control = remat.enable(model, 0.5, loss_fn=lambda out: out.pow(2).mean())
    model.compile(backend="aot_eager")
    with pytest.warns(UserWarning, match="run a plan in the graph"):
        _compiled_steps(model, model, reference, range(2), "aot_eager")
    remat.disable(model)
    assert not remat.is_enabled(model)
    calls = control._in_flight
    control._in_flight = None  # the controller must not be reached again
    _compiled_steps(model, model, reference, range(2, 4), "aot_eager")
    control._in_flight = calls
    with pytest.raises(remat.RematError, match="compiled in place"):
        remat.enable(model, 0.5)  # its compiled call is the old stand-in's: compile the model again after


@pytest.mark.parametrize("backend", ["aot_eager"])  # (inductor alike: the replays run before any backend)
def test_a_compiled_training_step_of_an_enabled_model_replays_its_stages_eagerly(backend: str) -> None:
    # loss.backward() inside the compiled step runs remat's replays from a compiled frame:
    # compiled themselves, they saved other tensors than the eager forward (and raised)
    model, reference = _blocks(), _blocks()
    remat.enable(model, 0.6, loss_fn=lambda out: out.pow(2).mean())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]

    def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = module(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled = torch.compile(train_step, backend=backend)
    x = torch.randn(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the graph's own notes on the plan it traced)
        for step in range(3):
            torch.manual_seed(step)
            expected = train_step(reference, optimizers[1], x)
            torch.manual_seed(step)
            _assert_same(backend, expected, compiled(model, optimizers[0], x), f"step {step}: loss")
            for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
                _assert_same(backend, p, q, f"step {step}: {name}")
    assert remat.controller(model).plan is not None and max(remat.controller(model).plan.forward_counts) > 1


_OFFLOADING = remat.policies.offload_ops("aten.addmm")  # (built outside the traced code)


def test_an_offloading_policy_under_compile_is_refused_with_what_to_do() -> None:
    block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(block, x, policy=_OFFLOADING).pow(2).mean()

    with pytest.raises(
        Exception, match=r"offloads the output of aten.addmm.default .* does not build under torch.compile"
    ):
        torch.compile(forward, backend="aot_eager", fullgraph=True)(torch.randn(4, 8)).backward()


def test_a_model_compiled_in_place_before_enabling_is_refused() -> None:
    model = _blocks()
    model.compile(backend="aot_eager")
    with pytest.raises(remat.RematError, match=r"compiled in place .* Enable it first and compile it after"):
        remat.enable(model, 0.5)
    assert not remat.is_enabled(model)


def test_the_controller_of_a_compiled_enabled_model_is_the_models() -> None:
    model = _blocks()
    control = remat.enable(model, 0.5)
    compiled = torch.compile(model, backend="aot_eager")
    assert remat.is_enabled(compiled) and remat.controller(compiled) is control
    remat.disable(compiled)
    assert not remat.is_enabled(model)
