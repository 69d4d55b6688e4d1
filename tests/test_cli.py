"""The ``pt-ray train`` command and the ``summary.json`` contract it writes."""

from __future__ import annotations

import json
import logging

import pytest

from pt_ray.api import default_config_path
from pt_ray.cli import main
from pt_ray.core.config import load_config
from pt_ray.reporting.summary import EpochRecord, ideal_speedup


TINY = [
    "--set", "engine=reference",
    "--set", "epochs=2",
    "--set", "model.depth=2",
    "--set", "model.width=32",
    "--set", "model.num_heads=2",
    "--set", "data.num_samples=128",
    "--set", "freeze.policy=schedule",
    "--set", "freeze.alpha=0.5",
    "--set", "freeze.warmup_epochs=1",
]
# Every field of RunSummary: a run writes them all (null, 0 or empty where its engine has none).
SUMMARY_KEYS = {"wall_time_s", "epochs", "metric_name", "final_eval_metric", "timeline", "config",
                "device", "precision", "engine", "run_id", "checkpoint", "decisions", "restarts",
                "rollbacks", "startup", "start_trials", "resumed_from", "cache", "data"}
RECORD_KEYS = {
    "epoch", "num_frozen", "num_layers", "pipeline_length", "num_replicas", "num_microbatches",
    "throughput_samples_per_s", "epoch_time_s", "transition_time_s", "cache_hit_rate",
    "train_loss", "eval_metric",
}


@pytest.mark.proc  # the report is drawn in a process of its own, which the command waits for
def test_train_writes_resolved_config_and_summary(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"

    assert main(["train", *TINY, "--output", str(out)]) == 0

    # config.yaml is the resolved default job with the overrides, and round-trips; the
    # reference engine resolved the device and precision (auto) to one CPU process at fp32.
    cfg = load_config(out / "config.yaml")
    assert cfg == load_config(default_config_path(),
                              [*TINY[1::2], "pipeline.use_gpu=false", "precision=fp32"])
    assert cfg.name == "default" and cfg.data.name == "digits"  # the default job's fields
    assert (cfg.epochs, cfg.model.depth, cfg.data.num_samples) == (2, 2, 128)

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["engine"] == "reference" and summary["run_id"] is None
    assert summary["rollbacks"] == []
    assert summary["cache"] == {} and summary["data"] == {}  # Ray's figures only
    assert summary["engine"] == "reference"
    assert (summary["device"], summary["precision"]) == ("cpu", "fp32")
    assert summary["epochs"] == 2 and summary["metric_name"] == "accuracy"
    assert summary["wall_time_s"] > 0
    assert summary["config"] == cfg.model_dump(mode="json")
    timeline = summary["timeline"]
    assert [r["epoch"] for r in timeline] == [0, 1]
    for rec in timeline:
        assert set(rec) == RECORD_KEYS | {"eval_time_s", "cache_saved_s", "cache_bytes",
                                          "cache_objects", "cache_cost_ratio", "memory",
                                              "mean_frozen", "probe_time_s"}
        assert rec["memory"] == []  # per-rank memory is the Ray engine's (one process here)
        assert rec["num_layers"] == 2
        assert (rec["pipeline_length"], rec["num_replicas"], rec["num_microbatches"]) == (1, 1, 1)
        assert 0.0 <= rec["eval_metric"] <= 1.0 and rec["throughput_samples_per_s"] > 0
    # schedule n(1) = ceil(2 * 0.5) = 1 (cap L - 1 = 1): the overrides reached the trainer.
    assert [r["num_frozen"] for r in timeline] == [0, 1]
    assert summary["final_eval_metric"] == timeline[-1]["eval_metric"]

    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0] == "devices: 1 CPU process (engine=reference), precision fp32"
    epoch_lines = [m for m in stdout.splitlines() if m.startswith("epoch ")]
    assert len(epoch_lines) == 2
    assert epoch_lines[0].startswith("epoch   1/2  loss ")
    assert "frozen  1/2" in epoch_lines[1]
    assert "final accuracy" in stdout and str(out / "summary.json") in stdout
    assert f"report at {out / 'report.png'}" in stdout and (out / "report.png").is_file()


@pytest.mark.unit
def test_explicit_precision_is_recorded(tmp_path):
    out = tmp_path / "run"

    assert main(["train", *TINY, "--set", "precision=bf16", "--set", "logging.report=false",
                 "--output", str(out)]) == 0

    assert json.loads((out / "summary.json").read_text())["precision"] == "bf16"
    assert load_config(out / "config.yaml").precision == "bf16"


@pytest.mark.unit
def test_use_gpu_true_without_gpus_exits_2_in_one_line_before_anything_starts(
        tmp_path, capsys, monkeypatch):
    import ray

    from pt_ray.service import trainer

    # No GPUs, whether the run would start its own cluster or attach to one already up.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer, "local_gpus", lambda: 0)
    monkeypatch.setattr(trainer.ray, "cluster_resources", lambda: {"CPU": 4.0})
    was_up = ray.is_initialized()
    out = tmp_path / "run"

    code = main(["train", *TINY, "--set", "engine=ray", "--set", "pipeline.use_gpu=true",
                 "--output", str(out)])

    assert code == 2
    assert capsys.readouterr().err == (
        "pt-ray: error: pipeline.use_gpu=true needs 2 GPUs (one per worker) but the cluster "
        "has 0; set pipeline.use_gpu=auto or false, or add GPUs\n")
    assert ray.is_initialized() == was_up  # no embedded cluster was started for the check
    assert not out.exists()


@pytest.mark.unit
def test_bad_override_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"

    code = main(["train", *TINY, "--set", "freeze.alpha=1.5", "--output", str(out)])

    assert code == 2
    err = capsys.readouterr().err
    assert "freeze.alpha=1.5" in err
    assert "less than or equal to 1" in err
    assert not out.exists()


@pytest.mark.unit
def test_unknown_field_suggests_the_close_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--set", "freeze.alpah=0.5", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "freeze.alpah" in err and "did you mean freeze.alpha" in err
    assert not out.exists()


def _record(epoch: int, num_frozen: int) -> EpochRecord:
    return EpochRecord(
        epoch=epoch, num_frozen=num_frozen, num_layers=4, pipeline_length=1, num_replicas=1,
        num_microbatches=1, throughput_samples_per_s=1.0, epoch_time_s=1.0,
        transition_time_s=0.0, cache_hit_rate=0.0, train_loss=1.0, eval_metric=0.5,
    )


@pytest.mark.unit
def test_ideal_speedup_of_a_literal_timeline():
    timeline = [_record(e, n) for e, n in enumerate([0, 2, 3, 3])]
    # No freezing: 4 epochs x 4 blocks x 3 units = 48. This run: 12 + (6 + 2) + (3 + 3) + (3 + 3)
    # = 32 without the cache. With it an epoch is served only as deep as the epoch before ran
    # frozen (its rows are read in the next epoch): 12 + (6 + 2) + (3 + 1) + 3 = 27, where
    # pricing every frozen block as cached would give 24 (2.0x).
    assert ideal_speedup(timeline) == pytest.approx(48 / 32)
    assert ideal_speedup(timeline, cached=True) == pytest.approx(48 / 27)
    # Blocks frozen inside an epoch count by their mean over its steps: 2 blocks from half-way
    # through epoch 1 (mean 1) are served in epoch 2 only as deep as that mean.
    grew = [{"num_frozen": n, "mean_frozen": m, "num_layers": 4}
            for n, m in [(0, 0.0), (2, 1.0), (2, 2.0)]]
    # 12 + (9 + 1) + (6 + 1) = 29 with the cache; 12 + 10 + 8 = 30 without.
    assert ideal_speedup(grew, cached=True) == pytest.approx(36 / 29)
    assert ideal_speedup(grew) == pytest.approx(36 / 30)
    # Priced from epoch 1 on, epoch 0 still says what the cache holds: 24 / (10 + 7).
    assert ideal_speedup(grew, cached=True, from_epoch=1) == pytest.approx(24 / 17)
    as_dicts = [
        {"num_frozen": r.num_frozen, "num_layers": r.num_layers} for r in timeline
    ]
    assert ideal_speedup(as_dicts) == pytest.approx(1.5)
    assert ideal_speedup([_record(0, 0)]) == 1.0


# Runs an entry point as its own process would, with a config error (exit status 2, before
# torch or Ray loads), and prints at exit how many objects the collections there skip.
ENTRY = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count()))
kind, target = sys.argv[1], sys.argv[2]
sys.argv = [target, *sys.argv[3:]]
run = runpy.run_module if kind == "module" else runpy.run_path
run(target, run_name="__main__")
"""


@pytest.mark.proc
@pytest.mark.parametrize("kind, target, args", [
    ("module", "pt_ray.cli", ["train", "--set", "epochs=0"]),  # python -m pt_ray.cli
    ("path", "jobs/train.py", ["--set", "epochs=0"]),  # the ray job submit entrypoint
])
def test_the_entry_points_exit_without_collecting_what_they_loaded(kind, target, args):
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pt-ray"] == "pt_ray.cli:console"
    done = subprocess.run([sys.executable, "-c", ENTRY, kind, target, *args], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # the command's own status comes through
    assert "epochs" in done.stderr
    frozen = int(done.stdout.split("frozen")[-1])
    assert frozen > 0  # atexit still ran, and what was alive stayed out of the collections


@pytest.mark.unit
def test_console_exits_with_the_commands_status_after_freezing(monkeypatch):
    import gc

    import pt_ray.cli as cli

    monkeypatch.setattr(cli, "main", lambda: 3)  # a command that ends with status 3
    try:
        with pytest.raises(SystemExit) as done:
            cli.console()
        assert done.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
