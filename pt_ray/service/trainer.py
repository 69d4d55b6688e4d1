"""The driver side of a run on Ray: cluster, controller and cache actors, and Ray Train's
``TorchTrainer``."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
from ray.train import (
    CheckpointConfig,
    FailureConfig,
    LoggingConfig,
    ScalingConfig,
    TrainingFailedError,
)
from ray.train import RunConfig as TrainRunConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pt_ray.core.config import CacheConfig, PipelineConfig, RunConfig
from pt_ray.core.devices import DeviceChoice, choose_devices
from pt_ray.core.placement import ClusterView, demand_for
from pt_ray.data.base import DatasetSplits
from pt_ray.cache.policy import may_turn_on
from pt_ray.cache.size import resolve_cache_sizes
from pt_ray.cache.owners import (
    cache_name,
    cache_nodes,
    object_store_report,
    owners_report,
    store_capacities,
)
from pt_ray.service.controller import ControllerActor, controller_name
from pt_ray.service.shipped import ship_splits
from pt_ray.service.placement import placement_failure, wait_for_room
from pt_ray.service.loop import WORKER_LOOP
from pt_ray.reporting.files import write_text_atomically
from pt_ray.reporting.summary import RunSummary

__all__ = ["EPOCH_LINES", "cluster_devices", "ensure_ray", "keep_epoch_lines", "run_on_ray"]

logger = logging.getLogger(__name__)

# How often Ray may restart a lost controller actor in one run.
_CONTROLLER_RESTARTS = 3

# pt-ray's own actors on an embedded cluster's one node: the controller and the cache owner
# it starts (the slots also serve a restarted controller).
_OWN_ACTORS = 2

# Ray Train 2.60's wait for its worker group's placement group, per attempt (default 60 s); a
# timed-out attempt is a controller failure, retried up to FailureConfig.controller_failure_limit.
_TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
_PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_gpus() -> int:
    """GPUs this host gives an embedded cluster: those torch can use here
    (``CUDA_VISIBLE_DEVICES`` honoured), so that the count is known before Ray starts."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def starts_embedded() -> bool:
    """Whether :func:`ensure_ray` would start an embedded cluster (not attach to one)."""
    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


# pt-ray's epoch lines: rank 0's "epoch   3/10  loss ..." and the controller's "epoch 3: frozen
# ...". Ray's driver merges worker lines that differ only in their numbers when they come from
# different processes within a few seconds: it shows one as "[repeated 4x across cluster]" and
# holds the others until more output arrives, so the trials of a sweep, or two runs on one
# cluster, would hide each other's epochs, and a run's last line could wait for the next run.
EPOCH_LINES = r"^epoch +\d+"


def keep_epoch_lines() -> None:
    """Exempt pt-ray's epoch lines (:data:`EPOCH_LINES`) from Ray's merging of repeated worker
    output in this driver, beside any pattern ``RAY_DEDUP_LOGS_ALLOW_REGEX`` already gives
    (idempotent). Ray 2.60 compiles that variable once, when ``ray`` is imported, into the
    driver's two de-duplicators; the pattern is extended there, whatever imported Ray first."""
    from ray._private import ray_logging

    for dedup in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
        allow = dedup.allow_re.pattern if dedup.allow_re is not None else ""
        if EPOCH_LINES not in allow:
            dedup.allow_re = re.compile(f"(?:{allow})|{EPOCH_LINES}" if allow else EPOCH_LINES)


def ensure_ray(pipeline: PipelineConfig, cache: CacheConfig, min_cpus: float = 0.0) -> bool:
    """Attach to the cluster in ``RAY_ADDRESS`` (as ``ray job submit`` sets it), or start an
    embedded local one sized for the run's ``pipeline`` (and for at least ``min_cpus`` logical
    CPUs, e.g. a Tune trial plus its run) with this host's :func:`local_gpus`, its object store
    and spill folder from the run's ``cache`` section. Returns True when this call started
    Ray. Either way pt-ray's epoch lines reach this driver unmerged (:func:`keep_epoch_lines`)."""
    keep_epoch_lines()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    need = max(pipeline.num_workers * pipeline.cpus_per_worker, min_cpus)
    spill = {}
    if cache.spill_directory is not None:
        cache.spill_directory.mkdir(parents=True, exist_ok=True)
        # Hidden ray.init option in 2.60 (`ray start --object-spilling-directory` on clusters).
        spill["object_spilling_directory"] = str(cache.spill_directory.resolve())
    port = _free_port()
    ray.init(
        address="local",
        num_cpus=max(int(-(-need // 1)), os.cpu_count() or 1),
        num_gpus=local_gpus(),
        # The dashboard serves Ray's state API, which Ray Train's placement-group cleaner polls
        # (without it, that actor logs a warning every few seconds).
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        # None: Ray's own default (30% of the available memory, within /dev/shm), which it
        # takes as objects arrive, not at start.
        object_store_memory=(None if cache.object_store_bytes == "auto"
                             else cache.object_store_bytes),
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
        # Ray prestarts one idle worker per CPU for a cluster's first driver, with an empty
        # runtime_env; every actor of a run here has one (this job's above, or Ray Train's
        # own), so none could take them: starting them would only take CPU from the run's own
        # processes while they start.
        # Ray starts at most as many worker processes at once as the host has CPUs; the
        # controller (a zero-CPU actor, created just before TorchTrainer.fit()) and the cache
        # owner it starts would take two of those start slots from Ray Train's own
        # controller and workers while they start. Slots for them: on a small head Ray Train
        # does not wait for pt-ray's actors to start.
        _system_config={"prestart_worker_first_driver": False,
                        "worker_maximum_startup_concurrency":
                            (os.cpu_count() or 1) + _OWN_ACTORS},
        **spill,
    )
    logger.info("object store %.0f MiB (cache.object_store_bytes=%s); spills to %s when full",
                ray.cluster_resources().get("object_store_memory", 0) / 2**20,
                cache.object_store_bytes,
                spill.get("object_spilling_directory", "the Ray session directory"))
    return True


def cluster_devices(pipeline: PipelineConfig, engine: str, precision: str) -> DeviceChoice:
    """Decide a run's devices and precision (from its ``pipeline`` section, ``engine`` and
    ``precision``) from the GPUs of the cluster the run will use (the connected one, or the
    embedded one :func:`ensure_ray` would start, before it starts), and log the choice in one
    line.

    Raises:
        ConfigError: ``pipeline.use_gpu=true`` and the cluster has too few GPUs.
    """
    gpus = local_gpus() if starts_embedded() else ray.cluster_resources().get("GPU", 0.0)
    choice = choose_devices(pipeline, gpus, engine=engine, precision=precision)
    logger.info(choice.describe())
    return choice


_T = TypeVar("_T")


def run_on_ray(
    cfg: RunConfig,
    run_dir: Path,
    worker_env: dict[str, str] | None = None,
    config_file: Path | None = None,
    choice: DeviceChoice | None = None,
    resume_from: Path | None = None,
    splits: DatasetSplits | None = None,
    then: Callable[[RunSummary], _T] | None = None,
) -> RunSummary | _T:
    """Run ``cfg`` on Ray Train with one worker per device and a named controller actor, and
    return the run's summary: the controller's timeline, decisions and rollbacks, the
    configuration the workers ran (``pipeline.use_gpu``, ``precision`` and the cache sizes
    resolved), the last checkpoint, the cache's and the dataset's figures (``cache``,
    ``data``) and where the start-up went (``startup``: ``worker_group_s``, from
    ``TorchTrainer.fit()`` until rank 0's worker function began, then rank 0's ``dataset_s``,
    ``model_s`` and ``setup_s``; empty when the controller lost them in a restart). The
    caller adds the wall time.

    Args:
        cfg: the validated run configuration.
        run_dir: the run's output folder; Ray Train's storage goes under ``run_dir/ray``.
        worker_env: extra environment variables for the training workers.
        config_file: where to write the resolved configuration (devices and precision
            chosen, and ``cache.worker_memo_bytes`` sized from the cluster's object stores)
            as YAML, before any actor or worker starts (None: nowhere).
        choice: the devices already chosen by :func:`cluster_devices` for the embedded
            cluster this call starts (None: chosen here).
        resume_from: a stopped run's checkpoint folder to continue from (its parameters,
            optimizer state, freeze state, plan, controller timeline, data position and RNG
            state), on this run's number of workers.
        splits: the dataset the driver built from ``cfg.data`` (its preflight's): shipped to
            the workers through the object store where it fits (:mod:`pt_ray.service.shipped`),
            so that they do not read and tokenise the files again (None: each worker builds).
        then: what to do with the summary once the run has trained (write it, export the
            model), returning the call's result; it runs while an embedded cluster this call
            started shuts down (about 1.4 s, mostly waiting for its processes), and the call
            returns once both are done. None: return the summary.

    Raises:
        ConfigError: ``pipeline.use_gpu=true`` and the cluster has too few GPUs; raised
            before an embedded cluster starts, or right after attaching to one.
        pt_ray.core.placement.PlacementError: a cluster pt-ray attached to can never hold the
            workers (no autoscaler), or had no room for them within
            ``pipeline.placement_timeout_s``, raised before any actor or worker starts; or Ray
            Train gave up placing them (each try bounded by the same timeout).
        ray.train.TrainingFailedError: the run failed more often than
            ``pipeline.max_failures`` allows.
    """
    embedded = starts_embedded()
    if choice is None and embedded:
        choice = cluster_devices(cfg.pipeline, cfg.engine, cfg.precision)
    started = ensure_ray(cfg.pipeline, cfg.cache)
    try:
        choice = choice or cluster_devices(cfg.pipeline, cfg.engine, cfg.precision)
        cfg = cfg.model_copy(update=choice.config_update(cfg.pipeline))
        # An embedded cluster is sized for the run and has no autoscaler; a cluster pt-ray
        # attached to may be too small, or busy with other jobs.
        autoscaler, watch = False, False
        if not embedded:
            view = wait_for_room(demand_for(cfg.pipeline, choice.use_gpu),
                                 cfg.pipeline.placement_timeout_s)
            autoscaler, watch = view.autoscaler, watches_preemption(view)
        # The nodes' object stores (one query): they size the cache and bound what ships.
        capacities = store_capacities()
        if may_turn_on(cfg.cache, cfg.freeze):
            # Once, here: the controller's planner and every worker's memo read this figure.
            cfg = cfg.model_copy(update={"cache": resolve_cache_sizes(cfg.cache, capacities)})
        if config_file is not None:
            write_text_atomically(config_file, cfg.to_yaml())
        shipped = _Shipped(*ship_splits(splits, capacities)) if splits is not None else _Shipped()
        summary = _run(cfg, choice, run_dir, worker_env or {}, autoscaler, resume_from, watch,
                       shipped)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    closing = None
    if started:  # nothing below uses Ray: the cluster goes down beside it
        closing = threading.Thread(target=ray.shutdown, name="pt-ray-shutdown", daemon=True)
        closing.start()
    try:
        return then(summary) if then is not None else summary
    finally:
        if closing is not None:
            closing.join()


def watches_preemption(view: ClusterView) -> bool:
    """Whether Ray Train's preemption watcher has anything to watch on a cluster pt-ray
    attached to: more than one node, or an autoscaler (which drains the nodes it removes).
    On one node without an autoscaler, as on an embedded cluster, no node is drained while the
    run lives, and the watcher would cost one more Ray worker process, started beside the
    run's own at every start. A cluster whose resources could not be
    read (``nodes_total`` empty) keeps it."""
    return view.autoscaler or len(view.nodes_total) != 1


@contextmanager
def _train_env(placement_timeout_s: float, watch_preemption: bool) -> Iterator[None]:
    """What a ``TorchTrainer``'s controller takes from this process's environment while it
    starts (Ray Train passes these variables on to the controller and its workers): each wait
    for the workers' placement group bounded by ``placement_timeout_s``, and without
    ``watch_preemption`` no preemption watcher. A variable the user set is left alone; the
    others are removed again afterwards."""
    wanted = {_TRAIN_START_TIMEOUT_ENV: f"{placement_timeout_s:g}"}
    if not watch_preemption:
        wanted[_PREEMPTION_WATCHER_ENV] = "0"
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _trainer(p: PipelineConfig, run: dict[str, Any], choice: DeviceChoice, run_dir: Path,
             run_id: str, cache: bool, worker_env: dict[str, str], autoscaler: bool,
             resume_from: Path | None, splits: Any = None
             ) -> tuple[TorchTrainer, int | tuple[int, int]]:
    """Ray Train's trainer for the run (``run``: its config as a dict, ``p`` its ``pipeline``
    section; ``splits``: the shipped dataset's object reference, or None), and its worker
    count (a range with ``pipeline.min_workers``)."""
    use_gpu = choice.use_gpu
    workers: int | tuple[int, int] = (
        p.num_workers if p.min_workers is None else (p.min_workers, p.num_workers)
    )
    trainer = TorchTrainer(
        # A stand-in that becomes the worker loop where Ray Train unpickles it: the driver
        # never imports the worker module (torch, torch._dynamo).
        WORKER_LOOP,
        train_loop_config={"run": run,
                           "device": choice.device,
                           "controller": controller_name(run_id),
                           "cache": cache,
                           "run_dir": str(run_dir.resolve()),
                           "resume_from": str(resume_from) if resume_from else None,
                           "splits": splits},
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": p.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        # Ray 2.60 passes the backend string to init_process_group unchanged and, for a
        # "cuda:nccl" entry as for "nccl", sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1.
        torch_config=TorchConfig(backend=choice.backend,
                                 timeout_s=int(-(-p.collective_timeout_s // 1))),
        run_config=TrainRunConfig(
            name=run_id,
            storage_path=str((run_dir / "ray").resolve()),
            # A worker group Ray Train cannot place within its timeout is a controller failure:
            # with an autoscaler it retries without limit (Ray's default); on a fixed cluster
            # it gives up after as many retries as worker failures may have.
            failure_config=FailureConfig(
                max_failures=p.max_failures,
                controller_failure_limit=-1 if autoscaler else p.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Ray Train's per-report INFO lines would bury pt-ray's one line per epoch.
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": worker_env} if worker_env else None,
        ),
    )
    return trainer, workers


@dataclass(frozen=True)
class _Shipped:
    """The dataset shipped to the workers: its object reference (None: each worker builds its
    own) and estimated size."""

    ref: Any = None
    bytes: int = 0


def _run(cfg: RunConfig, choice: DeviceChoice, run_dir: Path, worker_env: dict[str, str],
         autoscaler: bool = False, resume_from: Path | None = None,
         watch_preemption: bool = True, shipped: _Shipped = _Shipped()) -> RunSummary:
    p, run = cfg.pipeline, cfg.model_dump(mode="json")
    run_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    # A lost controller comes back (Ray restarts it) and restores itself from the latest
    # checkpoint in the run's storage folder when the workers find it again.
    # The cache's owners, one per node, outlive worker restarts (objects die with whoever put
    # them): the controller starts them as it starts, beside Ray Train's own start, wherever
    # the config lets the cache turn on (the dataset's transform and the planner's
    # predictions decide later whether a plan reads it).
    cache = may_turn_on(cfg.cache, cfg.freeze)
    controller = ControllerActor.options(
        name=controller_name(run_id), max_restarts=_CONTROLLER_RESTARTS,
    ).remote(run, str((run_dir / "ray" / run_id).resolve()), run_id if cache else None)
    use_gpu = choice.use_gpu
    trainer, workers = _trainer(p, run, choice, run_dir, run_id, cache, worker_env, autoscaler,
                                resume_from, shipped.ref)
    logger.info("run %s: %s workers (%s, %s) on Ray Train", run_id, workers,
                "GPU" if use_gpu else "CPU", choice.backend)
    cache_report: dict[str, Any] = {}
    owners: dict[str, Any] | None = None  # None until looked up
    t0 = time.monotonic()
    launched = time.time()  # beside the workers' time.time() of their start
    try:
        try:
            with _train_env(p.placement_timeout_s, watch_preemption):
                result = trainer.fit()
        except TrainingFailedError as err:
            # Ray Train's own wait for its workers (a race lost after the check, or a restart
            # after a node left) ends in the same one line as the check's.
            failure = placement_failure(err, demand_for(p, use_gpu), p.placement_timeout_s,
                                        time.monotonic() - t0)
            if failure is None:
                raise
            raise failure from err
        summary = _final_summary(controller)
        owners = _cache_owners(run_id) if cache else {}
        if owners and summary.get("cache_on"):
            cache_report = _cache_report(owners)
    finally:
        # The cache owners die with the controller; killed here too, at once (looked up here
        # when the run stopped before the end).
        if owners is None:
            owners = _cache_owners(run_id) if cache else {}
        ray.kill(controller)
        for owner in owners.values():
            ray.kill(owner)
    if result.error is not None:
        raise result.error
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    startup = dict(summary["startup"])
    if "entered_at" in startup:
        startup = {"worker_group_s": startup.pop("entered_at") - launched, **startup}
    data = {"shipped_bytes": shipped.bytes,
            "read_by_workers": bool(startup.pop("shipped_data", 0.0))}
    return RunSummary(
        timeline=summary["timeline"], metric_name=summary["metric_name"],
        config=cfg.model_dump(mode="json"), device=choice.device, precision=cfg.precision,
        engine="ray", run_id=run_id, checkpoint=checkpoint, decisions=summary["decisions"],
        restarts=summary["restarts"], rollbacks=summary["rollbacks"], startup=startup,
        start_trials=summary.get("start_trials", []), cache=cache_report, data=data)


def _final_summary(controller: Any) -> dict[str, Any]:
    """The controller's summary at the end of a run (a controller Ray restarted after the
    workers' last call restores itself from the run's last checkpoint first).

    Raises:
        RuntimeError: the controller is gone for good, or restarted and cannot restore itself
            (one line that says why; training itself finished).
    """
    try:
        return ray.get(controller.summary.remote())
    except ray.exceptions.RayActorError as err:
        raise RuntimeError("the controller was lost after training and did not come back: "
                           "the run's checkpoints hold its models, but no summary was "
                           "written") from err
    except ray.exceptions.RayTaskError as err:
        raise RuntimeError(f"the controller restarted after training and could not restore "
                           f"the run's timeline: {err.cause}") from err


def _cache_owners(run_id: str) -> dict[str, Any]:
    """``{node id: actor handle}`` of the run's cache owners alive now (none where the
    config ruled the cache out: its controller started none)."""
    found = {}
    for node in cache_nodes():
        try:
            found[node] = ray.get_actor(cache_name(run_id, node))
        except ValueError:
            pass
    return found


def _cache_report(owners: dict[str, Any]) -> dict[str, Any]:
    """The cache owners' final figures (:func:`owners_report`: distinct contents, what every
    node stores, per node under ``nodes``) and the object store's, logged in one line."""
    stats = owners_report(owners)
    if not any(stats["nodes"].values()):
        logger.warning("activation cache: no final figures")
        return {}
    store = object_store_report()
    logger.info(
        "activation cache: %.1f MiB in %d blocks, stored as %.1f MiB on %d nodes (budget "
        "%.0f MiB in all), %d rows refused; object store: %.1f MiB spilled to disk in %d "
        "objects", stats["bytes"] / 2**20, stats["objects"], stats["stored_bytes"] / 2**20,
        sum(1 for n in stats["nodes"].values() if n), stats["budget_bytes"] / 2**20,
        stats["refused_rows"], store.get("spilled_bytes", 0) / 2**20,
        store.get("spilled_objects", 0))
    return {**stats, "object_store": store}
