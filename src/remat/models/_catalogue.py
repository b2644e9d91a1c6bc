"""The catalogue of ready-made models the command-line tool offers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from remat.models._forwards import EncoderDecoder, ResidualLoop, UNet
from remat.models._gpt import GPTConfig, gpt2
from remat.models._resnet import resnet, resnet_small
from remat.models._simple import convnet, mlp_chain
from remat.models._vgg import vgg
from remat.models._vit import ViTConfig, vit

__all__ = ["CATALOGUE", "ModelSpec", "model_spec"]

_IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelSpec:
    """A model of the catalogue, with synthetic data and a loss to train it on.

    Usage::

        spec = CATALOGUE["resnet_small"]
        model = spec.factory()
        inputs, target = spec.make_batch(16, torch.device("cpu"))
        loss = spec.loss_fn(model(*inputs), target)

    Attributes:
        name: the key of the entry in :data:`CATALOGUE`.
        description: one line for listings.
        factory: builds the model (a chain, an ``nn.Sequential``, or a model with a
            forward of its own); its defaults are small enough for a CPU demo
            and keyword arguments override them (``spec.factory(width=8)``).
            ``make_input`` assumes the default input shape (image size,
            vocabulary, sequence length), so keep those when overriding.
        make_input: ``(batch_size, device) -> inputs``, a tuple of random
            tensors to call the model with, ``model(*inputs)``.
        make_target: ``inputs -> target``: random class labels for
            classifiers, the next token for a language model, random values
            for a regression.
        loss_fn: ``(output, target) -> loss``, a scalar tensor.
    """

    name: str
    description: str
    factory: Callable[..., nn.Module]
    make_input: Callable[[int, torch.device], tuple[Tensor, ...]]
    make_target: Callable[[tuple[Tensor, ...]], Tensor]
    loss_fn: Callable[[Tensor, Tensor], Tensor]

    def make_batch(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """Draws one synthetic batch: the model's inputs and the matching target.

        Args:
            batch_size: number of samples.
            device: where to create the tensors; None (the default): torch's default
                device, where ``build()`` puts the model's parameters too.

        Returns:
            ``(inputs, target)``.
        """
        inputs = self.make_input(batch_size, torch.get_default_device() if device is None else torch.device(device))
        return inputs, self.make_target(inputs)


def _random_images(batch_size: int, device: torch.device, *, size: int, channels: int = 3) -> tuple[Tensor, ...]:
    return (torch.randn(batch_size, channels, size, size, device=device),)


def _random_features(batch_size: int, device: torch.device, *, width: int) -> tuple[Tensor, ...]:
    return (torch.randn(batch_size, width, device=device),)


def _random_tokens(batch_size: int, device: torch.device, *, vocab_size: int, tokens: int) -> tuple[Tensor, ...]:
    return (torch.randint(0, vocab_size, (batch_size, tokens), device=device),)


def _random_sequences(
    batch_size: int, device: torch.device, *, lengths: tuple[int, ...], features: tuple[int, ...]
) -> tuple[Tensor, ...]:
    return tuple(torch.randn(batch_size, n, f, device=device) for n, f in zip(lengths, features, strict=True))


def _random_target(inputs: tuple[Tensor, ...], *, features: int) -> Tensor:
    last = inputs[-1]
    return torch.randn(*last.shape[:-1], features, device=last.device)


def _random_masks(inputs: tuple[Tensor, ...], *, classes: int) -> Tensor:
    images = inputs[0]
    return torch.randint(0, classes, (images.shape[0], *images.shape[2:]), device=images.device)


def _random_labels(inputs: tuple[Tensor, ...], *, num_classes: int) -> Tensor:
    first = inputs[0]
    return torch.randint(0, num_classes, (first.shape[0],), device=first.device)


def _random_like_input(inputs: tuple[Tensor, ...]) -> Tensor:
    return torch.randn_like(inputs[0])


def _next_tokens(inputs: tuple[Tensor, ...]) -> Tensor:
    """Each position's target is the following token; the last one is ignored."""
    ids = inputs[0]
    target = ids.roll(-1, dims=-1)
    target[..., -1] = _IGNORE_INDEX
    return target


def _classification_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def _language_model_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten(), ignore_index=_IGNORE_INDEX)


def _regression_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


_CLASSES = 10
_GPT_DEMO = GPTConfig(vocab_size=1024, n_positions=128, d_model=128, n_heads=4, n_layers=4, dropout=0.1)
_VIT_DEMO = ViTConfig(
    image_size=32,
    patch_size=4,
    num_classes=_CLASSES,
    d_model=128,
    n_heads=4,
    n_layers=4,
    mlp_dim=512,
    dropout=0.1,
)
_MLP_WIDTH = 256


def _image_classifier(name: str, description: str, factory: Callable[..., nn.Sequential], *, size: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=description,
        factory=factory,
        make_input=partial(_random_images, size=size),
        make_target=partial(_random_labels, num_classes=_CLASSES),
        loss_fn=_classification_loss,
    )


def _build() -> dict[str, ModelSpec]:
    specs = [
        _image_classifier(
            f"resnet{depth}",
            f"ResNet-{depth}, full width, 10 classes, 64x64 images",
            partial(resnet, depth=depth, num_classes=_CLASSES),
            size=64,
        )
        for depth in (18, 34, 50, 101, 152)
    ]
    specs += [
        _image_classifier(
            f"vgg{depth}",
            f"VGG-{depth} with batch norm, 512-wide classifier, 10 classes, 32x32 images",
            partial(
                vgg,
                depth=depth,
                num_classes=_CLASSES,
                batch_norm=True,
                hidden_features=512,
                image_size=32,
            ),
            size=32,
        )
        for depth in (11, 16, 19)
    ]
    specs += [
        ModelSpec(
            name="gpt2",
            description=(
                f"GPT-2-style decoder, {_GPT_DEMO.n_layers} layers, d_model {_GPT_DEMO.d_model}, "
                f"vocabulary {_GPT_DEMO.vocab_size}, {_GPT_DEMO.n_positions} tokens"
            ),
            factory=partial(gpt2, _GPT_DEMO),
            make_input=partial(_random_tokens, vocab_size=_GPT_DEMO.vocab_size, tokens=_GPT_DEMO.n_positions),
            make_target=_next_tokens,
            loss_fn=_language_model_loss,
        ),
        _image_classifier(
            "vit",
            (
                f"ViT-style encoder, {_VIT_DEMO.n_layers} layers, d_model {_VIT_DEMO.d_model}, "
                "4x4 patches, 10 classes, 32x32 images"
            ),
            partial(vit, _VIT_DEMO),
            size=_VIT_DEMO.image_size,
        ),
        ModelSpec(
            name="mlp",
            description=f"uniform chain of 8 MLP blocks ({_MLP_WIDTH} -> 4x -> {_MLP_WIDTH}), MSE",
            factory=partial(mlp_chain, depth=8, width=_MLP_WIDTH),
            make_input=partial(_random_features, width=_MLP_WIDTH),
            make_target=_random_like_input,
            loss_fn=_regression_loss,
        ),
        _image_classifier(
            "convnet",
            "heterogeneous conv chain (conv-BN-ReLU, 32 to 256 channels), 32x32 images",
            partial(convnet, num_classes=_CLASSES),
            size=32,
        ),
        ModelSpec(
            name="residual",
            description="residual loop x = x + gamma * block(norm(x)), 8 MLP blocks of 256, 128 tokens, MSE",
            factory=partial(ResidualLoop, "pre-norm, scaled", n=8, width=256, features=64),
            make_input=partial(_random_sequences, lengths=(128,), features=(64,)),
            make_target=partial(_random_target, features=4),
            loss_fn=_regression_loss,
        ),
        ModelSpec(
            name="encoder_decoder",
            description="encoder-decoder, 6 + 6 residual MLP blocks of 256, the decoder's taking the encoder's output",
            factory=partial(
                EncoderDecoder, n_encoder=6, n_decoder=6, width=256, source_features=64, target_features=32
            ),
            make_input=partial(_random_sequences, lengths=(128, 96), features=(64, 32)),
            make_target=partial(_random_target, features=4),
            loss_fn=_regression_loss,
        ),
        ModelSpec(
            name="unet",
            description="U-Net, 4 levels of conv-BN-ReLU from 16 channels, skips concatenated, 64x64 images",
            factory=partial(UNet, depth=4, channels=16, classes=2),
            make_input=partial(_random_images, size=64),
            make_target=partial(_random_masks, classes=2),
            loss_fn=_classification_loss,
        ),
        _image_classifier(
            "resnet_small",
            "small CIFAR-style ResNet (3 stages of 2 basic blocks, width 16), 32x32 images",
            partial(resnet_small, num_classes=_CLASSES),
            size=32,
        ),
    ]
    return {spec.name: spec for spec in specs}


CATALOGUE: dict[str, ModelSpec] = _build()
"""Every ready-made model, by name (``resnet18`` ... ``resnet_small``)."""


def model_spec(name: str) -> ModelSpec:
    """The catalogue entry called ``name``.

    Args:
        name: a key of :data:`CATALOGUE`.

    Returns:
        The entry.

    Raises:
        ValueError: no entry has that name; the message lists the valid ones.
    """
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(sorted(CATALOGUE))
        raise ValueError(f"unknown model {name!r}; choose one of: {known}") from None
