"""Memory measured per rank and epoch, beside the planners' estimate: the saved-activation
count on literal graphs, the estimate for literal costs, the records' round trip and report,
and the figures of 4 forked gloo ranks through K 4 -> 2 -> 1."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from dist_utils import run_ranks
from pt_ray.core.config import build_config
from pt_ray.control.state import ControlState, build_control_state
from pt_ray.costs.costplan import CostModelPlanner
from pt_ray.data.registry import build_dataset
from pt_ray.core.freeze import build_freeze_policy
from pt_ray.costs.hwprofile import load_hardware
from pt_ray.models.base import iter_layers
from pt_ray.core.plan import CostTable, LayerCost, PaperPlanner, PlanSettings, is_trainable
from pt_ray.core.memory import MemoryModel
from pt_ray.reporting.report import format_table, memory_table
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.memory import SavedActivations
from pt_ray.runtime.build import build_model_for
from pt_ray.reporting.summary import EpochRecord, RankMemory
from pt_ray.service.settings import run_settings

F32 = 4


# -- the saved-activation count --------------------------------------------------------------

@pytest.mark.unit
def test_saved_activations_count_each_storage_once_and_no_parameter():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    saved = SavedActivations([w])
    with saved.counting():
        h = x @ w                  # saves x (w needs a gradient); w itself is not counted
        y = h * h                  # saves h twice: one storage
        z = torch.tanh(y)          # saves its output
        loss = (z @ w.t()).sum()   # saves z and a view of w (not counted)
    assert saved.current == 3 * 4 * 8 * F32  # x, h, z
    loss.backward()
    assert saved.current == 0  # the graph is freed after its backward
    assert saved.peak == 3 * 4 * 8 * F32
    saved.reset_peak()
    assert saved.peak == 0


@pytest.mark.unit
def test_saved_activations_are_released_with_a_graph_that_never_runs_backward():
    w = torch.nn.Parameter(torch.randn(8, 8))
    saved = SavedActivations([w])
    with saved.counting():
        out = torch.relu(torch.randn(2, 8) @ w)
    assert saved.current == 2 * 2 * 8 * F32  # the input, relu's output
    del out
    assert saved.current == 0
    assert saved.peak == 2 * 2 * 8 * F32


# -- the estimate ------------------------------------------------------------------------------

def literal_costs() -> CostTable:
    # Parameters 100 / 10 per block / 50 bytes; outputs 1 / 2 per block / 3 bytes per sample.
    layer = lambda act, par: LayerCost(1.0, 2.0, act, par)  # noqa: E731
    return CostTable(layer(1.0, 100.0), tuple(layer(2.0, 10.0) for _ in range(4)),
                     layer(3.0, 50.0), samples=1)


@pytest.mark.unit
def test_paper_planner_estimate_for_a_literal_plan():
    planner = PaperPlanner(2, literal_costs(), PlanSettings(batch_size=8, schedule="gpipe",
                                                            initial_pipeline_length=2))
    plan = planner.initial_plan()
    assert plan.boundaries == (0, 2, 4)
    # Every active layer: 4 x its parameters + its output for each of the 8 samples (GPipe
    # keeps the whole replica batch).
    stage0 = 4 * 100 + 8 * 1 + 2 * (4 * 10 + 8 * 2)
    stage1 = 2 * (4 * 10 + 8 * 2) + 4 * 50 + 8 * 3
    assert planner.stage_memory(plan) == [stage0, stage1]
    # Embed and blocks 0-1 frozen (their parameters only); K 1, R 2: 4 samples a replica.
    frozen = planner.next_plan(plan, 2)
    assert (frozen.pipeline_length, frozen.num_replicas) == (1, 2)
    assert planner.stage_memory(frozen) == [
        100 + 2 * 10 + 2 * (4 * 10 + 4 * 2) + 4 * 50 + 4 * 3]
    # The memory rule and the record's estimate are one computation.
    assert planner.stage_memory(plan) == planner._stage_memory(
        planner._partition(0, 2), 0, 2)


@pytest.mark.unit
def test_cost_planner_estimate_for_a_literal_plan():
    planner = CostModelPlanner(2, literal_costs(), load_hardware("local-cpu"),
                               PlanSettings(batch_size=8, schedule="gpipe",
                                            initial_pipeline_length=2, num_microbatches=2),
                               activation_memory_factor=5.0)
    plan = planner.initial_plan()
    assert (plan.boundaries, plan.num_microbatches) == ((0, 2, 4), 2)
    # GPipe holds both micro-batches of 4: 8 samples, each keeping 5 outputs' worth per block
    # (and per embedding); the head keeps its output once.
    acts = 8 * 5
    stage0 = 4 * 100 + 1 * acts + 2 * (4 * 10 + 2 * acts)
    stage1 = 2 * (4 * 10 + 2 * acts) + 4 * 50 + 3 * 8
    assert planner.stage_memory(plan) == pytest.approx([stage0, stage1])


def rank_row(rank: int, stage: int) -> RankMemory:
    return RankMemory(rank=rank, stage=stage, param_bytes=400, grad_bytes=400,
                      optimizer_bytes=800, activation_bytes=1000, peak_bytes=2600,
                      held_param_bytes=800)


@pytest.mark.unit
def test_controller_sets_the_plans_estimate_beside_each_ranks_figures():
    planner = PaperPlanner(2, literal_costs(), PlanSettings(batch_size=8, schedule="gpipe",
                                                            initial_pipeline_length=2))
    state = ControlState(2, build_freeze_policy("none", num_layers=4, alpha=0.5),
                         lambda costs: planner)
    state.submit_costs(0, literal_costs())
    state.submit_costs(1, literal_costs())
    assert state.plans[0].num_microbatches == 8
    rec = EpochRecord(0, 0, 4, 2, 1, 8, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5,
                      memory=(rank_row(0, 0), rank_row(1, 1)))
    state.record(rec)
    got = state.timeline[0].memory
    assert [m.estimate_bytes for m in got] == planner.stage_memory(state.plans[0])
    # A record whose layout is not the plan's gets no estimate rather than a wrong one.
    state.record(replace(rec, epoch=1, pipeline_length=1, num_replicas=2))
    assert [m.estimate_bytes for m in state.timeline[1].memory] == [0.0, 0.0]


@pytest.mark.unit
def test_records_round_trip_through_json_and_old_summaries_still_load():
    rec = EpochRecord(0, 0, 4, 2, 1, 1, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5,
                      memory=(replace(rank_row(0, 0), estimate_bytes=2500.0),))
    back = EpochRecord.from_dict(json.loads(json.dumps(asdict(rec))))
    assert back == rec
    old = {k: v for k, v in asdict(rec).items() if k not in ("memory", "cache_cost_ratio")}
    assert EpochRecord.from_dict(old).memory == ()


@pytest.mark.unit
def test_report_shows_each_layouts_memory_beside_the_estimate():
    ranks = (replace(rank_row(0, 0), estimate_bytes=2048.0),
             replace(rank_row(1, 1), estimate_bytes=0.0))
    timeline = [asdict(EpochRecord(e, n, 4, k, 2 // k, 1, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5,
                                   memory=ranks))
                for e, (n, k) in enumerate([(0, 2), (0, 2), (2, 1)])]
    summary = {"timeline": timeline, "metric_name": "accuracy"}
    table = memory_table(summary)
    lines = table.splitlines()
    assert lines[0].startswith("memory per rank (KiB) in the first epoch of each layout")
    assert "all 0.8 KiB of the model's parameters" in lines[1]
    # Epochs 1 and 3 (where the layout changes), one row per rank; 2600 B against 2048 B.
    body = [line.split() for line in lines[4:]]
    assert [(row[0], row[4]) for row in body] == [("1", "0"), ("1", "1"), ("3", "0"), ("3", "1")]
    assert body[0][-3:] == ["2.5", "2.0", "-21%"]  # the estimate's error: 2048 / 2600 - 1
    assert body[1][-2:] == ["-", "-"]
    assert table in format_table(summary)
    old = [{k: v for k, v in r.items() if k != "memory"} for r in timeline]
    assert memory_table({"timeline": old}) == ""
    assert "memory per rank" not in format_table({"timeline": old})


# -- 4 gloo ranks ------------------------------------------------------------------------------

VIT = {
    "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
              "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
    "data": {"name": "synthetic_image", "num_samples": 96, "image_size": 8, "batch_size": 16},
    "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
    "pipeline": {"num_workers": 4, "schedule": "1f1b", "policy": "paper"},
    "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
    "epochs": 3,
}


def train_and_record(rank, world, cfg):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    # Equal costs: K 4 -> 2 -> 1 as 0 -> 2 -> 3 blocks freeze.
    costs = CostTable.from_param_counts(1.0, [1.0] * adapter.num_layers, 1.0)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs)
    plans = []
    worker.fit(on_epoch=lambda rec: plans.append(worker.plan))
    worker.close()
    sizes = {name: sum(p.numel() * p.element_size() for p in module.parameters())
             for name, module in iter_layers(adapter)}
    tensors = {name: len(list(module.parameters())) for name, module in iter_layers(adapter)}
    estimates = [control.planner.stage_memory(p) for p in plans]
    return control.timeline, plans, sizes, tensors, estimates


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_four_ranks_measure_their_stages_exactly_through_k_4_2_1():
    cfg = build_config(VIT)
    results = run_ranks(train_and_record, 4, cfg)
    timeline, plans, sizes, tensors, estimates = results[0]
    assert [(r.num_frozen, r.pipeline_length) for r in timeline] == [(0, 4), (2, 2), (3, 1)]
    for other in results[1:]:
        # Every rank's controller kept the same figures.
        assert [r.memory for r in other[0]] == [r.memory for r in timeline]
    whole = sum(sizes.values())
    per_rank = []
    for rec, plan, estimate in zip(timeline, plans, estimates):
        assert [m.rank for m in rec.memory] == [0, 1, 2, 3]
        for m in rec.memory:
            stage = plan.coords(m.rank)[1]
            layers = plan.stage_layers(stage)
            trained = [n for n in layers if is_trainable(plan, n)]
            assert m.stage == stage
            assert m.param_bytes == sum(sizes[n] for n in layers)
            assert m.grad_bytes == sum(sizes[n] for n in trained)
            # AdamW: two fp32 moments per parameter, and a 4-byte step count per tensor;
            # frozen layers none.
            steps = F32 * sum(tensors[n] for n in trained)
            assert m.optimizer_bytes - steps == 2 * sum(sizes[n] for n in trained)
            # A rank holds its stage's layers only (the others' storage is freed).
            assert m.held_param_bytes == m.param_bytes < whole or plan.pipeline_length == 1
            assert m.held_param_bytes == m.param_bytes
            assert m.activation_bytes > 0 and not m.cuda
            assert m.peak_bytes == (m.param_bytes + m.grad_bytes + m.optimizer_bytes
                                    + m.activation_bytes)
            assert m.estimate_bytes == pytest.approx(estimate[stage])
        per_rank.append([(m.param_bytes, m.activation_bytes) for m in rec.memory])
    # Epoch 1 (K 4 -> 2) and 2 (K 2 -> 1) each change what every rank holds.
    assert per_rank[0] != per_rank[1] != per_rank[2]
    for before, after in zip(per_rank, per_rank[1:]):
        assert all(a != b for a, b in zip(before, after))
    # Frozen layers carry no optimizer state: rank 0 holds embed and blocks 0-1 frozen at K 2.
    rank0 = timeline[1].memory[0]
    assert rank0.param_bytes - rank0.grad_bytes == sizes["embed"] + sizes["block.0"] + sizes[
        "block.1"]


@pytest.mark.unit
def test_one_memory_model_weighs_both_planners_stages():
    # Literal costs, K = 2 at (0, 2, 4), 4 samples in flight on each stage.
    costs = literal_costs()
    outputs = MemoryModel(optimizer_state_factor=4.0)
    assert outputs.stage_bytes(costs, (0, 2, 4), 0, [4, 4]) == [
        4 * 100 + 4 * 1 + 2 * (4 * 10 + 4 * 2), 2 * (4 * 10 + 4 * 2) + 4 * 50 + 4 * 3]
    # Frozen embed and block 0 weigh their parameters times frozen_param_factor on stage 0.
    assert outputs.stage_bytes(costs, (1, 2, 4), 1, [4, 4])[0] == 100 + 10 + (4 * 10 + 4 * 2)
    half = MemoryModel(optimizer_state_factor=4.0, frozen_param_factor=0.5)
    assert half.stage_bytes(costs, (1, 2, 4), 1, [4, 4])[0] == 50 + 5 + (4 * 10 + 4 * 2)
    # A factor: each trainable layer keeps that many outputs, the head its output once.
    saved = MemoryModel(optimizer_state_factor=4.0, activation_factor=5.0)
    assert saved.stage_bytes(costs, (0, 2, 4), 0, [4, 4])[1] == (
        2 * (4 * 10 + 4 * 10) + 4 * 50 + 4 * 3)
    # The planners hold that model, configured from their own arguments.
    paper = PaperPlanner(2, costs, PlanSettings(batch_size=8, schedule="gpipe",
                                                initial_pipeline_length=2))
    assert paper.memory_model == MemoryModel(optimizer_state_factor=4.0, frozen_param_factor=1.0)
    cost = CostModelPlanner(2, costs, load_hardware("local-cpu"), PlanSettings(
        batch_size=8, schedule="gpipe", initial_pipeline_length=2, num_microbatches=2),
        activation_memory_factor=5.0)
    assert cost.memory_model == saved
    plan = cost.initial_plan()
    assert cost.stage_memory(plan) == saved.stage_bytes(costs, plan.boundaries, 0, [8, 8],
                                                       per_microbatch=4)
