"""The elastic engine on forked gloo processes equals the single-process reference trainer."""

from __future__ import annotations

import pytest
import torch

from datafiles import write_cifar10
from dist_utils import run_ranks, written_layers
from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import training_sampler
from pt_ray.core.plan import CostTable
from pt_ray.runtime.engine import ElasticWorker, EngineHooks, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.reference import build_reference
from pt_ray.service.settings import run_settings

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

VIT = {
    "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
              "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
    "data": {"name": "synthetic_image", "num_samples": 96, "image_size": 8, "batch_size": 16},
}
BERT = {
    # Dropout off: random masks would differ between one process and a pipeline.
    "model": {"family": "hf", "name": "bert", "depth": 4, "width": 32, "num_heads": 2,
              "mlp_ratio": 2.0, "dropout": 0.0},
    "data": {"name": "synthetic_text", "num_samples": 96, "seq_len": 12, "batch_size": 16},
}


def config(base, schedule, workers, **extra):
    return build_config({
        **base,
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": workers, "schedule": schedule, "policy": "paper"},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        "epochs": 3,
        **extra,
    })


def costs_for(num_layers):
    # Fixed, equal costs make the plan sequence known: K 4 -> 2 -> 1 as 0 -> 2 -> 3 blocks freeze.
    return CostTable.from_param_counts(1.0, [1.0] * num_layers, 1.0)


def train_rank(rank, world, cfg):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    steps = len(splits.train) // cfg.data.batch_size
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world, steps)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline


def train_rank_counting_passes(rank, world, cfg):
    """``train_rank``, also returning the rows of every training forward of the head (a pass's
    replica share at K = 1, a micro-batch in a pipeline; empty off the last stage)."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    rows: list[int] = []
    adapter.head.register_forward_hook(
        lambda module, args, out: rows.append(out.shape[0]) if torch.is_grad_enabled() else None)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, rows


def reference_layers(cfg):
    trainer = build_reference(run_settings(cfg).reference)
    timeline = trainer.fit()
    from pt_ray.models.base import iter_layers

    return {n: m.state_dict() for n, m in iter_layers(trainer.adapter)}, timeline


def assert_same_parameters(results, cfg):
    merged = {}
    for states, _ in results:
        for layer, sd in states.items():
            assert layer not in merged, f"{layer} reported by two ranks"
            merged[layer] = sd
    ref, ref_timeline = reference_layers(cfg)
    assert set(merged) == set(ref)
    worst = 0.0
    for layer, sd in ref.items():
        for key, value in sd.items():
            worst = max(worst, float((merged[layer][key] - value).abs().max()))
    assert worst <= 1e-4, f"max abs parameter difference {worst:.3g}"
    return ref_timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("base", [VIT, BERT], ids=["vit", "bert"])
def test_four_workers_with_transitions_match_reference(base, schedule):
    cfg = config(base, schedule, 4)
    results = run_ranks(train_rank, 4, cfg)
    timeline = results[0][1]
    assert [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline] == [
        (0, 4, 1), (2, 2, 2), (3, 1, 4)
    ]
    for _, other in results[1:]:
        assert [r.eval_metric for r in other] == [r.eval_metric for r in timeline]
    ref_timeline = assert_same_parameters(results, cfg)
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)
        assert mine.eval_metric == pytest.approx(ref.eval_metric, abs=1e-9)


def train_rank_counting_eval_prefixes(rank, world, cfg):
    """``train_rank``, also returning, per epoch, how many times stage 0 ran its prefix (the
    embedding and the frozen blocks) while the epoch was scored (training runs it in steps)."""
    from pt_ray.runtime.stages import StageModule

    runs = [0]
    run_prefix = StageModule.run_prefix

    def counted(self, *inputs):
        runs[0] += 1
        return run_prefix(self, *inputs)

    StageModule.run_prefix = counted  # this forked rank's class only
    record = ElasticWorker._epoch_record
    per_epoch: list[int] = []

    def recorded(self, *args):
        before = runs[0]
        out = record(self, *args)
        per_epoch.append(runs[0] - before)
        return out

    ElasticWorker._epoch_record = recorded
    states, timeline = train_rank(rank, world, cfg)
    return states, timeline, per_epoch


@pytest.mark.parametrize("base", [VIT, BERT], ids=["vit", "bert"])
def test_evaluations_under_one_plan_read_the_frozen_prefix_once_and_score_as_the_reference(base):
    # 5 epochs on 2 ranks, blocks frozen from epoch 1 and the last plan standing for the last
    # three (a ViT keeps K = 2 with 2 blocks frozen, a BERT ends on K = 1 with 3): a plan's
    # first evaluation runs stage 0's prefix over each eval batch and the next ones read what
    # it kept; a rank off stage 0 holds no prefix. Epoch 0 freezes nothing: the embedding
    # still trains, so nothing is kept.
    cfg = config(base, "1f1b", 2, epochs=5)
    results = run_ranks(train_rank_counting_eval_prefixes, 2, cfg)
    plans = [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in results[0][1]]
    assert plans[0][0] == 0 and plans[2] == plans[3] == plans[4] and plans[4][0] > 0
    for rank, (_, _, per_epoch) in enumerate(results):
        for epoch, plan in enumerate(plans):
            stage0 = rank == 0 or plan[1] == 1  # rank 0 holds stage 0; at K = 1 every rank
            kept = epoch > 0 and plan == plans[epoch - 1] and plan[0] > 0
            runs = per_epoch[epoch]
            assert runs == 0 if kept or not stage0 else runs > 0, (rank, epoch, plans, per_epoch)
    timeline = results[0][1]
    ref_timeline = assert_same_parameters([r[:2] for r in results], cfg)
    assert [r.eval_metric for r in timeline] == [r.eval_metric for r in ref_timeline]


def test_kept_prefix_states_stop_at_the_budget_and_stay_in_batch_order():
    from pt_ray.runtime.records import PrefixStarts

    cpu = torch.device("cpu")
    batch = (torch.zeros(4, 8), torch.ones(4, dtype=torch.int64))  # 128 + 32 bytes
    starts = PrefixStarts(budget_bytes=400, host=True)
    starts.put(1, batch)  # batch 0 not held yet: kept batches stay in order
    assert starts.get(1, cpu) is None
    for i in range(4):
        starts.put(i, batch)
    assert starts.bytes == 320 and starts.full  # batch 2 passed the budget
    assert starts.get(1, cpu) is not None and starts.get(2, cpu) is None
    starts.put(3, batch)  # nothing after a refused batch
    assert starts.get(3, cpu) is None
    assert all(torch.equal(a, b) for a, b in zip(starts.get(0, cpu), batch))


def test_pinned_pipeline_freezes_in_place_and_matches_reference():
    # pipeline.elastic=false (the "freeze only" ablation): K = 2 and R = 1 for the whole run;
    # freezing is capped at L - K = 2 blocks (max_frozen asks for 3), which stage 0 takes over
    # while the active blocks re-balance over both stages.
    cfg = config(VIT, "1f1b", 2, pipeline={"num_workers": 2, "schedule": "1f1b",
                                           "policy": "paper", "elastic": False})
    results = run_ranks(train_rank, 2, cfg)
    timeline = results[0][1]
    assert [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline] == [
        (0, 2, 1), (2, 2, 1), (2, 2, 1)
    ]
    ref_timeline = assert_same_parameters(results, cfg)
    assert [r.num_frozen for r in ref_timeline] == [0, 2, 2]
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)


def test_step_interval_transitions_mid_epoch_match_reference():
    # 6 steps an epoch, decisions at its steps 0 and 4: n = 0, 2, 3, 3, .. (ceil(4 (1 - 0.5^d))).
    # Epoch 0 opens with nothing frozen and ends with 2 blocks frozen: the transition came at
    # its step 4, in the middle of the epoch.
    cfg = config(VIT, "1f1b", 2, freeze={"policy": "schedule", "alpha": 0.5, "max_frozen": 3,
                                         "warmup_epochs": 0, "interval": "steps",
                                         "interval_steps": 4})
    results = run_ranks(train_rank, 2, cfg)
    timeline = results[0][1]
    assert [r.num_frozen for r in timeline] == [2, 3, 3]
    # Steps 0-3 of epoch 0 trained with nothing frozen and steps 4-5 with 2 blocks frozen: the
    # mean over its steps is 2 x 2 / 6, which only a transition at step 4 gives.
    assert timeline[0].mean_frozen == pytest.approx(2 * 2 / 6)
    assert [r.mean_frozen for r in timeline[1:]] == [3, 3]
    assert timeline[0].transition_time_s > 0
    ref_timeline = assert_same_parameters(results, cfg)
    assert [r.num_frozen for r in ref_timeline] == [2, 3, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("length", [1, 2], ids=["ddp", "pipeline"])
def test_two_accumulation_passes_match_the_reference_without_accumulation(length):
    # K = 1: two DDP replicas, the first pass under no_sync. K = 2: one pipeline, the schedule
    # stepped once per pass (8 samples, M = 8) through the first freeze, then K 2 -> 1 and
    # R 1 -> 2 at the second; either way one reduction per optimizer step.
    pipeline = {"num_workers": 2, "schedule": "1f1b", "policy": "paper",
                "pipeline_length": length}
    cfg = config(VIT, "1f1b", 2, pipeline=pipeline,
                 optimizer={"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2,
                            "accumulation_steps": 2})
    results = run_ranks(train_rank_counting_passes, 2, cfg)
    timeline = results[0][1]
    expected = {1: [(0, 1, 2, 1), (2, 1, 2, 1), (3, 1, 2, 1)],
                2: [(0, 2, 1, 8), (2, 2, 1, 8), (3, 1, 2, 1)]}[length]
    assert [(r.num_frozen, r.pipeline_length, r.num_replicas, r.num_microbatches)
            for r in timeline] == expected
    # 6 steps an epoch of 2 passes of 8 samples: 4 rows per replica at K = 1; at K = 2 rank 1
    # (the last stage) runs 8 micro-batches of 1 row per pass.
    ddp_epoch = [4] * 12
    if length == 1:
        assert results[0][2] == results[1][2] == ddp_epoch * 3
    else:
        assert results[0][2] == ddp_epoch and results[1][2] == [1] * 192 + ddp_epoch
    whole = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(
        update={"accumulation_steps": 1})})
    ref_timeline = assert_same_parameters([r[:2] for r in results], whole)
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)


def train_then_checkpoint(rank, world, cfg, directory, epochs):
    """Train ``epochs`` epochs on ``world`` ranks and write a checkpoint as the Ray worker does."""
    from pathlib import Path

    from pt_ray.runtime.checkpoint import write_meta

    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    controller = LocalController(control)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=controller,
                           costs=costs_for(adapter.num_layers))
    worker.start()
    for epoch in range(epochs):
        worker.train_epoch(epoch)
    worker.state.save_shard(Path(directory), worker.next_epoch - 1)
    if rank == 0:
        write_meta(Path(directory), {**worker.state.meta(epochs - 1),
                                     "next_decision": worker.decision,
                                     "controller": control.state_dict()})
    worker.close()
    return worker.plan


def resume_parts(world, cfg, directory):
    """What a rank of ``world`` builds to resume from the checkpoint in ``directory``: the
    splits, the model, the control state rolled back to the checkpoint, and its plan."""
    from pathlib import Path

    from pt_ray.runtime.checkpoint import read_meta

    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    meta = read_meta(Path(directory))
    return splits, adapter, control, control.resume(meta["controller"], meta["next_decision"])


def resume_and_finish(rank, world, cfg, directory):
    from pathlib import Path

    splits, adapter, control, plan = resume_parts(world, cfg, directory)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control))
    first = worker.restore(Path(directory), plan)
    timeline = worker.fit(first_epoch=first)
    states = written_layers(worker)
    worker.close()
    return states, timeline


def test_checkpoint_of_four_workers_resumes_on_two_and_matches_reference(tmp_path):
    cfg = config(VIT, "1f1b", 4)
    run_ranks(train_then_checkpoint, 4, cfg, str(tmp_path), 1)
    # Fewer devices after a restart (elastic N): the plan is re-made for N = 2, training goes on
    # from the checkpoint and still ends on the reference's parameters (fixed_global batches).
    small = config(VIT, "1f1b", 2)
    results = run_ranks(resume_and_finish, 2, small, str(tmp_path))
    timeline = results[0][1]
    assert [r.epoch for r in timeline] == [1, 2]
    assert all(r.pipeline_length * r.num_replicas == 2 for r in timeline)
    assert_same_parameters(results, cfg)


def resume_fused(rank, world, cfg, directory):
    """``resume_and_finish``, also returning whether the optimizer runs fused and whether every
    ``step`` counter sits on its parameter's device (the fused kernels' rule)."""
    from pathlib import Path

    splits, adapter, control, plan = resume_parts(world, cfg, directory)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control))
    first = worker.restore(Path(directory), plan)
    timeline = worker.fit(first_epoch=first)
    opt = worker.optimizer
    steps_placed = all(st["step"].device == p.device for p, st in opt.state.items())
    states = written_layers(worker)
    worker.close()
    return states, timeline, bool(opt.defaults.get("fused")), steps_placed


def test_fused_adamw_through_migrations_a_checkpoint_and_a_resume_matches_reference(tmp_path):
    # optimizer.fused=auto (the default) runs torch's fused AdamW on the CPU: its state goes
    # through a checkpoint, a resume on 2 workers and the transitions after it, and the run
    # still ends on the reference's parameters (the reference runs fused AdamW too).
    optimizer = {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2}
    cfg = config(VIT, "1f1b", 4, optimizer=optimizer)
    run_ranks(train_then_checkpoint, 4, cfg, str(tmp_path), 1)
    results = run_ranks(resume_fused, 2, config(VIT, "1f1b", 2, optimizer=optimizer),
                        str(tmp_path))
    assert all(fused and placed for _, _, fused, placed in results)
    timeline = results[0][1]
    assert len({(r.pipeline_length, r.num_replicas) for r in timeline}) == 2  # a transition
    assert_same_parameters([r[:2] for r in results], cfg)


def train_rank_compiled(rank, world, cfg):
    """``train_rank``, also returning how many graphs torch compiled in this rank."""
    from torch._dynamo.utils import counters

    states, timeline = train_rank(rank, world, cfg)
    return states, timeline, counters["stats"]["unique_graphs"]


@pytest.mark.timeout(600)
def test_compiled_blocks_equal_eager_across_freeze_transitions():
    # pipeline.compile=on compiles each block on the CPU too (auto does so only on CUDA). Two
    # ranks go through K 2 -> 1 as blocks freeze (trained and frozen graphs, new micro-batch
    # sizes) and end within 1e-4 of the eager reference trainer's parameters.
    cfg = config(VIT, "1f1b", 2, pipeline={"num_workers": 2, "schedule": "1f1b",
                                           "policy": "paper", "compile": "on"})
    results = run_ranks(train_rank_compiled, 2, cfg)
    assert all(graphs > 0 for _, _, graphs in results)
    timeline = results[0][1]
    assert len({(r.num_frozen, r.pipeline_length) for r in timeline}) == 3
    ref_timeline = assert_same_parameters([r[:2] for r in results], cfg)
    for mine, ref in zip(timeline, ref_timeline):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)


def train_rank_prefetching(rank, world, cfg):
    """``train_rank``, also returning how many reads the background loader served."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, worker.stepper.prefetched, worker.stepper.kept_ahead


def test_background_loader_serves_every_read_in_order_and_matches_reference(tmp_path):
    # data.num_workers=2 on CIFAR-layout files (100 training images, augmented, resized to
    # 8 px): each first stage's input reads of an epoch come from two loader processes, in the
    # order the steps take them, as stored uint8 images that the rank crops, flips, resizes and
    # normalises itself. The last stage of a pipeline reads labels only, so it loads nothing
    # in the background. Rank 0 (stage 0 throughout) is served all 18 reads (6 steps x 3
    # epochs); rank 1 only in the epochs at K = 1, where it is a first stage too. The run ends
    # on the reference's parameters (the reference transforms on the host, batch by batch).
    # (It trains on 96 of the 100 images: 6 whole batches.)
    write_cifar10(tmp_path, per_batch=20)
    data = {"name": "cifar10", "path": str(tmp_path), "image_size": 8, "augment": True,
            "batch_size": 16, "num_workers": 2}
    cfg = config(VIT, "1f1b", 2, data=data)
    results = run_ranks(train_rank_prefetching, 2, cfg, daemon=False)
    timeline = results[0][1]
    lengths = [r.pipeline_length for r in timeline]
    assert lengths[0] == 2 and lengths[-1] == 1
    assert [r[2] for r in results] == [18, 6 * lengths.count(1)]
    # Epoch 1 runs epoch 0's plan (K = 2): rank 0's reads of it, started when epoch 0's steps
    # ended, were kept; epoch 2's, started under K = 2 too, were not (it runs at K = 1), and
    # rank 1, a last stage until then, had none to keep.
    assert lengths == [2, 2, 1] and [r[3] for r in results] == [1, 0]
    assert_same_parameters([r[:2] for r in results], cfg)


def guarded_rank(rank, world, cfg, metrics):
    """``train_rank`` with the eval metric scripted per epoch (the accuracy guard's input)."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    # Each rank counts its share: the counts summed over the ranks give the scripted metric.
    scripted = EngineHooks(on_eval=lambda epoch, _: metrics[epoch] * len(splits.eval) / world)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers),
                           hooks=scripted)
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, control.rollbacks, [
        (r.epoch, r.num_frozen, r.pipeline_length, r.num_replicas) for r in control.discarded]


def test_rollback_on_two_workers_equals_a_run_that_never_froze_that_block():
    # Run A: blocks 0-1 freeze at epoch 1 (K 2 -> 1, R 1 -> 2) and block 2 at epoch 2, whose
    # scripted evaluation falls 20 points: every rank restores its snapshot of the start of
    # epoch 2 and trains epochs 2 and 3 with two frozen blocks. Run B never freezes block 2.
    metrics = {0: 0.5, 1: 0.6, 2: 0.4, 3: 0.7}
    a = config(VIT, "1f1b", 2, epochs=4,
               freeze={"policy": "schedule", "alpha": 0.5, "max_frozen": 3,
                       "warmup_epochs": 1, "rollback": True})
    b = config(VIT, "1f1b", 2, epochs=4,
               freeze={"policy": "schedule", "alpha": 0.5, "max_frozen": 2, "warmup_epochs": 1})
    run_a = run_ranks(guarded_rank, 2, a, metrics)
    run_b = run_ranks(guarded_rank, 2, b, {**metrics, 2: 0.65})
    _, timeline, rollbacks, discarded = run_a[0]
    layout = [(r.epoch, r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline]
    assert layout == [(0, 0, 2, 1), (1, 2, 2, 1), (2, 2, 2, 1), (3, 2, 2, 1)]
    assert [(r["epoch"], r["rollback_to"], r["num_frozen"], r["undone"]) for r in rollbacks] == [
        (2, 2, 2, 3)]
    assert discarded == [(2, 3, 1, 2)]  # the undone epoch ran K = 1, R = 2: the layout changes back
    assert run_b[0][2] == []
    assert [(r.epoch, r.num_frozen, r.pipeline_length, r.num_replicas)
            for r in run_b[0][1]] == layout
    merged_a = {k: v for states, *_ in run_a for k, v in states.items()}
    merged_b = {k: v for states, *_ in run_b for k, v in states.items()}
    assert set(merged_a) == set(merged_b)
    worst = max(float((merged_a[n][k] - v).abs().max())
                for n, sd in merged_b.items() for k, v in sd.items())
    assert worst <= 1e-4, f"max abs parameter difference {worst:.3g}"
    for ra, rb in zip(timeline, run_b[0][1]):
        assert ra.train_loss == pytest.approx(rb.train_loss, abs=1e-4)


def test_rollback_with_decisions_inside_epochs_returns_to_the_epoch_start():
    # Decisions at steps 0 and 4 of each 6-step epoch; a half-epoch warm-up lets block 0 freeze
    # at step 4 of epoch 0, blocks 1 and 2 at the start and at step 4 of epoch 1, whose scripted
    # evaluation falls 30 points. Every rank restores its snapshot of epoch 1's start (one block
    # frozen) and trains on without freezing more: run B, capped at one frozen block, is that.
    metrics = {0: 0.5, 1: 0.2, 2: 0.6, 3: 0.7}
    steps = {"interval": "steps", "interval_steps": 4, "warmup_epochs": 0.5}
    a = config(VIT, "1f1b", 2, epochs=4,
               freeze={"policy": "schedule", "alpha": 0.25, "max_frozen": 3, "rollback": True,
                       **steps})
    b = config(VIT, "1f1b", 2, epochs=4,
               freeze={"policy": "schedule", "alpha": 0.25, "max_frozen": 1, **steps})
    run_a = run_ranks(guarded_rank, 2, a, metrics)
    run_b = run_ranks(guarded_rank, 2, b, metrics)
    _, timeline, rollbacks, discarded = run_a[0]
    assert [(r["epoch"], r["rollback_to"], r["num_frozen"], r["undone"]) for r in rollbacks] == [
        (1, 1, 1, 3)]
    assert [d[:2] for d in discarded] == [(1, 3)]
    assert [(r.epoch, r.num_frozen) for r in timeline] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert run_b[0][2] == []
    assert [(r.epoch, r.num_frozen, r.pipeline_length, r.num_replicas) for r in timeline] == [
        (r.epoch, r.num_frozen, r.pipeline_length, r.num_replicas) for r in run_b[0][1]]
    merged_a = {k: v for states, *_ in run_a for k, v in states.items()}
    merged_b = {k: v for states, *_ in run_b for k, v in states.items()}
    worst = max(float((merged_a[n][k] - v).abs().max())
                for n, sd in merged_b.items() for k, v in sd.items())
    assert worst <= 1e-4, f"max abs parameter difference {worst:.3g}"
    for ra, rb in zip(timeline, run_b[0][1]):
        assert ra.train_loss == pytest.approx(rb.train_loss, abs=1e-4)


def train_rank_with_trials(rank, world, cfg):
    """``train_rank`` on profiled costs, with the RNG state around the start and what the
    controller measured of the first layouts."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control))
    rehearse, same = worker.stepper.rehearse, []

    def watched(batches):  # the RNG as each layout's rehearsals found it, after them
        before = torch.random.get_rng_state()
        seconds = rehearse(batches)
        same.append(torch.equal(before, torch.random.get_rng_state()))
        return seconds

    worker.stepper.rehearse = watched
    worker.start()
    same_rng = len(same) == len(control.start_trials) and all(same)
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, control.start_trials, control.plans[0], same_rng


def test_timed_first_layouts_leave_the_run_on_the_reference():
    # A margin no prediction misses: both first layouts (K 1 R 2 and K 2 R 1) are rehearsed on
    # both ranks before the run starts on the one measured fastest, then freezes 0 -> 2 -> 3.
    cfg = config(VIT, "1f1b", 2, pipeline={"num_workers": 2, "policy": "cost",
                                          "start_trial_margin": 100.0})
    results = run_ranks(train_rank_with_trials, 2, cfg)
    trials = results[0][2]
    assert [t["pipeline_length"] for t in trials] and \
        sorted(t["pipeline_length"] for t in trials) == [1, 2]
    assert all(t["pass_s"] > 0 and t["measured_rate"] > 0 for t in trials)
    assert results[1][2] == trials  # every rank's controller chose from the same figures
    chosen = max(trials, key=lambda t: t["measured_rate"])
    first = results[0][3]
    assert (first.pipeline_length, first.generation) == (chosen["pipeline_length"], 2)
    assert all(r[4] for r in results), "the rehearsals moved the RNG"
    assert [r.num_frozen for r in results[0][1]] == [0, 2, 3]
    # Nothing the rehearsals ran reached the parameters or the optimizer.
    assert_same_parameters([(r[0], r[1]) for r in results], cfg)


def test_rehearsals_with_dropout_leave_the_rng_where_it_was():
    # Dropout draws a mask in every rehearsed forward; the run must draw the masks it would
    # have drawn without the trials.
    base = {**BERT, "model": {**BERT["model"], "dropout": 0.1}}
    cfg = config(base, "1f1b", 2, epochs=1,
                 pipeline={"num_workers": 2, "policy": "cost", "start_trial_margin": 100.0})
    results = run_ranks(train_rank_with_trials, 2, cfg)
    assert len(results[0][2]) == 2 and all(r[4] for r in results)


def _recording(policy, seen):
    """``policy`` with every decision's probe figures appended to ``seen``."""
    decide = policy.decide

    def recorded(decision, num_frozen, inputs=None):
        figures = {k: v for k, v in (inputs or {}).items() if k < -1}
        result = decide(decision, num_frozen, inputs)
        seen.append((decision, num_frozen, figures, result.num_frozen))
        return result

    policy.decide = recorded
    return policy


def train_rank_probing(rank, world, cfg):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    # Steps as the sampler counts them: the probe split is never drawn.
    steps = training_sampler(cfg.freeze, cfg.data.batch_size, cfg.seed,
                             len(splits.train)).steps_per_epoch
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world, steps)
    seen = []
    _recording(control.policy, seen)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs_for(adapter.num_layers))
    timeline = worker.fit()
    states = written_layers(worker)
    worker.close()
    return states, timeline, seen


def test_probe_decisions_inside_epochs_match_the_reference():
    # Decisions every 2 steps; each tests blocks on 9 held-out samples, reverting them on 2
    # ranks (K 2, stages holding different blocks) as the reference does in one process; a
    # generous threshold lets tests pass, so the prefix grows.
    cfg = config(VIT, "1f1b", 2, freeze={
        "policy": "probe", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 0.3,
        "interval": "steps", "interval_steps": 2, "probe_threshold": 0.9})
    results = run_ranks(train_rank_probing, 2, cfg)
    seen = results[0][2]
    assert results[1][2] == seen  # every rank's controller saw the same figures
    trainer = build_reference(run_settings(cfg).reference)
    ref_seen = []
    _recording(trainer.policy, ref_seen)
    ref_timeline = trainer.fit()
    # The engine also decides after the last epoch (for a resume), the reference does not.
    assert len(seen) == len(ref_seen) + 1
    assert [(d, n, after) for d, n, _, after in seen[:-1]] == \
        [(d, n, after) for d, n, _, after in ref_seen]
    tested = [(f, g) for (_, _, f, _), (_, _, g, _) in zip(seen, ref_seen) if f]
    assert len(tested) >= 2 and all(set(f) == set(g) == {-2, -3} for f, g in tested)
    worst = max(abs(f[k] - g[k]) for f, g in tested for k in f)
    assert worst <= 1e-4, f"probe losses differ by {worst:.3g}"
    # The tests froze blocks inside epochs, and the run still ends on the reference.
    timeline = results[0][1]
    assert any(r.mean_frozen not in (0, r.num_frozen) for r in timeline)
    assert timeline[-1].num_frozen > 0
    assert [r.num_frozen for r in timeline] == [r.num_frozen for r in ref_timeline]
    assert_same_parameters([(r[0], r[1]) for r in results], cfg)
    # Both record what the probe took, each epoch less than its training time.
    for line in (timeline, ref_timeline):
        assert sum(r.probe_time_s for r in line) > 0
        assert all(0 <= r.probe_time_s < r.epoch_time_s for r in line)
