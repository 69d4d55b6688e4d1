"""``logging.every_steps``: the step reports' cadence, figures, Ray Train gate and live
TensorBoard scalars, on the reference engine (the Ray engine's run is in
tests/test_worker_logging.py)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict

import numpy as np
import pytest

from pt_ray.core.config import build_config
from pt_ray.reporting.steplog import STEP_TAGS, StepRecord, StepReporter, StepWindow, StepWriter
from pt_ray.service.settings import run_settings
from test_report import read_scalars



def tiny_config(tmp_path, engine="reference", **logging_fields):
    return build_config({
        "name": "steps", "engine": engine,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 96, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 1, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "policy": "paper"},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        "logging": {"report": False, **logging_fields},
        "epochs": 2,
        "output_dir": str(tmp_path),
    })


def record(global_step, epoch_step, epoch_steps=100, window_steps=5, step_s=0.1, epoch=0):
    return StepRecord(epoch=epoch, global_step=global_step, epoch_step=epoch_step,
                      epoch_steps=epoch_steps, train_loss=1.0 / global_step,
                      samples_per_s=32 / step_s, lr=1e-3, num_frozen=0,
                      window_s=window_steps * step_s, window_steps=window_steps)


@pytest.mark.unit
def test_window_reports_every_n_steps_with_their_throughput():
    w = StepWindow(3)
    assert [s for s in range(1, 10) if w.due(s)] == [3, 6, 9]
    for _ in range(3):
        w.add(32, 0.5)
    assert w.take() == (64.0, 1.5, 3)
    w.add(32, 0.5)
    assert w.take(seconds=2.0) == (16.0, 2.0, 1)  # rank 0's time, when given
    with pytest.raises(ValueError, match="every=0"):
        StepWindow(0)


@pytest.mark.unit
def test_ray_train_gets_a_report_only_when_its_last_one_has_been_collected():
    """Every 5 steps of 0.1 s, gap 1 s: every other record, none within 1 s of either end of
    an epoch (its own report), the same calls for the next epoch."""
    got = []
    reporter = StepReporter(got.append, min_gap_s=1.0)
    for epoch in range(2):
        for s in range(5, 101, 5):
            reporter(record(100 * epoch + s, s, epoch=epoch))
    steps = [m["global_step"] for m in got]
    assert steps == [10, 20, 30, 40, 50, 60, 70, 80, 90,
                     110, 120, 130, 140, 150, 160, 170, 180, 190]
    assert got[0] == {"report": "step", **asdict(record(10, 10))}
    # Short epochs (2 s here) take at most what fits a gap from both ends; gap 0 takes all.
    few = []
    reporter = StepReporter(few.append, min_gap_s=1.0)
    for s in range(5, 21, 5):
        reporter(record(s, s, epoch_steps=20))
    assert [m["global_step"] for m in few] == [10]
    every = []
    reporter = StepReporter(every.append)
    for s in range(5, 21, 5):
        reporter(record(s, s, epoch_steps=20))
    assert len(every) == reporter.reported == 4


@pytest.mark.unit
def test_a_failing_writer_is_dropped_and_reports_go_on(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    got = []
    reporter = StepReporter(got.append, StepWriter(blocked / "tensorboard"))
    with caplog.at_level(logging.WARNING):
        reporter(record(5, 5))
        reporter(record(10, 10))
    assert reporter.writer is None and len(got) == 2
    assert caplog.text.count("step scalars not written") == 1


@pytest.mark.unit
def test_reference_steps_report_the_epoch_figures_step_by_step(tmp_path):
    """every_steps=1: each epoch's loss is the mean of its steps' reported losses, and the
    learning rate follows the schedule; every_steps=2 reports the same figures at 2, 4, ...;
    every_steps=0 reports nothing."""
    from pt_ray.runtime.optim import lr_factor
    from pt_ray.runtime.reference import build_reference

    cfg = tiny_config(tmp_path, every_steps=1)
    records = []
    timeline = build_reference(run_settings(cfg).reference, on_step_report=records.append).fit()
    assert [r.global_step for r in records] == list(range(1, 13))
    assert [(r.epoch, r.epoch_step, r.epoch_steps) for r in records[5:7]] == [(0, 6, 6),
                                                                              (1, 1, 6)]
    for rec in timeline:
        losses = [r.train_loss for r in records if r.epoch == rec.epoch]
        assert np.mean(losses) == pytest.approx(rec.train_loss, rel=1e-12)
    total = cfg.epochs * 6 * cfg.data.batch_size
    assert [r.lr for r in records] == pytest.approx(
        [cfg.optimizer.lr * lr_factor((s - 1) * 16 / total, cfg.optimizer) for s in range(1, 13)])
    assert [r.num_frozen for r in records] == [0] * 6 + [1] * 6
    assert all(r.window_steps == 1 and r.samples_per_s > 0 for r in records)

    every2 = []
    build_reference(run_settings(tiny_config(tmp_path, every_steps=2)).reference,
                    on_step_report=every2.append).fit()
    assert [r.global_step for r in every2] == [2, 4, 6, 8, 10, 12]
    assert [r.train_loss for r in every2] == [r.train_loss for r in records[1::2]]
    assert {r.window_steps for r in every2} == {2}

    none = []
    build_reference(run_settings(tiny_config(tmp_path, every_steps=0)).reference,
                    on_step_report=none.append).fit()
    assert none == []


@pytest.mark.unit
def test_reference_run_writes_live_step_scalars_beside_the_timeline(tmp_path):
    """fit(engine=reference, tensorboard): one event file per writer in one folder; reading
    it back gives the step scalars at steps 3, 6, ... and the per-epoch ones."""
    from pt_ray.api import fit

    result = fit(tiny_config(tmp_path, every_steps=3, tensorboard=True))
    logdir = result.run_dir / "tensorboard"
    files = sorted(p.name for p in logdir.glob("events.out.tfevents.*"))
    assert len(files) == 2 and sum(f.endswith(".steps") for f in files) == 1
    scalars = read_scalars(logdir)
    assert set(STEP_TAGS) | {"train/loss", "eval/accuracy"} <= set(scalars)
    assert [s for s, _ in scalars["step/loss"]] == [3, 6, 9, 12]
    assert [v for _, v in scalars["step/epoch"]] == [1, 1, 2, 2]
    assert all(math.isfinite(v) and v > 0 for _, v in scalars["step/loss"])
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]


@pytest.mark.unit
def test_live_scalars_are_on_disk_before_the_run_ends(tmp_path):
    writer = StepWriter(tmp_path / "tb")
    writer.write(record(5, 5))
    try:
        scalars = read_scalars(tmp_path / "tb")  # not closed: flushed
        assert scalars["step/loss"] == [(5, pytest.approx(0.2))]
        assert scalars["step/samples_per_s"] == [(5, pytest.approx(320.0))]
    finally:
        writer.close()


def report_rank(rank, world, cfg):
    from pt_ray.control.state import build_control_state
    from pt_ray.data.registry import build_dataset
    from pt_ray.core.plan import CostTable
    from pt_ray.runtime.engine import ElasticWorker, EngineHooks, LocalController
    from pt_ray.runtime.build import build_model_for

    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    records = []
    # Equal costs: K 2 while nothing is frozen, then K 1 x R 2 once a block is.
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control),
                           costs=CostTable.from_param_counts(1.0, [1.0] * 2, 1.0),
                           hooks=EngineHooks(on_step_report=records.append))
    timeline = worker.fit()
    worker.close()
    return records, timeline


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_engine_ranks_report_the_same_steps_with_the_reference_losses(tmp_path):
    """Two gloo ranks (K 2: only rank 1 holds the loss; then K 1 x R 2: each holds half):
    both get identical records at every step, whose losses are the reference trainer's and
    average to the epoch's loss."""
    from dist_utils import run_ranks
    from pt_ray.runtime.reference import build_reference

    cfg = tiny_config(tmp_path, engine="ray", every_steps=1)
    (records, timeline), (records_1, _) = run_ranks(report_rank, 2, cfg)
    assert records == records_1
    assert [(r.pipeline_length, r.num_replicas) for r in timeline] == [(2, 1), (1, 2)]
    expected = []
    build_reference(run_settings(cfg).reference, on_step_report=expected.append).fit()
    assert [r.global_step for r in records] == list(range(1, 13))
    assert [r.train_loss for r in records] == pytest.approx(
        [r.train_loss for r in expected], rel=1e-5)
    assert [r.lr for r in records] == pytest.approx([r.lr for r in expected], rel=1e-12)
    for rec in timeline:
        losses = [r.train_loss for r in records if r.epoch == rec.epoch]
        # The epoch sums its losses in float32 on the device.
        assert np.mean(losses) == pytest.approx(rec.train_loss, rel=1e-6)
