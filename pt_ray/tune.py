"""Alpha sweeps on Ray Tune: one trial per alpha (times an optional grid), each a whole pt-ray
run, plus a no-freeze baseline on the same data and seed; then speedups, Pareto front, table,
``sweep.json`` and ``sweep.png`` (:mod:`pt_ray.core.sweep`).

Each trial is a Tune function trial holding a sliver of a CPU; it calls :func:`pt_ray.api.fit`,
which starts pt-ray's controller actor and a Ray Train ``TorchTrainer`` on the same cluster.
A trial thus holds its sliver while its Train run waits for workers, so no more trials start
than the cluster's free resources can run whole (:func:`pt_ray.core.sweep.trial_concurrency`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune

from pt_ray.core.config import ConfigError, LoggingConfig, PipelineConfig, RunConfig
from pt_ray.core.devices import choose_devices
from pt_ray.core.freeze import policy_traits
from pt_ray.api import resolve_config
from pt_ray.reporting.logs import setup_logging
from pt_ray.reporting.tracking import open_sweep_run
from pt_ray.service.trainer import ensure_ray
from pt_ray.reporting.summary import ideal_speedup
from pt_ray.core.sweep import (
    ClusterTooSmallError,
    Variant,
    build_variants,
    check_alphas,
    fitting_cpus_per_worker,
    trial_concurrency,
    trial_need,
)
from pt_ray.reporting.sweep_report import (
    TrialRow,
    analyse,
    format_sweep_table,
    render_sweep_png,
    write_sweep_json,
)

__all__ = ["SweepResult", "TRIAL_CPUS", "sweep"]

logger = logging.getLogger(__name__)

TRIAL_CPUS = 0.05
"""CPU held by each Tune trial actor (it only waits on its Ray Train run). Tune rejects 0."""

EXPERIMENT = "tune"
"""Tune's experiment folder under the sweep folder (``Tuner.restore`` takes its path)."""

_SPEC = "sweep_spec.json"


@dataclass(frozen=True)
class SweepResult:
    """What :func:`sweep` returns.

    Attributes:
        sweep_dir: the sweep's folder (``sweep.json``, ``sweep.txt``, ``sweep.png``, one run
            folder per trial, Tune's experiment under ``tune/``).
        trials: one row per trial, baselines last, with speedups and Pareto marks.
        concurrency: trials run at once, and why.
        wall_time_s: the sweep's wall time (cluster start excluded).
        table: the text table (also in ``sweep.txt``).
    """

    sweep_dir: Path
    trials: list[TrialRow]
    concurrency: int
    concurrency_reason: str
    wall_time_s: float
    table: str

    @property
    def pareto(self) -> list[TrialRow]:
        """The Pareto-optimal trials."""
        return [r for r in self.trials if r.pareto]

    @property
    def ok(self) -> bool:
        """Every trial finished."""
        return all(r.status == "ok" for r in self.trials)


def sweep(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    alphas: Sequence[float],
    grid: Mapping[str, Sequence[Any]] | None = None,
    overrides: Iterable[str] = (),
    output_dir: str | Path | None = None,
    baseline: bool = True,
    max_concurrent: int | None = None,
    resume: bool = False,
    worker_env: dict[str, str] | None = None,
) -> SweepResult:
    """Run one pt-ray run per alpha (times ``grid``) and a no-freeze baseline, on Ray Tune.

    Args:
        config: the base job: a RunConfig, a dict, a YAML path, or None (the default job).
        alphas: ``freeze.alpha`` values, each in (0, 1].
        grid: other fields to cross with the alphas, e.g. ``{"pipeline.schedule": ["gpipe",
            "1f1b"]}`` (values as Python values or ``--set`` text).
        overrides: ``key=value`` strings applied to every trial.
        output_dir: the sweep folder (default: ``<output_dir>/<name>-sweep`` of the config).
        baseline: also run ``freeze.policy=none`` (once per grid point outside ``freeze.*``).
        max_concurrent: at most this many trials at once (never more than fit the cluster).
        resume: continue the sweep in ``output_dir`` with Tune's restore (finished trials are
            kept, errored and unfinished ones run again); starts afresh when there is none.
        worker_env: extra environment variables for the training workers.

    Raises:
        ConfigError: a bad alpha, grid or config value, or a sweep folder that already holds
            a sweep without ``resume`` (before anything starts).
        pt_ray.core.sweep.ClusterTooSmallError: not even one trial fits the cluster.
    """
    alphas, overrides = check_alphas(alphas), list(overrides)
    if max_concurrent is not None and max_concurrent < 1:
        raise ConfigError(f"max_concurrent={max_concurrent}: give 1 or more, or leave it unset "
                          f"to run as many trials as the cluster fits")
    variants, base, configs = _plan(config, alphas, grid, overrides, baseline)
    sweep_dir = Path(output_dir if output_dir is not None
                     else base.output_dir / f"{base.name}-sweep").expanduser().resolve()
    exp_dir = sweep_dir / EXPERIMENT
    restoring = _check_folder(sweep_dir, exp_dir, variants, configs, resume)
    _preflight(configs.values())

    # One trial must fit: 2 workers x 1 CPU + the trial's sliver is 3 logical CPUs on a 2-core
    # machine (the sliver only waits).
    started = ensure_ray(base.pipeline, base.cache,
                         min_cpus=_need(base.pipeline, base.engine, use_gpu=False)["CPU"])
    try:
        k, why = _size(base.pipeline, len(variants), max_concurrent, engine=base.engine,
                       precision=base.precision)
        logger.info("sweep of %d trials (%s) in %s: %d at a time (%s)", len(variants),
                    ", ".join(v.name for v in variants), sweep_dir, k, why)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / _SPEC).write_text(json.dumps(_spec(variants, configs), indent=2))
        parent, configs = _nest_in_mlflow(base.logging, sweep_dir, configs, name=base.name,
                                          params=base.model_dump(mode="json"))
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        results = _run_tune(sweep_dir, exp_dir, variants, configs, base.engine, k, restoring,
                            worker_env or {})
        wall = time.perf_counter() - t0
    finally:
        if started:
            ray.shutdown()

    rows = analyse(_rows(variants, results))
    table = _table(rows, k, why, wall, load_before)
    (sweep_dir / "sweep.txt").write_text(table + "\n")
    write_sweep_json(
        sweep_dir / "sweep.json", rows, sweep_dir=str(sweep_dir), alphas=alphas,
        grid={k_: list(map(str, v)) for k_, v in (grid or {}).items()},
        overrides=overrides, baseline=baseline, base_config=base.model_dump(mode="json"),
        concurrency={"trials_at_once": k, "why": why, "trial_cpus": TRIAL_CPUS},
        wall_time_s=wall,
        machine={"cpus": os.cpu_count(), "load_before": load_before,
                 "load_after": os.getloadavg()},
    )
    try:
        render_sweep_png(rows, sweep_dir / "sweep.png",
                         title=f"{base.name}: alpha sweep ({len(variants)} trials)")
    except Exception as err:  # a plot must not fail a finished sweep
        logger.warning("sweep.png not written: %s", err)
    logger.info("%s", table)
    if parent is not None:
        parent.finish_sweep()
    unfinished = [r.name for r in rows if r.status != "ok"]
    if unfinished:
        logger.warning("%d trials did not finish (%s); continue with --resume (Tune restores "
                       "%s)", len(unfinished), ", ".join(unfinished), exp_dir)
    return SweepResult(sweep_dir, rows, k, why, wall, table)


# -- before Tune ---------------------------------------------------------------------------------


def _plan(config, alphas, grid, overrides, baseline
          ) -> tuple[list[Variant], RunConfig, dict[str, dict[str, Any]]]:
    """The trials and each one's validated config (as JSON-able dicts)."""
    base = resolve_config(config, overrides)
    if not policy_traits(base.freeze.policy).freezes:
        raise ConfigError("freeze.policy=none in the base config: an alpha sweep needs a "
                          "freezing policy; use --set freeze.policy=paper (or schedule)")
    variants = build_variants(alphas, grid, baseline)
    configs: dict[str, dict[str, Any]] = {}
    for v in variants:
        try:
            cfg = resolve_config(base, [*v.overrides, f"name={base.name}-{v.name}"])
        except ConfigError as err:
            raise ConfigError(f"trial {v.label}: {err}") from None
        configs[v.name] = cfg.model_dump(mode="json")
    return variants, base, configs


def _nest_in_mlflow(settings: LoggingConfig, sweep_dir: Path, configs: dict[str, dict[str, Any]],
                    *, name: str, params: Mapping[str, Any]):
    """With ``logging.mlflow``: the sweep's parent run (named after the base config's ``name``,
    its ``params`` logged), and the trials' configs pointed at its store as its children (after
    the spec is written, so a resumed sweep still matches it)."""
    parent = open_sweep_run(settings, sweep_dir, name=name, params=params)
    if parent is None:
        return None, configs
    tracker, overrides = parent
    return tracker, {name: resolve_config(c, overrides).model_dump(mode="json")
                     for name, c in configs.items()}


def _table(rows: Sequence[TrialRow], k: int, why: str, wall: float,
           load_before: Sequence[float]) -> str:
    """The sweep's text table, with a footer on its concurrency, wall time and machine load."""
    footer = [f"{len(rows)} trials, {k} at a time ({why}); sweep wall time {wall:.1f} s; "
              f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after on "
              f"{os.cpu_count()} CPUs"]
    return format_sweep_table(rows, footer)


def _spec(variants: Sequence[Variant], configs: Mapping[str, Any]) -> dict[str, Any]:
    return {"trials": [{"name": v.name, "overrides": list(v.overrides),
                        "config": configs[v.name]} for v in variants]}


def _check_folder(sweep_dir: Path, exp_dir: Path, variants, configs, resume: bool) -> bool:
    """Whether to restore Tune's experiment; refuses to mix a new sweep into an old one."""
    if not resume:
        if exp_dir.exists():
            raise ConfigError(
                f"{sweep_dir} already holds a sweep; pass --resume (resume=True) to continue "
                f"it, or choose another --output folder")
        return False
    if not tune.Tuner.can_restore(str(exp_dir)):
        logger.info("no sweep to resume in %s; starting one", sweep_dir)
        return False
    spec_path = sweep_dir / _SPEC
    if spec_path.is_file():
        old = json.loads(spec_path.read_text())
        if old != json.loads(json.dumps(_spec(variants, configs))):
            raise ConfigError(
                f"the sweep in {sweep_dir} was started with other trials or another config; "
                f"resume it with the same arguments, or choose another --output folder")
    return True


def _preflight(configs: Iterable[Mapping[str, Any]]) -> None:
    """Build each distinct dataset and model once here, so a bad path or layout fails before
    any trial starts (freeze fields and names do not change them)."""
    from pt_ray.api import preflight
    from pt_ray.core.config import build_config

    seen: set[str] = set()
    for c in configs:
        if c["engine"] != "ray":
            continue
        key = json.dumps({k: v for k, v in c.items() if k not in ("name", "freeze")},
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            preflight(build_config(c))


def _need(p: PipelineConfig, engine: str, use_gpu: bool) -> dict[str, float]:
    return trial_need(trial_cpus=TRIAL_CPUS, num_workers=p.num_workers,
                      cpus_per_worker=p.cpus_per_worker, gpus_per_worker=1.0 if use_gpu else 0.0,
                      engine=engine)


def _size(p: PipelineConfig, num_trials: int, requested: int | None, *, engine: str,
          precision: str) -> tuple[int, str]:
    """Trials at once for runs of pipeline ``p`` on this cluster, and why."""
    # Each trial's run makes the same choice (pt_ray.service.trainer); pipeline.use_gpu=true
    # without the GPUs fails here, before any trial starts.
    choice = choose_devices(p, ray.cluster_resources().get("GPU", 0.0), engine=engine,
                            precision=precision)
    need = _need(p, engine, choice.use_gpu)
    free = ray.available_resources()
    try:
        return trial_concurrency(free, need, num_trials, requested)
    except ClusterTooSmallError as err:
        cpw = fitting_cpus_per_worker(free.get("CPU", 0.0), TRIAL_CPUS, p.num_workers)
        if engine != "ray" or cpw <= 0 or cpw >= p.cpus_per_worker:
            raise
        raise ClusterTooSmallError(
            f"{err}; here --set pipeline.cpus_per_worker={cpw:g} would fit one trial") from None


# -- Tune ----------------------------------------------------------------------------------------


def _trial_name(trial) -> str:
    return trial.config["trial"]


def _run_tune(sweep_dir: Path, exp_dir: Path, variants: Sequence[Variant],
              configs: Mapping[str, dict[str, Any]], engine: str, k: int, restoring: bool,
              worker_env: dict[str, str]):
    runs = {v.name: {"config": configs[v.name], "run_dir": str(sweep_dir / v.name),
                     "worker_env": worker_env, "reuse": restoring, "cwd": os.getcwd()}
            for v in variants}
    cpus = trial_need(trial_cpus=TRIAL_CPUS, num_workers=0, cpus_per_worker=0.0,
                      engine=engine)["CPU"]
    trainable = tune.with_resources(tune.with_parameters(_run_trial, runs=runs), {"CPU": cpus})
    if restoring:
        logger.info("resuming the sweep in %s (Tune restore; errored trials run again)", exp_dir)
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_errored=True)
        _set_concurrency(tuner, k)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search([v.name for v in variants])},
            tune_config=tune.TuneConfig(max_concurrent_trials=k, trial_name_creator=_trial_name,
                                        trial_dirname_creator=_trial_name),
            run_config=tune.RunConfig(name=EXPERIMENT, storage_path=str(sweep_dir), verbose=1),
        )
    return tuner.fit()


def _set_concurrency(tuner, k: int) -> None:
    """Tune restores the saved TuneConfig; the cluster may differ now, so re-apply the
    concurrency that fits it (no public API for this in Ray 2.60)."""
    inner = getattr(tuner, "_local_tuner", None)
    config = getattr(inner, "_tune_config", None)
    if config is None:
        logger.warning("could not re-size the restored sweep; it keeps its saved concurrency")
        return
    inner._tune_config = dataclasses.replace(config, max_concurrent_trials=k)


def _quiet(_rec) -> None:
    """The Ray engine's workers log each epoch already."""


def _run_trial(config: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """One Tune trial: a whole pt-ray run, then its figures via ``ray.tune.report``."""
    from pt_ray.api import fit

    setup_logging()
    spec = runs[config["trial"]]
    if os.path.isdir(spec["cwd"]):
        os.chdir(spec["cwd"])  # Tune starts trials in their own folder; relative paths are the
        # user's
    run_dir = Path(spec["run_dir"])
    summary = _finished_summary(run_dir, spec["config"]) if spec["reuse"] else None
    if summary is None:
        fit(spec["config"], output_dir=run_dir, worker_env=spec["worker_env"] or None,
            on_epoch=None if spec["config"]["engine"] == "reference" else _quiet)
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        logger.info("%s: reusing the finished run in %s", config["trial"], run_dir)
    tune.report(_figures(summary, run_dir / "summary.json"))


def _finished_summary(run_dir: Path, cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """A finished run of exactly this config in ``run_dir`` (a sweep stopped after it)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    same = _same_config(summary.get("config"), cfg)
    return summary if same and summary.get("epochs") == cfg["epochs"] else None


def _same_config(recorded: Any, wanted: Mapping[str, Any]) -> bool:
    """Whether a run's recorded config is ``wanted``. A run records ``precision``,
    ``pipeline.use_gpu`` and ``cache.worker_memo_bytes`` resolved, so ``auto`` in ``wanted``
    matches what it resolved to."""
    wanted = json.loads(json.dumps(wanted))
    if isinstance(recorded, dict):
        if wanted.get("precision") == "auto" and "precision" in recorded:
            wanted["precision"] = recorded["precision"]
        for section, key in (("pipeline", "use_gpu"), ("cache", "worker_memo_bytes")):
            mine, theirs = wanted.get(section) or {}, recorded.get(section) or {}
            if mine.get(key) == "auto" and key in theirs:
                mine[key] = theirs[key]
    return json.dumps(recorded, sort_keys=True) == json.dumps(wanted, sort_keys=True)


def _figures(summary: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """What a trial reports: final metric, times, last layout, the ideal bound, where the
    summary is."""
    tl = summary["timeline"]
    last = tl[-1]
    return {
        "final_metric": summary["final_eval_metric"],
        "metric_name": summary["metric_name"],
        "wall_time_s": summary["wall_time_s"],
        "train_time_s": sum(r["epoch_time_s"] + r["transition_time_s"] for r in tl),
        # The cache's bound when it served (as pt_ray.reporting.report does), else the plain one.
        "ideal_speedup": ideal_speedup(tl, cached=any(r.get("cache_hit_rate", 0.0) > 0
                                                       for r in tl)),
        "num_frozen": last["num_frozen"],
        "num_layers": last["num_layers"],
        "pipeline_length": last["pipeline_length"],
        "num_replicas": last["num_replicas"],
        "summary_path": str(path),
    }


def _rows(variants: Sequence[Variant], results) -> list[TrialRow]:
    """One row per variant from Tune's ResultGrid (``unfinished`` when Tune has none)."""
    by_name: dict[str, Any] = {}
    for i in range(len(results)):
        res = results[i]
        name = (res.config or {}).get("trial")
        if name is not None:
            by_name[name] = res
    rows = []
    for v in variants:
        res = by_name.get(v.name)
        if res is None:
            rows.append(TrialRow.from_metrics(v, None, status="unfinished"))
        elif res.error is not None:
            rows.append(TrialRow.from_metrics(v, None, status="error",
                                              error=_short(res.error)))
        elif not res.metrics or "final_metric" not in res.metrics:
            rows.append(TrialRow.from_metrics(v, None, status="unfinished"))
        else:
            rows.append(TrialRow.from_metrics(v, res.metrics))
    return rows


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[-1] if text else type(err).__name__)[:300]
