"""Alpha sweeps: the trials, concurrency sizing, Pareto marks, table/JSON/PNG from literal
results, argument checks before anything starts, and one small sweep on Ray Tune."""

import argparse
import json

import pytest

from pt_ray.core.config import ConfigError
from pt_ray.core.sweep import (
    ClusterTooSmallError,
    build_variants,
    fitting_cpus_per_worker,
    parse_alphas,
    parse_grid,
    trial_concurrency,
    trial_need,
)
from pt_ray.reporting.sweep_report import (
    TrialRow,
    analyse,
    format_sweep_table,
    pareto_front,
    render_sweep_png,
    write_sweep_json,
)
from pt_ray.cli.sweep import add_sweep_parser

unit = pytest.mark.unit


def _row(name, alpha, train, wall, metric, status="ok", baseline="baseline", **kw):
    return TrialRow(name=name, label=name, alpha=alpha, baseline=None if alpha is None
                    else baseline, status=status, metric_name="accuracy", final_metric=metric,
                    wall_time_s=wall, train_time_s=train, **kw)


def _literal_rows():
    return [
        _row("alpha-0.2", 0.2, 5.0, 30.0, 0.94),
        _row("alpha-0.33", 0.33, 6.0, 35.0, 0.93),  # dominated by alpha-0.2
        _row("alpha-0.5", 0.5, 4.0, 28.0, 0.90),
        _row("baseline", None, 10.0, 40.0, 0.95),
    ]


# -- Pareto and the results ----------------------------------------------------------------------


@unit
def test_pareto_front_of_literal_points():
    pts = [(1.0, 0.95), (2.0, 0.94), (1.6, 0.93), (2.5, 0.90), (2.5, 0.90), (0.9, 0.80)]
    assert pareto_front(pts) == [True, True, False, True, True, False]
    assert pareto_front([]) == []


@unit
def test_analyse_speedups_diffs_and_front():
    rows = {r.name: r for r in analyse(_literal_rows())}
    assert rows["alpha-0.2"].speedup_train == pytest.approx(2.0)
    assert rows["alpha-0.2"].speedup_wall == pytest.approx(40 / 30)
    assert rows["alpha-0.5"].speedup_train == pytest.approx(2.5)
    assert rows["alpha-0.33"].speedup_train == pytest.approx(10 / 6)
    assert rows["alpha-0.2"].metric_diff_points == pytest.approx(-1.0)
    assert rows["alpha-0.5"].metric_diff_points == pytest.approx(-5.0)
    assert rows["baseline"].speedup_train == pytest.approx(1.0)
    assert rows["baseline"].metric_diff_points == pytest.approx(0.0)
    assert {n for n, r in rows.items() if r.pareto} == {"alpha-0.2", "alpha-0.5", "baseline"}


@unit
def test_failed_trials_are_off_the_front_and_a_failed_baseline_gives_no_speedups():
    rows = _literal_rows()
    rows[2] = TrialRow(name="alpha-0.5", label="alpha-0.5", alpha=0.5, baseline="baseline",
                       status="error", error="boom")
    out = {r.name: r for r in analyse(rows)}
    assert not out["alpha-0.5"].pareto and out["alpha-0.5"].speedup_train is None
    assert out["alpha-0.33"].pareto is False and out["alpha-0.2"].pareto

    rows = _literal_rows()
    rows[3] = TrialRow(name="baseline", label="baseline", alpha=None, status="unfinished")
    out = analyse(rows)
    assert all(r.speedup_train is None and r.metric_diff_points is None for r in out)
    # Without a baseline the front still ranks by train time: 0.5 fastest, 0.2 most accurate.
    assert {r.name for r in out if r.pareto} == {"alpha-0.2", "alpha-0.5"}


@unit
def test_table_json_and_png_from_literal_results(tmp_path):
    rows = analyse(_literal_rows())
    table = format_sweep_table(rows, ["footer line"])
    lines = table.splitlines()
    assert lines[0].split() == ["trial", "alpha", "frozen/L", "K", "R", "train", "s", "wall",
                                "s", "speedup", "wall", "x", "ideal", "accuracy", "diff",
                                "pts", "pareto"]
    by_name = {ln.split()[0]: ln for ln in lines[2:6]}
    assert by_name["alpha-0.2"].split()[-3:] == ["0.9400", "-1.00", "*"]
    assert "2.00x" in by_name["alpha-0.2"] and "1.33x" in by_name["alpha-0.2"]
    assert not by_name["alpha-0.33"].rstrip().endswith("*")
    assert by_name["baseline"].split()[1] == "none" and by_name["baseline"].endswith("*")
    assert lines[-1] == "footer line"

    data = write_sweep_json(tmp_path / "sweep.json", rows, wall_time_s=12.5)
    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert on_disk == json.loads(json.dumps(data))
    assert on_disk["pareto"] == ["alpha-0.2", "alpha-0.5", "baseline"]
    assert on_disk["metric_name"] == "accuracy" and on_disk["wall_time_s"] == 12.5
    trials = {t["name"]: t for t in on_disk["trials"]}
    assert trials["baseline"]["is_baseline"] and not trials["alpha-0.2"]["is_baseline"]
    assert trials["alpha-0.5"]["speedup_train"] == pytest.approx(2.5)
    assert "speedup_train" in on_disk["definitions"]

    png = render_sweep_png(rows, tmp_path / "sweep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@unit
def test_table_shows_grid_columns_and_failures():
    rows = [TrialRow(name="alpha-0.2_pipeline.schedule-gpipe", label="x", alpha=0.2,
                     grid={"pipeline.schedule": "gpipe"}, status="error", error="it broke")]
    table = format_sweep_table(analyse(rows))
    assert "pipeline.schedule" in table.splitlines()[0]
    assert "gpipe" in table and "error (it broke)" in table


# -- the trials ----------------------------------------------------------------------------------


@unit
def test_variants_one_baseline_per_non_freeze_grid_point():
    vs = build_variants([0.2, 0.5], {"pipeline.schedule": ["gpipe", "1f1b"],
                                     "freeze.warmup_epochs": [2, 4]})
    alphas = [v for v in vs if not v.is_baseline]
    bases = [v for v in vs if v.is_baseline]
    assert len(alphas) == 8
    assert [b.name for b in bases] == ["baseline_pipeline.schedule-gpipe",
                                       "baseline_pipeline.schedule-1f1b"]
    assert bases[0].overrides == ("pipeline.schedule=gpipe", "freeze.policy=none")
    first = alphas[0]
    assert first.name == "alpha-0.2_pipeline.schedule-gpipe_freeze.warmup_epochs-2"
    assert first.overrides == ("pipeline.schedule=gpipe", "freeze.warmup_epochs=2",
                               "freeze.alpha=0.2")
    assert first.baseline == "baseline_pipeline.schedule-gpipe"
    assert len({v.name for v in vs}) == len(vs)

    plain = build_variants([0.25], baseline=True)
    assert [(v.name, v.label, v.baseline) for v in plain] == [
        ("alpha-0.25", "alpha=0.25", "baseline"), ("baseline", "baseline", None)]
    assert [v.name for v in build_variants([0.25], baseline=False)] == ["alpha-0.25"]


@unit
@pytest.mark.parametrize("text, fragment", [
    ("abc", "'abc' is not a number"),
    ("0.2,x", "'x' is not a number"),
    ("0", "alpha=0 is outside (0, 1]"),
    ("1.5", "alpha=1.5 is outside (0, 1]"),
    ("-0.1", "outside (0, 1]"),
    ("nan", "outside (0, 1]"),
    ("0.2,0.20", "given twice"),
    ("", "no alpha values"),
])
def test_bad_alphas_are_refused_with_the_rule(text, fragment):
    with pytest.raises(ConfigError, match="e.g. --alpha 0.2,0.25,0.33|given twice") as err:
        parse_alphas(text)
    assert fragment in str(err.value)


@unit
def test_alphas_parse():
    assert parse_alphas("0.2, 0.25,0.33,1") == [0.2, 0.25, 0.33, 1.0]


@unit
@pytest.mark.parametrize("items, fragment", [
    (["pipeline.schedule"], "is not key=v1,v2"),
    (["=a,b"], "is not key=v1,v2"),
    (["epochs=2,"], "empty value"),
    (["freeze.alpha=0.2,0.3"], "use --alpha|give its values with --alpha"),
    (["epochs=2", "epochs=3"], "given twice"),
    (["epochs=2,2"], "repeats a value"),
])
def test_bad_grid_is_refused(items, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_grid(items)
    assert parse_grid(["epochs=2,3", "pipeline.schedule=gpipe"]) == {
        "epochs": ["2", "3"], "pipeline.schedule": ["gpipe"]}


@unit
def test_baseline_reads_the_alpha_trials_batches_with_the_cache_on():
    from pt_ray.core.config import build_config
    from pt_ray.data.sampler import training_sampler
    from pt_ray.tune import _plan

    # The cache changes no order, so the baseline needs no pin to read the alpha trial's batches.
    variants, _, configs = _plan(None, [0.5], None, ["data.num_samples=64", "cache.mode=on"],
                                 True)
    assert variants[-1].overrides == ("freeze.policy=none",)
    alpha, base = (build_config(configs[n]) for n in ("alpha-0.5", "baseline"))
    assert (alpha.cache.mode, base.freeze.policy) == ("on", "none")

    def order(c):
        return training_sampler(c.freeze, c.data.batch_size, c.seed, 64)

    for epoch in range(3):
        assert (order(alpha).epoch_order(epoch).tolist()
                == order(base).epoch_order(epoch).tolist())


# -- concurrency ---------------------------------------------------------------------------------


@unit
def test_concurrency_is_floor_of_free_over_need():
    need = trial_need(trial_cpus=0.05, num_workers=2, cpus_per_worker=1.0)
    assert need == {"CPU": pytest.approx(2.05)}
    assert trial_concurrency({"CPU": 4.0}, need, 4)[0] == 1
    assert trial_concurrency({"CPU": 16.0}, need, 10)[0] == 7
    k, why = trial_concurrency({"CPU": 16.0}, need, 4)
    assert k == 4 and "only 4 trials" in why
    k, why = trial_concurrency({"CPU": 16.0}, need, 10, requested=2)
    assert k == 2 and "capped at max_concurrent=2" in why
    k, why = trial_concurrency({"CPU": 16.0}, need, 10, requested=50)
    assert k == 7 and "lowered to what fits" in why
    # Exact multiples fit (no float round-off loss).
    assert trial_concurrency({"CPU": 6.3}, {"CPU": 2.1}, 9)[0] == 3


@unit
def test_concurrency_counts_gpus():
    need = trial_need(trial_cpus=0.05, num_workers=2, cpus_per_worker=1.0, gpus_per_worker=1.0)
    assert need == {"CPU": pytest.approx(2.05), "GPU": 2.0}
    k, why = trial_concurrency({"CPU": 32.0, "GPU": 4.0}, need, 8)
    assert k == 2 and "GPU" in why
    with pytest.raises(ClusterTooSmallError, match=r"2 GPU \(the cluster has 1 free\)"):
        trial_concurrency({"CPU": 32.0, "GPU": 1.0}, need, 8)


@unit
def test_a_trial_that_cannot_fit_is_refused_with_the_fix():
    need = trial_need(trial_cpus=0.05, num_workers=2, cpus_per_worker=1.0)
    with pytest.raises(ClusterTooSmallError) as err:
        trial_concurrency({"CPU": 2.0}, need, 4)
    msg = str(err.value)
    assert "2.05 CPU" in msg and "has 2 free" in msg and "pipeline.cpus_per_worker" in msg
    with pytest.raises(ConfigError, match="max_concurrent=0"):
        trial_concurrency({"CPU": 8.0}, need, 4, requested=0)
    # The hint the service adds: what cpus_per_worker would fit 2 free CPUs.
    assert fitting_cpus_per_worker(2.0, 0.05, 2) == 0.97
    assert fitting_cpus_per_worker(4.0, 0.05, 2) == 1.97
    assert fitting_cpus_per_worker(0.04, 0.05, 2) == 0.0


@unit
def test_reference_engine_trial_takes_one_cpu_and_no_workers():
    assert trial_need(trial_cpus=0.05, num_workers=4, cpus_per_worker=1.0,
                      engine="reference") == {"CPU": 1.0}


# -- the command line: bad input fails before Ray ------------------------------------------------


def _args(argv):
    parser = argparse.ArgumentParser(prog="pt-ray")
    add_sweep_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sweep", *argv])


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if a sweep gets as far as starting or attaching to Ray."""
    import pt_ray.tune as tune_mod

    def refuse(_cfg, min_cpus=0.0):
        raise AssertionError("Ray was started despite bad input")

    monkeypatch.setattr(tune_mod, "ensure_ray", refuse)
    return tune_mod


@unit
@pytest.mark.parametrize("argv, fragment", [
    (["--alpha", "0.2,abc"], "'abc' is not a number"),
    (["--alpha", "1.5"], "alpha=1.5 is outside (0, 1]"),
    (["--alpha", "0.2", "--grid", "freeze.alpha=0.1,0.2"], "--alpha"),
    (["--alpha", "0.2", "--set", "epochs=0"], "epochs=0"),
    (["--alpha", "0.2", "--grid", "pipeline.schedule=gpipe,zigzag"],
     "trial alpha=0.2 pipeline.schedule=zigzag"),
    (["--alpha", "0.2", "--set", "freeze.policy=none"], "needs a freezing policy"),
    (["--alpha", "0.2", "--max-concurrent", "0"], "max_concurrent=0"),
])
def test_cli_refuses_bad_input_before_ray(argv, fragment, tmp_path, capsys, no_ray):
    args = _args([*argv, "--output", str(tmp_path / "s")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pt-ray: error: ") and fragment in err
    assert not (tmp_path / "s").exists()


@unit
def test_existing_sweep_needs_resume(tmp_path, capsys, no_ray):
    (tmp_path / "s" / "tune").mkdir(parents=True)
    args = _args(["--alpha", "0.2", "--output", str(tmp_path / "s")])
    assert args.func(args) == 2
    assert "pass --resume" in capsys.readouterr().err


@unit
def test_alpha_is_required():
    with pytest.raises(SystemExit):
        _args([])


# -- on Ray Tune ---------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_sweep_that_cannot_fit_fails_before_any_trial(ray_cluster, tmp_path):
    from pt_ray.tune import sweep

    with pytest.raises(ClusterTooSmallError, match="would fit one trial") as err:
        sweep(alphas=[0.5], overrides=["epochs=1", "data.num_samples=64",
                                       "pipeline.cpus_per_worker=2.5"], output_dir=tmp_path / "s")
    assert "5.05 CPU" in str(err.value)
    assert not (tmp_path / "s" / "tune").exists()


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_small_sweep_on_tune(ray_cluster, tmp_path):
    from pt_ray.tune import sweep

    out = tmp_path / "sweep"
    # cache.mode=on: the alpha trial caches, the baseline cannot; both read the same batches.
    result = sweep(alphas=[0.5], overrides=["epochs=2", "data.num_samples=256", "engine=ray",
                                            "pipeline.num_workers=2", "cache.mode=on",
                                            "logging.mlflow=true"],
                   output_dir=out)
    assert result.ok and result.concurrency == 1  # 4 CPUs / 2.05 per trial
    for name in ("sweep.json", "sweep.png", "sweep.txt"):
        assert (out / name).is_file(), name
    data = json.loads((out / "sweep.json").read_text())
    trials = {t["name"]: t for t in data["trials"]}
    assert set(trials) == {"alpha-0.5", "baseline"}
    assert trials["baseline"]["is_baseline"] and trials["baseline"]["speedup_train"] == 1.0
    assert trials["alpha-0.5"]["baseline"] == "baseline"
    assert trials["alpha-0.5"]["status"] == "ok" and trials["alpha-0.5"]["speedup_train"] > 0
    # Two epochs are all warm-up (nothing freezes) and the baseline reads the same batches:
    # the two runs are the same computation.
    assert trials["alpha-0.5"]["final_metric"] == trials["baseline"]["final_metric"]
    for t in trials.values():
        summary = json.loads((out / t["name"] / "summary.json").read_text())
        assert summary["epochs"] == 2 and t["final_metric"] == summary["final_eval_metric"]
        assert summary["config"]["data"]["num_samples"] == 256
    assert trials["baseline"]["summary_path"] == str(out / "baseline" / "summary.json")
    cfg = json.loads((out / "baseline" / "summary.json").read_text())["config"]
    assert cfg["freeze"]["policy"] == "none" and "order" not in cfg["cache"]
    assert json.loads((out / "alpha-0.5" / "summary.json").read_text())["config"]["freeze"][
        "alpha"] == 0.5
    assert data["pareto"] and set(data["pareto"]) <= set(trials)
    table = (out / "sweep.txt").read_text()
    assert "alpha-0.5" in table and "baseline" in table and result.table in table

    # MLflow: one parent run for the sweep, one child per trial, in the sweep folder's store.
    from mlflow.tracking import MlflowClient

    parent = json.loads((out / "mlflow.json").read_text())
    client = MlflowClient(parent["tracking_uri"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    by_id = {r.info.run_id: r for r in runs}
    assert by_id[parent["run_id"]].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent["run_id"]]
    assert sorted(r.info.run_name for r in children) == sorted(
        json.loads((out / n / "summary.json").read_text())["config"]["name"] for n in trials)
    assert all(r.info.status == "FINISHED" and "eval_metric" in r.data.metrics
               for r in children)
    assert len(runs) == 3
    assert "sweep.json" in {a.path for a in client.list_artifacts(parent["run_id"])}


# -- the job entry points (no processes) ---------------------------------------------------------


def _load_job(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "jobs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"jobs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@unit
def test_sweep_job_output_defaults_outside_the_jobs_working_dir(tmp_path, monkeypatch):
    entry = _load_job("sweep")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    base = tmp_path / "base"
    assert entry.output_dir([], {"PT_RAY_OUTPUT": str(base)}) == base / "default-sweep"
    assert entry.output_dir(["--alpha", "0.2", "--set", "name=n1"],
                            {"PT_RAY_OUTPUT": str(base)}) == base / "n1-sweep"
    assert entry.output_dir(["--set", f"output_dir={base}"], {}) == base / "default-sweep"
    assert entry.output_dir([], {}) == tmp_path / "home" / "pt-ray-runs" / "default-sweep"
    assert entry.output_dir(["--output", "rel"], {**job, "PT_RAY_OUTPUT": str(base)}) == (
        base / "rel")
    assert entry.output_dir(["--set", "epochs=0"], {}) is None  # the sweep reports the error


@unit
def test_sweep_job_refuses_a_bad_alpha(capsys, tmp_path):
    entry = _load_job("sweep")
    assert entry.main(["--alpha", "0.2,7", "--output", str(tmp_path / "s")]) == 2
    assert "alpha=7 is outside (0, 1]" in capsys.readouterr().err


@unit
def test_bench_job_out_folder(tmp_path, monkeypatch):
    entry = _load_job("bench")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert entry.out_dir([], job) == tmp_path / "home" / "pt-ray-runs" / "bench"
    assert entry.out_dir([], {"PT_RAY_OUTPUT": str(tmp_path)}) == tmp_path / "bench"
    assert entry.out_dir(["--out", "r1"], {**job, "PT_RAY_OUTPUT": str(tmp_path)}) == (
        tmp_path / "r1")
    assert entry.out_dir(["--out", str(tmp_path / "abs")], job) == tmp_path / "abs"
