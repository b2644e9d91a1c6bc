"""What a replay holds for a later glue (NOTE [constants an earlier stage takes]): each value
until the last glue that takes it, as the plan counts it.

A Hugging Face encoder (DistilBERT's layout) makes its attention mask after the embeddings'
last stage, in that stage's glue, where the first block's query and key projections run
too; every block's glue takes the mask. A replay held all three until the last block's
glue, so the first block's query and key were alive through the last block's attention,
which the plan does not count: with attention dropout (the math attention, which saves
copies of the query and key, not the projections) the step went over its budget.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.discover.glue import EarlierInputs, GlueRecorder

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class MaskedAttention(nn.Module):
    """Query, key and value projections (the chain goes on through the value's), with an
    additive mask the model made once for every block, and dropout on the weights."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1 if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, width))


class PostNormBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = MaskedAttention(width, 4)
        self.ln_1 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x, mask))
        return self.ln_2(x + self.fc(x))


class MaskedEncoder(nn.Module):
    def __init__(self, width: int = 64, depth: int = 2, vocabulary: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(PostNormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(self.embed(tokens)))
        mask = (1.0 - keep[:, None, None, :].float()) * -1e4  # glue after `drop`, beside q and k
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def test_a_mask_every_block_takes_does_not_keep_the_first_blocks_query_and_key_through_the_replay() -> None:
    model = MaskedEncoder().train()
    tokens, target = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    keep = torch.ones_like(tokens)
    keep[:, -4:] = 0
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    _loss(reference(tokens, keep), target).backward()
    wrapped = remat.Checkpointable(model, "min", loss_fn=lambda out: _loss(out, target), output_kept=False, nested=True)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with remat.MemoryTracker() as tracker:
            torch.manual_seed(1)
            _loss(wrapped(tokens, keep), target).backward()
        plan = wrapped.plan
        assert plan is not None and plan.budget_bytes is not None
        names = plan.schedule.profile.names
        assert "drop" in names and "blocks.1.attn.v_proj" in names and "blocks.0.attn.q_proj" not in names
        assert any(taken.made and len(taken.pairs) > 1 for taken in plan.measurement.taken_again)  # the mask
        assert tracker.peak_bytes <= plan.predicted_peak_bytes, step
        assert tracker.peak_bytes <= plan.budget_bytes, step
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_replay_lets_go_of_what_an_earlier_glue_made_after_the_last_glue_that_takes_it() -> None:
    # the glue after stage 1 makes a query, taken by the glue after stage 2, and a mask,
    # taken by the glues after stages 2 and 4
    earlier = EarlierInputs(frozenset({(1, 2), (1, 4)}))
    stage_in, stage_out = torch.randn(4), torch.randn(4)
    recorder = GlueRecorder([stage_in], [stage_out])
    recorder.start()
    query, mask = stage_out * 2, stage_out - 1
    first = recorder.finish((stage_out + 1,), {})
    earlier.recorded(1, first, recorder)
    glues = {}
    for stage, takes in ((2, lambda out: out + query + mask), (4, lambda out: out * mask)):
        later_in, later_out = torch.randn(4), torch.randn(4)
        recorder = GlueRecorder([later_in], [later_out])
        recorder.start()
        result = takes(later_out)
        glues[stage] = (recorder.finish((result,), {}), [later_in, later_out], result)
        earlier.recorded(stage, glues[stage][0], recorder)
        assert glues[stage][0].constants == []  # taken from the replay, not kept
    made: list[weakref.ref[torch.Tensor]] = []
    keep = earlier.keeper(1)
    assert keep is not None

    def watched(slot: int, tensor: torch.Tensor) -> None:
        made.append(weakref.ref(tensor))
        keep(slot, tensor)

    with earlier.replay():
        first.replay([stage_in, stage_out * 1], earlier.input, watched)
        replayed_query, replayed_mask = made[0], made[1]
        for stage in (2, 4):
            glue, values, result = glues[stage]
            (args, _) = glue.replay(list(values), earlier.input)
            earlier.glue_replayed(stage)
            assert torch.equal(args[0], result)
            assert replayed_query() is None  # the glue after stage 2 was its last taker
            assert (replayed_mask() is None) == (stage == 4)
