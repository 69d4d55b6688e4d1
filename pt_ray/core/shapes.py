"""Transformer shapes by model name, and their per-layer FLOPs, parameters and activations.

Pure module: known timm ViT and Hugging Face BERT-family names map to their architecture without
importing timm or transformers, so ``pt-ray plan`` can predict a run for a model it never builds.

Counts are per sample; FLOPs count a multiply-add as 2. For a block of width D over T tokens with
MLP ratio r (Vaswani et al.; the attention cost as in Korthikanti et al., 2022):

1. attention projections (Q, K, V, output): ``4 T D^2`` multiply-adds;
2. attention scores and their product with V: ``2 T^2 D``;
3. MLP: ``2 T D (r D)``;

so a block's forward is ``2 (4 T D^2 + 2 T^2 D + 2 r T D^2)`` FLOPs; its backward is twice that.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "MODEL_SHAPES",
    "LayerShape",
    "ModelShape",
    "layer_shapes",
    "model_shape",
    "saved_activation_factor",
]


@dataclass(frozen=True)
class ModelShape:
    """A Transformer's architecture, as far as costs go.

    Attributes:
        name: the model's name.
        kind: ``vit`` (patch embedding, CLS-token classifier) or ``bert`` (token embedding,
            pooler and classifier; ``num_classes=2`` with ``task=qa`` is a span head).
        num_layers: L, transformer blocks.
        width: D, hidden size.
        heads: attention heads.
        tokens: T, sequence length (ViT: patches + 1 class token).
        mlp_ratio: r, MLP hidden size over D.
        num_classes: classifier outputs.
        patch_size: ViT patch side in pixels.
        in_chans: ViT input channels.
        vocab_size: BERT vocabulary.
        max_positions: BERT position table length.
    """

    name: str
    kind: Literal["vit", "bert"]
    num_layers: int
    width: int
    heads: int
    tokens: int
    mlp_ratio: float = 4.0
    num_classes: int = 1000
    patch_size: int = 16
    in_chans: int = 3
    vocab_size: int = 30522
    max_positions: int = 512

    def __post_init__(self) -> None:
        for field in ("num_layers", "width", "heads", "tokens", "num_classes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)} must be positive")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio={self.mlp_ratio} must be positive")
        if self.width % self.heads:
            raise ValueError(f"width={self.width} is not divisible by heads={self.heads}")


def _vit(name: str, layers: int, width: int, heads: int, patch: int = 16, image: int = 224):
    return ModelShape(name, "vit", layers, width, heads, (image // patch) ** 2 + 1,
                      patch_size=patch)


def _bert(name: str, layers: int, width: int, heads: int, vocab: int = 30522,
          positions: int = 512):
    return ModelShape(name, "bert", layers, width, heads, 128, num_classes=2,
                      vocab_size=vocab, max_positions=positions)


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _vit("vit_tiny_patch16_224", 12, 192, 3),
        _vit("vit_small_patch16_224", 12, 384, 6),
        _vit("vit_base_patch16_224", 12, 768, 12),
        _vit("vit_base_patch32_224", 12, 768, 12, patch=32),
        _vit("vit_large_patch16_224", 24, 1024, 16),
        _vit("vit_huge_patch14_224", 32, 1280, 16, patch=14),
        _vit("deit_tiny_patch16_224", 12, 192, 3),
        _vit("deit_small_patch16_224", 12, 384, 6),
        _vit("deit_base_patch16_224", 12, 768, 12),
        _bert("bert-base-uncased", 12, 768, 12),
        _bert("bert-base-cased", 12, 768, 12, vocab=28996),
        _bert("bert-large-uncased", 24, 1024, 16),
        _bert("bert-large-cased", 24, 1024, 16, vocab=28996),
        _bert("roberta-base", 12, 768, 12, vocab=50265, positions=514),
        _bert("roberta-large", 24, 1024, 16, vocab=50265, positions=514),
        _bert("distilbert-base-uncased", 6, 768, 12),
    )
}
"""Known names. BERT-family shapes default to 128 tokens and 2 classes; override as needed."""


def model_shape(name: str, **overrides) -> ModelShape:
    """The shape of a known model, with fields replaced by ``overrides`` (None values ignored).

    Raises:
        ValueError: an unknown name (listing the close and the known ones) or a bad override.
    """
    if name not in MODEL_SHAPES:
        close = difflib.get_close_matches(name, MODEL_SHAPES, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; known models: "
                         f"{', '.join(sorted(MODEL_SHAPES))}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(fields) - set(ModelShape.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown shape fields {sorted(unknown)}")
    return replace(MODEL_SHAPES[name], **fields)


@dataclass(frozen=True)
class LayerShape:
    """Per-sample counts of one layer (embed, a block, head).

    Attributes:
        flops: forward FLOPs.
        params: parameters.
        out_elements: elements of the layer's output.
    """

    flops: float
    params: float
    out_elements: float


def layer_shapes(shape: ModelShape) -> tuple[LayerShape, LayerShape, LayerShape]:
    """``(embed, block, head)`` counts of ``shape`` (every block alike)."""
    t, d, r = shape.tokens, shape.width, shape.mlp_ratio
    hidden = r * d
    block = LayerShape(
        flops=2.0 * (4 * t * d * d + 2 * t * t * d + 2 * t * d * hidden),
        params=4 * d * d + 4 * d + 2 * d * hidden + hidden + d + 4 * d,
        out_elements=t * d,
    )
    c = shape.num_classes
    if shape.kind == "vit":
        patch_in = shape.patch_size ** 2 * shape.in_chans
        embed = LayerShape(2.0 * (t - 1) * patch_in * d, patch_in * d + d + t * d + d, t * d)
        head = LayerShape(2.0 * d * c + 5 * d, 2 * d + d * c + c, c)
    else:
        embed = LayerShape(5.0 * t * d, (shape.vocab_size + shape.max_positions + 2) * d + 2 * d,
                           t * d)
        # pooler (D x D on the first token) and a classifier (a span head differs negligibly).
        head = LayerShape(2.0 * (d * d + d * c), d * d + d + d * c + c, c)
    return embed, block, head


def saved_activation_factor(shape: ModelShape) -> float:
    """Bytes a block keeps for its backward per byte of its output (same element size).

    Korthikanti et al. (2022, Eq. 2) count ``T D (34 + 5 a T / D)`` bytes per sample for a
    16-bit block, i.e. ``17 + 2.5 a T / D`` outputs' worth (about 25 for ViT-B/16).
    """
    return 17.0 + 2.5 * shape.heads * shape.tokens / shape.width
