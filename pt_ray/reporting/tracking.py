"""MLflow tracking of a run (``logging.mlflow``), one MLflow run per pt-ray run, whatever stops
and restarts it.

The driver opens (or reopens) the MLflow run before training and keeps its id in the run folder
(``mlflow.json``), so a resume (``--resume``) continues the same MLflow run; the workers need no
tracking client. When the run ends, the driver logs what the run folder holds: every epoch's
record (step = epoch), every ``logging.every_steps`` report (``steps.jsonl``, step = global
step), the freeze timeline (as metrics and as ``timeline.json``), ``report.png`` and the exported
model. Worker-group restarts inside the run are the ``restarts`` metric; each resume is a
``resumes`` count and a ``pt_ray.resumed_from.<n>`` tag naming the checkpoint. A Tune trial
(``logging.mlflow_parent``) nests under its sweep's run.

As Ray's own MLflow integration does, this uses MLflow's client API with an explicit tracking
URI, not the process-global active run, so concurrent runs in one driver do not mix.

The functions here read the ``logging`` section only; the entry passes the run's name and its
resolved config (as JSON-able values, logged as the MLflow run's parameters) beside it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError, LoggingConfig
from pt_ray.reporting.steplog import STEP_JOURNAL

__all__ = ["RUN_FILE", "Tracker", "flatten", "open_sweep_run", "open_tracker", "tracking_uri"]

logger = logging.getLogger(__name__)

RUN_FILE = "mlflow.json"
"""In the run folder: the MLflow run this pt-ray run logs to."""

EPOCH_METRICS = ("train_loss", "eval_metric", "throughput_samples_per_s", "epoch_time_s",
                 "transition_time_s", "num_frozen", "pipeline_length", "num_replicas",
                 "num_microbatches", "cache_hit_rate")
STEP_METRICS = {"train_loss": "step/loss", "samples_per_s": "step/samples_per_s",
                "lr": "step/lr", "num_frozen": "step/num_frozen"}


def tracking_uri(settings: LoggingConfig, run_dir: Path) -> str:
    """The tracking URI ``logging.mlflow`` names (``true``/``local``: SQLite in the run
    folder)."""
    value = settings.mlflow
    if value is True or value == "local":
        return f"sqlite:///{(Path(run_dir) / 'mlflow' / 'mlflow.db').resolve()}"
    return str(value)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config values as dotted keys (``freeze.alpha``), each as text (MLflow's params
    are strings, at most 6,000 characters)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]
    return out


def _client_for(settings: LoggingConfig, folder: Path) -> tuple[Any, str]:
    """MLflow's client for ``settings``' tracking URI (a local store's folder made), and the
    URI.

    Raises:
        ConfigError: MLflow is not installed.
    """
    uri = tracking_uri(settings, folder)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError("logging.mlflow is set but MLflow is not installed; "
                          "pip install 'pt-ray[mlflow]', or unset logging.mlflow") from None
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri), uri


class Tracker:
    """The MLflow run of one pt-ray run (see the module docstring)."""

    def __init__(self, client: Any, run_id: str, run_dir: Path) -> None:
        self.client = client
        self.run_id = run_id
        self.run_dir = run_dir

    def _batch(self, metrics: list[Any] = (), params: list[Any] = (),
               tags: list[Any] = ()) -> None:
        """``log_batch`` within MLflow's limits (1,000 metrics, 100 params, 100 tags a call)."""
        metrics, params, tags = list(metrics), list(params), list(tags)
        while metrics or params or tags:
            self.client.log_batch(self.run_id, metrics=metrics[:1000], params=params[:100],
                                  tags=tags[:100])
            metrics, params, tags = metrics[1000:], params[100:], tags[100:]

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Log the finished run (see the module docstring) and mark the MLflow run done."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(rec[key]), now, int(rec["epoch"]))
                   for rec in summary["timeline"] for key in EPOCH_METRICS
                   if rec.get(key) is not None and rec[key] == rec[key]]
        metrics += [Metric(tag, float(step[key]), int(step["time"] * 1000),
                           int(step["global_step"]))
                    for step in _steps(self.run_dir) for key, tag in STEP_METRICS.items()]
        metrics.append(Metric("restarts", float(summary.get("restarts", 0)), now, 0))
        final = summary.get("final_eval_metric")
        if final is not None and final == final:
            metrics.append(Metric(f"final_{summary['metric_name']}", float(final), now, 0))
        self._batch(metrics=metrics, tags=[RunTag("pt_ray.metric", summary["metric_name"])])
        self.client.log_text(self.run_id, json.dumps(summary["timeline"], indent=1),
                             "timeline.json")
        for name in ("report.png", "summary.json", "config.yaml"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        if (self.run_dir / "model").is_dir():
            self.client.log_artifacts(self.run_id, str(self.run_dir / "model"), "model")
        self.client.set_terminated(self.run_id, "FINISHED")
        logger.info("MLflow: run %s logged (%d metric values)", self.run_id, len(metrics))

    def finish_sweep(self) -> None:
        """Log a finished sweep's table and plot and mark its run done."""
        for name in ("sweep.json", "sweep.txt", "sweep.png"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self) -> None:
        """Mark the MLflow run failed (a resume sets it running again)."""
        self.client.set_terminated(self.run_id, "FAILED")


def _steps(run_dir: Path) -> Iterator[dict[str, Any]]:
    path = run_dir / STEP_JOURNAL
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except ValueError:  # a line cut short by a killed worker
            continue


def open_tracker(settings: LoggingConfig, run_dir: Path, resumed_from: str | None, *,
                 name: str, params: Mapping[str, Any]) -> Tracker | None:
    """Open the run's MLflow run (None when ``logging.mlflow`` is off): a new one named
    ``name`` with ``params`` (the run's config as JSON-able values) as its parameters, or the
    one ``mlflow.json`` names when the run folder already has one (a resume), recorded as such.

    Raises:
        ConfigError: MLflow is not installed.
    """
    if not settings.mlflow:
        return None
    client, uri = _client_for(settings, run_dir)
    from mlflow.entities import RunTag

    record = run_dir / RUN_FILE
    if record.is_file() and resumed_from is not None:
        run_id = json.loads(record.read_text())["run_id"]
        tracker = Tracker(client, run_id, run_dir)
        resumes = int(client.get_run(run_id).data.metrics.get("resumes", 0)) + 1
        client.update_run(run_id, status="RUNNING")
        tracker._batch(tags=[RunTag(f"pt_ray.resumed_from.{resumes}", resumed_from)])
        client.log_metric(run_id, "resumes", resumes, step=resumes)
        logger.info("MLflow: resuming run %s (%s)", run_id, uri)
        return tracker
    tags = {"pt_ray.run_dir": str(run_dir.resolve())}
    if settings.mlflow_parent:
        tags["mlflow.parentRunId"] = settings.mlflow_parent
    return _new_run(client, settings.mlflow_experiment, uri, run_dir, name, tags, params)


def _new_run(client: Any, experiment_name: str, uri: str, folder: Path, name: str,
             tags: dict[str, str], params: Mapping[str, Any]) -> Tracker:
    """A new MLflow run in ``experiment_name`` for ``folder`` (its id kept in
    ``folder/mlflow.json``), with ``params`` (nested config values) as its parameters."""
    from mlflow.entities import Param

    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = (experiment.experiment_id if experiment is not None else
                     client.create_experiment(
                         experiment_name,
                         artifact_location=(str((folder / "mlflow" / "artifacts").resolve())
                                            if uri.startswith("sqlite:///") else None)))
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    tracker = Tracker(client, run.info.run_id, folder)
    flat = flatten(params)
    tracker._batch(params=[Param(k, v) for k, v in sorted(flat.items())])
    (folder / RUN_FILE).write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": uri}))
    logger.info("MLflow: run %s in experiment %r (%s)", run.info.run_id, experiment_name, uri)
    return tracker


def open_sweep_run(settings: LoggingConfig, sweep_dir: Path, *, name: str,
                   params: Mapping[str, Any]) -> tuple[Tracker, list[str]] | None:
    """The parent MLflow run of a sweep (reopened when the sweep resumes; a new one is named
    ``<name>-sweep``, with ``params``, the base config's values, as its parameters), and the
    overrides that nest each trial under it in the same store. None when ``logging.mlflow`` is
    off.

    Raises:
        ConfigError: MLflow is not installed.
    """
    if not settings.mlflow:
        return None
    client, uri = _client_for(settings, sweep_dir)
    record = sweep_dir / RUN_FILE
    if record.is_file():
        tracker = Tracker(client, json.loads(record.read_text())["run_id"], sweep_dir)
        client.update_run(tracker.run_id, status="RUNNING")
    else:
        tracker = _new_run(client, settings.mlflow_experiment, uri, sweep_dir, f"{name}-sweep",
                           {"pt_ray.sweep_dir": str(sweep_dir)}, params)
    return tracker, [f"logging.mlflow={uri}", f"logging.mlflow_parent={tracker.run_id}"]
