"""A GPT-2-style decoder-only language model as a chain."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from remat.models._transformer import TransformerBlock

__all__ = ["GPTConfig", "GPTEmbedding", "LMHead", "gpt2"]


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2-style model. The defaults are GPT-2 small (124 M).

    Attributes:
        vocab_size: number of token ids.
        n_positions: longest sequence the position embedding covers.
        d_model: width of the tokens.
        n_heads: attention heads per block.
        n_layers: number of transformer blocks.
        dropout: dropout probability on the embeddings, the attention
            probabilities and the residual branches.
        tie_weights: share the token embedding matrix with the LM head.
        layer_norm_eps: epsilon of every layer norm.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    dropout: float = 0.1
    tie_weights: bool = True
    layer_norm_eps: float = 1e-5


class GPTEmbedding(nn.Module):
    """Token embedding plus learned position embedding, then dropout.

    The first stage of the chain: it takes token ids, a ``LongTensor`` shaped
    ``(batch, tokens)``, and returns ``(batch, tokens, d_model)`` floats.

    Args:
        vocab_size: number of token ids.
        n_positions: longest sequence accepted.
        d_model: width of the tokens.
        dropout: dropout probability on the sum.
    """

    def __init__(self, vocab_size: int, n_positions: int, d_model: int, *, dropout: float = 0.0):
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(n_positions, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        """Embeds ``ids``.

        Raises:
            ValueError: the sequence is longer than ``n_positions``.
        """
        tokens = ids.shape[-1]
        if tokens > self.position.num_embeddings:
            raise ValueError(f"sequence of {tokens} tokens is longer than n_positions={self.position.num_embeddings}")
        positions = torch.arange(tokens, device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


class LMHead(nn.Module):
    """The output projection from ``d_model`` to vocabulary logits (no bias).

    Args:
        d_model: width of the tokens.
        vocab_size: number of token ids.
        weight: a ``(vocab_size, d_model)`` parameter to share, usually the
            token embedding matrix; a fresh one is made when ``None``.

    .. warning::
        With a shared ``weight`` the same :class:`~torch.nn.Parameter` is
        registered in two stages. ``model.parameters()`` lists it once and its
        gradient sums both uses; keep the two stages in the same model (moving
        or copying the whole chain keeps them tied, copying one stage alone
        does not).
    """

    def __init__(self, d_model: int, vocab_size: int, *, weight: nn.Parameter | None = None):
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(vocab_size, d_model))
            nn.init.normal_(weight, 0.0, 0.02)
        elif weight.shape != (vocab_size, d_model):
            raise ValueError(f"shared weight has shape {tuple(weight.shape)}, expected {(vocab_size, d_model)}")
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        """Returns the logits, shaped ``(..., vocab_size)``."""
        return F.linear(x, self.weight)


def _initialize(model: nn.Module, n_layers: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            # Residual projections are scaled down with depth, as in GPT-2.
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj", "fc2")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)


def gpt2(config: GPTConfig | None = None, **overrides: Any) -> nn.Sequential:
    """A GPT-2-style decoder as a chain.

    The chain is ``embedding`` (:class:`GPTEmbedding`, takes token ids),
    ``blocks`` (a nested :class:`~torch.nn.Sequential` of causal pre-LN
    :class:`TransformerBlock`), ``ln_f`` and ``head`` (:class:`LMHead`). The
    output is the logits, ``(batch, tokens, vocab_size)``.

    Args:
        config: the model shape; GPT-2 small when ``None``.
        **overrides: fields of :class:`GPTConfig` to replace, for example
            ``gpt2(n_layers=4)``.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        TypeError: an override is not a field of :class:`GPTConfig`.
        ValueError: ``n_heads`` does not divide ``d_model``.
    """
    config = dataclasses.replace(config or GPTConfig(), **overrides)
    embedding = GPTEmbedding(config.vocab_size, config.n_positions, config.d_model, dropout=config.dropout)
    blocks = nn.Sequential(
        *(
            TransformerBlock(
                config.d_model,
                config.n_heads,
                4 * config.d_model,
                dropout=config.dropout,
                attention_dropout=config.dropout,
                causal=True,
                gelu_approximate="tanh",
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.n_layers)
        )
    )
    model = nn.Sequential(
        OrderedDict(
            embedding=embedding,
            blocks=blocks,
            ln_f=nn.LayerNorm(config.d_model, eps=config.layer_norm_eps),
            head=LMHead(
                config.d_model,
                config.vocab_size,
                weight=cast(nn.Parameter, embedding.token.weight) if config.tie_weights else None,
            ),
        )
    )
    _initialize(model, config.n_layers)
    return model
