"""Nested plans (``nested=True``): blocks split into their own submodules, planned as one chain.

Each test trains an unmodified model whose blocks call their submodules with code in
between (residual additions, a shortcut, dropout) and compares it with plain autograd:
gradients bit for bit, the measured peak (first step included) against the budget, and
the prediction against the measured peak.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.discover import discover_chain
from remat.discover.glue import EarlierInputs, GlueRecorder
from remat.errors import RematError
from remat.plan.lifetimes import Lifetimes, ReplayHold, peak_with_lifetimes
from remat.plan.operations import Operation, OperationKind
from remat.plan.share import prepared
from remat.plan.simulate import SimulationResult, TimelineEntry

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(out.transpose(1, 2).reshape(batch, length, width)))


class Block(nn.Module):
    """A pre-norm transformer block: its forward adds the residual stream back twice."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, 4)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, vocabulary: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BasicBlock(nn.Module):
    """A residual block with BatchNorm whose shortcut is a module of its own (a stage)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        inner = channels // stride
        self.conv_1 = nn.Conv2d(inner, channels, 3, stride, 1, bias=False)
        self.norm_1 = nn.BatchNorm2d(channels)
        self.conv_2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm_2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Conv2d(inner, channels, 1, stride, bias=False) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm_1(self.conv_1(x)))
        h = self.norm_2(self.conv_2(h))
        return F.relu(h + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(8, 1), BasicBlock(16, 2), BasicBlock(16, 1), BasicBlock(32, 2))
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(images)).mean((2, 3)))


def decoder_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (4, 64))
    return Decoder(), tokens, torch.randint(0, 64, (4, 64))


def resnet_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return SmallResNet(), torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))


CASES = {"decoder": decoder_case, "resnet": resnet_case}


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def _plain(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    with remat.MemoryTracker() as tracker:
        torch.manual_seed(1)
        _loss(model(inputs), target).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_nested_chains_split_blocks_into_their_submodules(case: str) -> None:
    model, inputs, _ = CASES[case]()
    blocks = discover_chain(model, (inputs,), {})
    nested = discover_chain(model, (inputs,), {}, nested=True)
    assert len(nested) > 2 * len(blocks)
    # every stage of the nested chain lies inside one block of the chain of blocks
    for name in nested.names:
        assert any(name == block or name.startswith(block + ".") for block in blocks.names), name


# The small ResNet's blocks keep their input for the shortcut (NOTE [glue constants]),
# taken from replays or kept: its nested plans need most of the plain peak.
BUDGETS = [("decoder", 0.3), ("decoder", 0.6), ("decoder", "min"), ("resnet", 0.95), ("resnet", "min")]


@pytest.mark.parametrize(("case", "budget"), BUDGETS)
def test_nested_plans_train_exactly_within_the_budget(case: str, budget: float | str) -> None:
    model, inputs, target = CASES[case]()
    model.train()
    plain_peak, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
    )
    peaks = []
    for step in range(2):
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(inputs), target).backward()
        peaks.append(tracker.peak_bytes)
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert len(plan.forward_counts) > 8
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    # the first step (which measures) included; the prediction errs on the safe side
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes
    if budget != "min":
        assert plan.budget_bytes <= budget * plain_peak + 1
    assert sum(count > 1 for count in plan.forward_counts) > 0


def test_nested_plans_of_a_transformer_go_lower_than_plans_over_its_blocks() -> None:
    model, inputs, target = decoder_case()
    minimums = []
    for nested in (False, True):
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=nested
        )
        wrapped.measure(inputs)
        plan = wrapped.plan_for("min")
        minimums.append(plan.budget_bytes)
    assert minimums[1] < minimums[0]


def test_nested_plans_update_batch_norm_statistics_once() -> None:
    model, inputs, target = resnet_case()
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True)
    for _ in range(2):
        torch.manual_seed(1)
        _loss(wrapped(inputs), target).backward()
        torch.manual_seed(1)
        _loss(reference(inputs), target).backward()
    assert sum(count > 1 for count in wrapped.plan.forward_counts) > 0
    for ours, theirs in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


# NOTE [constants an earlier stage takes]: the residual stream a block's inner stages leave
# is what its first stage took; a plan whose regions replay that stage with the glue that
# adds it back takes it from the replay instead of keeping it through the step.
@pytest.mark.parametrize("case", sorted(CASES))
def test_residuals_taken_from_the_replay_lower_the_smallest_budget(case: str) -> None:
    model, inputs, target = CASES[case]()
    model.train()
    plain_peak, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True)
    measurement = wrapped.measure(inputs)
    assert measurement.taken_again  # the residuals (decoder) and the shortcuts' inputs (resnet)
    kept, taken = (
        prepared(measurement, loss_measured=True, output_kept=False, margin=0.0, solver=wrapped._solver(), take_again=t)
        for t in (False, True)
    )
    assert taken.held_outside_bytes < kept.held_outside_bytes
    assert taken.minimum_total_bytes() < kept.minimum_total_bytes()
    plan = wrapped.plan_for("min")
    assert plan.budget_bytes == taken.minimum_total_bytes()
    assert plan.schedule.profile.glue_spans  # the plan takes them from replays
    model.zero_grad(set_to_none=True)
    with remat.MemoryTracker() as tracker:
        torch.manual_seed(1)
        _loss(wrapped(inputs), target).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    assert tracker.peak_bytes < kept.minimum_total_bytes() < plain_peak


@pytest.mark.parametrize("budget", [0.25, 0.4])
def test_replays_holding_a_residual_are_predicted_within_the_budget(budget: float) -> None:
    # a replay holds the block's input from its first stage to the glue that adds it back
    model, inputs, target = decoder_case()
    model.train()
    _, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
    )
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(inputs), target).backward()
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))
    assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes <= 1.05 * tracker.peak_bytes


def test_a_glue_that_no_longer_takes_an_earlier_input_is_warned_about_and_a_missing_one_refused() -> None:
    # the executor's side of NOTE [constants an earlier stage takes]: a plan counted the
    # input of stage 1 as taken again by the glue after stage 3
    earlier = EarlierInputs(frozenset({(1, 3)}))
    residual, other = torch.randn(4), torch.randn(4)
    earlier.called(1, [residual])
    stage_in, stage_out = torch.randn(4), torch.randn(4)
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    summed = stage_out + other  # takes another tensor, not stage 1's input
    glue = recorder.finish((summed,), {})
    with pytest.warns(RuntimeWarning, match="no longer takes a value of stage"):
        earlier.recorded(3, glue, recorder)
    assert glue.constants == [other]
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    summed = stage_out + residual
    glue = recorder.finish((summed,), {})
    earlier.recorded(3, glue, recorder)
    assert glue.constants == []  # taken from the replay, not kept
    with pytest.raises(RematError, match="did not run"):
        glue.replay([stage_in, stage_out], earlier.input)
    with earlier.replay():
        earlier.replaying(1, [residual * 1])
        (args, _) = glue.replay([stage_in, stage_out], earlier.input)
        earlier.glue_replayed(3)
    assert torch.equal(args[0], summed)


class ConvNorm(nn.Sequential):
    def __init__(self, inner: int, channels: int, stride: int, act: bool = True) -> None:
        super().__init__(
            nn.Conv2d(inner, channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU() if act else nn.Identity(),
        )


class ShortcutBlock(nn.Module):
    """A residual block shaped like Hugging Face's ResNet layer: its main path a Sequential
    (the chain), its shortcut (a convolution and a norm) run after it on the block's input,
    as glue, which saves that input for its backward."""

    def __init__(self, inner: int, channels: int, stride: int) -> None:
        super().__init__()
        self.layer = nn.Sequential(ConvNorm(inner, channels, stride), ConvNorm(channels, channels, 1, act=False))
        changes = stride > 1 or inner != channels
        self.shortcut = (
            nn.Sequential(nn.Conv2d(inner, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))
            if changes
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = self.layer(x)
        return F.relu(h + self.shortcut(residual))


class ShortcutResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvNorm(3, 8, 1)
        widths = [(8, 8, 1), (8, 16, 2), (16, 16, 1), (16, 32, 2)]
        self.blocks = nn.Sequential(*(ShortcutBlock(*w) for w in widths))
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean((2, 3)))


# A shortcut run as glue saves the block's input, which its first stage took: a plan takes
# it from the replay (NOTE [constants an earlier stage takes]); a stored glue stage holds it
# to its backward, in the first forward and in replays. The gradient the shortcut gives that
# input is freed at the block's first stage's backward, and the model's own hold on it is
# the same tensor, counted once. (On Hugging Face's ResNet-18, nested plans went from a
# seventh of the plain peak above plans over blocks to as low as them.)
def test_a_shortcut_run_as_glue_is_taken_from_replays_and_nested_plans_go_as_low_as_blocks() -> None:
    torch.manual_seed(0)
    model, inputs, target = ShortcutResNet().train(), torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    plain_peak, _ = _plain(copy.deepcopy(model), inputs, target)
    minimums = []
    for nested in (False, True):
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=nested
        )
        measurement = wrapped.measure(inputs)
        minimums.append(wrapped.plan_for("min").budget_bytes)
    assert any(taken.saved for taken in measurement.taken_again)
    # every gradient a block's last stage leaves for its input (the residual's, the
    # shortcut's) is freed by the block's first stage's backward
    assert sum(nbytes for _, nbytes in measurement.leftover_freed) == sum(measurement.leftover_bytes) > 0
    assert minimums[1] <= minimums[0]
    for budget in ("min", 0.5):
        reference, ours = copy.deepcopy(model), copy.deepcopy(model)
        wrapped = remat.Checkpointable(
            ours, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
        )
        peaks = []
        for _ in range(2):
            with remat.MemoryTracker() as tracker:
                torch.manual_seed(1)
                _loss(wrapped(inputs), target).backward()
            peaks.append(tracker.peak_bytes)
            torch.manual_seed(1)
            _loss(reference(inputs), target).backward()
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None
        assert sum(count > 1 for count in plan.forward_counts) > 0
        assert plan.schedule.profile.glue_spans
        assert max(peaks) <= plan.budget_bytes
        assert peaks[1] <= plan.predicted_peak_bytes <= 1.05 * peaks[1]
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ours.buffers(), reference.buffers(), strict=True))
        if budget != "min":
            assert plan.budget_bytes <= budget * plain_peak + 1


class SplitAttention(nn.Module):
    """Attention with a projection each for query, key and value (Hugging Face's layout):
    the chain goes on through the value's projection, so the query's and the key's run as
    glue after the norm before it, and the scores as glue after the value's."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q, k = heads(self.q_proj(x)) * 0.5, heads(self.k_proj(x))
        v = heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, width))


class SplitBlock(Block):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.attn = SplitAttention(width, 4)  # type: ignore[assignment]


def split_decoder_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = Decoder()
    model.blocks = nn.ModuleList(SplitBlock(32) for _ in range(4))
    return model, torch.randint(0, 64, (4, 64)), torch.randint(0, 64, (4, 64))


# What the glue after a norm made (a query and a key) and the glue after the value's
# projection takes is taken from the replay of the norm's stage too (NOTE [constants an
# earlier stage takes]), with the attention's dropout drawing the same numbers.
@pytest.mark.parametrize("budget", ["min", 0.3, 0.5])
def test_a_query_and_key_made_by_an_earlier_glue_are_taken_from_replays(budget: float | str) -> None:
    torch.manual_seed(0)
    model, inputs, target = split_decoder_case()
    model.train()
    plain_peak, plain_grads = _plain(model, inputs, target)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True
    )
    measurement = wrapped.measure(inputs)
    names = discover_chain(model, (inputs,), {}, nested=True).names
    assert "blocks.0.attn.v_proj" in names and not any("q_proj" in name or "k_proj" in name for name in names)
    made = [taken for taken in measurement.taken_again if taken.made]
    assert len(made) == 2 * 4  # a query and a key per block
    if budget == "min":
        kept, taken = (
            prepared(
                measurement, loss_measured=True, output_kept=False, margin=0.0, solver=wrapped._solver(), take_again=t
            )
            for t in (False, True)
        )
        assert taken.minimum_total_bytes() < kept.minimum_total_bytes()
    peaks = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(inputs), target).backward()
        peaks.append(tracker.peak_bytes)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True)), step
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    assert sum(count > 1 for count in plan.forward_counts) > 0
    assert max(peaks) <= plan.budget_bytes
    assert peaks[1] <= plan.predicted_peak_bytes <= 1.05 * peaks[1]
    if budget != "min":
        assert plan.budget_bytes <= budget * plain_peak + 1


def test_a_glue_takes_what_an_earlier_glue_made_from_its_replay_and_refuses_a_missing_one() -> None:
    # the glue after stage 1 made `made`; the plan counted the glue after stage 3 as taking it
    earlier = EarlierInputs(frozenset({(1, 3)}))
    stage_in, stage_out = torch.randn(4), torch.randn(4)
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    made = stage_out * 2
    follows = stage_out + 1
    first = recorder.finish((follows,), {})
    earlier.recorded(1, first, recorder)
    later_in, later_out = torch.randn(4), torch.randn(4)
    recorder = GlueRecorder([later_in], [later_out])
    recorder.start()
    summed = later_out + made
    later = recorder.finish((summed,), {})
    earlier.recorded(3, later, recorder)
    assert later.constants == []  # taken from the replay, not kept
    with pytest.raises(RematError, match="did not run"):
        later.replay([later_in, later_out], earlier.input)
    with earlier.replay():
        replayed_out = stage_out * 1
        first.replay([stage_in, replayed_out], earlier.input, earlier.keeper(1))
        (args, _) = later.replay([later_in, later_out], earlier.input)
        earlier.glue_replayed(3)
    assert torch.equal(args[0], summed)


@pytest.mark.parametrize(("made", "held"), [(True, 100), (False, 0)])
def test_a_replay_that_checkpoints_a_stage_holds_what_its_glue_made_for_a_later_glue(made: bool, held: int) -> None:
    # NOTE [constants an earlier stage takes]: a checkpoint keeps a stage's input, not what
    # its glue makes (a query), which the replay holds until the later glue that takes it,
    # then (saved by it, the glue's stage stored) until that stage's backward
    # (an input: kept by the checkpoint, and by the stage, which saves it, when stored)
    kinds = [
        (OperationKind.FORWARD_CHECKPOINT, 0), (OperationKind.FORWARD_DISCARD, 1), (OperationKind.FORWARD_DISCARD, 2),
        (OperationKind.LOSS, None), (OperationKind.FORWARD_CHECKPOINT, 1), (OperationKind.FORWARD_STORE, 2),
        (OperationKind.BACKWARD, 2), (OperationKind.FORWARD_STORE, 1), (OperationKind.BACKWARD, 1),
        (OperationKind.FORWARD_STORE, 0), (OperationKind.BACKWARD, 0),
    ]  # fmt: skip
    timeline = tuple(TimelineEntry(Operation(kind, stage), 0, 0) for kind, stage in kinds)
    simulation = SimulationResult(0, 0.0, 0.0, (2, 3, 2), timeline)
    hold = ReplayHold(stage=1, glue_stage=2, nbytes=100, kept_by_stage=not made, saved_by_glue=True, made=made)
    assert peak_with_lifetimes(simulation, Lifetimes(replay_held=(hold,))) == held
    # a glue stored in the first forward is never replayed: it takes nothing
    first = (
        (OperationKind.FORWARD_STORE, 2) if stage == 2 and i == 2 else (kind, stage)
        for i, (kind, stage) in enumerate(kinds)
    )
    stored = tuple(TimelineEntry(Operation(kind, stage), 0, 0) for kind, stage in first)
    assert peak_with_lifetimes(SimulationResult(0, 0.0, 0.0, (2, 3, 2), stored), Lifetimes(replay_held=(hold,))) == 0


class _CheckpointsItsBlocks(nn.Module):
    """Runs each block through torch's checkpoint, as Hugging Face's gradient checkpointing
    does: the backward calls the blocks' submodules again."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_model_that_checkpoints_itself_is_refused_with_the_reason() -> None:
    wrapped = remat.Checkpointable(_CheckpointsItsBlocks(), "min", nested=True, loss_fn=lambda out: out.sum())
    with pytest.raises(remat.UnsupportedModel, match="during the backward.*gradient_checkpointing_disable"):
        wrapped(torch.randn(8, 16)).sum().backward()


class _PreNormMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))


@pytest.mark.parametrize("budget", ["min", 0.4])
def test_a_pinned_nested_plan_takes_residuals_from_replays_as_its_controller_did(budget: float | str) -> None:
    # the pairs whose glue takes a value from a replay came from the measurement alone: a
    # pinned plan (from JSON or the object) kept those values through the step, 25% over
    torch.manual_seed(0)
    model = nn.Sequential(*(_PreNormMLP(64) for _ in range(6)), nn.Linear(64, 8))
    own, pinned, reference = model, copy.deepcopy(model), copy.deepcopy(model)
    control = remat.enable(own, budget, nested=True)
    x, y = torch.randn(128, 64), torch.randint(0, 8, (128,))
    F.cross_entropy(own(x), y).backward()
    plan = control.plan
    assert plan is not None and plan.taken_again_pairs
    read = remat.plan.Plan.from_json(plan.to_json())
    assert read.taken_again_pairs == plan.taken_again_pairs
    remat.enable(pinned, plan=read, nested=True)
    with remat.MemoryTracker() as own_step:
        F.cross_entropy(own(x), y).backward()
    with remat.MemoryTracker() as pinned_step:
        F.cross_entropy(pinned(x), y).backward()
    assert pinned_step.peak_bytes == own_step.peak_bytes <= plan.budget_bytes
    F.cross_entropy(reference(x), y).backward()
    F.cross_entropy(reference(x), y).backward()  # (own ran two steps)
    for p, q in zip(pinned.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(2 * p.grad, q.grad)
