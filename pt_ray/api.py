"""The Python entry point: ``pt_ray.fit(config) -> Result``, usable from scripts and notebooks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pt_ray.config import ConfigError, RunConfig, apply_overrides, build_config, load_config
from pt_ray.summary import EpochRecord, format_epoch, write_summary

__all__ = ["Result", "default_config_path", "fit", "preflight", "resolve_config"]

logger = logging.getLogger(__name__)


def default_config_path() -> Path:
    """The default job's YAML (a small ViT on scikit-learn's digits)."""
    return Path(str(resources.files("pt_ray") / "configs" / "default.yaml"))


def resolve_config(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    overrides: Iterable[str] = (),
) -> RunConfig:
    """A validated RunConfig from a RunConfig, a dict, a YAML path, or None (the default job),
    with ``key=value`` overrides applied on top."""
    overrides = list(overrides)
    if config is None:
        return load_config(default_config_path(), overrides)
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        config = config.model_dump(mode="json")
    return build_config(apply_overrides(config, overrides))


def preflight(cfg: RunConfig) -> None:
    """Build the dataset and the model once in the driver, so that a bad path, model name or
    layout fails here, before any Ray worker starts.

    Raises:
        ConfigError: the configuration cannot run (the message names the field and the fix).
    """
    from pt_ray.data.registry import build_dataset
    from pt_ray.runtime.reference import build_model_for

    try:
        splits = build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
        num_layers = build_model_for(cfg, splits).num_layers
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from err
    k = cfg.pipeline.pipeline_length
    if isinstance(k, int) and k > num_layers:
        raise ConfigError(
            f"pipeline.pipeline_length={k} exceeds the model's {num_layers} blocks; every stage "
            f"needs a block, so choose at most {num_layers}"
        )
    if cfg.freeze.max_frozen is not None and cfg.freeze.max_frozen > num_layers:
        raise ConfigError(
            f"freeze.max_frozen={cfg.freeze.max_frozen} exceeds the model's {num_layers} "
            f"blocks; choose at most {num_layers}"
        )


def _write_extras(cfg: RunConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """The report PNG and TensorBoard scalars the config asks for (never fails the run)."""
    try:
        if cfg.logging.report:
            from pt_ray.report import render_report

            render_report(summary, run_dir / "report.png")
        if cfg.logging.tensorboard:
            from pt_ray.tensorboard import write_tensorboard

            write_tensorboard(summary, run_dir / "tensorboard")
    except Exception as err:  # a plot must not fail a finished run
        logger.warning("run report not written: %s", err)


def _export_model(cfg: RunConfig, run_dir: Path, adapter: Any, checkpoint: str | None) -> None:
    """The trained model in its library's own format into ``run_dir/model`` (from the
    reference trainer's ``adapter`` in memory, else the Ray run's last checkpoint); a failure
    is logged with the command that retries it, and never fails the finished run."""
    from pt_ray.export import MODEL_DIR, export_adapter, export_checkpoint

    out = run_dir / MODEL_DIR
    try:
        if adapter is not None:
            export_adapter(cfg, adapter, out, f"run {cfg.name!r} in {run_dir}")
        elif checkpoint is not None:
            export_checkpoint(cfg, checkpoint, out)
        else:
            logger.warning("model not exported: the run left no checkpoint")
            return
    except Exception as err:  # hours of training must not end in a traceback here
        logger.warning("model not exported: %s; retry with `pt-ray export %s`", err, run_dir)
        return
    logger.info("model exported to %s (see its README.txt)", out)


@dataclass(frozen=True)
class Result:
    """What a run returns.

    Attributes:
        config: the resolved configuration (``pipeline.use_gpu`` and ``precision`` concrete).
        timeline: one record per epoch.
        metric_name: name of the eval metric.
        final_eval_metric: the eval metric after the last epoch.
        wall_time_s: wall time of the whole run.
        run_dir: where ``config.yaml`` and ``summary.json`` were written, and the trained
            model in its library's own format (``model/``; :meth:`load_model` reads it).
        checkpoint: the latest checkpoint directory (Ray engine), loadable with
            ``pt_ray.load_checkpoint_layers``; None for the reference engine.
        decisions: every freeze decision with its numbers and reason (Ray engine).
        restarts: worker-group restarts from a checkpoint during the run.
        rollbacks: the accuracy guard's rollbacks (``freeze.rollback``): the epoch whose
            evaluation fell, the epoch returned to, the blocks frozen before and after, the
            metric before and after, and the undone epochs' records.
    """

    config: RunConfig
    timeline: list[EpochRecord]
    metric_name: str
    final_eval_metric: float
    wall_time_s: float
    run_dir: Path
    checkpoint: str | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)

    def load_model(self) -> Any:
        """The trained model as a plain timm or transformers model, in eval mode, read from the
        export the run wrote into ``run_dir/model`` (see :mod:`pt_ray.models.export`).

        Raises:
            FileNotFoundError: the run wrote no export (the message gives the command that
                writes one).
        """
        from pt_ray.export import MODEL_DIR
        from pt_ray.models.export import load_exported

        return load_exported(self.run_dir / MODEL_DIR)


def fit(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    overrides: Iterable[str] = (),
    output_dir: str | Path | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
    worker_env: dict[str, str] | None = None,
) -> Result:
    """Train a model with AutoFreeze and write ``config.yaml``, ``summary.json`` and the
    trained model in its library's own format (``model/``, see :mod:`pt_ray.export`).

    Args:
        config: a RunConfig, a dict of fields, a YAML path, or None for the default job.
        overrides: ``key=value`` strings applied on top (e.g. ``"freeze.alpha=0.25"``).
        output_dir: folder for the run's files (default: ``<output_dir>/<name>`` of the config).
        on_epoch: called with each epoch's record (default: log one line per epoch). On Ray
            the workers log each epoch as it ends and ``on_epoch`` sees the records at the end.
        worker_env: extra environment variables for Ray's training workers.

    Raises:
        ConfigError: a bad value, before anything is built; or ``pipeline.use_gpu=true`` on a
            cluster without the GPUs, once Ray has started and before anything else has.
    """
    cfg = resolve_config(config, overrides)
    choice = None
    if cfg.engine == "ray":
        from pt_ray.service.trainer import cluster_devices, starts_embedded

        # An embedded cluster's GPUs are known now: a missing GPU fails before the preflight.
        choice = cluster_devices(cfg) if starts_embedded() else None
        preflight(cfg)
    run_dir = Path(output_dir) if output_dir is not None else cfg.run_dir()

    def start(resolved: RunConfig) -> None:
        # Written once devices and precision are resolved, before any worker starts.
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(resolved.to_yaml())

    def report(rec: EpochRecord) -> None:
        if on_epoch is not None:
            on_epoch(rec)
        else:
            logger.info(format_epoch(rec, cfg.epochs, metric_name))

    t0 = time.perf_counter()
    extra: dict[str, Any] = {"engine": cfg.engine}
    # Imported here so that config errors surface before torch, Ray and the model load.
    if cfg.engine == "reference":
        from pt_ray.devices import choose_devices

        choice = choose_devices(cfg, cluster_gpus=0)
        logger.info(choice.describe())
        cfg, device = choice.apply(cfg), choice.device
        start(cfg)
        from pt_ray.runtime.reference import ReferenceTrainer

        trainer = ReferenceTrainer(cfg)
        trained = trainer.adapter
        metric_name = trainer.adapter.metric_name
        timeline = trainer.fit(report)
        extra["rollbacks"] = [{**r, "discarded": [asdict(d) for d in trainer.discarded]}
                              for r in trainer.rollbacks]
    else:
        from pt_ray.service.trainer import run_on_ray

        trained = None  # the parameters are in the checkpoint's shards
        run = run_on_ray(cfg, run_dir, worker_env, on_start=start, choice=choice)
        cfg, device = run.config, run.device
        metric_name, timeline = run.metric_name, run.timeline
        if on_epoch is not None:
            for rec in timeline:
                on_epoch(rec)
        extra.update(run_id=run.run_id, checkpoint=run.checkpoint_path,
                     decisions=run.decisions, restarts=run.restarts, cache=run.cache,
                     rollbacks=run.rollbacks)
    wall = time.perf_counter() - t0
    summary = write_summary(
        run_dir / "summary.json",
        wall_time_s=wall,
        metric_name=metric_name,
        timeline=timeline,
        config=cfg.model_dump(mode="json"),
        device=device,
        precision=cfg.precision,
        extra=extra,
    )
    _write_extras(cfg, summary, run_dir)
    _export_model(cfg, run_dir, trained, extra.get("checkpoint"))
    return Result(cfg, timeline, metric_name, timeline[-1].eval_metric, wall, run_dir,
                  checkpoint=extra.get("checkpoint"), decisions=extra.get("decisions", []),
                  restarts=extra.get("restarts", 0), rollbacks=extra.get("rollbacks", []))
