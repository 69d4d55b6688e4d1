"""The benchmark's peer and headline: bench/peer_ddp.py (plain Ray Train DDP) trains the model
pt-ray builds for the same config, with pt-ray's steps per epoch, and reports what
bench/compare.py reads; the report turns runs into pt-ray over the peer and a wall-time split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pt_ray.core.config import build_config
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import training_sampler
from pt_ray.runtime.build import build_model_for

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
        "pipeline": {"num_workers": 2, "use_gpu": False},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.1},
        "epochs": 1,
        "output_dir": str(tmp_path),
        **extra,
    })


@pytest.mark.unit
@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {"family": "hf", "name": "bert", "depth": 2, "width": 32, "num_heads": 2},
      "data": {"name": "squad_json", "path": "squad", "batch_size": 32}},
     r"data\.name=squad_json: the peer arm trains classifiers only"),
    ({"batch_policy": "per_replica"}, r"batch_policy=per_replica"),
    ({"precision": "bf16"}, r"precision=bf16"),
    ({"pipeline": {"num_workers": 2, "use_gpu": True}, "precision": "fp16"},
     r"use_gpu=True, precision=fp16"),
])
def test_peer_refuses_what_it_cannot_run_like_for_like(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        peer_ddp.check_config(tiny_config(tmp_path, **overrides))


@pytest.mark.unit
@pytest.mark.parametrize(("use_gpu", "precision", "expected"), [
    (True, "auto", (True, torch.bfloat16)),   # as pt-ray: bf16 on GPUs unless told otherwise
    (True, "fp32", (True, torch.float32)),
    (True, "bf16", (True, torch.bfloat16)),
    (False, "auto", (False, torch.float32)),
    (False, "bf16", (False, None)),           # no bf16 autocast on CPUs: refused
])
def test_the_peer_trains_where_and_how_pt_ray_would(tmp_path, use_gpu, precision, expected):
    cfg = tiny_config(tmp_path, pipeline={"num_workers": 1, "use_gpu": use_gpu},
                      precision=precision)
    assert peer_ddp.peer_device(cfg) == expected


@pytest.mark.unit
@pytest.mark.parametrize("family", ["timm", "hf"])
def test_the_peers_forward_is_pt_rays_on_the_same_batches(tmp_path, family):
    """The peer calls the plain model (a ViT on pixels, a BERT classifier on its named text
    inputs); its logits and loss are those of pt-ray's cut of the same model."""
    from torch.utils.data import DataLoader

    from pt_ray.models import forward_layers

    extra = {} if family == "timm" else {
        "model": {"family": "hf", "name": "bert", "depth": 2, "width": 32, "num_heads": 2,
                  "mlp_ratio": 2.0},
        "data": {"name": "synthetic_text", "num_samples": 64, "seq_len": 12, "batch_size": 32,
                 "num_classes": NUM_CLASSES}}
    cfg = tiny_config(tmp_path, **extra)
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    adapter.model.eval()
    names = peer_ddp.input_names(adapter)
    inputs, target = next(iter(DataLoader(peer_ddp._Samples(splits.train), batch_size=8)))
    with torch.no_grad():
        peer = peer_ddp.logits(adapter.model, inputs, names)
        ours = forward_layers(adapter, tuple(inputs))
    torch.testing.assert_close(peer, ours)
    assert peer.shape == (8, NUM_CLASSES)
    torch.testing.assert_close(torch.nn.functional.cross_entropy(peer, target),
                               adapter.loss(ours, target))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_peer_trains_pt_rays_model_and_reports_each_epoch(ray_cluster, tmp_path):
    # pt-ray's cadence: the first epoch neither evaluates nor checkpoints, the last does both.
    cfg = tiny_config(tmp_path, epochs=2, eval_every=2, checkpoint_every=2)
    run = peer_ddp.run_peer(cfg, tmp_path / "peer")

    first, last = run.timeline
    assert run.metric_name == "accuracy"
    # Rank 0's start-up in parts, within the fit's wall time.
    assert set(run.startup) == {"worker_group_s", "dataset_s", "model_s", "setup_s"}
    assert all(v >= 0 for v in run.startup.values())
    assert sum(run.startup.values()) < run.wall_time_s
    assert first["eval_time_s"] == 0 and first["eval_metric"] != first["eval_metric"]  # NaN
    for rec in (first, last):
        assert rec["epoch_time_s"] > 0 and rec["transition_time_s"] == 0
        assert rec["num_replicas"] == 2 and rec["num_layers"] == 2
        # An epoch has pt-ray's steps (throughput is their samples / training time).
        steps = training_sampler(cfg.freeze, cfg.data.batch_size, cfg.seed, 511).steps_per_epoch
        assert rec["throughput_samples_per_s"] * rec["epoch_time_s"] == pytest.approx(steps * 32)
    # Trains: the loss falls, and the accuracy on class templates plus noise lands well above
    # chance (0.25).
    assert last["train_loss"] < first["train_loss"] < float(torch.log(torch.tensor(4.0))) + 0.2
    assert last["eval_time_s"] > 0
    assert run.final_eval_metric == last["eval_metric"] > 1.5 / NUM_CLASSES

    # The model is pt-ray's: the checkpoint has the same keys and shapes as the model that
    # build_model_for makes for this config, and the weights moved from that initialisation.
    saved = torch.load(Path(run.checkpoint) / "model.pt", weights_only=True)
    splits = build_dataset(cfg.data, seed=cfg.seed)
    own = build_model_for(cfg.model, cfg.seed, splits).model.state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in own.items()}
    assert sum(v.numel() for v in saved.values()) == sum(v.numel() for v in own.values())
    assert not torch.equal(saved["head.weight"], own["head.weight"])


def _run(train, call, acc, evals, gaps, startup=8.0, teardown=2.0, **extra):
    """A compare.py record with the fields the report reads (times in s)."""
    timeline = [{"epoch": e, "epoch_time_s": train / len(evals), "transition_time_s": 0.0,
                 "eval_time_s": ev, "num_frozen": 0, "num_layers": 4, "pipeline_length": 1,
                 "num_replicas": 2, "num_microbatches": 1,
                 "throughput_samples_per_s": 100.0} for e, ev in enumerate(evals)]
    return {"train_time_s": train, "fit_call_s": call, "wall_time_s": call,
            "eval_time_sum_s": sum(evals), "final_accuracy": acc, "restarts": 0,
            "timeline": timeline,
            "overhead_split": {"startup_s": startup, "between_epochs_each_s": gaps,
                               "between_epochs_s": sum(gaps), "teardown_s": teardown},
            **extra}


@pytest.mark.unit
def test_checkpoint_times_split_a_run_into_startup_epochs_and_teardown():
    import compare  # bench/compare.py

    timeline = [{"epoch_time_s": 3.0, "transition_time_s": 0.5, "eval_time_s": 0.5}] * 3
    split = compare.time_split(100.0, 125.0, [112.0, 117.5, 122.0], timeline)
    # Each epoch's work is 4 s: start-up is the first checkpoint less its epoch, and the gaps
    # are what each later epoch took beyond its work (checkpoint, report).
    assert split["startup_s"] == pytest.approx(8.0)
    assert split["between_epochs_each_s"] == pytest.approx([1.5, 0.5])
    assert split["teardown_s"] == pytest.approx(3.0)
    assert compare.time_split(100.0, 125.0, [112.0], timeline) == {"checkpoints_seen": 1}


@pytest.mark.unit
def test_headline_is_pt_ray_over_the_peer_with_the_engine_tax_and_overheads():
    import compare_report

    runs = {
        "pt-ray": [_run(20.0, 60.0, 0.970, [1.0, 1.0, 1.0], [0.5, 0.7], ideal_bound=1.6)],
        "dp": [_run(31.2, 80.0, 0.975, [1.0, 1.0, 1.0], [0.5, 0.5])],
        "peer": [_run(30.0, 75.0, 0.975, [0.5, 0.5, 0.5], [0.2, 0.2], startup=6.0)],
    }
    parts = compare_report.breakdown(runs)
    # One epoch after the first: its evaluation plus the gap before the next checkpoint.
    assert parts["pt-ray"]["per_epoch_overhead_s"] == pytest.approx(1.6)
    assert parts["peer"]["per_epoch_overhead_s"] == pytest.approx(0.7)
    head = compare_report.against_peer(runs, parts)
    assert head["speedup_vs_peer"] == pytest.approx(1.5)
    assert head["wall_ratio_vs_peer"] == pytest.approx(1.25) and head["meets_peer_wall_aim"]
    assert head["fraction_of_bound_vs_peer"] == pytest.approx(1.5 / 1.6)
    assert head["accuracy_diff_vs_peer_points"] == pytest.approx(-0.5)
    assert head["engine_tax_k1"] == pytest.approx(0.04) and head["meets_engine_tax_aim"]
    assert not head["meets_overhead_aim"]  # pt-ray starts slower and pays more per epoch
    # The start-up parts the runs noted: medians over repeats, and only the parts a run has.
    assert "startup_parts" in parts["dp"] and parts["dp"]["startup_parts"] == {}
    runs["peer"].append(_run(30.0, 75.0, 0.975, [0.5] * 3, [0.2, 0.2]))
    runs["peer"][0]["startup"] = {"worker_group_s": 4.0, "model_s": 1.0}
    runs["peer"][1]["startup"] = {"worker_group_s": 6.0, "model_s": 2.0, "setup_s": 0.5}
    assert compare_report.breakdown(runs)["peer"]["startup_parts"] == {
        "worker_group_s": 5.0, "model_s": 1.5, "setup_s": 0.5}


@pytest.mark.unit
def test_sparse_checkpoints_split_the_time_between_them_per_epoch():
    import compare  # bench/compare.py
    import compare_report

    timeline = [{"epoch_time_s": 3.0, "transition_time_s": 0.0, "eval_time_s": 1.0}] * 4
    # Checkpoints after epochs 1 and 3 (checkpoint_every=2): 8 s of work before each.
    split = compare.time_split(0.0, 30.0, [10.0, 21.0], timeline, [1, 3])
    assert split["startup_s"] == pytest.approx(2.0)
    assert split["between_epochs_each_s"] == pytest.approx([3.0])
    run = _run(12.0, 30.0, 0.9, [1.0] * 4, [3.0])
    run["overhead_split"] = split
    # Epochs 2-3: 2 s of evaluation and 3 s besides, over two epochs.
    assert compare_report.breakdown({"peer": [run]})["peer"]["per_epoch_overhead_s"] == \
        pytest.approx(2.5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_engine_tax_times_both_loops_on_the_same_ranks(tmp_path):
    import json

    import engine_tax
    import yaml

    cfg = tiny_config(tmp_path).model_dump(mode="json")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert engine_tax.main(["--config", str(path), "--rounds", "2",
                            "--out", str(tmp_path / "out")]) == 0
    got = json.loads((tmp_path / "out" / "engine_tax.json").read_text())
    assert got["ranks"] == 2 and [r["round"] for r in got["rows"]] == [1, 2]
    for row in got["rows"]:
        assert row["engine"] > 0 and row["peer"] > 0 and row["engine_cpu"] > 0
    taxes = sorted(r["engine"] / r["peer"] - 1 for r in got["rows"])
    assert got["tax_median"] == pytest.approx(sum(taxes) / 2)
    assert got["tax_min"] == taxes[0] and got["tax_max"] == taxes[1]

    # --policy: the engine under settled (decisions every 2 steps, nothing ever frozen) against
    # the engine with none, on the same ranks.
    assert engine_tax.main(["--config", str(path), "--rounds", "2", "--policy", "settled",
                            "--set", "freeze.interval=steps", "--set", "freeze.interval_steps=2",
                            "--out", str(tmp_path / "policy")]) == 0
    got = json.loads((tmp_path / "policy" / "engine_tax.json").read_text())
    assert got["policy"] == "settled"
    assert all(r["engine"] > 0 and r["peer"] > 0 and r["engine_frozen"] == 0
               for r in got["rows"])
    # 3 epochs (the warm-up round and 2 counted) of 15 steps: one decision opens each epoch
    # and one more follows every 2 steps inside it (freeze.policy=none decides per epoch).
    assert got["engine_decisions"] > 3


@pytest.mark.unit
def test_the_warm_up_runs_are_printed_as_the_cold_start_and_kept_out_of_the_medians():
    import compare_output
    import compare_report

    runs = {"pt-ray": [_run(20.0, 60.0, 0.97, [1.0] * 3, [0.5, 0.7])],
            "peer": [_run(30.0, 75.0, 0.975, [0.5] * 3, [0.2, 0.2])]}
    data = {"arms": ["pt-ray", "peer"], "runs": runs, "metric_name": "accuracy",
            "summary": {"breakdown": compare_report.breakdown(runs)}, "warmup_epochs": 1,
            "cold_start": {"pt-ray": {"fit_call_s": 31.5, "startup_s": 14.25,
                                      "startup": {"preflight_s": 1.93, "model_s": 2.4}},
                           "peer": {"fit_call_s": 22.0, "startup_s": None,
                                    "startup": {"worker_group_s": 9.5}}}}
    lines = compare_output.breakdown_lines(data)
    at = next(i for i, line in enumerate(lines) if line.startswith("warm-up"))
    assert "1-epoch run" in lines[at] and "the first, pt-ray," in lines[at]
    assert lines[at + 2].split() == ["pt-ray", "14.2", "31.5", "1.93", "-", "-", "2.40", "-"]
    assert lines[at + 3].split() == ["peer", "?", "22.0", "-", "9.50", "-", "-", "-"]
    # The measured rows stay the measured runs' medians.
    assert lines[2].split()[:2] == ["pt-ray", "8.0"]
    assert "warm-up" not in "\n".join(compare_output.breakdown_lines(
        {**data, "cold_start": {}}))


@pytest.mark.unit
def test_the_peer_on_pt_rays_order_gets_pt_rays_batches(tmp_path):
    from torch.utils.data import DataLoader

    cfg = tiny_config(tmp_path, seed=3)
    n, world, per_worker = 511, 2, 16
    pt_ray_order = training_sampler(cfg.freeze, cfg.data.batch_size, cfg.seed, n)
    loaders = []
    for rank in range(world):
        sampler = peer_ddp.PtRayOrder(cfg, n, rank, world)
        loaders.append((sampler, DataLoader(range(n), batch_size=per_worker, sampler=sampler,
                                            drop_last=True)))
    for epoch in (0, 1):
        for sampler, _ in loaders:
            sampler.set_epoch(epoch)
        batches = [list(loader) for _, loader in loaders]
        # pt-ray's 15 steps per epoch; rank r's batch s is replica r's share of step s.
        assert [len(b) for b in batches] == [pt_ray_order.steps_per_epoch] * world
        for step in range(pt_ray_order.steps_per_epoch):
            for rank in range(world):
                assert batches[rank][step].tolist() == pt_ray_order.replica_indices(
                    epoch, step, rank, world).tolist()
    # Each epoch reshuffles, as a DistributedSampler with set_epoch does.
    first = loaders[0][0]
    first.set_epoch(0)
    zero = list(first)
    first.set_epoch(1)
    assert list(first) != zero and len(zero) == len(first) == 15 * per_worker


@pytest.mark.unit
def test_the_peer_refuses_an_unknown_sample_order(tmp_path):
    with pytest.raises(ValueError, match=r"sample_order='shuffled'.*distributed, pt-ray"):
        peer_ddp.run_peer(tiny_config(tmp_path), tmp_path / "peer", sample_order="shuffled")


@pytest.mark.unit
def test_against_none_pairs_repeats_and_shows_each_first_plan():
    import compare_output
    import compare_report

    trial = {"layout": "K 1 R 2 M 1", "predicted_rate": 50.4, "measured_rate": 40.0}
    runs = {"pt-ray": [_run(20.0, 40.0, 0.90, [1.0], [], start_trials=[trial]),
                       _run(30.0, 50.0, 0.90, [1.0], [])],
            "none": [_run(25.0, 44.0, 0.91, [1.0], []), _run(27.0, 46.0, 0.91, [1.0], [])]}
    n = compare_report.against_none(runs)
    # Repeat 1 froze and ran faster (1.25x); repeat 2 ran slower (0.9x): not never slower.
    assert n["speedup_vs_none_per_repeat"] == pytest.approx([1.25, 0.9])
    assert not n["never_slower"]
    assert n["accuracy_diff_vs_none_points"] == pytest.approx(-1.0)
    first = n["first_plans"]["pt-ray"][0]
    assert first["layout"] == "K 1 R 2 M 1" and first["start_trials"] == [trial]
    text = "\n".join(compare_output.none_lines(n))
    assert "never slower: not met" in text and "predicted 50.4, measured 40.0" in text
