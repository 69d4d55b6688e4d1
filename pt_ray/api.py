"""The Python entry point: ``pt_ray.fit(config) -> Result``, usable from scripts and notebooks."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pt_ray.core.config import (ConfigError, DataConfig, LoggingConfig, ModelConfig,
                                PipelineConfig, RunConfig, build_config, layer_config,
                                load_config)
from pt_ray.core.datasets import DATASETS
from pt_ray.reporting.summary import (EpochRecord, RunSummary, format_epoch, read_summary,
                                      write_summary)
from pt_ray.reporting.files import hold_run_folder, write_text_atomically

if TYPE_CHECKING:
    from pt_ray.core.devices import DeviceChoice
    from pt_ray.data.base import DatasetSplits
    from pt_ray.models.base import ModelAdapter
    from pt_ray.runtime.resume import ResumePoint

__all__ = ["Result", "check_output_dir", "default_config_path", "fit", "preflight",
           "resolve_config"]

logger = logging.getLogger(__name__)


def default_config_path() -> Path:
    """The default job's YAML (a small ViT on scikit-learn's digits)."""
    return Path(str(resources.files("pt_ray") / "configs" / "default.yaml"))


def resolve_config(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    overrides: Iterable[str] = (),
) -> RunConfig:
    """A validated RunConfig from a RunConfig, a dict, a YAML path, or None (the default job),
    with ``key=value`` overrides applied on top. Overrides that switch the model to a
    checkpoint take its shape from the checkpoint (``pt_ray.core.config.layer_config``)."""
    overrides = list(overrides)
    if config is None:
        return load_config(default_config_path(), overrides)
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        config = config.model_dump(mode="json")
    return build_config(layer_config(config, overrides, base_label="the given config"))


def check_output_dir(run_dir: str | Path) -> None:
    """Fail unless ``run_dir`` is a writable folder or can be created as one, leaving nothing.

    Beyond the permission bits, it tries: it makes the missing folders and a file in the last
    one, then removes what it made (a folder that permissions allow can still refuse, as
    ``/proc`` or a read-only mount does, and root passes every permission check).

    Raises:
        ConfigError: a file is in the way, the nearest existing folder is read-only, or the
            folder cannot be made or written for another reason (the system's, named).
    """
    path = Path(run_dir).absolute()
    fix = "choose another --output (or output_dir/name in the config)"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output folder {str(path)!r} is a file, not a folder; {fix}")
    existing = path
    while not existing.exists():  # the root always exists
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output folder {str(path)!r} cannot be created: {str(existing)!r} "
                          f"is a file, not a folder; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder {str(path)!r} cannot be created: {str(existing)!r} "
                          f"is not writable; {fix}, or make it writable")
    _try_output_dir(path, existing, fix)


def _try_output_dir(path: Path, existing: Path, fix: str) -> None:
    """Make ``path`` (below its nearest existing folder ``existing``) and a file in it, then
    remove both; a failure becomes one line naming the system's reason."""
    made: list[Path] = []
    try:
        for folder in reversed([f for f in (path, *path.parents) if existing in f.parents]):
            folder.mkdir()
            made.append(folder)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pt-ray-write-check-"):
            pass
    except OSError as err:
        what = "written" if path == existing else "created"
        where = f" ({str(err.filename)!r})" if err.filename else ""
        raise ConfigError(f"output folder {str(path)!r} cannot be {what}: "
                          f"{err.strerror or err}{where}; {fix}") from None
    finally:
        for folder in reversed(made):
            folder.rmdir()


def preflight(cfg: RunConfig, *, meta: bool = False) -> tuple[DatasetSplits, ModelAdapter]:
    """Build the dataset and the model once in the driver, so that a bad path, file, model name
    or layout fails here, before any Ray worker starts.

    Args:
        cfg: the run's configuration.
        meta: build the model on torch's meta device where its builder allows it
            (:func:`pt_ray.runtime.build.builds_on_meta`): every check runs (names, fields,
            weights files read and matched, the layer count against ``pipeline_length`` and
            ``max_frozen``) but no parameter memory is allocated. The Ray engine's driver
            uses it: its workers build the real model.

    Returns:
        The built splits and model (the reference engine trains them; on the Ray engine the
        export reuses both: the splits size the model it loads the last checkpoint into, and
        a model built for real is that model).

    Raises:
        ConfigError: the configuration cannot run (the message names the field and the fix).
    """
    from pt_ray.data.registry import build_dataset
    from pt_ray.runtime.build import build_model_for

    # The builders raise ConfigError for what the user gave them (paths, files, names, model
    # fields); anything else they raise is a bug and keeps its traceback.
    splits = build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
    adapter = build_model_for(cfg.model, cfg.seed, splits, meta=meta)
    num_layers = adapter.num_layers
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
    return splits, adapter


def _write_extras(logging_cfg: LoggingConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """The report PNG and TensorBoard scalars the ``logging`` section asks for (never fails the
    run). The PNG is drawn in a process of its own, started here, which outlives the call
    (:mod:`pt_ray.reporting.report_process`): the run does not wait for it."""
    try:
        if logging_cfg.report:
            from pt_ray.reporting.report_process import start_report

            start_report(run_dir / "summary.json", run_dir / "report.png")
        if logging_cfg.tensorboard:
            from pt_ray.reporting.tensorboard import write_tensorboard

            write_tensorboard(summary, run_dir / "tensorboard")
    except Exception as err:  # a plot must not fail a finished run
        logger.warning("run report not written: %s", err)


def _export_model(run_dir: Path, adapter: Any, checkpoint: str | None,
                  summary: dict[str, Any], *, model: ModelConfig, data: DataConfig, seed: int,
                  name: str, splits: DatasetSplits, built: ModelAdapter) -> None:
    """The trained model in its library's own format into ``run_dir/model`` (from the
    reference trainer's ``adapter`` in memory, else the Ray run's last checkpoint loaded into
    the preflight's model ``built``, or into one built from the run's ``model`` and ``seed``
    and sized by the preflight's ``splits`` when ``built`` holds shapes only), with its model
    card; a failure is logged with the command that retries it, and never fails the finished
    run."""
    from pt_ray.runtime.export import MODEL_DIR, export_adapter, export_checkpoint, write_card

    out = run_dir / MODEL_DIR
    try:
        if adapter is not None:
            export_adapter(adapter, out, f"run {name!r} in {run_dir}", model=model,
                           tokenizer=data.tokenizer)
        elif checkpoint is not None:
            export_checkpoint(checkpoint, out, model=model, data=data, seed=seed, name=name,
                              splits=splits, adapter=built)
        else:
            logger.warning("model not exported: the run left no checkpoint")
            return
        write_card(out, summary)
    except Exception as err:  # hours of training must not end in a traceback here
        logger.warning("model not exported: %s; retry with `pt-ray export %s`", err, run_dir)
        return
    logger.info("model exported to %s (its README.md is the model card)", out)


@dataclass(frozen=True)
class Result:
    """What a run returns: the summary it wrote into ``run_dir/summary.json``, with its
    configuration as a :class:`RunConfig`.

    Attributes:
        summary: the run's :class:`pt_ray.reporting.summary.RunSummary`, as written (every
            figure of the run: cache, start-up, start trials, ...).
        config: the resolved configuration (``pipeline.use_gpu`` and ``precision`` concrete).
        run_dir: where ``config.yaml`` and ``summary.json`` were written, and the trained
            model in its library's own format (``model/``; :meth:`load_model` reads it).
            ``report.png`` (``logging.report``) is drawn there by a process of its own, which
            may still run when ``fit`` returns: :meth:`wait_for_report` waits for it.

    The summary's main fields read directly: ``timeline`` (one record per epoch),
    ``metric_name``, ``final_eval_metric`` (after the last epoch), ``wall_time_s`` (of the
    whole run; of this part of it, for a resumed run), ``checkpoint`` (the latest checkpoint
    folder on Ray, loadable with ``pt_ray.runtime.checkpoint.load_layers``; None for the
    reference engine), ``decisions`` (every freeze decision with its numbers and reason, on
    Ray), ``restarts`` (worker-group restarts from a checkpoint) and ``rollbacks`` (the
    accuracy guard's: the epoch whose evaluation fell, the epoch returned to, the blocks
    frozen before and after, the metric before and after, and the undone epochs' records).
    """

    summary: RunSummary
    config: RunConfig
    run_dir: Path

    @property
    def timeline(self) -> list[EpochRecord]:
        return self.summary.timeline

    @property
    def metric_name(self) -> str:
        return self.summary.metric_name

    @property
    def final_eval_metric(self) -> float:
        return self.summary.timeline[-1].eval_metric

    @property
    def wall_time_s(self) -> float:
        return self.summary.wall_time_s or 0.0

    @property
    def checkpoint(self) -> str | None:
        return self.summary.checkpoint

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return self.summary.decisions

    @property
    def restarts(self) -> int:
        return self.summary.restarts

    @property
    def rollbacks(self) -> list[dict[str, Any]]:
        return self.summary.rollbacks

    def load_model(self) -> Any:
        """The trained model as a plain timm or transformers model, in eval mode, read from the
        export the run wrote into ``run_dir/model`` (see :mod:`pt_ray.models.export`).

        Raises:
            FileNotFoundError: the run wrote no export (the message gives the command that
                writes one).
        """
        from pt_ray.runtime.export import MODEL_DIR
        from pt_ray.models.export import load_exported

        return load_exported(self.run_dir / MODEL_DIR)

    def wait_for_report(self, timeout_s: float = 120.0) -> Path | None:
        """Wait up to ``timeout_s`` for ``run_dir/report.png`` to be drawn; returns its path,
        or None when it was not (``logging.report`` off, a failure: its reason is in
        ``report.error.txt`` beside it, or still drawing after ``timeout_s``)."""
        from pt_ray.reporting.report_process import wait_for_reports

        png = self.run_dir / "report.png"
        wait_for_reports(timeout_s, out=png)
        return png if png.is_file() else None


def fit(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    resume_from: str | Path | None = None,
    overrides: Iterable[str] = (),
    output_dir: str | Path | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
    worker_env: dict[str, str] | None = None,
    train_data: Any = None,
    eval_data: Any = None,
) -> Result:
    """Train a model with AutoFreeze and write ``config.yaml``, ``summary.json`` and the
    trained model in its library's own format (``model/``, see :mod:`pt_ray.runtime.export`).

    ``fit`` returns once the model and the summary are written. ``report.png`` is drawn by a
    process of its own, started with the summary and left running (an interrupt of the caller
    does not stop it); :meth:`Result.wait_for_report` waits for it, and ``pt-ray train``
    does so before it exits. A report that cannot be drawn never fails the run: the reason is
    in ``report.error.txt`` beside it. On the Ray engine the driver's preflight builds the model
    on the meta device (shapes and checks only) and the export is the one full build of the
    model in this process; the reference engine builds it once, trains it and exports it.

    Args:
        config: a RunConfig, a dict of fields, a YAML path, or None for the default job.
        resume_from: the folder of a stopped run on Ray to continue (instead of ``config``):
            its newest complete checkpoint is loaded (see :mod:`pt_ray.runtime.resume`) and the run
            goes on in that folder; ``overrides`` may then change ``pipeline.*`` (e.g. the
            number of workers) and ``logging.*`` only.
        overrides: ``key=value`` strings applied on top (e.g. ``"freeze.alpha=0.25"``).
        output_dir: folder for the run's files (default: ``<output_dir>/<name>`` of the config).
        on_epoch: called with each epoch's record (default: log one line per epoch). On Ray
            the workers log each epoch as it ends and ``on_epoch`` sees the records at the end.
        worker_env: extra environment variables for Ray's training workers.
        train_data, eval_data: the splits as a Ray Dataset, a pyarrow Table or a pandas
            DataFrame, for a table dataset (``data.name`` ``text_table``, ``qa_table`` or
            ``image_table``): written once into ``<run folder>/data`` as Parquet, which
            ``data.path`` then names (see :mod:`pt_ray.service.datasets` for the sizes this
            suits).

    Raises:
        ConfigError: before anything starts or is written: a bad value, an output folder that
            cannot be created, dataset, weights or tokenizer files that cannot be read, a model
            that cannot be built, or ``pipeline.use_gpu=true`` on an embedded cluster without
            the GPUs; or, on a cluster already running, once Ray has connected and before any
            actor or worker has started: ``pipeline.use_gpu=true`` without its GPUs, or
            workers the cluster can never hold, or has no room for within
            ``pipeline.placement_timeout_s`` (:class:`pt_ray.core.placement.PlacementError`). The
            same error ends a run whose workers Ray Train itself gave up placing (each try
            bounded by ``pipeline.placement_timeout_s``), once ``config.yaml`` is written.
            With ``resume_from``: the folder holds no run that can resume (see
            :func:`pt_ray.runtime.resume.resume_point`), or ``config`` or ``output_dir`` was
            given too.
    """
    in_memory = train_data is not None or eval_data is not None
    if in_memory:  # data.path is set for real once the splits are written
        overrides = [*overrides, "data.path=."]
    if resume_from is None:
        cfg = resolve_config(config, overrides)
        run_dir, resumed = Path(output_dir) if output_dir is not None else cfg.run_dir(), None
    else:
        cfg, run_dir, resumed = _resumed(resume_from, overrides,
                                         config is not None or output_dir is not None)
    check_output_dir(run_dir)
    if in_memory:
        cfg = resolve_config(cfg, _write_tables(cfg.data, run_dir, train_data, eval_data))
    choice = _early_device_choice(cfg.engine, cfg.pipeline, cfg.precision)
    built_from = time.perf_counter()
    # The reference engine trains the preflight's model; on Ray it only needs its shapes.
    splits, adapter = preflight(cfg, meta=cfg.engine == "ray")
    preflight_s = time.perf_counter() - built_from
    from pt_ray.cache.policy import cache_policy

    det = splits.train.deterministic_transform
    logger.info(cache_policy(cfg.cache, cfg.freeze, det).describe())
    # One live run per folder: a second one stops here, before it writes anything.
    with hold_run_folder(run_dir):
        from pt_ray.reporting.tracking import open_tracker

        tracker = open_tracker(cfg.logging, run_dir,
                               str(resumed.checkpoint) if resumed else None, name=cfg.name,
                               params=cfg.model_dump(mode="json"))
        try:
            result = _train(cfg, choice, run_dir, splits, adapter, built_from, preflight_s,
                            worker_env, on_epoch, resumed)
        except BaseException:
            if tracker is not None:
                _quietly(tracker.fail, "MLflow run not marked failed")
            raise
        if tracker is not None:
            result.wait_for_report()  # MLflow logs the PNG
            _quietly(lambda: tracker.finish(read_summary(run_dir)), "MLflow run not logged")
        return result


def _quietly(action: Callable[[], None], what: str) -> None:
    """Run ``action``; a failure is a warning (a tracker never fails a finished run)."""
    try:
        action()
    except Exception as err:
        logger.warning("%s: %s", what, err)


def _train(cfg: RunConfig, choice: DeviceChoice | None, run_dir: Path, splits: DatasetSplits,
           adapter: ModelAdapter, built_from: float, preflight_s: float,
           worker_env: dict[str, str] | None, on_epoch: Callable[[EpochRecord], None] | None,
           resumed: ResumePoint | None) -> Result:
    """Steps 4-6 of :func:`fit`, in the run folder it holds: train on the engine the config
    names, then write ``summary.json``, the extras and the exported model. ``config.yaml`` is
    written once devices and precision are resolved, before any worker starts."""
    # The reference run's time counts building its dataset and model, as the Ray workers' does.
    t0 = built_from if cfg.engine == "reference" else time.perf_counter()

    def finish(summary: RunSummary, ran: RunConfig, trained: Any = None) -> Result:
        """Step 6 for the config the run ran (``trained``: the reference trainer's adapter;
        None on Ray, whose parameters are in the checkpoint's shards)."""
        export = partial(_export_model, run_dir, trained, model=ran.model, data=ran.data,
                         seed=ran.seed, name=ran.name, splits=splits, built=adapter)
        return Result(_finish(summary, run_dir, t0, ran.logging, export), ran, run_dir)

    if cfg.engine == "reference":
        assert choice is not None
        cfg = cfg.model_copy(update=choice.config_update(cfg.pipeline))
        summary, trained = _train_reference(cfg, choice.device, splits, adapter, run_dir,
                                            on_epoch)
        return finish(summary, cfg, trained)
    # The workers read the splits shipped (where they fit) and build their own model.
    from pt_ray.service.trainer import run_on_ray

    def finish_on_ray(trained: RunSummary) -> Result:
        return finish(_ray_summary(trained, on_epoch, resumed, preflight_s),
                      RunConfig.model_validate(trained.config))  # as the workers ran it

    return run_on_ray(cfg, run_dir, worker_env, config_file=run_dir / "config.yaml",
                      choice=choice, resume_from=resumed.checkpoint if resumed else None,
                      splits=splits, then=finish_on_ray)


def _finish(summary: RunSummary, run_dir: Path, t0: float, logging_cfg: LoggingConfig,
            export: Callable[[str | None, dict[str, Any]], None]) -> RunSummary:
    """Step 6 of :func:`fit`: the wall time, ``summary.json``, the exported model
    (``export(checkpoint, written summary)``), then the extras (the report's own process
    starts last, so that it does not slow the export); returns the summary written."""
    summary = summary.model_copy(update={"wall_time_s": time.perf_counter() - t0})
    written = write_summary(run_dir / "summary.json", summary)
    export(summary.checkpoint, written)
    _write_extras(logging_cfg, written, run_dir)
    return summary


def _write_tables(data: DataConfig, run_dir: Path, train_data: Any,
                  eval_data: Any) -> list[str]:
    """Step 1b of :func:`fit`: in-memory splits written into the run folder; returns the
    overrides that point the config (its ``data`` section given) at them."""
    tables = [name for name, entry in DATASETS.items() if entry.table]
    if data.name not in tables:
        raise ConfigError(f"train_data and eval_data are tables: set data.name to "
                          f"{', '.join(tables[:-1])} or {tables[-1]} (it is {data.name})")
    from pt_ray.service.datasets import materialise

    return materialise(run_dir, train_data, eval_data)


def _resumed(resume_from: str | Path, overrides: Iterable[str],
             with_config: bool) -> tuple[RunConfig, Path, ResumePoint]:
    """Step 1 of :func:`fit` for a resumed run: its config and folder (``with_config``: fit
    was given a config or an output folder too, which a resumed run refuses)."""
    from pt_ray.runtime.resume import resume_point

    if with_config:
        raise ConfigError("resume_from continues a run with its own config.yaml in its own "
                          "folder: pass neither config nor output_dir with it")
    resumed = resume_point(resume_from, list(overrides))
    cfg, run_dir = resumed.config, resumed.run_dir
    logger.info("resuming %r in %s from its checkpoint after epoch %d of %d (%s)", cfg.name,
                run_dir, resumed.next_epoch, cfg.epochs, resumed.checkpoint.name)
    return cfg, run_dir, resumed


def _early_device_choice(engine: str, pipeline: PipelineConfig,
                         precision: str) -> DeviceChoice | None:
    """Step 2 of :func:`fit`: the devices (from the run's ``engine``, ``pipeline`` section and
    ``precision``), where they are known before the preflight (the reference engine's, an
    embedded cluster's); None when a cluster decides once connected. Imported here so that
    config errors surface before torch, Ray and the model load."""
    if engine == "ray":
        from pt_ray.service.trainer import cluster_devices, starts_embedded

        # An embedded cluster's GPUs are known now: a missing GPU fails before the preflight.
        return cluster_devices(pipeline, engine, precision) if starts_embedded() else None
    from pt_ray.core.devices import choose_devices

    choice = choose_devices(pipeline, cluster_gpus=0, engine=engine, precision=precision)
    logger.info(choice.describe())
    return choice


def _train_reference(cfg: RunConfig, device: str, splits: DatasetSplits, adapter: ModelAdapter,
                     run_dir: Path, on_epoch: Callable[[EpochRecord], None] | None
                     ) -> tuple[RunSummary, ModelAdapter]:
    """Step 3 of :func:`fit` on the reference engine: train the preflight's dataset and model
    in this process (``cfg``: devices and precision resolved, written as ``config.yaml``
    first); returns the run's summary (without its wall time) and the trained model."""
    write_text_atomically(run_dir / "config.yaml", cfg.to_yaml())
    from pt_ray.runtime.reference import build_reference
    from pt_ray.service.settings import run_settings

    from pt_ray.reporting.steplog import StepReporter, step_writers

    # No Ray Train to report to: the step reports go to TensorBoard and the journal, if on.
    writer = step_writers(run_dir, cfg.logging.tensorboard, bool(cfg.logging.mlflow))
    steps = StepReporter(writer=writer) if writer is not None else None
    # The preflight's dataset and model: built once, in the order the trainer builds them.
    trainer = build_reference(run_settings(cfg).reference, splits=splits, adapter=adapter,
                              on_step_report=steps)
    metric_name = trainer.adapter.metric_name

    def report(rec: EpochRecord) -> None:
        if on_epoch is not None:
            on_epoch(rec)
        else:
            logger.info(format_epoch(rec, cfg.epochs, metric_name))

    try:
        timeline = trainer.fit(report)
    finally:
        if steps is not None:
            steps.close()
    rollbacks = [{**r, "discarded": [asdict(d) for d in trainer.discarded]}
                 for r in trainer.rollbacks]
    summary = RunSummary(timeline=timeline, metric_name=metric_name,
                         config=cfg.model_dump(mode="json"), device=device,
                         precision=cfg.precision, engine=cfg.engine, rollbacks=rollbacks)
    return summary, trainer.adapter


def _ray_summary(summary: RunSummary, on_epoch: Callable[[EpochRecord], None] | None,
                 resumed: ResumePoint | None, preflight_s: float) -> RunSummary:
    """Step 3 of :func:`fit` on Ray, once the workers have trained (and logged each epoch as
    it ended): ``on_epoch`` sees the records at the end; the summary gains the driver's
    preflight time and, for a resumed run, where it resumed."""
    if on_epoch is not None:
        for rec in summary.timeline:
            on_epoch(rec)
    # The driver's checks come before wall_time_s starts; the rest within it.
    update: dict[str, Any] = {"startup": {"preflight_s": preflight_s, **summary.startup}}
    if resumed is not None:
        update["resumed_from"] = {"checkpoint": str(resumed.checkpoint),
                                  "after_epoch": resumed.next_epoch}
    return summary.model_copy(update=update)
