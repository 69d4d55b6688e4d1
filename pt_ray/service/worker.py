"""The Ray Train worker loop: one :class:`ElasticWorker` per device, driven by the controller.

Ray Train starts one of these per worker with the WORLD process group already formed. Each
rank builds the model from the run's seed, reaches the controller by name, resumes from Ray
Train's latest checkpoint when there is one (a failure restart, possibly with a different worker
count) or else from the stopped run it continues (``resume_from``), and reports metrics every
epoch and a checkpoint every ``checkpoint_every`` epochs and after the last
(``ray.train.report`` is a barrier: every rank reports).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
# Every worker loads torch._dynamo, with sympy and DTensor (timm's torchvision imports it, and so
# does transformers), a heavy import. Imported here it loads while Ray Train deserialises the
# training function, before the function starts in a thread of its own; inside the function it
# would compete for the CPU with Ray Train starting its helper actors beside it, which lengthens
# every run's start-up.
import torch._dynamo  # noqa: F401

from pt_ray.reporting.logs import setup_logging
from pt_ray.core.config import LoggingConfig, PipelineConfig, RunConfig
from pt_ray.data.registry import build_dataset
from pt_ray.runtime.faults import FaultSwitch, Faults, fault_hooks, stall
from pt_ray.costs.hwprofile import HardwareProfile, profile_for_gpu
from pt_ray.runtime.checkpoint import read_meta, usable_checkpoint, write_meta
from pt_ray.runtime.engine import ElasticWorker, EngineHooks
from pt_ray.runtime.build import build_model_for
from pt_ray.cache.owners import RayStore
from pt_ray.service.controller import RayController
from pt_ray.service.settings import run_settings
from pt_ray.reporting.progress import RunProgress
from pt_ray.reporting.steplog import StepReporter, step_writers
from pt_ray.reporting.summary import format_epoch

__all__ = ["quiet_ray_train", "train_loop_per_worker"]

logger = logging.getLogger("pt_ray.worker")

# A fault injected in a test (pt_ray.runtime.faults) first waits this long, so that Ray Train's
# controller, which collects reports when it polls the workers, has registered the previous
# epoch's checkpoint.
_FAULT_DELAY_S = 4.0


def _worker_faults(fault: Faults | None, controller_name: str):
    """The ``step``, ``controller`` and ``hang`` points, reached before each step."""
    if fault is None:
        return None

    def kill_controller() -> None:
        ray.kill(ray.get_actor(controller_name), no_restart=False)

    def hang() -> None:
        while True:  # until Ray Train ends this process with the rest of the group
            time.sleep(60)

    def at_step(epoch: int, step: int) -> None:
        fault.at("step", epoch, step)
        fault.at("controller", epoch, step, kill_controller)
        fault.at("hang", epoch, step, hang)
        fault.at("stall", epoch, step, stall)

    return at_step


def _device(chosen: str) -> torch.device:
    """The worker's device from the driver's choice (``chosen``: ``cuda`` or ``cpu``, the
    :class:`pt_ray.core.devices.DeviceChoice` shipped in the worker config; the worker does not
    decide again): the GPU Ray Train assigned it on ``cuda``, else the CPU."""
    if chosen == "cuda":
        # Ray Train shares CUDA_VISIBLE_DEVICES among a node's workers and maps each to its
        # own GPU; its TorchConfig has already made that the current device.
        return ray.train.torch.get_device()
    return torch.device("cpu")


def _hardware(pipeline: PipelineConfig, precision: str, device: torch.device,
              rank: int) -> str | HardwareProfile:
    """What ``pipeline.hardware=auto`` means on this worker: ``local-cpu`` on CPUs, a profile
    of the detected GPU (its name, memory and links; measured per-layer costs replace its
    compute figures) on GPUs."""
    if device.type != "cuda":
        return "local-cpu"
    props = torch.cuda.get_device_properties(device)
    hw = profile_for_gpu(props.name, props.total_memory,
                         ray.train.get_context().get_local_world_size(), precision)
    if rank == 0 and pipeline.hardware == "auto":
        logger.info("hardware profile from the device: %s", hw.description)
    return hw


def quiet_ray_train() -> None:
    """Keep Ray Train's INFO lines out of the run's output (pt-ray logs one line per epoch).

    Ray Train 2.60 logs every ``ray.train.report`` ("Reporting training result N:
    TrainingReport(...)", the whole metrics dict) at INFO through a logger named by its
    module's file path rather than ``ray.train...``, so it is silenced by that name too.
    """
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray version: nothing of that name to silence
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


# Ray Train's controller collects each worker's reports when it polls them, every this many
# seconds (2 by default; pt-ray's embedded cluster sets 0.25).
_POLL_ENV, _POLL_DEFAULT_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0


def _step_reporter(logging_cfg: LoggingConfig, rank: int, run_dir: str | None,
                   report: Callable[[dict[str, Any]], None] | None = None) -> StepReporter:
    """Where the ``logging.every_steps`` reports go: Ray Train's ``report`` on every rank (a
    barrier like the epoch's: every rank gets the same records and makes the same calls),
    at most once per 1.5 poll intervals and at least 1 s apart, so that a report never waits
    for the controller's poll and its barrier costs little; and with ``logging.tensorboard``
    every record as live scalars from rank 0 into ``<run_dir>/tensorboard``. ``report``
    stands in for Ray Train's in tests."""
    writer = (step_writers(run_dir, logging_cfg.tensorboard, bool(logging_cfg.mlflow))
              if rank == 0 and run_dir is not None else None)
    poll_s = float(os.environ.get(_POLL_ENV, _POLL_DEFAULT_S))
    return StepReporter(report or ray.train.report, writer, min_gap_s=max(1.5 * poll_s, 1.0))


def _start_or_restore(worker: ElasticWorker, controller: RayController,
                      resume_from: str | None, rank: int, world: int) -> int:
    """Enter the first plan: from Ray Train's latest checkpoint of this run (a restart after a
    failure), else from the stopped run's checkpoint this run continues (``--resume``), else
    from the start. Returns the first epoch to train."""
    checkpoint = ray.train.get_checkpoint()
    restart = checkpoint is not None
    if checkpoint is None and resume_from:
        checkpoint = ray.train.Checkpoint.from_directory(resume_from)
    if checkpoint is None:
        worker.start()
        return 0
    with checkpoint.as_directory() as directory:
        # The same on every rank: a damaged checkpoint gives way to the one before it.
        directory = usable_checkpoint(Path(directory))
        meta = read_meta(directory)
        if rank == 0:
            controller.resume(meta["controller"], meta["next_decision"], restart)
        worker.comm.barrier()
        plan = controller.plan_for(meta["next_decision"])
        first_epoch = worker.restore(directory, plan)
    if rank == 0:
        logger.info("resumed after epoch %d on %d workers: %s", first_epoch - 1, world,
                    plan.describe())
    return first_epoch


def _report_with_checkpoint(worker: ElasticWorker, controller: RayController, rank: int,
                            epoch: int, metrics: dict[str, Any]) -> None:
    """The epoch's report with a checkpoint: every rank's shard, and rank 0's metadata with
    the controller's state once the next decision is made; ``epoch`` is the one it resumes at.
    Ray Train copies the folder into the run's storage in the background and then deletes it,
    while the next epoch trains (a barrier still names it on every rank)."""
    nxt = worker.decision
    tmp = Path(tempfile.mkdtemp(prefix="pt-ray-checkpoint-"))
    try:
        if rank == 0:  # answered once every rank's norms are in: the decision is made
            controller.send_checkpoint_state(nxt)
        worker.state.save_shard(tmp, worker.next_epoch - 1)
        if rank == 0:
            # The state saved is the one epoch `epoch` starts from.
            write_meta(tmp, {**worker.state.meta(epoch - 1), "next_decision": nxt,
                             "controller": controller.checkpoint_state(nxt)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function.

    Args:
        config: ``{"run": RunConfig as a dict, "device": the driver's device choice
            (``cuda`` or ``cpu``), "controller": actor name, "cache": whether the
            cache may turn on (its owners are then asked of the controller), "resume_from":
            the checkpoint folder of a stopped run to continue, or None, "run_dir": the run
            folder (rank 0 writes the live ``logging.every_steps`` TensorBoard scalars into
            its ``tensorboard``), "splits": the driver's dataset in the object store, or None
            (each worker builds it)}``.
    """
    entered = time.time()  # the driver's clock on one host; across hosts, as synced as theirs
    setup_logging()
    quiet_ray_train()
    cfg = RunConfig.model_validate(config["run"])
    torch.set_num_threads(max(1, int(cfg.pipeline.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # The driver's preflight built the dataset; where it fitted the object store, it is read
    # there rather than from the files (tokenised again) on every worker.
    shipped = config.get("splits")
    splits = (ray.get(shipped) if shipped is not None
              else build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights))
    built_data = time.time()
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    built_model = time.time()
    controller = RayController(config["controller"], cfg.pipeline.collective_timeout_s,
                               checkpoints_after=cfg.checkpoints_after)
    device = _device(config["device"])
    # The controller started the cache's owners; the store asks it for them on first use.
    store = RayStore(controller.cache_owners) if config.get("cache") else None
    # Rank 0 shows each epoch's progress (plain lines: a Ray worker's stdout is no terminal).
    progress = RunProgress(
        cfg.epochs, lambda _epoch: worker.steps_in_epoch(),
        enabled=rank == 0 and cfg.logging.progress != "off",
        mode="auto" if cfg.logging.progress == "off" else cfg.logging.progress,
    )
    fault = FaultSwitch.from_env(rank, delay_s=_FAULT_DELAY_S)
    at_step = _worker_faults(fault, config["controller"])

    def on_step(epoch: int, step: int) -> None:
        progress(epoch, step)
        if at_step is not None:
            at_step(epoch, step)

    steps = _step_reporter(cfg.logging, rank, config.get("run_dir"))
    hooks = fault_hooks(fault, EngineHooks(on_step=on_step, on_step_report=steps))
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=controller, device=device, store=store, hooks=hooks)
    controller.setup(adapter.num_layers, world, worker.sampler.steps_per_epoch,
                     adapter.metric_name, _hardware(cfg.pipeline, cfg.precision, device, rank),
                     splits.train.deterministic_transform)

    first_epoch = _start_or_restore(worker, controller, config.get("resume_from"), rank, world)
    if rank == 0:
        # Where this worker's start-up went (the driver adds the worker group's start).
        controller.startup({"entered_at": entered, "dataset_s": built_data - entered,
                            "model_s": built_model - built_data,
                            "setup_s": time.time() - built_model,
                            "shipped_data": float(shipped is not None)})

    epoch = first_epoch
    while epoch < cfg.epochs:
        rec = worker.train_epoch(epoch)
        metrics = {**asdict(rec), "metric_name": adapter.metric_name}
        if rank == 0:
            progress.end_epoch()
            logger.info(format_epoch(rec, cfg.epochs, adapter.metric_name))
        epoch = worker.next_epoch  # earlier than rec.epoch + 1 after a rollback
        if not cfg.checkpoints_after(rec.epoch):
            ray.train.report(metrics)  # a barrier too: every rank reports
            continue
        _report_with_checkpoint(worker, controller, rank, epoch, metrics)
    if at_step is not None:
        at_step(cfg.epochs, 0)  # epoch `epochs`: after every call the workers make
    steps.close()
    worker.close()
