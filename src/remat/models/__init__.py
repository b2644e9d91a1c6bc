"""Ready-made models for the planner: chains, and models with a forward of their own.

Every chain factory returns an :class:`~torch.nn.Sequential` whose elements (after
flattening nested sequentials) each take one tensor and return one tensor, and
never modify their input in place: in-place ReLUs live inside block modules.
The parameters come in the same order as in the usual hand-written model with
its own ``forward``, so :func:`copy_weights` moves weights between the two.

Models written with their own ``forward``, the way people write them, are
:class:`ResidualLoop` (a residual loop, four spellings), :class:`SideInputs` (blocks taking
side inputs by keyword), :class:`EncoderDecoder` and :class:`UNet`.

Families: ResNet (:func:`resnet18` ... :func:`resnet152`, :func:`resnet_small`),
VGG (:func:`vgg11` ... :func:`vgg19`), a GPT-2-style decoder (:func:`gpt2`), a
ViT-style encoder (:func:`vit`) and two synthetic chains (:func:`mlp_chain`,
:func:`convnet`). :data:`CATALOGUE` pairs small versions of them with synthetic
data and a loss, for the command-line tool.
"""

from remat.models._catalogue import CATALOGUE, ModelSpec, model_spec
from remat.models._forwards import (
    RESIDUAL_KINDS,
    ConvBNReLU,
    EncoderDecoder,
    ResidualLoop,
    SideInputBlock,
    SideInputs,
    UNet,
)
from remat.models._gpt import GPTConfig, GPTEmbedding, LMHead, gpt2
from remat.models._hf import CAUSAL_LMS, hugging_face_architectures, hugging_face_model
from remat.models._resnet import (
    BasicBlock,
    Bottleneck,
    resnet,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
    resnet_small,
)
from remat.models._simple import MLPBlock, convnet, mlp_chain
from remat.models._transformer import SelfAttention, TransformerBlock, TransformerMLP
from remat.models._vgg import ConvBlock, LinearBlock, vgg, vgg11, vgg13, vgg16, vgg19
from remat.models._vit import ClassTokenHead, PatchEmbedding, ViTConfig, vit
from remat.models._weights import copy_weights, count_parameters

__all__ = [
    "CAUSAL_LMS",
    "RESIDUAL_KINDS",
    "ConvBNReLU",
    "EncoderDecoder",
    "ResidualLoop",
    "SideInputBlock",
    "SideInputs",
    "UNet",
    "hugging_face_architectures",
    "hugging_face_model",
    "BasicBlock",
    "Bottleneck",
    "CATALOGUE",
    "ClassTokenHead",
    "ConvBlock",
    "GPTConfig",
    "GPTEmbedding",
    "LMHead",
    "LinearBlock",
    "MLPBlock",
    "ModelSpec",
    "PatchEmbedding",
    "SelfAttention",
    "TransformerBlock",
    "TransformerMLP",
    "ViTConfig",
    "convnet",
    "copy_weights",
    "count_parameters",
    "gpt2",
    "mlp_chain",
    "model_spec",
    "resnet",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet_small",
    "vgg",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "vit",
]
