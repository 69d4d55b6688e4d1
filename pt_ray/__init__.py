"""pt-ray: PipeTransformer (ICML 2021) rebuilt as a Ray service.

Train a Transformer while its converged leading blocks freeze, the pipeline shortens and the
freed devices become more data-parallel replicas::

    import pt_ray
    result = pt_ray.fit()                                   # the default job
    result = pt_ray.fit("my.yaml", overrides=["freeze.alpha=0.25"])
    result.timeline                                         # per-epoch layout and speed
    model = result.load_model()                             # plain timm / transformers model

``sweep`` (Ray Tune) loads on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pt_ray.api import Result, default_config_path, fit, resolve_config
from pt_ray.core.config import ConfigError, RunConfig, load_config
from pt_ray.reporting.summary import EpochRecord, read_summary

# What a user calls (a script, a notebook, a Ray job). Everything else is reached through its
# module (pt_ray.runtime.reference.ReferenceTrainer, pt_ray.reporting.report.render_report, ...).
__all__ = [
    "ConfigError",
    "EpochRecord",
    "Result",
    "RunConfig",
    "SweepResult",
    "default_config_path",
    "fit",
    "load_config",
    "read_summary",
    "resolve_config",
    "sweep",
]

# Ray Tune's driver side: imported on first use, so `import pt_ray` does not load Ray.
_LAZY = {
    "SweepResult": ("pt_ray.tune", "SweepResult"),
    "sweep": ("pt_ray.tune", "sweep"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'pt_ray' has no attribute {name!r}")
