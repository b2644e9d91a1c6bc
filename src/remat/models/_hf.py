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

__all__ = ["CAUSAL_LMS", "hugging_face_architectures", "hugging_face_model"]

Case = tuple[Callable[[], nn.Module], dict[str, Any]]

#: The architectures that generate text.
CAUSAL_LMS = frozenset({"gpt2", "llama", "qwen2", "mistral", "gpt_neox"})


def _transformers() -> Any:
    import transformers

    return transformers


def _tokens(scale: int, length: int = 32, vocab: int = 256) -> torch.Tensor:
    # made on the CPU whatever torch's default device: the generator is the CPU's
    generator = torch.Generator(device="cpu").manual_seed(1)
    return torch.randint(0, vocab, (2 * scale, length * scale), generator=generator, device="cpu")


def _config(config_class: Any, overrides: dict[str, Any], **defaults: Any) -> Any:
    """The config of small sizes, with `overrides` (each a setting the config has)."""
    known = config_class()
    unknown = [key for key in overrides if not hasattr(known, key)]
    if unknown:
        raise ValueError(
            f"{config_class.__name__} has no setting {', '.join(map(repr, unknown))}; settings are the "
            f"attributes of {config_class.__name__}() (e.g. {', '.join(sorted(defaults)[:4])})"
        )
    settings = {**defaults, **overrides}
    vocabulary = settings.get("vocab_size", getattr(known, "vocab_size", None))
    for name in ("bos_token_id", "eos_token_id"):  # the defaults name tokens of the full vocabulary
        token = getattr(known, name, None)
        if name not in settings and isinstance(vocabulary, int) and isinstance(token, int) and token >= vocabulary:
            settings[name] = 0
    return config_class(**settings)


def _causal_lm(name: str, scale: int, overrides: dict[str, Any]) -> Case:
    families = {
        "llama": (_transformers().LlamaForCausalLM, _transformers().LlamaConfig, {"num_key_value_heads": 2}),
        "qwen2": (_transformers().Qwen2ForCausalLM, _transformers().Qwen2Config, {"num_key_value_heads": 2}),
        "mistral": (_transformers().MistralForCausalLM, _transformers().MistralConfig, {"num_key_value_heads": 2}),
        "gpt_neox": (_transformers().GPTNeoXForCausalLM, _transformers().GPTNeoXConfig, {}),
    }
    model_class, config_class, extra = families[name]
    config = _config(
        config_class,
        overrides,
        vocab_size=256,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=128 * scale,
        **extra,
    )
    tokens = _tokens(scale, vocab=config.vocab_size)
    return lambda: model_class(config), {"input_ids": tokens, "labels": tokens}


def _bert(scale: int, overrides: dict[str, Any]) -> Case:
    config = _config(
        _transformers().BertConfig,
        overrides,
        vocab_size=256,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=max(512, 32 * scale),
    )
    tokens = _tokens(scale, vocab=config.vocab_size)
    mask = torch.ones_like(tokens)
    mask[:, -4:] = 0
    return lambda: _transformers().BertForMaskedLM(config), {
        "input_ids": tokens,
        "attention_mask": mask,
        "labels": tokens,
    }


def _seq2seq_inputs(scale: int, vocab: int) -> dict[str, torch.Tensor]:
    """An encoder-decoder's training inputs: source tokens, and shorter target tokens as labels."""
    return {"input_ids": _tokens(scale, vocab=vocab), "labels": _tokens(scale, length=16, vocab=vocab)}


def _t5(scale: int, overrides: dict[str, Any]) -> Case:
    config = _config(
        _transformers().T5Config,
        overrides,
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
    return lambda: _transformers().T5ForConditionalGeneration(config), _seq2seq_inputs(scale, config.vocab_size)


def _bart(scale: int, overrides: dict[str, Any]) -> Case:
    config = _config(
        _transformers().BartConfig,
        overrides,
        vocab_size=256,
        d_model=64 * scale,
        encoder_ffn_dim=128 * scale,
        decoder_ffn_dim=128 * scale,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        max_position_embeddings=128 * scale,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return lambda: _transformers().BartForConditionalGeneration(config), _seq2seq_inputs(scale, config.vocab_size)


def _images(scale: int, pixels: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(2)
    return torch.randn(2 * scale, 3, pixels, pixels, generator=generator, device="cpu")


def _image_classifier(model_class: str, config: Any, scale: int, pixels: int) -> Case:
    """A Hugging Face image classifier, with a batch (of ``2 * scale``) of images of `pixels`."""
    labels = torch.arange(2 * scale, device="cpu") % config.num_labels
    inputs = {"pixel_values": _images(scale, pixels), "labels": labels}
    return lambda: getattr(_transformers(), model_class)(config), inputs


def _vit(scale: int, overrides: dict[str, Any]) -> Case:
    config = _config(
        _transformers().ViTConfig,
        overrides,
        image_size=32 * scale,
        patch_size=8,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_labels=3,
    )
    return _image_classifier("ViTForImageClassification", config, scale, config.image_size)


def _cnn(name: str, scale: int, overrides: dict[str, Any], **sizes: Any) -> Case:
    """A Hugging Face CNN classifier (``ResNet``, ``ConvNext``) of four stages, 3 labels."""
    config = _config(
        getattr(_transformers(), f"{name}Config"),
        overrides,
        hidden_sizes=[16 * scale, 32 * scale, 64 * scale, 64 * scale],
        depths=[1, 1, 2, 1],
        num_labels=3,
        **sizes,
    )
    return _image_classifier(f"{name}ForImageClassification", config, scale, 64 * scale)


def _resnet(scale: int, overrides: dict[str, Any]) -> Case:
    return _cnn("ResNet", scale, overrides, embedding_size=16 * scale)


def _convnext(scale: int, overrides: dict[str, Any]) -> Case:
    return _cnn("ConvNext", scale, overrides)


def _gpt2(scale: int, overrides: dict[str, Any]) -> Case:
    config = _config(
        _transformers().GPT2Config,
        overrides,
        n_layer=4,
        n_embd=64 * scale,
        n_head=4,
        vocab_size=256,
        n_positions=64 * scale,
    )
    tokens = _tokens(scale, vocab=config.vocab_size)
    return lambda: _transformers().GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}


_BUILDERS: dict[str, Callable[[int, dict[str, Any]], Case]] = {
    "gpt2": _gpt2,
    "llama": functools.partial(_causal_lm, "llama"),
    "qwen2": functools.partial(_causal_lm, "qwen2"),
    "mistral": functools.partial(_causal_lm, "mistral"),
    "gpt_neox": functools.partial(_causal_lm, "gpt_neox"),
    "bert": _bert,
    "t5": _t5,
    "bart": _bart,
    "vit": _vit,
    "resnet": _resnet,
    "convnext": _convnext,
}


#: The architectures ``--hf`` builds, in the order the help lists them.
HUGGING_FACE_NAMES = tuple(_BUILDERS)


def hugging_face_architectures(scale: int = 1) -> dict[str, Callable[[], Case]]:
    """Name -> a function giving ``(factory, kwargs)``: the model's factory and the keyword
    inputs of one training call (with ``labels``). `scale` multiplies the widths, the
    batch and the sequence length (or image size): 1 for tests, 4 for a benchmark whose
    steps take tens of milliseconds."""
    return {name: functools.partial(hugging_face_model, name, scale) for name in _BUILDERS}


def hugging_face_model(name: str, scale: int = 1, **config: Any) -> Case:
    """One architecture of :func:`hugging_face_architectures`, its config's settings
    changed by `config` (``num_hidden_layers=8``): ``(factory, kwargs)``.

    Raises:
        KeyError: no architecture of that name (the message lists them).
        ValueError: a setting its config does not have.
    """
    build = _BUILDERS.get(name)
    if build is None:
        raise KeyError(f"no Hugging Face architecture {name!r}; choose one of: {', '.join(sorted(_BUILDERS))}")
    return build(scale, config)
