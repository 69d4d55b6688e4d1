"""The benchmark's peer: bench/peer_ddp.py (plain Ray Train DDP) trains the model pt-ray builds
for the same config, with pt-ray's steps per epoch, and reports what bench/compare.py reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pt_ray.config import build_config
from pt_ray.data.registry import build_dataset
from pt_ray.runtime.cache import training_sampler
from pt_ray.runtime.reference import build_model_for

# bench/ holds scripts, not a package: its modules import each other as top-level names.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import peer_ddp  # noqa: E402

NUM_CLASSES = 4


def tiny_config(tmp_path, **extra):
    return build_config({
        "name": "peer",
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        # 511 samples: pt-ray takes 511 // 32 = 15 steps; a sampler that pads its shards would
        # give each of 2 workers 256 samples, 16 batches of 16.
        "data": {"name": "synthetic_image", "num_samples": 511, "image_size": 8,
                 "batch_size": 32, "num_classes": NUM_CLASSES},
        "pipeline": {"num_workers": 2},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.1},
        "epochs": 1,
        "output_dir": str(tmp_path),
        **extra,
    })


@pytest.mark.unit
@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {"family": "hf", "name": "bert", "depth": 2, "width": 32, "num_heads": 2},
      "data": {"name": "synthetic_text", "batch_size": 32}}, r"model\.family=hf"),
    ({"batch_policy": "per_replica"}, r"batch_policy=per_replica"),
    ({"precision": "bf16"}, r"precision=bf16"),
])
def test_peer_refuses_what_it_cannot_run_like_for_like(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        peer_ddp.check_config(tiny_config(tmp_path, **overrides))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_peer_trains_pt_rays_model_and_reports_each_epoch(ray_cluster, tmp_path):
    # pt-ray's cadence: the first epoch neither evaluates nor checkpoints, the last does both.
    cfg = tiny_config(tmp_path, epochs=2, eval_every=2, checkpoint_every=2)
    run = peer_ddp.run_peer(cfg, tmp_path / "peer")

    first, last = run.timeline
    assert run.metric_name == "accuracy"
    assert first["eval_time_s"] == 0 and first["eval_metric"] != first["eval_metric"]  # NaN
    for rec in (first, last):
        assert rec["epoch_time_s"] > 0 and rec["transition_time_s"] == 0
        assert rec["num_replicas"] == 2 and rec["num_layers"] == 2
        # An epoch has pt-ray's steps (throughput is their samples / training time).
        steps = training_sampler(cfg, 511, True).steps_per_epoch
        assert rec["throughput_samples_per_s"] * rec["epoch_time_s"] == pytest.approx(steps * 32)
    # Trains: the loss falls, and the accuracy on class templates plus noise lands well above
    # chance (0.25).
    assert last["train_loss"] < first["train_loss"] < float(torch.log(torch.tensor(4.0))) + 0.2
    assert last["eval_time_s"] > 0
    assert run.final_eval_metric == last["eval_metric"] > 1.5 / NUM_CLASSES

    # The model is pt-ray's: the checkpoint has the same keys and shapes as the model that
    # build_model_for makes for this config, and the weights moved from that initialisation.
    saved = torch.load(Path(run.checkpoint) / "model.pt", weights_only=True)
    own = build_model_for(cfg, build_dataset(cfg.data, seed=cfg.seed)).model.state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in own.items()}
    assert sum(v.numel() for v in saved.values()) == sum(v.numel() for v in own.values())
    assert not torch.equal(saved["head.weight"], own["head.weight"])

