"""Hugging Face architectures built from small configs with random weights (no download).

Every setting is left at its default but the sizes (``use_cache=True`` for the causal
LMs, dropout on), and each comes with keyword inputs for a training call that computes the
model's own loss from ``labels``. :func:`hugging_face_architectures` needs the ``hf``
extra (``transformers``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["CAUSAL_LMS", "hugging_face_architectures"]

Case = tuple[Callable[[], nn.Module], dict[str, Any]]

#: The architectures that generate text.
CAUSAL_LMS = frozenset({"gpt2", "llama", "qwen2", "mistral", "gpt_neox"})


def _transformers() -> Any:
    import transformers

    return transformers


def _tokens(scale: int, length: int = 32, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2 * scale, length * scale), generator=torch.Generator().manual_seed(1))


def _causal_lm(name: str, scale: int) -> Case:
    families = {
        "llama": (_transformers().LlamaForCausalLM, _transformers().LlamaConfig, {"num_key_value_heads": 2}),
        "qwen2": (_transformers().Qwen2ForCausalLM, _transformers().Qwen2Config, {"num_key_value_heads": 2}),
        "mistral": (_transformers().MistralForCausalLM, _transformers().MistralConfig, {"num_key_value_heads": 2}),
        "gpt_neox": (_transformers().GPTNeoXForCausalLM, _transformers().GPTNeoXConfig, {}),
    }
    model_class, config_class, extra = families[name]
    config = config_class(
        vocab_size=256,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128 * scale,
        **extra,
    )
    tokens = _tokens(scale)
    return lambda: model_class(config), {"input_ids": tokens, "labels": tokens}


def _bert(scale: int) -> Case:
    config = _transformers().BertConfig(
        vocab_size=256,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=max(512, 32 * scale),
    )
    tokens = _tokens(scale)
    mask = torch.ones_like(tokens)
    mask[:, -4:] = 0
    return lambda: _transformers().BertForMaskedLM(config), {
        "input_ids": tokens,
        "attention_mask": mask,
        "labels": tokens,
    }


def _t5(scale: int) -> Case:
    config = _transformers().T5Config(
        vocab_size=256,
        d_model=64 * scale,
        d_ff=128 * scale,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        d_kv=16 * scale,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    kwargs = {"input_ids": _tokens(scale), "labels": _tokens(scale, length=16)}
    return lambda: _transformers().T5ForConditionalGeneration(config), kwargs


def _images(scale: int, size: int) -> torch.Tensor:
    return torch.randn(2 * scale, 3, size * scale, size * scale, generator=torch.Generator().manual_seed(2))


def _image_classifier(model_class: str, config: Any, scale: int, size: int) -> Case:
    """A Hugging Face image classifier of 3 labels, with a batch of images of `size`."""
    inputs = {"pixel_values": _images(scale, size), "labels": torch.arange(2 * scale) % 3}
    return lambda: getattr(_transformers(), model_class)(config), inputs


def _vit(scale: int) -> Case:
    config = _transformers().ViTConfig(
        image_size=32 * scale,
        patch_size=8,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_labels=3,
    )
    return _image_classifier("ViTForImageClassification", config, scale, 32)


def _resnet(scale: int) -> Case:
    config = _transformers().ResNetConfig(
        embedding_size=16 * scale,
        hidden_sizes=[16 * scale, 32 * scale, 64 * scale, 64 * scale],
        depths=[1, 1, 2, 1],
        num_labels=3,
    )
    return _image_classifier("ResNetForImageClassification", config, scale, 64)


def _convnext(scale: int) -> Case:
    config = _transformers().ConvNextConfig(
        hidden_sizes=[16 * scale, 32 * scale, 64 * scale, 64 * scale], depths=[1, 1, 2, 1], num_labels=3
    )
    return _image_classifier("ConvNextForImageClassification", config, scale, 64)


def _gpt2(scale: int) -> Case:
    config = _transformers().GPT2Config(n_layer=4, n_embd=64 * scale, n_head=4, vocab_size=256, n_positions=64 * scale)
    tokens = _tokens(scale)
    return lambda: _transformers().GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}


_BUILDERS: dict[str, Callable[[int], Case]] = {
    "gpt2": _gpt2,
    "llama": lambda scale: _causal_lm("llama", scale),
    "qwen2": lambda scale: _causal_lm("qwen2", scale),
    "mistral": lambda scale: _causal_lm("mistral", scale),
    "gpt_neox": lambda scale: _causal_lm("gpt_neox", scale),
    "bert": _bert,
    "t5": _t5,
    "vit": _vit,
    "resnet": _resnet,
    "convnext": _convnext,
}


def hugging_face_architectures(scale: int = 1) -> dict[str, Callable[[], Case]]:
    """Name -> a function giving ``(factory, kwargs)``: the model's factory and the keyword
    inputs of one training call (with ``labels``). `scale` multiplies the widths, the
    batch and the sequence length (or image size): 1 for tests, 4 for a benchmark whose
    steps take tens of milliseconds."""
    return {name: functools.partial(build, scale) for name, build in _BUILDERS.items()}
