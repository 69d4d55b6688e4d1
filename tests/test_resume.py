"""Resuming a stopped run: the driver killed after an epoch, then ``fit(resume_from=...)`` on
another number of workers ends where a run never stopped ends; damaged checkpoints are
skipped; what cannot resume says so in one line before anything starts."""

from __future__ import annotations

import json
import os
import zlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pt_ray.api import fit
from pt_ray.cli import main
from pt_ray.core.config import ConfigError, build_config
from pt_ray.models.base import iter_layers, layer_names
from pt_ray.runtime.resume import resume_point
from pt_ray.runtime.checkpoint import damage, deal_layers, latest_checkpoint, load_layers, \
    read_meta, read_shard, usable_checkpoint, write_meta, write_shard
from pt_ray.runtime.reference import build_reference
from pt_ray.service.settings import run_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from procs import kill_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def resumable_config(tmp_path: Path, **extra):
    return build_config({
        "name": "resume",
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        # 32 steps an epoch: long enough to stop the driver between two checkpoints.
        "data": {"name": "synthetic_image", "num_samples": 512, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "schedule": "1f1b", "policy": "paper"},
        # SGD: AdamW's normalised steps would grow float rounding (different on one worker
        # and two) past 1e-4 over 96 steps, whether or not the run stops.
        "optimizer": {"name": "sgd", "lr": 0.05, "warmup_fraction": 0.2},
        "logging": {"report": False, "progress": "off"},
        "epochs": 3,
        "output_dir": str(tmp_path),
        **extra,
    })


def _complete_checkpoints(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "ray").glob("*/checkpoint_*")
            if p.is_dir() and damage(p) is None]


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_driver_killed_after_an_epoch_resumes_on_one_worker_and_ends_as_never_stopped(
        ray_cluster, tmp_path):
    cfg = resumable_config(tmp_path)
    run_dir = tmp_path / "run"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(cfg.to_yaml())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    # The driver (with the embedded cluster it starts) in its own session, so that killing it
    # takes its Ray processes with it and nothing else.
    driver = subprocess.Popen(
        [sys.executable, "-m", "pt_ray.cli", "train", "--config", str(config_file),
         "--output", str(run_dir)],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "driver.log").open("w"))
    try:
        deadline = time.monotonic() + 300
        while not _complete_checkpoints(run_dir):
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        kill_session(driver.pid)
    assert not (run_dir / "summary.json").exists(), "the run finished before it was stopped"

    point = resume_point(run_dir)
    assert point.next_epoch in (1, 2)
    # Resumed on one worker instead of two: the plan is re-made for N=1, the rest goes on.
    result = fit(resume_from=run_dir, overrides=["pipeline.num_workers=1"])
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert result.restarts == 0 and result.config.pipeline.num_workers == 1
    assert all(r.num_replicas * r.pipeline_length == 1
               for r in result.timeline[point.next_epoch:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == {"checkpoint": str(point.checkpoint),
                                       "after_epoch": point.next_epoch}

    # A run never stopped: the reference trainer, the engine's numerical oracle.
    ref_cfg = resumable_config(tmp_path / "ref", engine="reference")
    reference = build_reference(run_settings(ref_cfg).reference)
    timeline = reference.fit()
    layers, _ = load_layers(result.checkpoint, layer_names(4))
    difference = max(
        float((layers[name]["params"][key] - value).abs().max())
        for name, module in iter_layers(reference.adapter)
        for key, value in module.state_dict().items())
    assert difference <= 1e-4
    assert abs(result.final_eval_metric - timeline[-1].eval_metric) <= 1e-4
    assert [r.num_frozen for r in result.timeline] == [r.num_frozen for r in timeline]


def _checkpoint(folder: Path, epoch: int, shards: int = 2) -> Path:
    for rank in range(shards):
        write_shard(folder, rank, {f"block{rank}": {"params": {"w": torch.full((4,), 1.0)}}})
    write_meta(folder, {"epoch": epoch, "num_shards": shards})
    return folder


def _same(a, b) -> bool:
    """Equal structure, types, and tensors equal in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_shards_come_back_bit_for_bit_and_nothing_else_is_read(tmp_path):
    layers = {
        "blocks.0": {
            "params": {"w": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
                       "t": torch.randn(4, 6).t(), "empty": torch.empty(0, 3)},
            "optim": [{"step": torch.tensor(12.0), "exp_avg": torch.randn(3, 5),
                       "flag": torch.tensor([True, False, True])},
                      {"step": 3, "lr": 0.5, "ids": torch.arange(5), "none": None}],
        },
        "__norms__": {"sums": {0: 1.5, 1: 2.0}, "steps": 4, "pair": (torch.ones(2), "x")},
    }
    # Two views of one tensor are written as two tensors.
    base = torch.arange(6.0)
    layers["blocks.0"]["params"]["v1"], layers["blocks.0"]["params"]["v2"] = base[:3], base[3:]
    path = write_shard(tmp_path / "new", 0, layers)
    back = read_shard(path)
    assert _same(layers, back)
    found, norms = load_layers(tmp_path / "new", ["blocks.0"])
    assert _same(found["blocks.0"], layers["blocks.0"]) and norms == {"sums": {0: 1.5, 1: 2.0},
                                                                       "steps": 4}
    # The manifest's size and CRC-32 are the file's.
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["bytes"] == path.stat().st_size
    assert manifest["crc32"] == zlib.crc32(path.read_bytes())
    assert manifest["layers"] == ["blocks.0"]
    # A file pt-ray did not write (a pickle, or safetensors without the structure) is refused
    # with the fix; nothing unpickles it.
    pickled = tmp_path / "pickled.safetensors"
    torch.save(layers, pickled)
    with pytest.raises(ValueError, match="is not a pt-ray checkpoint shard"):
        read_shard(pickled)
    bare = tmp_path / "bare.safetensors"
    save_file({"w": torch.ones(2)}, bare)
    with pytest.raises(ValueError, match="is not a pt-ray checkpoint shard .* resume from a "
                                         "checkpoint pt-ray wrote"):
        read_shard(bare)
    # What could only come back through pickle is refused when written.
    with pytest.raises(TypeError, match="cannot hold a set"):
        write_shard(tmp_path / "bad", 0, {"blocks.0": {"params": {}, "odd": {1, 2}}})


@pytest.mark.unit
def test_damaged_checkpoints_are_named_and_skipped_for_the_one_before(tmp_path, caplog):
    older = _checkpoint(tmp_path / "a" / "checkpoint_2026-11-30_10-00-00.000000", 0)
    assert damage(older) is None

    cut = _checkpoint(tmp_path / "b" / "checkpoint_2026-11-30_10-05-00.000000", 1)
    shard = cut / "shard-rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert damage(cut) == f"shard-rank1.safetensors holds {shard.stat().st_size} bytes of " \
        f"{shard.stat().st_size + 10}"

    missing = _checkpoint(tmp_path / "b" / "checkpoint_2026-11-30_10-06-00.000000", 1)
    (missing / "shard-rank0.safetensors").unlink()
    assert damage(missing) == "shard-rank0.safetensors missing"

    changed = _checkpoint(tmp_path / "b" / "checkpoint_2026-11-30_10-07-00.000000", 1)
    other = write_shard(tmp_path / "other", 1, {"block1": {"params": {"w": torch.full((4,), 2.0)}}})
    (changed / "shard-rank1.safetensors").write_bytes(other.read_bytes())  # the same size
    assert damage(changed) == "shard-rank1.safetensors does not match its CRC-32"
    no_meta = _checkpoint(tmp_path / "b" / "checkpoint_2026-11-30_10-08-00.000000", 1)
    (no_meta / "meta.json").write_text('{"epoch": ')
    assert damage(no_meta).startswith("meta.json unreadable")

    with caplog.at_level("WARNING", logger="pt_ray.runtime.checkpoint"):
        chosen = latest_checkpoint([older, cut, missing, changed, no_meta])
    assert chosen == older
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 4


@pytest.mark.unit
def test_a_restart_given_a_damaged_checkpoint_takes_the_one_before_it(tmp_path, caplog):
    run = tmp_path / "ray" / "run-1"
    older = _checkpoint(run / "checkpoint_2026-11-30_10-00-00.000000", 0)
    newer = _checkpoint(run / "checkpoint_2026-11-30_10-05-00.000000", 1)
    assert usable_checkpoint(newer) == newer
    (newer / "shard-rank1.json").unlink()
    with caplog.at_level("WARNING", logger="pt_ray.runtime.checkpoint"):
        assert usable_checkpoint(newer) == older
    assert "shard-rank1.json missing or unreadable" in caplog.text
    (older / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="is damaged \\(shard-rank1.json missing or "
                       "unreadable\\) and no complete checkpoint precedes it"):
        usable_checkpoint(newer)


@pytest.mark.unit
def test_what_cannot_resume_ends_in_one_line_before_anything_starts(tmp_path, capsys):
    cfg = resumable_config(tmp_path, epochs=2)
    run_dir = tmp_path / "run"

    def fails(*args, **kwargs) -> str:
        with pytest.raises(ConfigError) as err:
            resume_point(run_dir, *args, **kwargs)
        return str(err.value)

    assert "config.yaml' not found; pass the folder of a run pt-ray started" in fails()
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    assert "no complete checkpoint under" in fails()
    assert fails(["freeze.alpha=0.1"]) == (
        "freeze.alpha cannot change when a run resumes (only pipeline.* and logging.* can); "
        "start a new run to change it")
    checkpoint = _checkpoint(run_dir / "ray" / "resume-1" / "checkpoint_2026-11-30_10-00-00.0", 0)
    assert resume_point(run_dir, ["pipeline.num_workers=1"]).next_epoch == 1
    write_meta(checkpoint, {**read_meta(checkpoint), "epoch": 1})
    assert "already finished all 2 epochs; nothing to resume" in fails()
    (run_dir / "config.yaml").write_text(cfg.model_copy(update={"engine": "reference"}).to_yaml())
    assert "used engine=reference, which writes no checkpoints" in fails()

    # The command line: exit status 2 and one line, for these and for --resume with --config.
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    assert main(["train", "--resume", str(run_dir), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("pt-ray: error: ") for line in err)
    assert err[1].endswith("drop --config and --output")
    with pytest.raises(ConfigError, match="pass neither config nor output_dir"):
        fit(cfg, resume_from=run_dir)


@pytest.mark.unit
def test_layers_are_dealt_to_replicas_by_bytes_largest_first():
    # Default-job-like stage at 5 of 6 frozen: block.5 and the head train (3x bytes).
    weights = {"embed": 30, "block.0": 100, "block.1": 100, "block.2": 100, "block.3": 100,
               "block.4": 100, "block.5": 300, "head": 12}
    shares = deal_layers(weights, 2)
    # block.5 first (to replica 1, the tie), then the blocks to whichever holds less.
    assert shares == [["block.0", "block.1", "block.2", "block.4", "head"],
                      ["embed", "block.3", "block.5"]]
    assert sorted(sum(shares, [])) == sorted(weights)  # every layer once
    loads = [sum(weights[n] for n in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(weights.values())
    # A tie leaves replica 0 the smaller share; more replicas than layers leave some empty.
    assert deal_layers({"a": 5, "b": 5, "c": 5}, 2) == [["b"], ["a", "c"]]
    assert deal_layers({"a": 1}, 3) == [[], [], ["a"]]
