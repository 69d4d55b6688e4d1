"""The training workers' log holds pt-ray's lines, not Ray Train's per-report dumps."""

from __future__ import annotations

import logging

import pytest

from pt_ray.service.settings import run_settings


@pytest.mark.unit
def test_ray_train_report_lines_are_silenced_by_their_file_named_logger(caplog):
    from ray.train.v2._internal.execution import context

    from pt_ray.service.worker import quiet_ray_train

    logger = logging.getLogger(context.__file__)
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        caplog.set_level(logging.INFO)
        # The very call Ray Train makes for each report (its module logger, at INFO): shown
        # by default, not once the worker has quietened Ray Train.
        context.logger.info("Reporting training result 1: TrainingReport(...) from rank 0")
        assert "Reporting training result 1" in caplog.text
        quiet_ray_train()
        context.logger.info("Reporting training result 2: TrainingReport(...) from rank 0")
        assert "Reporting training result 2" not in caplog.text
        assert not logger.isEnabledFor(logging.INFO)
        assert logger.isEnabledFor(logging.WARNING)
    finally:
        logger.setLevel(before)


# --- logging.every_steps --------------------------------------------------------------------


def step_config(tmp_path, **extra):
    from pt_ray.core.config import build_config

    return build_config({
        "name": "every-steps",
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 128, "image_size": 8,
                 "batch_size": 16},
        # K 2 (rank 0 holds no loss) for 1 epoch, 2 frozen; then K 1, R 2 (each holds half).
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "schedule": "1f1b", "policy": "paper"},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        "logging": {"every_steps": 5, "tensorboard": True, "report": False,
                    "progress": "off"},
        "epochs": 3,
        "output_dir": str(tmp_path),
        **extra,
    })


@pytest.mark.unit
def test_worker_step_reports_reach_ray_train_on_every_rank_and_tensorboard_from_rank_0(
        tmp_path, monkeypatch):
    from pt_ray.service.worker import _step_reporter
    from pt_ray.reporting.steplog import StepRecord
    from test_report import read_scalars

    cfg = step_config(tmp_path)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    reported: dict[int, list[dict]] = {0: [], 1: []}
    reporters = {rank: _step_reporter(cfg.logging, rank, str(tmp_path), reported[rank].append)
                 for rank in (0, 1)}
    assert reporters[0].min_gap_s == 3.0  # 1.5 of Ray Train's poll interval
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    assert _step_reporter(cfg.logging, 0, None, print).min_gap_s == 1.0  # at least 1 s
    # One epoch of 200 steps of 0.1 s, a record every 5 steps (0.5 s): every rank sees the
    # same records (rank 0's window time) and so makes the same calls.
    for s in range(5, 201, 5):
        rec = StepRecord(epoch=0, global_step=s, epoch_step=s, epoch_steps=200,
                         train_loss=2.0 / s, samples_per_s=160.0, lr=1e-3, num_frozen=0,
                         window_s=0.5, window_steps=5)
        for reporter in reporters.values():
            reporter(rec)
    for reporter in reporters.values():
        reporter.close()
    assert reported[0] == reported[1]
    # 3 s apart, none within 3 s of the epoch's end (its own report).
    assert [m["global_step"] for m in reported[0]] == [30, 60, 90, 120, 150]
    assert reported[0][0] == {"report": "step", "epoch": 0, "global_step": 30,
                              "epoch_step": 30, "epoch_steps": 200, "train_loss": 2.0 / 30,
                              "samples_per_s": 160.0, "lr": 1e-3, "num_frozen": 0,
                              "window_s": 0.5, "window_steps": 5}
    # TensorBoard gets every record, from rank 0 only (one event file).
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["step/loss"]] == list(range(5, 201, 5))


@pytest.fixture
def own_driver():
    """A cluster, and this process's connection to it, started for this test alone (a session
    cluster that was up is started again and left up). The terminal check reads what Ray's
    driver forwards from the workers: after half an hour of other tests on one connection, the
    CI saw none of a run's lines arrive within a minute, while the same test passed after any
    one other module; this test reads a connection with no history."""
    import ray
    from conftest import SESSION_RAY

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    ray.init(**SESSION_RAY)
    yield
    if not was_up:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_run_reports_steps_while_it_runs_and_prints_pt_ray_lines_only(tmp_path, capfd,
                                                                            own_driver):
    """every_steps=5 on Ray Train (K 2, then K 1 x R 2): rank 0's live event file holds the
    step losses at 5, 10, 15, 20, equal to the reference trainer's; the per-epoch scalars sit
    beside them; the terminal shows pt-ray's epoch lines and none of Ray Train's reports.

    ``fit`` attaches to the cluster this test started (a cluster ``fit`` starts itself is shut
    down when it returns, which could cut off the last lines Ray had yet to forward)."""
    import math
    import time

    from pt_ray.api import fit
    from pt_ray.runtime.reference import build_reference
    from test_report import read_scalars

    expected = []
    build_reference(run_settings(step_config(tmp_path / "ref", engine="reference")).reference,
                     on_step_report=expected.append).fit()
    assert [r.global_step for r in expected] == [5, 10, 15, 20]
    capfd.readouterr()

    result = fit(step_config(tmp_path / "ray"))
    # Ray forwards the workers' output to this process every few 100 ms: wait for the last
    # epoch's line rather than a fixed time.
    out, deadline = "", time.monotonic() + 60
    while "epoch   3/3" not in out and time.monotonic() < deadline:
        out += "".join(capfd.readouterr())
        time.sleep(0.05)

    logdir = result.run_dir / "tensorboard"
    assert len(list(logdir.glob("events.out.tfevents.*.steps"))) == 1
    scalars = read_scalars(logdir)
    assert [s for s, _ in scalars["step/loss"]] == [5, 10, 15, 20]
    losses = [v for _, v in scalars["step/loss"]]
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx([r.train_loss for r in expected], rel=1e-4)
    assert [v for _, v in scalars["step/lr"]] == pytest.approx([r.lr for r in expected])
    assert [v for _, v in scalars["step/num_frozen"]] == [r.num_frozen for r in expected]
    assert all(v > 0 for _, v in scalars["step/samples_per_s"])
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]  # the end-of-run timeline

    assert "epoch   1/3  loss" in out  # the workers' lines did reach this terminal
    for ray_train_line in ("Reporting training result", "TrainingReport", "'train_loss'",
                           "'global_step'"):
        assert ray_train_line not in out


@pytest.mark.unit
def test_epoch_lines_of_two_processes_both_reach_the_driver_at_once():
    """Ray's driver merges lines that differ only in their numbers when two processes print
    them within a few seconds (two trials of a sweep, two runs on one cluster); pt-ray's epoch
    lines are exempt in any driver that started or attached through ``ensure_ray``."""
    from ray._private import ray_logging

    from pt_ray.service.trainer import keep_epoch_lines

    def batch(pid, line):
        return {"ip": "10.0.0.1", "pid": pid, "job": "01000000", "is_err": False,
                "lines": [line], "actor_name": "RayTrainWorker", "task_name": None}

    trial_a = "epoch   1/3  loss 2.2943  accuracy 0.3164  frozen  0/4  K 2 R 1 M 8"
    trial_b = "epoch   1/3  loss 2.1007  accuracy 0.3550  frozen  0/4  K 2 R 1 M 8"
    # Ray's de-duplicator without an exempt pattern: the second trial's line is held back.
    plain = ray_logging.LogDeduplicator(5, None, None)
    plain.deduplicate(batch(1013, trial_a))
    assert plain.deduplicate(batch(1380, trial_b))[0]["lines"] == []

    keep_epoch_lines()
    keep_epoch_lines()  # idempotent
    for dedup in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
        assert dedup.allow_re.pattern.count("epoch") == 1
    # The first batch returned holds what this batch shows now (later ones: held lines due).
    shown = [ray_logging.stdout_deduplicator.deduplicate(batch(pid, line))[0]["lines"]
             for pid, line in ((1013, trial_a), (1380, trial_b))]
    assert shown == [[trial_a], [trial_b]]
    # Other lines are still merged: a user's chatter from two processes shows once at first.
    chatter = "loaded shard 3 of 8"
    assert ray_logging.stdout_deduplicator.allow_re.search(chatter) is None
