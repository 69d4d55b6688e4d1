"""Each rank holds, in storage, only the layers its plan gives it, and reads only their shards
when it restores (4 and 2 forked gloo ranks; in-place release and materialisation unit-tested)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks, written_layers
from pt_ray.control.state import build_control_state
from pt_ray.data.registry import build_dataset
from pt_ray.models.base import iter_layers
from pt_ray.core.plan import is_trainable
from pt_ray.runtime.checkpoint import load_layers, write_shard
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.owned import has_storage, is_held, materialise, release
from pt_ray.runtime.build import build_model_for
from pt_ray.service.settings import run_settings
from test_engine_dist import (VIT, assert_same_parameters, config, costs_for, resume_parts,
                              train_then_checkpoint)

F32 = 4


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def holdings(worker: ElasticWorker) -> dict:
    """What a rank holds in storage now: layers, parameter bytes, optimizer bytes."""
    params = [p for m in worker.modules.values() for p in m.parameters() if has_storage(p)]
    optim = [v for st in worker.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v)]
    return {
        "plan": worker.plan,
        "stage": worker.topo.stage,
        "held": sorted(n for n, m in worker.modules.items() if is_held(m)),
        "released_grads": sum(p.grad is not None for m in worker.modules.values()
                          for p in m.parameters() if not has_storage(p)),
        "param_bytes": _bytes(params),
        "optim_bytes": _bytes(optim),
        "optim_params": sorted({n for n, m in worker.modules.items()
                                for p in m.parameters() if p in worker.optimizer.state}),
    }


def train_and_watch(rank, world, cfg):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    # Sizes from the whole build, before any layer is released.
    sizes = {n: _bytes(m.parameters()) for n, m in iter_layers(adapter)}
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    seen = []
    worker.fit(on_epoch=lambda rec: seen.append({**holdings(worker), "record": rec}))
    states = written_layers(worker)
    worker.close()
    return states, [s["record"] for s in seen], seen, sizes


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_four_ranks_hold_only_their_stage_through_k_4_2_1_and_match_the_reference():
    cfg = config(VIT, "1f1b", 4)
    results = run_ranks(train_and_watch, 4, cfg)
    timeline = results[0][1]
    assert [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline] == [
        (0, 4, 1), (2, 2, 2), (3, 1, 4)]
    sizes = results[0][3]
    whole = sum(sizes.values())
    for rank, (_, _, seen, _) in enumerate(results):
        for epoch, s in enumerate(seen):
            plan, stage = s["plan"], s["stage"]
            layers = plan.stage_layers(stage)
            trained = [n for n in layers if is_trainable(plan, n)]
            share = sum(sizes[n] for n in layers)
            assert s["held"] == sorted(layers), (rank, epoch)
            assert abs(s["param_bytes"] - share) <= 0.1 * share, (rank, epoch)
            if plan.pipeline_length > 1:
                assert s["param_bytes"] < whole
            # AdamW: two fp32 moments per trained parameter and one 4-byte step per tensor.
            moments = 2 * sum(sizes[n] for n in trained)
            assert moments <= s["optim_bytes"] <= 1.1 * moments, (rank, epoch)
            assert s["optim_params"] == sorted(trained)
            assert s["released_grads"] == 0
            # The measured figure of the record says the same.
            m = s["record"].memory[rank]
            assert m.held_param_bytes == m.param_bytes == s["param_bytes"]
    # Stage 0 holds the frozen prefix it runs (embed, blocks 0-1 at K 2) and nothing of stage 1.
    k2 = results[2][2][1]
    assert k2["stage"] == 0 and k2["held"] == ["block.0", "block.1", "block.2", "embed"]
    ref_timeline = assert_same_parameters([r[:2] for r in results], cfg)
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)


@contextmanager
def shards_opened():
    """The names of the shard files read inside the block."""
    from pt_ray.runtime import checkpoint

    opened: list[str] = []
    real_read = checkpoint.read_shard

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_read(path, *args, **kwargs)

    checkpoint.read_shard = spy
    try:
        yield opened
    finally:
        checkpoint.read_shard = real_read


def resume_from_own_shards(rank, world, cfg, directory):
    """Restore from a copy of the checkpoint without the shards of layers this rank does not
    hold, recording which shard files it opened."""
    splits, adapter, control, plan = resume_parts(world, cfg, directory)
    mine = set(plan.stage_layers(plan.coords(rank)[1]))
    copy = Path(f"{directory}-rank{rank}")
    shutil.copytree(directory, copy)
    kept = []
    for manifest in sorted(copy.glob("shard-rank*.json")):
        if mine & set(json.loads(manifest.read_text())["layers"]):
            kept.append(manifest.with_suffix(".safetensors").name)
        else:
            manifest.with_suffix(".safetensors").unlink()
            manifest.unlink()
    with shards_opened() as opened:
        worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                               controller=LocalController(control))
        first = worker.restore(copy, plan)
    held = sorted(n for n, m in worker.modules.items() if is_held(m))
    timeline = worker.fit(first_epoch=first)
    states = written_layers(worker)
    worker.close()
    return states, timeline, sorted(opened), sorted(kept), held, sorted(mine)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_restore_reads_only_the_shards_of_its_own_layers(tmp_path):
    cfg = config(VIT, "1f1b", 4)
    ckpt = tmp_path / "ckpt"
    run_ranks(train_then_checkpoint, 4, cfg, str(ckpt), 1)
    # Four shards (K 4 wrote one per stage); on two workers each rank needs only some of them.
    small = config(VIT, "1f1b", 2)
    results = run_ranks(resume_from_own_shards, 2, small, str(ckpt))
    for _, _, opened, kept, held, mine in results:
        assert opened == kept and len(kept) < 4
        assert held == mine
    assert_same_parameters([r[:2] for r in results], cfg)


# -- no processes --------------------------------------------------------------------------------


@pytest.mark.unit
def test_release_and_materialise_keep_shared_parameters_one_tensor():
    cfg = config(VIT, "1f1b", 1)
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    pos = adapter.model.pos_embed  # registered in the model and in the adapter's embedding
    before = pos.detach().clone()
    images = splits.train.inputs[0][:4]
    adapter.model(images).sum().backward()  # pos_embed now has a gradient and its autograd node
    release(adapter.embed)
    assert not is_held(adapter.embed) and adapter.model.pos_embed is pos and not has_storage(pos)
    assert pos.shape == before.shape and pos.grad is None  # the memory went; the tensor stays
    assert is_held(adapter.blocks[0])
    materialise(adapter.embed, torch.device("cpu"))
    assert is_held(adapter.embed) and has_storage(adapter.model.pos_embed)
    with torch.no_grad():
        adapter.embed.pos_embed.copy_(before)  # what a migration or a checkpoint writes
    assert torch.equal(adapter.model.pos_embed, before)
    # The same tensor trains again: its gradient arrives where the model looks for it.
    adapter.model(images).sum().backward()
    assert pos.grad is not None and pos.grad.shape == before.shape


@pytest.mark.unit
def test_only_the_shards_that_hold_a_wanted_layer_are_read(tmp_path):
    for rank, name in enumerate(["embed", "head"]):
        write_shard(tmp_path, rank, {name: {"params": {"w": torch.full((2,), float(rank))}},
                                     "__norms__": {"sums": {}, "steps": rank}})
    with shards_opened() as opened:
        layers, _ = load_layers(tmp_path, ["head"])
        assert opened == ["shard-rank1.safetensors"]
        assert float(layers["head"]["params"]["w"][0]) == 1.0
        opened.clear()
        layers, _ = load_layers(tmp_path, ["embed", "head"])
        assert opened == ["shard-rank0.safetensors", "shard-rank1.safetensors"]
