"""Model adapters: timm ViTs and Hugging Face BERT-family encoders cut into embed|blocks|head."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pt_ray.models.base import (
    ModelAdapter,
    State,
    Task,
    check_partition,
    forward_layers,
    frozen_layer_names,
    iter_layers,
    layer_module,
    layer_names,
    run_blocks,
)
from pt_ray.models.vit import TimmViTAdapter, load_timm_weights

if TYPE_CHECKING:
    from pt_ray.models.bert import HF_ENCODERS, HFEncoderAdapter
    from pt_ray.models.registry import build_adapter

# transformers takes seconds to import; load it only when a name that needs it is used, so
# code that only needs the protocol (stages, migration, their tests) stays quick to import.
_LAZY = {
    "HF_ENCODERS": "pt_ray.models.bert",
    "HFEncoderAdapter": "pt_ray.models.bert",
    "build_adapter": "pt_ray.models.registry",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HF_ENCODERS",
    "HFEncoderAdapter",
    "ModelAdapter",
    "State",
    "Task",
    "TimmViTAdapter",
    "build_adapter",
    "check_partition",
    "forward_layers",
    "frozen_layer_names",
    "iter_layers",
    "layer_module",
    "layer_names",
    "load_timm_weights",
    "run_blocks",
]
