"""Activation checkpointing (``pipeline.activation_checkpointing``): the same training, less
activation memory kept for backward, and the engine still equal to the reference."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks, written_layers
from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.registry import build_dataset
from pt_ray.core.plan import Plan
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.reference import build_reference
from pt_ray.runtime.stages import StageModule
from pt_ray.service.settings import run_settings
from test_engine_dist import VIT, assert_same_parameters, config, costs_for

DROPOUT = 0.1
TINY_VIT = {
    "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 3, "width": 32,
              "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4, "dropout": DROPOUT},
    "data": {"name": "synthetic_image", "num_samples": 64, "image_size": 8, "batch_size": 16},
}
TINY_BERT = {
    "model": {"family": "hf", "name": "bert", "depth": 3, "width": 32, "num_heads": 2,
              "mlp_ratio": 2.0, "dropout": DROPOUT},
    "data": {"name": "synthetic_text", "num_samples": 64, "seq_len": 12, "batch_size": 16},
}


def reference_config(base, checkpointing):
    # Two epochs, blocks freezing 0 -> 2 after the first: checkpointed and frozen blocks mix.
    return build_config({
        **base,
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 2, "warmup_epochs": 1},
        "pipeline": {"activation_checkpointing": checkpointing},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        "epochs": 2,
    })


def train_reference(cfg):
    """Per-step losses and final parameters of a reference run (dropout draws from torch's
    global generator, seeded the same for every run)."""
    torch.manual_seed(0)
    trainer = build_reference(run_settings(cfg).reference)
    losses = []
    step = trainer.train_step
    trainer.train_step = lambda batch: losses.append(step(batch)) or losses[-1]
    timeline = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.adapter.model.named_parameters()}
    return losses, params, [r.num_frozen for r in timeline]


@pytest.mark.unit
@pytest.mark.parametrize("base", [TINY_VIT, TINY_BERT], ids=["vit", "bert"])
def test_reference_with_checkpointing_trains_exactly_as_without(base):
    plain = train_reference(reference_config(base, False))
    ckpt = train_reference(reference_config(base, True))
    assert plain[2] == ckpt[2] == [0, 2]
    assert len(plain[0]) == 8 and plain[0] == ckpt[0]  # every step's loss, bit for bit
    for name, value in plain[1].items():
        assert torch.equal(value, ckpt[1][name]), name
    # Dropout is on (two forwards of one batch differ), so the equality rests on the
    # recompute drawing the same masks as the first forward.
    trainer = build_reference(run_settings(reference_config(base, True)).reference)
    batch = trainer.splits.train.batch(list(range(16)))
    with torch.no_grad():
        assert float(trainer._loss(batch)) != float(trainer._loss(batch))


def stage_of_four_blocks(checkpointing, dropout=DROPOUT):
    cfg = build_config({
        "model": {**TINY_VIT["model"], "depth": 4, "dropout": dropout},
        "data": {**TINY_VIT["data"], "image_size": 16},
    })
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    plan = Plan(generation=0, num_layers=4, num_frozen=0, pipeline_length=1, num_replicas=1,
                boundaries=(0, 4), num_microbatches=1, activation_checkpointing=checkpointing)
    adapter.model.train()
    stage = StageModule(adapter, plan, 0)
    batch = splits.train.batch(list(range(8)))
    return stage, adapter, batch.inputs, batch.target


def saved_bytes(stage, inputs):
    """Bytes of the distinct tensors autograd keeps for backward during one forward (the
    stage's parameters excluded: they are held either way)."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*inputs)
    return sum(seen.values()), out


@pytest.mark.unit
def test_checkpointed_stage_keeps_far_fewer_activations_and_gives_the_same_gradients():
    results = {}
    for checkpointing in (False, True):
        stage, adapter, inputs, targets = stage_of_four_blocks(checkpointing)
        torch.manual_seed(0)
        kept, out = saved_bytes(stage, inputs)
        adapter.loss(out, targets).backward()
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        results[checkpointing] = kept, out.detach(), grads
    (plain, out0, g0), (ckpt, out1, g1) = results[False], results[True]
    assert torch.equal(out0, out1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    # Four blocks keep their inputs only (the embedding and the head keep what they did):
    # measured 114,752 of 1,389,888 bytes, 8%.
    assert ckpt < 0.15 * plain, (ckpt, plain)


@pytest.mark.unit
def test_frozen_prefix_and_eval_forwards_are_never_checkpointed():
    stage, adapter, inputs, _ = stage_of_four_blocks(True)
    calls = {0: [], 2: []}
    for i, seen in calls.items():
        # A pre-hook: the recompute stops once it has what the backward needs (torch's early
        # stop), so a forward hook would not see it.
        adapter.blocks[i].register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(torch.is_grad_enabled()))
    with torch.no_grad():  # evaluation: one plain forward
        stage(*inputs)
    assert calls == {0: [False], 2: [False]}
    calls[0].clear()
    calls[2].clear()
    frozen = Plan(generation=0, num_layers=4, num_frozen=2, pipeline_length=1, num_replicas=1,
                  boundaries=(2, 4), num_microbatches=1, activation_checkpointing=True)
    for block in adapter.blocks[:2]:
        block.requires_grad_(False)
    StageModule(adapter, frozen, 0)(*inputs).sum().backward()
    # Frozen block 0: once, without gradients. Trainable block 2: forward, then recompute.
    assert calls == {0: [False], 2: [True, True]}


def train_rank_counting_forwards(rank, world, cfg):
    """The engine on one rank; also counts, per rank, the forwards with gradients of the last
    block and of the head (the recompute runs the block's forward again in the backward)."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    counts = {"block": 0, "head": 0}

    def counter(key):
        def hook(module, args):
            counts[key] += torch.is_grad_enabled()
        return hook

    adapter.blocks[-1].register_forward_pre_hook(counter("block"))
    adapter.head.register_forward_pre_hook(counter("head"))
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, counts


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_ranks_with_checkpointing_match_the_reference_through_pipeline_and_ddp():
    # K = 2 (1F1B, torch.distributed.pipelining) for two epochs, then K = 1 with R = 2 (DDP).
    pipeline = {"num_workers": 2, "schedule": "1f1b", "policy": "paper", "pipeline_length": 2,
                "activation_checkpointing": True}
    cfg = config(VIT, "1f1b", 2, pipeline=pipeline)
    results = run_ranks(train_rank_counting_forwards, 2, cfg)
    timeline = results[0][1]
    layout = [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline]
    # At 2 frozen the memory budget (the largest stage of the first partition, which balances
    # profiled times) may or may not allow K 1: under load a noisy embedding or head time moves
    # the first stage boundary.
    assert layout[0] == (0, 2, 1) and layout[2] == (3, 1, 2)
    assert layout[1] in ((2, 2, 1), (2, 1, 2))
    for _, _, counts in results:
        assert counts["head"] > 0 and counts["block"] == 2 * counts["head"], counts
    plain = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(
        update={"activation_checkpointing": False})})
    ref_timeline = assert_same_parameters([r[:2] for r in results], plain)
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)


@pytest.mark.unit
def test_a_checkpoint_is_on_disk_before_its_manifest_and_meta_vouch_for_it(tmp_path, monkeypatch):
    """After a power loss a manifest or ``meta.json`` never names bytes that did not reach the
    disk: the shard is fsynced before its manifest, and each JSON file is fsynced, renamed into
    place, and its folder synced."""
    import os

    from pt_ray.runtime.checkpoint import read_meta, read_shard, write_meta, write_shard

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(
        ("replace", os.path.basename(dst))) or real_replace(src, dst))

    shard = write_shard(tmp_path, 0, {"block.0": {"params": {"w": torch.ones(2)}, "optim": []}})
    write_meta(tmp_path, {"epoch": 3})
    assert read_meta(tmp_path)["epoch"] == 3
    assert torch.equal(read_shard(shard)["block.0"]["params"]["w"], torch.ones(2))
    folder = tmp_path.name
    assert [e for e in events if e[0] == "replace" or not e[1].startswith(".")] == [
        ("fsync", "shard-rank0.safetensors"), ("replace", "shard-rank0.json"),
        ("fsync", folder), ("replace", "meta.json"), ("fsync", folder)]
    assert [e[1].split(".")[1] for e in events if e[1].startswith(".")] == ["shard-rank0", "meta"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "meta.json", "shard-rank0.json", "shard-rank0.safetensors"]
