"""The driver side of a run on Ray: cluster, controller and cache actors, and Ray Train's
``TorchTrainer``."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, ScalingConfig
from ray.train import RunConfig as TrainRunConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pt_ray.config import RunConfig
from pt_ray.service.cache import CacheActor, cache_name, object_store_report
from pt_ray.service.controller import ControllerActor, controller_name
from pt_ray.service.worker import train_loop_per_worker
from pt_ray.summary import EpochRecord

__all__ = ["RayRun", "ensure_ray", "run_on_ray"]

logger = logging.getLogger(__name__)

# Object store for the embedded cluster: enough for the activation cache of the default job
# without claiming 30% of the machine's memory as Ray's default would.
_LOCAL_OBJECT_STORE_BYTES = 512 * 2**20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_ray(cfg: RunConfig, min_cpus: float = 0.0) -> bool:
    """Attach to the cluster in ``RAY_ADDRESS`` (as ``ray job submit`` sets it), or start an
    embedded local one sized for the run (and for at least ``min_cpus`` logical CPUs, e.g. a
    Tune trial plus its run). Returns True when this call started Ray."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    need = max(cfg.pipeline.num_workers * cfg.pipeline.cpus_per_worker, min_cpus)
    spill = {}
    if cfg.cache.spill_directory is not None:
        cfg.cache.spill_directory.mkdir(parents=True, exist_ok=True)
        # Hidden ray.init option in 2.60 (`ray start --object-spilling-directory` on clusters).
        spill["object_spilling_directory"] = str(cfg.cache.spill_directory.resolve())
    port = _free_port()
    ray.init(
        address="local",
        num_cpus=max(int(-(-need // 1)), os.cpu_count() or 1),
        # The dashboard serves Ray's state API, which Ray Train's placement-group cleaner polls
        # (without it, that actor logs a warning every few seconds).
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {
            # The cleaner resolves the state API by address "auto", which fails when another
            # Ray instance runs on the host; name this cluster's API server instead.
            "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}",
            # Ray Train collects each rank's report when it polls the workers (every 2 s by
            # default); with short epochs that floors an epoch's wall time at the interval.
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get(
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25"),
        }},
        **spill,
    )
    logger.info("object store %.0f MiB; spills to %s when full", _LOCAL_OBJECT_STORE_BYTES / 2**20,
                spill.get("object_spilling_directory", "the Ray session directory"))
    return True


@dataclass(frozen=True)
class RayRun:
    """What a run on Ray returns to the driver.

    Attributes:
        timeline: the controller's per-epoch records.
        decisions: every freeze decision with its reason.
        metric_name: the eval metric's name.
        checkpoint_path: the latest checkpoint directory (shards + meta.json), if any.
        run_id: the unique Ray Train run name.
        restarts: worker-group restarts from a checkpoint during the run.
        cache: the activation cache at the end (bytes, objects, refused rows, ...) and the
            object store's figures (spilled bytes, ...); empty when the cache was off.
    """

    timeline: list[EpochRecord]
    decisions: list[dict[str, Any]]
    metric_name: str
    checkpoint_path: str | None
    run_id: str
    restarts: int
    cache: dict[str, Any] = field(default_factory=dict)


def run_on_ray(
    cfg: RunConfig, run_dir: Path, worker_env: dict[str, str] | None = None
) -> RayRun:
    """Run ``cfg`` on Ray Train with one worker per device and a named controller actor.

    Args:
        cfg: the validated run configuration.
        run_dir: the run's output folder; Ray Train's storage goes under ``run_dir/ray``.
        worker_env: extra environment variables for the training workers.

    Raises:
        ray.train.TrainingFailedError: the run failed more often than
            ``pipeline.max_failures`` allows.
    """
    started = ensure_ray(cfg)
    try:
        return _run(cfg, run_dir, worker_env or {})
    finally:
        if started:
            ray.shutdown()


def _run(cfg: RunConfig, run_dir: Path, worker_env: dict[str, str]) -> RayRun:
    p = cfg.pipeline
    run_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    controller = ControllerActor.options(name=controller_name(run_id)).remote(
        cfg.model_dump(mode="json")
    )
    # The cache's owner outlives worker restarts (objects die with whoever put them). Whether
    # the cache may really turn on (the dataset's transform) is the workers' call.
    cache = None
    if cfg.cache.mode != "off" and cfg.freeze.policy != "none":
        cache = CacheActor.options(name=cache_name(run_id)).remote(
            cfg.cache.budget_fraction, cfg.cache.budget_bytes)
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = gpus >= (p.min_workers or p.num_workers)
    workers: int | tuple[int, int] = (
        p.num_workers if p.min_workers is None else (p.min_workers, p.num_workers)
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"run": cfg.model_dump(mode="json"),
                           "controller": controller_name(run_id),
                           "cache": cache_name(run_id) if cache is not None else None},
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": p.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=600),
        run_config=TrainRunConfig(
            name=run_id,
            storage_path=str((run_dir / "ray").resolve()),
            failure_config=FailureConfig(max_failures=p.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Ray Train's per-report INFO lines would bury pt-ray's one line per epoch.
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": worker_env} if worker_env else None,
        ),
    )
    logger.info("run %s: %s workers (%s) on Ray Train", run_id, workers,
                "GPU/nccl" if use_gpu else "CPU/gloo")
    cache_report: dict[str, Any] = {}
    try:
        result = trainer.fit()
        summary = ray.get(controller.summary.remote())
        if cache is not None:
            cache_report = _cache_report(cache)
    finally:
        ray.kill(controller)
        if cache is not None:
            ray.kill(cache)
    if result.error is not None:
        raise result.error
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    return RayRun(summary["timeline"], summary["decisions"], summary["metric_name"], checkpoint,
                  run_id, summary["restarts"], cache_report)


def _cache_report(cache) -> dict[str, Any]:
    """The cache actor's final figures and the object store's, logged in one line."""
    try:
        stats = asdict(ray.get(cache.stats.remote(), timeout=30))
    except ray.exceptions.RayError as err:
        logger.warning("activation cache: no final figures (%s)", type(err).__name__)
        return {}
    store = object_store_report()
    logger.info(
        "activation cache: %.1f MiB in %d objects (budget %.0f MiB), %d rows refused; "
        "object store: %.1f MiB spilled to disk in %d objects", stats["bytes"] / 2**20,
        stats["objects"], stats["budget_bytes"] / 2**20, stats["refused_rows"],
        store.get("spilled_bytes", 0) / 2**20, store.get("spilled_objects", 0))
    return {**stats, "object_store": store}
