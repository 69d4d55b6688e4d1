"""Building a run's model from its config: the one helper the workers, the driver's preflight,
the export, the reference trainer and the benchmarks share, so that every rank starts with the
same parameters as the reference trainer.

Torch runtime layer (it builds torch modules), no Ray.
"""

from __future__ import annotations

import torch

from pt_ray.core.config import ModelConfig
from pt_ray.data.base import DatasetSplits
from pt_ray.models.base import ModelAdapter
from pt_ray.models.registry import build_adapter

__all__ = ["build_model_for", "builds_on_meta", "on_meta"]


def builds_on_meta(model: ModelConfig) -> bool:
    """Whether ``model`` can be built on torch's meta device (shapes only, no weights) with
    every check of a real build: timm models, and Hugging Face models built from their config.
    A Hugging Face checkpoint directory cannot: ``from_pretrained`` refuses the meta device,
    and a model type found by discovery is checked by running its forward."""
    return model.family == "timm" or model.weights is None


def build_model_for(model: ModelConfig, seed: int, splits: DatasetSplits, *,
                    meta: bool = False) -> ModelAdapter:
    """Build the run's ``model`` section from its ``seed``, sized for the dataset (classes,
    image size, vocabulary).

    Args:
        model: the run's ``model`` section.
        seed: the run's ``seed``.
        splits: the run's datasets, which size the model.
        meta: build on torch's meta device where :func:`builds_on_meta` allows it: the same
            layers, shapes and checks (a weights file is read and checked against the model),
            no parameter memory and no initialisation. Elsewhere the model is built for real.
    """
    if meta and builds_on_meta(model):
        with torch.device("meta"):
            return _build(model, seed, splits)
    return _build(model, seed, splits)


def on_meta(adapter: ModelAdapter) -> bool:
    """Whether ``adapter``'s parameters are on the meta device (built with ``meta=True``)."""
    return any(p.is_meta for p in adapter.model.parameters())


def _build(model: ModelConfig, seed: int, splits: DatasetSplits) -> ModelAdapter:
    return build_adapter(
        model,
        num_classes=splits.num_classes,
        task=splits.task,
        image_size=splits.image_size,
        in_chans=splits.in_chans,
        vocab_size=splits.vocab_size,
        seq_len=splits.seq_len,
        seed=seed,
    )
