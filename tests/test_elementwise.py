"""remat.recompute_elementwise: saved tensors made by cheap elementwise operations, made again in backward."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat.errors import RecomputeInputModified


def _gelu_written_out(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _Mlp(nn.Module):
    def __init__(self, width: int = 32, gated: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.gate = nn.Linear(width, 4 * width) if gated else None
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h * nn.functional.silu(self.gate(x)) if self.gate is not None else _gelu_written_out(h)
        return x + self.dropout(self.down(h))


def _tiny_gpt2(n_layer: int, tokens: int) -> tuple[nn.Module, torch.Tensor]:
    """A Hugging Face GPT-2 of width 64 with random weights, in training, and 2 sequences of token ids."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(3)
    return transformers.GPT2LMHeadModel(config).train(), torch.randint(0, 128, (2, tokens))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _run(model: nn.Module, x: torch.Tensor, elementwise: bool, **options: object):
    torch.manual_seed(0)
    state = None
    if elementwise:
        with remat.recompute_elementwise(**options) as state:  # type: ignore[arg-type]
            loss = model(x).square().sum()
    else:
        loss = model(x).square().sum()
    loss.backward()
    return loss, state


def _assert_exact(model: nn.Module, x: torch.Tensor, **options: object):
    plain = copy.deepcopy(model)
    x_plain = x.detach().clone().requires_grad_(x.requires_grad)
    loss, _ = _run(plain, x_plain, False)
    rng_plain = torch.get_rng_state()
    x_ours = x.detach().clone().requires_grad_(x.requires_grad)
    loss_ours, state = _run(model, x_ours, True, **options)
    assert torch.equal(torch.get_rng_state(), rng_plain)
    assert torch.equal(loss, loss_ours)
    for a, b in zip(_grads(plain), _grads(model), strict=True):
        assert torch.equal(a, b)
    if x.requires_grad:
        assert torch.equal(x_plain.grad, x_ours.grad)
    return state


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradients_are_those_of_plain_autograd_and_products_are_made_again(gated: bool, dropout: float) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(*[_Mlp(gated=gated, dropout=dropout) for _ in range(3)])
    x = torch.randn(8, 32, requires_grad=True)
    state = _assert_exact(model, x)
    # the GELU's two factors and product, or the gated product, of each block
    assert state.tensors_recomputed >= (3 if gated else 9)
    assert state.operations_run >= state.tensors_recomputed


def test_the_step_keeps_less_memory() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(*[_Mlp(width=64) for _ in range(4)])
    x = torch.randn(64, 64)
    with remat.MemoryTracker() as plain:
        model(x).sum().backward()
    with remat.MemoryTracker() as ours:
        with remat.recompute_elementwise() as state:
            loss = model(x).sum()
        loss.backward()
    # per block the GELU keeps x, the tanh, two factors and the product (64 x 256 floats each);
    # made again: the factors and the product
    block = 64 * 256 * 4
    assert state.saved_bytes_recomputed == 4 * 3 * block
    assert ours.peak_bytes <= plain.peak_bytes - 3 * 3 * block


def test_a_hugging_face_gpt2_trains_exactly() -> None:
    model, ids = _tiny_gpt2(2, 32)
    plain = copy.deepcopy(model)
    losses = []
    for m, elementwise in ((plain, False), (model, True)):
        torch.manual_seed(0)
        if elementwise:
            with remat.recompute_elementwise() as state:
                loss = m(ids, labels=ids).loss
        else:
            loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(*losses)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    # per block: the GELU's two factors and its product (through the view its projection saves),
    # the attention's dropout output (through its view) and its two layer norms' outputs; and the
    # final layer norm's output
    assert state.tensors_recomputed == 2 * 6 + 1


def test_backward_runs_exactly_the_operations_of_the_recipes_it_reads() -> None:
    x = torch.randn(16, requires_grad=True)
    y = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise() as state:
        product = x * y  # saves x and y
        s = product + 1.0
        out = (s * s).sum()  # saves s twice: a recipe each, of two operations (x * y, + 1.0)
        del product, s
    out.backward()
    assert state.tensors_recomputed == 2
    assert state.operations_run == 4
    expected_x, expected_y = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    ((x * y + 1.0) * (x * y + 1.0)).sum().backward()
    assert torch.equal(expected_x, x.grad) and torch.equal(expected_y, y.grad)


def test_a_tensor_still_alive_is_not_made_again() -> None:
    x = torch.randn(16, requires_grad=True)

    def forward(keep: list[torch.Tensor]) -> torch.Tensor:
        with remat.recompute_elementwise() as state:
            y = x * x  # saves x
            z = y + 1.0
            keep.append(z)
            out = (z * z).sum()  # saves z twice
        states.append(state)
        return out

    states: list[remat.ElementwiseRecompute] = []
    forward([]).backward()
    held: list[torch.Tensor] = []
    forward(held).backward()  # z lives: backward reads it as it is
    assert [s.tensors_recomputed for s in states] == [2, 2]
    assert [s.operations_run for s in states] == [4, 0]  # z = x * x + 1.0, read twice


@pytest.mark.parametrize("max_operations, recomputed", [(4, 0), (5, 2)])
def test_at_most_max_operations_are_run_for_one_tensor(max_operations: int, recomputed: int) -> None:
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise(max_operations=max_operations) as state:
        y = x * x  # saves x
        chain = ((y + 1.0) * 2.0 - 3.0) * 0.5  # five operations from x; none saves anything
        out = (chain * chain).sum()  # saves chain twice
        del y, chain
    out.backward()
    assert state.tensors_recomputed == recomputed
    assert state.operations_run == 5 * recomputed


def test_transcendental_operations_are_kept_unless_named() -> None:
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise() as state:
        out = (torch.tanh(x * x) * x).sum()  # mul saves the tanh: made by tanh, not cheap
    out.backward()
    assert state.tensors_recomputed == 0
    with remat.recompute_elementwise(operations=remat.manual.elementwise.CHEAP_OPERATIONS | {"tanh"}) as state:
        out = (torch.tanh(x * x) * x).sum()
    out.backward()
    assert state.tensors_recomputed >= 1


class _NormThenProject(nn.Module):
    """A layer norm whose output only the next projection saves (as in a transformer block)."""

    def __init__(self, width: int = 32, affine: bool = True, frozen: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=affine)
        self.project = nn.Linear(width, width)
        self.norm.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.norm(x))


@pytest.mark.parametrize(
    ("options", "recomputed"),
    [({}, 2), ({"affine": False}, 2), ({"frozen": True}, 2)],
    ids=["affine", "no-affine", "frozen-weights"],
)
def test_layer_norm_outputs_are_made_again_from_the_input_it_keeps(options: dict, recomputed: int) -> None:
    # NOTE [layer norms made again]: the norm keeps its input; its output is the projection's
    # to keep. A frozen norm's weight is no trained parameter, but the norm keeps it too.
    torch.manual_seed(4)
    model = nn.Sequential(_NormThenProject(**options), _NormThenProject(**options))
    state = _assert_exact(model, torch.randn(8, 32, requires_grad=True))
    assert state.tensors_recomputed == recomputed
    assert state.saved_bytes_recomputed == recomputed * 8 * 32 * 4


def test_layer_norm_outputs_are_kept_when_the_operations_leave_it_out() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(_NormThenProject(), _NormThenProject())
    names = remat.manual.elementwise.CHEAP_OPERATIONS - {"native_layer_norm"}
    state = _assert_exact(model, torch.randn(8, 32, requires_grad=True), operations=names)
    assert state.tensors_recomputed == 0


def test_a_changed_input_of_a_recipe_raises_as_autograd_does() -> None:
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise():
        a = x * 1.0  # not saved: a's history is the recipe
        b = a * a  # saves a (twice)
        c = b + 1.0
        out = (c * c).sum()  # saves c: made from b's recipe, from a (saved)
    a.add_(1.0)  # autograd raises for this too
    with pytest.raises(RecomputeInputModified, match="modified by an in-place operation"):
        out.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a2 = x * 1.0
        out2 = ((a2 * a2 + 1.0) ** 2).sum()
        a2.add_(1.0)
        out2.backward()


def test_a_changed_tensor_a_recipe_reads_raises_even_when_the_recipe_runs_first() -> None:
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise() as state:
        a = torch.sin(x)  # not cheap: a is saved as it is (by b, and by sin for its input... x)
        b = a * a
        c = b + 1.0
        out = (c * c).sum()  # saves c: a recipe reading a
        del b, c
    assert state.tensors_recomputed == 2
    a.mul_(2.0)
    with pytest.raises(RecomputeInputModified, match="recomputed from"):
        out.backward()  # c's recipe runs first, and finds a changed


def test_a_tensor_saved_as_it_is_and_changed_raises_as_autograd_does() -> None:
    # autograd does not check tensors saved through hooks (NOTE [versions of tensors saved through hooks])
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise():
        a = torch.sin(x)
        out = (a * a).sum()
    a.add_(1.0)
    with pytest.raises(RecomputeInputModified, match="saved at version 0"):
        out.backward()


def test_a_saved_tensor_changed_while_alive_then_let_go_raises() -> None:
    x = torch.randn(16, requires_grad=True)
    with remat.recompute_elementwise():
        y = x * x  # saves x
        z = y + 1.0
        out = z * z  # saves z (a recipe)
        z.mul_(2.0)  # changed after being saved, then let go
        del z
        total = out.sum()
    with pytest.raises(RecomputeInputModified, match="after it was saved"):
        total.backward()


def test_a_tensor_changed_before_use_is_made_from_its_new_value() -> None:
    torch.manual_seed(4)
    x = torch.randn(16, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * x  # saves x
        t = y + 1.0
        t.mul_(3.0)  # t's history is now stale; t is not saved: no recipe goes through it
        u = t * 2.0
        return (u * u).sum() + (x * t).sum()

    expected = torch.autograd.grad(f(x), x)[0]
    with remat.recompute_elementwise():
        out = f(x)
    assert torch.equal(torch.autograd.grad(out, x)[0], expected)


def test_a_parameter_changed_under_no_grad_after_its_use_is_not_read_again() -> None:
    weight = nn.Parameter(torch.randn(16))
    original = weight.detach().clone()
    x = torch.randn(16, requires_grad=True)

    def f() -> torch.Tensor:
        c = x * x + weight  # c = (x * x) + weight: a recipe could read weight
        with torch.no_grad():
            weight.add_(1.0)  # autograd saved no weight: its gradient is still exact
        return (c * c).sum()

    expected = torch.autograd.grad(f(), (x, weight))
    with torch.no_grad():
        weight.copy_(original)
    with remat.recompute_elementwise() as state:
        out = f()
    assert state.tensors_recomputed == 0  # weight is not what c was made from any more
    for a, b in zip(expected, torch.autograd.grad(out, (x, weight)), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layers", ["mlp", "layer norms"])  # (NOTE [layer norms made again])
def test_double_backward_goes_through_the_recomputed_tensors(layers: str) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(*((_Mlp(width=16) if layers == "mlp" else _NormThenProject(16)) for _ in range(2)))
    x = torch.randn(4, 16, requires_grad=True)

    def penalty(elementwise: bool) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        if elementwise:
            with remat.recompute_elementwise():
                out = m(x).square().sum()
        else:
            out = m(x).square().sum()
        (grad_x,) = torch.autograd.grad(out, x, create_graph=True)
        grad_x.square().sum().backward()
        return [p.grad for p in m.parameters()]

    for a, b in zip(penalty(False), penalty(True), strict=True):
        assert torch.equal(a, b)


def test_inside_remat_regions_and_under_a_budget_the_gradients_stay_exact() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(*[_Mlp(width=32, dropout=0.2) for _ in range(6)])
    x = torch.randn(16, 32)
    plain = copy.deepcopy(model)
    torch.manual_seed(0)
    plain(x).sum().backward()
    marked = copy.deepcopy(model)
    remat.mark(marked[1])
    remat.mark(marked[3])
    torch.manual_seed(0)
    with remat.recompute_elementwise():
        loss = marked(x).sum()
    loss.backward()
    for a, b in zip(plain.parameters(), marked.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    planned = remat.Checkpointable(copy.deepcopy(model), 0.5)
    for _ in range(2):
        planned.zero_grad()
        torch.manual_seed(0)
        with remat.recompute_elementwise():
            loss = planned(x).sum()
        with remat.MemoryTracker() as tracker:
            loss.backward()
    for a, b in zip(plain.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    torch.manual_seed(0)
    planned.zero_grad()
    with remat.MemoryTracker() as tracker:
        with remat.recompute_elementwise():
            loss = planned(x).sum()
        loss.backward()
    assert tracker.peak_bytes <= planned.plan.predicted_peak_bytes


def test_the_context_leaves_nothing_behind_after_an_error() -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with remat.recompute_elementwise():
            _ = x * x
            raise ZeroDivisionError
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize(
    "options, error",
    [({"max_operations": 0}, ValueError), ({"max_operations": True}, ValueError), ({"operations": [1]}, TypeError)],
)
def test_bad_options_are_refused(options: dict, error: type) -> None:
    with pytest.raises(error, match="max_operations|operations"):
        with remat.recompute_elementwise(**options):
            pass


_BINARY = [torch.add, torch.sub, torch.mul, torch.maximum, torch.minimum]
_UNARY = [torch.neg, torch.abs, torch.relu, torch.square, lambda t: torch.clamp(t, -1.0, 1.0), lambda t: t * 0.5]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=12))
def test_random_elementwise_programs_give_plain_gradients(program: list[tuple[int, int, int]]) -> None:
    torch.manual_seed(7)
    leaves = [torch.randn(6, requires_grad=True) for _ in range(2)]

    def run() -> torch.Tensor:
        values = list(leaves)
        for op, i, j in program:
            a, b = values[-1 - i % len(values)], values[-1 - j % len(values)]
            values.append(_BINARY[op](a, b) if op < len(_BINARY) else _UNARY[op - len(_BINARY)](a))
        return sum((v * v).sum() for v in values[2:])  # type: ignore[return-value]

    expected = torch.autograd.grad(run(), leaves, allow_unused=True, materialize_grads=True)
    with remat.recompute_elementwise():
        out = run()
    for a, b in zip(expected, torch.autograd.grad(out, leaves, allow_unused=True, materialize_grads=True), strict=True):
        assert torch.equal(a, b)


def test_under_autocast_the_casts_are_made_again_and_gradients_stay_exact() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(*[_Mlp(width=32, gated=True) for _ in range(2)])
    x = torch.randn(8, 32)

    def run(m: nn.Module, elementwise: bool) -> tuple[torch.Tensor, remat.ElementwiseRecompute | None]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if elementwise:
                with remat.recompute_elementwise() as state:
                    loss = m(x).float().square().sum()
            else:
                loss, state = m(x).float().square().sum(), None
        loss.backward()
        return loss, state

    plain = copy.deepcopy(model)
    expected, _ = run(plain, False)
    loss, state = run(model, True)
    assert torch.equal(expected, loss)
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert state is not None and state.tensors_recomputed > 0


# -- planned: Checkpointable(..., elementwise=True) (NOTE [elementwise saves in planned stages])


def _planned_case() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(9)
    return nn.Sequential(*[_Mlp(width=32, dropout=0.2) for _ in range(8)]), torch.randn(32, 32)


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _planned_steps(model: nn.Module, x: torch.Tensor, budget: object, elementwise: bool, steps: int = 2):
    planned = remat.Checkpointable(model, budget, elementwise=elementwise, output_kept=False, loss_fn=_loss)
    for _ in range(steps):
        planned.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with remat.MemoryTracker() as tracker:
            loss = _loss(planned(x))
            loss.backward()
    return planned, loss.detach(), tracker.peak_bytes


def _plain_peak(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    plain = copy.deepcopy(model)
    torch.manual_seed(0)
    with remat.MemoryTracker() as tracker:
        loss = _loss(plain(x))
        loss.backward()
    return loss.detach(), [p.grad for p in plain.parameters()], tracker.peak_bytes


def _planned_exactly(model: nn.Module, x: torch.Tensor, fraction: object) -> remat.Checkpointable:
    """The model planned with elementwise saves at `fraction` of its plain peak: gradients exact,
    and the measured peak the predicted one, within the budget."""
    loss, grads, plain_peak = _plain_peak(model, x)
    budget = fraction if fraction == "min" else int(fraction * plain_peak)  # type: ignore[operator]
    planned, planned_loss, peak = _planned_steps(copy.deepcopy(model), x, budget, True)
    assert torch.equal(loss, planned_loss)
    for a, b in zip(grads, planned.parameters(), strict=True):
        assert torch.equal(a, b.grad)
    assert planned.plan is not None and peak == planned.plan.predicted_peak_bytes <= planned.plan.budget_bytes
    return planned


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.35, 0.25, "min"])
def test_planned_with_elementwise_the_prediction_is_the_measured_peak_and_gradients_are_exact(fraction: object) -> None:
    model, x = _planned_case()
    plan = _planned_exactly(model, x, fraction).plan
    assert plan is not None
    if fraction in (0.35, 0.25):
        # regions whose replays store stages: the recompute frames hold recipes there too
        assert any(count > 1 for count in plan.forward_counts)
        assert any(count == 1 for count in plan.forward_counts)


class _NormedFusedMlp(nn.Module):
    """A pre-norm block with a GELU of one operation: its norm's output is all it leaves to backward."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("fraction", [0.5, "min"])
def test_planned_with_elementwise_makes_layer_norm_outputs_again(fraction: object) -> None:
    # NOTE [layer norms made again]: blocks with a fused GELU (BERT's, ViT's) leave their norm's output
    torch.manual_seed(9)
    model, x = nn.Sequential(*[_NormedFusedMlp() for _ in range(6)]), torch.randn(32, 32)
    planned = _planned_exactly(model, x, fraction)
    assert planned.plan is not None
    assert list(planned.plan.schedule.profile.metadata["elementwise_stages"]) == list(range(6))
    budget = fraction if fraction == "min" else planned.plan.budget_bytes
    without, _, _ = _planned_steps(copy.deepcopy(model), x, budget, False, steps=1)
    stored = [p.plan.measurement.profile.saved_bytes[0] for p in (without, planned)]  # type: ignore[union-attr]
    assert stored[0] - stored[1] == 32 * 32 * 4  # the norm's output


def test_planned_with_elementwise_recomputes_fewer_stages_at_the_same_budget() -> None:
    model, x = _planned_case()
    _, _, plain_peak = _plain_peak(model, x)
    budget = plain_peak // 2
    without, _, _ = _planned_steps(copy.deepcopy(model), x, budget, False, steps=1)
    with_it, _, _ = _planned_steps(copy.deepcopy(model), x, budget, True, steps=1)
    recomputed = [sum(count > 1 for count in p.plan.forward_counts) for p in (without, with_it)]
    assert recomputed[1] < recomputed[0]
    # each block's GELU leaves its two factors and its product (3 tensors of 32 x 128 floats) to
    # backward: the plan sizes the stored stage smaller by that
    stored = [p.plan.measurement.profile.saved_bytes[0] for p in (without, with_it)]  # type: ignore[union-attr]
    assert stored[0] - stored[1] == 3 * 32 * 128 * 4


def test_planned_sizes_on_fake_tensors_are_those_of_a_real_step() -> None:
    model, x = _planned_case()
    sizes = []
    for measure in ("sized", "plain"):
        planned = remat.Checkpointable(copy.deepcopy(model), 1.0, elementwise=True, measure=measure)
        measurement = planned.measure(x)
        sizes.append((measurement.profile.saved_bytes, measurement.measured_peak_bytes))
    assert sizes[0] == sizes[1]


def test_planned_with_elementwise_on_a_hugging_face_gpt2() -> None:
    model, ids = _tiny_gpt2(4, 64)
    plain = copy.deepcopy(model)
    torch.manual_seed(0)
    with remat.MemoryTracker() as tracker:
        expected = plain(ids, labels=ids).loss
        expected.backward()
    for budget in (tracker.peak_bytes // 2, "min"):
        planned = remat.Checkpointable(copy.deepcopy(model), budget, elementwise=True)
        for _ in range(2):
            planned.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            with remat.MemoryTracker() as step:
                loss = planned(ids, labels=ids).loss
                loss.backward()
        assert torch.equal(loss, expected)
        for a, b in zip(plain.parameters(), planned.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        assert step.peak_bytes <= planned.plan.predicted_peak_bytes <= planned.plan.budget_bytes


@pytest.mark.parametrize(
    "options, error",
    [
        ({"policy": remat.policies.save_matmuls}, NotImplementedError),
        ({"offload": 1e9}, NotImplementedError),
        ({"measure": "frugal"}, NotImplementedError),
        ({"elementwise": 1}, TypeError),
    ],
)
def test_planned_with_elementwise_refuses_what_is_not_built(options: dict, error: type) -> None:
    model, _ = _planned_case()
    with pytest.raises(error, match="elementwise"):
        remat.Checkpointable(model, 0.5, **{"elementwise": True, **options})


def test_measuring_leaves_no_scope_behind_after_an_error() -> None:
    from remat.manual._planned_scope import planning
    from remat.manual.elementwise import filling

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ZeroDivisionError

    model = nn.Sequential(_Mlp(width=8), Failing())
    with pytest.raises(ZeroDivisionError):
        remat.Checkpointable(model, 0.5, elementwise=True)(torch.randn(2, 8))
    assert planning() is None and filling() is None
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert torch._C._len_torch_dispatch_stack() == 0


class _Product(nn.Module):
    """A stage whose output is a product of two tensors it saves: the next stage saves it too."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


@pytest.mark.parametrize("fraction", [0.6, 0.45, 0.3])
def test_a_recipe_reads_only_what_its_own_stage_saved(fraction: float) -> None:
    # Were the product made again from the factors of the stage before, a stage would keep
    # less only while the stage before is stored: the plan, sizing each stage once, would
    # not hold where the stage before is recomputed.
    torch.manual_seed(10)
    model, x = nn.Sequential(*[_Product() for _ in range(10)]), torch.randn(64, 32)
    loss, grads, plain_peak = _plain_peak(model, x)
    planned, planned_loss, peak = _planned_steps(copy.deepcopy(model), x, int(fraction * plain_peak), True)
    assert torch.equal(loss, planned_loss)
    for a, b in zip(grads, planned.parameters(), strict=True):
        assert torch.equal(a, b.grad)
    assert peak == planned.plan.predicted_peak_bytes


def test_a_plan_runs_only_as_it_was_made_with_or_without_elementwise_saves(tmp_path: object) -> None:
    model, x = _planned_case()
    planned = remat.Checkpointable(copy.deepcopy(model), 0.5, elementwise=True, loss_fn=_loss)
    _loss(planned(x)).backward()
    assert planned.plan.schedule.profile.metadata["elementwise"] is True
    path = tmp_path / "plan.json"  # type: ignore[operator]
    path.write_text(planned.plan.to_json())
    with pytest.raises(remat.RematError, match="made with elementwise=True"):
        remat.Checkpointable(copy.deepcopy(model), plan=path, loss_fn=_loss)(x)
    again = remat.Checkpointable(copy.deepcopy(model), plan=path, elementwise=True, loss_fn=_loss)
    _loss(again(x)).backward()


def test_a_recipe_finds_what_was_saved_when_ids_are_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recompute frame holds a detached alias of what it saves, and the tensor itself dies at
    # once: its id may go to a tensor saved later. Here every tensor of a replay is filed under
    # one key: the replays must still make again what the measuring step made again.
    from remat.manual.elementwise import filling

    monkeypatch.setattr(remat.manual._recipes, "_key", lambda tensor: 0 if filling() else id(tensor))
    model, ids = _tiny_gpt2(4, 64)
    planned = remat.Checkpointable(model, "min", elementwise=True)
    for _ in range(2):
        planned.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as step:
            planned(ids, labels=ids).loss.backward()
    assert step.peak_bytes <= planned.plan.predicted_peak_bytes


# -- NOTE [stages that make no recipe]


class _OneOperationGelu(nn.Module):
    """A block whose GELU is one ATen operation: nothing it saves is made by a cheap one."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def _mixed_case() -> tuple[nn.Module, torch.Tensor]:
    """Blocks 1, 3 and 6 write their GELU out (recipes); the others keep only what one operation made."""
    torch.manual_seed(5)
    blocks = [_Mlp(width=32) if i in (1, 3, 6) else _OneOperationGelu(32) for i in range(8)]
    return nn.Sequential(*blocks), torch.randn(32, 32)


@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.4, "min"])
def test_only_the_stages_that_make_a_recipe_run_in_the_scope(fraction: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.manual._planned_scope import planning

    entered: list[tuple[int | None, str]] = []
    stage_call = remat.ElementwiseRecompute.stage_call

    def noted(self: remat.ElementwiseRecompute, index: int | None = None, *, replay: bool = False):  # type: ignore[no-untyped-def]
        measuring = planning() is self
        entered.append((index, "executor" if not measuring else "sizing" if self.scoped_stages is None else "timing"))
        return stage_call(self, index, replay=replay)

    monkeypatch.setattr(remat.ElementwiseRecompute, "stage_call", noted)
    model, x = _mixed_case()
    loss, grads, plain_peak = _plain_peak(model, x)
    budget = fraction if fraction == "min" else int(fraction * plain_peak)  # type: ignore[operator]
    planned, planned_loss, peak = _planned_steps(copy.deepcopy(model), x, budget, True)
    assert planned.plan.schedule.profile.metadata["elementwise_stages"] == [1, 3, 6]
    assert "elementwise:     stage calls 1, 3, 6 leave saves to backward" in str(planned.plan.schedule)
    assert torch.equal(loss, planned_loss)
    for a, b in zip(grads, planned.parameters(), strict=True):
        assert torch.equal(a, b.grad)
    assert peak == planned.plan.predicted_peak_bytes <= planned.plan.budget_bytes
    # the sizing step scopes every stage call; the timing pass and the steps, those three alone
    scoped = {
        phase: {index for index, where in entered if where == phase} for phase in ("sizing", "timing", "executor")
    }
    assert scoped == {"sizing": set(range(8)), "timing": {1, 3, 6}, "executor": {1, 3, 6}}


def test_a_model_that_makes_no_recipe_runs_its_own_forward_at_a_full_budget() -> None:
    torch.manual_seed(5)
    model, x = nn.Sequential(*[_OneOperationGelu(32) for _ in range(6)]), torch.randn(32, 32)
    loss, grads, plain_peak = _plain_peak(model, x)
    planned, planned_loss, peak = _planned_steps(copy.deepcopy(model), x, 1.0, True)
    assert planned.plan.schedule.profile.metadata["elementwise_stages"] == []
    assert "elementwise:     no stage call leaves saves to backward" in str(planned.plan.schedule)
    (executor,) = planned._executors.values()
    assert executor.plain  # NOTE [nothing to recompute]: no stage intercepted
    assert torch.equal(loss, planned_loss) and peak == plain_peak


def _without_key(data: object, key: str) -> object:
    if isinstance(data, dict):
        return {k: _without_key(v, key) for k, v in data.items() if k != key}
    if isinstance(data, list):
        return [_without_key(v, key) for v in data]
    return data


def test_a_plan_that_does_not_name_its_scoped_stages_scopes_every_one() -> None:
    from remat.plan.elementwise import elementwise_stages

    model, x = _mixed_case()
    planned, _, _ = _planned_steps(copy.deepcopy(model), x, 0.6, True, steps=1)
    plan = planned.plan
    assert elementwise_stages(plan.schedule.profile, 8) == (1, 3, 6)
    metadata = {k: v for k, v in plan.schedule.profile.metadata.items() if k != "elementwise_stages"}
    older = remat.Plan.from_json(json.dumps(_without_key(json.loads(plan.to_json()), "elementwise_stages")))
    assert dict(older.schedule.profile.metadata) == metadata
    assert elementwise_stages(older.schedule.profile, 8) == tuple(range(8))
    again = remat.Checkpointable(copy.deepcopy(model), plan=older, elementwise=True, loss_fn=_loss)
    _loss(again(x)).backward()
    (executor,) = again._executors.values()
    assert executor.elementwise == frozenset(range(8))
    without, _, _ = _planned_steps(copy.deepcopy(model), x, 0.6, False, steps=1)
    assert elementwise_stages(without.plan.schedule.profile, 8) == ()
