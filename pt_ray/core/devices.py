"""The run's devices and precision: ``pipeline.use_gpu`` and ``precision`` resolved against the
cluster on the driver, before any worker starts.

Pure module (stdlib and the config's ``pipeline`` section). The service counts the cluster's
GPUs and carries the decision out (the entry writes :meth:`DeviceChoice.config_update` into
the run's config); this module only decides, so the rule is tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pt_ray.core.config import ConfigError, PipelineConfig

__all__ = ["CPU_BACKEND", "GPU_BACKEND", "DeviceChoice", "choose_devices", "resolve_precision"]

GPU_BACKEND = "cpu:gloo,cuda:nccl"
"""torch.distributed backend on GPU workers: NCCL serves CUDA tensors and gloo, in the same
process groups, the CPU ones (pickled objects, CPU-side counters)."""
CPU_BACKEND = "gloo"


@dataclass(frozen=True)
class DeviceChoice:
    """Where a run trains and at what precision.

    Attributes:
        device: ``cuda`` (one GPU per worker) or ``cpu``.
        precision: the concrete compute precision (``fp32``, ``bf16`` or ``fp16``).
        backend: the torch.distributed backend string for Ray Train's ``TorchConfig``.
        workers: the worker count, ``"2"`` or, with ``pipeline.min_workers``, ``"2-4"``.
        note: why the run is on CPUs when it is (empty on GPUs).
        engine: ``ray`` or ``reference``.
    """

    device: Literal["cpu", "cuda"]
    precision: str
    backend: str
    workers: str
    note: str = ""
    engine: str = "ray"

    @property
    def use_gpu(self) -> bool:
        return self.device == "cuda"

    def describe(self) -> str:
        """One log line, e.g. ``devices: 2 GPU workers (NCCL + gloo), precision bf16``."""
        if self.engine == "reference":
            where = "1 CPU process (engine=reference)"
        elif self.use_gpu:
            where = f"{self.workers} GPU workers (NCCL + gloo)"
        else:
            where = f"{self.workers} CPU workers (gloo)"
        return f"devices: {where}, precision {self.precision}" + (
            f"; {self.note}" if self.note else "")

    def config_update(self, pipeline: PipelineConfig) -> dict[str, Any]:
        """The run config's fields this choice fixes, as a ``model_copy`` update: ``pipeline``
        with ``use_gpu`` replaced by the concrete choice, and ``precision`` (what the workers
        run with and ``config.yaml`` records). The entry applies it:
        ``cfg.model_copy(update=choice.config_update(cfg.pipeline))``."""
        return {"pipeline": pipeline.model_copy(update={"use_gpu": self.use_gpu}),
                "precision": self.precision}


def resolve_precision(precision: str, device: str) -> str:
    """``auto`` is ``bf16`` on GPUs and ``fp32`` on CPUs; an explicit value stays."""
    if precision != "auto":
        return precision
    return "bf16" if device == "cuda" else "fp32"


def choose_devices(pipeline: PipelineConfig, cluster_gpus: float, *, engine: str,
                   precision: str) -> DeviceChoice:
    """Decide CPU or GPU workers for a run (its ``pipeline`` section, ``engine`` and
    ``precision``) on a cluster with ``cluster_gpus`` GPUs.

    1. A run needs one GPU per worker, counted at ``pipeline.min_workers`` when set (an elastic
       run may start with that many), else ``pipeline.num_workers``.
    2. ``use_gpu=true`` with fewer GPUs fails; ``auto`` takes GPUs when there are enough, else
       CPUs; ``false`` takes CPUs.
    3. The reference engine is one CPU process whatever the cluster holds.
    4. ``precision=auto`` follows the device (:func:`resolve_precision`).

    Raises:
        ConfigError: ``pipeline.use_gpu=true`` and the cluster lacks the GPUs, or the reference
            engine was asked for GPUs; one line with the numbers and the fix.
    """
    p = pipeline
    if engine == "reference":
        if p.use_gpu is True:
            raise ConfigError("pipeline.use_gpu=true: engine=reference trains in one CPU "
                              "process; set pipeline.use_gpu=auto or false, or engine=ray")
        return DeviceChoice("cpu", resolve_precision(precision, "cpu"), CPU_BACKEND, "1",
                            engine="reference")
    need = p.min_workers or p.num_workers
    workers = str(p.num_workers) if p.min_workers is None else f"{p.min_workers}-{p.num_workers}"
    enough = cluster_gpus >= need
    if p.use_gpu is True and not enough:
        per = "one per worker" + (f", pipeline.min_workers={need}" if p.min_workers else "")
        raise ConfigError(
            f"pipeline.use_gpu=true needs {_gpus(need)} ({per}) but the cluster has "
            f"{cluster_gpus:g}; set pipeline.use_gpu=auto or false, or add GPUs")
    if p.use_gpu is False:
        note = "pipeline.use_gpu=false"
    elif not enough:
        note = ("no GPUs in the cluster" if cluster_gpus == 0 else
                f"the cluster has {_gpus(cluster_gpus)}, {need} needed (one per worker)")
    else:
        return DeviceChoice("cuda", resolve_precision(precision, "cuda"), GPU_BACKEND, workers)
    return DeviceChoice("cpu", resolve_precision(precision, "cpu"), CPU_BACKEND, workers,
                        note)


def _gpus(n: float) -> str:
    return f"{n:g} GPU" + ("" if n == 1 else "s")
