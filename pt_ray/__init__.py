"""pt-ray: PipeTransformer (ICML 2021) rebuilt as a Ray service.

Train a Transformer while its converged leading blocks freeze, the pipeline shortens and the
freed devices become more data-parallel replicas::

    import pt_ray
    result = pt_ray.fit()                                   # the default job
    result = pt_ray.fit("my.yaml", overrides=["freeze.alpha=0.25"])
    result.timeline                                         # per-epoch layout and speed
    model = result.load_model()                             # plain timm / transformers model

Names that pull in torch, timm or transformers load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pt_ray.api import Result, default_config_path, fit, resolve_config
from pt_ray.core.config import ConfigError, RunConfig, load_config
from pt_ray.core.freeze import build_freeze_policy
from pt_ray.core.partition import Partition, partition
from pt_ray.core.plan import CostTable, LayerCost, Plan, Planner
from pt_ray.reporting.summary import EpochRecord, RankMemory, ideal_speedup, read_summary

__all__ = [
    "ActivationStore",
    "ConfigError",
    "CostTable",
    "EpochRecord",
    "InMemoryStore",
    "LayerCost",
    "Partition",
    "Plan",
    "Planner",
    "RankMemory",
    "ReferenceTrainer",
    "Result",
    "SweepResult",
    "RunConfig",
    "build_adapter",
    "build_dataset",
    "build_freeze_policy",
    "default_config_path",
    "export_run",
    "fit",
    "ideal_speedup",
    "load_checkpoint_layers",
    "load_config",
    "partition",
    "read_summary",
    "resolve_config",
    "sweep",
]

_LAZY = {
    "ActivationStore": ("pt_ray.runtime.cache", "ActivationStore"),
    "InMemoryStore": ("pt_ray.runtime.cache", "InMemoryStore"),
    "ReferenceTrainer": ("pt_ray.runtime.reference", "ReferenceTrainer"),
    "build_adapter": ("pt_ray.models.registry", "build_adapter"),
    "build_dataset": ("pt_ray.data.registry", "build_dataset"),
    "export_run": ("pt_ray.runtime.export", "export_run"),
    "load_checkpoint_layers": ("pt_ray.runtime.checkpoint", "load_layers"),
    "SweepResult": ("pt_ray.tune", "SweepResult"),
    "sweep": ("pt_ray.tune", "sweep"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'pt_ray' has no attribute {name!r}")
