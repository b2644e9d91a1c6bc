"""The pre-LayerNorm transformer block shared by the GPT-2 and ViT chains."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["SelfAttention", "TransformerBlock", "TransformerMLP"]


class SelfAttention(nn.Module):
    """Multi-head self-attention, written out so every saved tensor is visible.

    The attention matrix is computed explicitly (``softmax(q k^T / sqrt(d))``,
    then dropout, then ``@ v``) rather than by a fused kernel, so that the
    memory a stage holds is what a planner expects and so that dropout draws
    from the global random number generator.

    Args:
        d_model: width of the tokens.
        n_heads: number of heads; must divide ``d_model``.
        dropout: dropout after the output projection.
        attention_dropout: dropout on the attention probabilities.
        causal: mask attention to later positions (for a decoder). The mask is
            built inside :meth:`forward` from the sequence length, so the stage
            takes one tensor only.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must divide d_model ({d_model})")
        self.n_heads = n_heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attention_dropout = nn.Dropout(attention_dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attends over the tokens of ``x``, shaped ``(batch, tokens, d_model)``."""
        batch, tokens, d_model = x.shape
        head_dim = d_model // self.n_heads
        q, k, v = (
            part.view(batch, tokens, self.n_heads, head_dim).transpose(1, 2)
            for part in self.qkv(x).split(d_model, dim=2)
        )
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        if self.causal:
            allowed = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(allowed.logical_not(), float("-inf"))
        probabilities = self.attention_dropout(scores.softmax(dim=-1))
        out = (probabilities @ v).transpose(1, 2).reshape(batch, tokens, d_model)
        return self.dropout(self.proj(out))


class TransformerMLP(nn.Module):
    """Linear, GELU, linear, dropout: the feed-forward half of a block.

    Args:
        d_model: width of the tokens.
        hidden_features: width of the hidden layer.
        dropout: dropout after the second linear layer (and after the GELU when
            ``inner_dropout`` is set).
        inner_dropout: also apply dropout after the GELU (as ViT does).
        gelu_approximate: ``"none"`` for the exact GELU, ``"tanh"`` for the
            approximation GPT-2 uses.
    """

    def __init__(
        self,
        d_model: int,
        hidden_features: int,
        *,
        dropout: float = 0.0,
        inner_dropout: bool = False,
        gelu_approximate: str = "none",
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden_features)
        self.activation = nn.GELU(approximate=gelu_approximate)
        self.inner_dropout = nn.Dropout(dropout) if inner_dropout else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the feed-forward network token by token."""
        hidden = self.inner_dropout(self.activation(self.fc1(x)))
        return self.dropout(self.fc2(hidden))


class TransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block: one stage of a chain.

    ``x + attention(ln1(x))`` followed by ``x + mlp(ln2(x))``.

    Args:
        d_model: width of the tokens.
        n_heads: number of attention heads.
        hidden_features: width of the feed-forward hidden layer.
        dropout: dropout after the attention projection and in the MLP.
        attention_dropout: dropout on the attention probabilities.
        causal: use a causal attention mask.
        mlp_inner_dropout: also apply dropout after the GELU.
        gelu_approximate: ``"none"`` or ``"tanh"``.
        layer_norm_eps: epsilon of both layer norms.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        hidden_features: int,
        *,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        causal: bool = False,
        mlp_inner_dropout: bool = False,
        gelu_approximate: str = "none",
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.attention = SelfAttention(
            d_model,
            n_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
            causal=causal,
        )
        self.ln2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.mlp = TransformerMLP(
            d_model,
            hidden_features,
            dropout=dropout,
            inner_dropout=mlp_inner_dropout,
            gelu_approximate=gelu_approximate,
        )

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block to ``x``, shaped ``(batch, tokens, d_model)``."""
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))
