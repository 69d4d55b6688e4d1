"""Building a run's model from its config: the one helper the workers, the driver's preflight,
the export, the reference trainer and the benchmarks share, so that every rank starts with the
same parameters as the reference trainer.

Torch runtime layer (it builds torch modules), no Ray.
"""

from __future__ import annotations

from pt_ray.core.config import ModelConfig
from pt_ray.data.base import DatasetSplits
from pt_ray.models.base import ModelAdapter
from pt_ray.models.registry import build_adapter

__all__ = ["build_model_for"]


def build_model_for(model: ModelConfig, seed: int, splits: DatasetSplits) -> ModelAdapter:
    """Build the run's ``model`` section from its ``seed``, sized for the dataset (classes,
    image size, vocabulary)."""
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
