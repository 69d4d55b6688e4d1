"""The planner: the paper's K table for ViT-B/16, plan invariants, memory budget and M."""

import pytest

from pt_ray.core.plan import (
    CostTable,
    LayerCost,
    PaperPlanner,
    Plan,
    PlanSettings,
    feed_line,
    replica_batch,
)
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit

VIT_B16_C100 = CostTable.from_param_counts(0.743, [7.088] * 12, 0.077)


def paper_planner(n=8):
    # The 2021 code: parameter counts as costs, frozen layers weighing zero.
    return PaperPlanner(n, VIT_B16_C100, PlanSettings(batch_size=64, optimizer_state_factor=1.0),
                        frozen_weight=0.0)


def test_paper_rule_reproduces_vit_b16_pipeline_lengths():
    planner = paper_planner()
    expected = {**dict.fromkeys(range(0, 5), 8), **dict.fromkeys(range(5, 9), 4),
                9: 2, 10: 2, 11: 1, 12: 1}
    plan = planner.initial_plan()
    assert plan.pipeline_length == 8
    got = {0: 8}
    for n in range(1, 13):
        plan = planner.next_plan(plan, n)
        got[n] = plan.pipeline_length
    assert got == expected


def test_plans_are_consistent_and_generations_count_changes():
    planner = paper_planner()
    plan = planner.initial_plan()
    assert plan.generation == 0 and plan.boundaries[0] == 0 and plan.boundaries[-1] == 12
    same = planner.next_plan(plan, 0)
    assert same is plan
    for n in (3, 6, 9, 11):
        nxt = planner.next_plan(plan, n)
        assert nxt.generation == plan.generation + 1
        assert nxt.num_workers == 8
        assert nxt.pipeline_length <= plan.pipeline_length
        assert nxt.boundaries[0] == n and nxt.boundaries[-1] == 12
        assert sum(len(nxt.stage_blocks(s)) for s in range(nxt.pipeline_length)) == 12 - n
        plan = nxt
    with pytest.raises(ValueError, match="only grow"):
        planner.next_plan(plan, 5)


def test_stage_layers_and_rank_layout():
    plan = Plan(generation=1, num_layers=6, num_frozen=2, pipeline_length=2, num_replicas=2,
                boundaries=(2, 4, 6), num_microbatches=4)
    assert plan.stage_layers(0) == ["embed", "block.0", "block.1", "block.2", "block.3"]
    assert plan.stage_layers(1) == ["block.4", "block.5", "head"]
    assert [plan.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.rank_of(1, 0) == 2
    assert "K 2 [2-3|4-5], R 2" in plan.describe()


def test_invalid_plan_rejected():
    with pytest.raises(ValueError):
        Plan(generation=0, num_layers=4, num_frozen=1, pipeline_length=2, num_replicas=1,
             boundaries=(0, 2, 4), num_microbatches=2)


def test_measured_frozen_cost_counts_on_stage_zero():
    # Frozen blocks cost their forward (1 of 3 units) on stage 0: with 6 frozen blocks the
    # prefix weighs 6 and stage 0 gets fewer active blocks than an even split.
    costs = CostTable.from_param_counts(0.0, [1.0] * 12, 0.0)
    planner = PaperPlanner(2, costs, PlanSettings(batch_size=8))
    plan = planner.next_plan(planner.initial_plan(), 6)
    # Even without a budget change the shrink to K=1 is impossible (more memory per stage),
    # so K stays 2 with the prefix's forward balanced against active blocks.
    assert plan.pipeline_length == 2
    assert plan.boundaries == (6, 8, 12)
    assert plan.stage_loads == (12.0, 12.0)


def test_memory_budget_controls_shrinking():
    costs = CostTable(
        embed=LayerCost(1, 2, 0, 10),
        blocks=tuple(LayerCost(1, 2, 0, 100) for _ in range(4)),
        head=LayerCost(1, 2, 0, 10),
    )
    tight = PaperPlanner(4, costs, PlanSettings(batch_size=8, optimizer_state_factor=1.0))
    roomy = PaperPlanner(4, costs, PlanSettings(batch_size=8, optimizer_state_factor=1.0,
                                                memory_budget=1e9))
    plan = tight.initial_plan()
    assert tight.next_plan(plan, 2).pipeline_length == 2
    assert roomy.next_plan(roomy.initial_plan(), 1).pipeline_length == 1


def test_microbatches_divide_replica_batch():
    planner = PaperPlanner(4, VIT_B16_C100, PlanSettings(batch_size=48))
    for k, r in ((4, 1), (2, 2), (1, 4)):
        m = planner.microbatches_for(k, r)
        assert (48 // r) % m == 0
        assert m == 1 if k == 1 else 1 < m <= 4 * k
    forced = PaperPlanner(4, VIT_B16_C100, PlanSettings(batch_size=48, num_microbatches=3))
    assert forced.microbatches_for(2, 2) == 3


@pytest.mark.timeout(30)
def test_accumulation_sizes_microbatches_and_memory_for_one_pass():
    # B = 48 in 2 passes on 4 workers: at K = 2 (R = 2) a pass gives each replica 12 samples,
    # so M is the largest divisor of 12 up to 4K = 8 (6), not of the step's 24 (8); memory is
    # a planner's without accumulation at B = 24.
    costs = CostTable.from_param_counts(1.0, [1.0] * 4, 1.0)
    two = PaperPlanner(4, costs, PlanSettings(batch_size=48, accumulation_steps=2))
    whole, half = PaperPlanner(4, costs, PlanSettings(batch_size=48)), PaperPlanner(4, costs,
                                                                                    PlanSettings(batch_size=24))
    assert two.replica_batch(2) == 12 and whole.replica_batch(2) == 24
    assert two.microbatches_for(2, 2) == 6 and whole.microbatches_for(2, 2) == 8
    part = two._partition(1, 2)
    assert two._stage_memory(part, 1, 2) == half._stage_memory(part, 1, 2)
    assert two.replan(two.initial_plan(), 2).num_microbatches == half.replan(
        half.initial_plan(), 2).num_microbatches
    # Passes too small to fill a 1F1B pipeline: the fix names the accumulation too.
    with pytest.raises(ValueError, match=r"a replica batch of 2 per pass \(optimizer\."
                       r"accumulation_steps=4\) cannot fill 4 pipeline stages .* lower "
                       r"optimizer\.accumulation_steps"):
        PaperPlanner(4, costs, PlanSettings(batch_size=8, accumulation_steps=4)).initial_plan()


def test_bad_initial_pipeline_length():
    with pytest.raises(ValueError, match="does not divide num_workers=8"):
        PaperPlanner(8, VIT_B16_C100, PlanSettings(batch_size=8, initial_pipeline_length=3))


def test_replan_for_fewer_workers_keeps_frozen_prefix():
    planner = paper_planner()
    plan = planner.next_plan(planner.initial_plan(), 5)
    smaller = planner.replan(plan, 4)
    assert smaller.num_workers == 4 and smaller.num_frozen == 5
    assert smaller.generation == plan.generation + 1


def test_pinned_pipeline_keeps_k_and_r_and_rebalances():
    planner = PaperPlanner(8, VIT_B16_C100, PlanSettings(batch_size=64, initial_pipeline_length=4,
                                                         elastic=False))
    plan = planner.initial_plan()
    for n in (2, 5, 8):
        plan = planner.next_plan(plan, n)
        assert (plan.pipeline_length, plan.num_replicas) == (4, 2)
        assert plan.boundaries[0] == n and plan.boundaries[-1] == 12
        assert all(hi > lo for lo, hi in zip(plan.boundaries, plan.boundaries[1:]))
    with pytest.raises(ValueError, match=r"freeze at most 8 blocks.*pipeline.elastic=true"):
        planner.next_plan(plan, 9)
    # The elastic planner shrinks K for the same freeze.
    elastic = PaperPlanner(8, VIT_B16_C100, PlanSettings(batch_size=64, initial_pipeline_length=4))
    assert elastic.next_plan(elastic.initial_plan(), 8).pipeline_length < 4


def tiny_config(depth, freeze, pipeline):
    """A 2-worker run of a tiny ViT on 64 synthetic images, batch 16."""
    from pt_ray.core.config import build_config

    return build_config({
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": depth,
                  "width": 32, "num_heads": 2, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 64, "image_size": 8,
                 "batch_size": 16},
        "freeze": freeze,
        "pipeline": {"num_workers": 2, **pipeline},
    })


@pytest.mark.parametrize("policy", ["paper", "cost"])
def test_pinned_run_caps_freezing_at_l_minus_k(policy, caplog):
    from pt_ray.control.state import build_control_state

    cfg = tiny_config(6, {"policy": "schedule", "alpha": 0.9, "warmup_epochs": 0},
                      {"policy": policy, "elastic": False})
    caplog.set_level("INFO", logger="pt_ray.control.state")
    state = build_control_state(run_settings(cfg).control, 6, 2, 4)
    assert "at most 4 of 6 blocks will freeze" in caplog.text
    for r in range(2):
        state.submit_costs(r, CostTable.from_param_counts(1.0, [1.0] * 6, 1.0))
    plan = state.plan_for(0)
    for decision in range(1, 6):
        state.submit_norms(decision - 1, {i: 1.0 for i in range(6)})
        plan = state.plan_for(decision)
        assert (plan.pipeline_length, plan.num_replicas) == (2, 1)
    assert plan.num_frozen == 4


def test_one_replica_batch_for_both_policies_and_accumulation():
    assert replica_batch(48, 4) == 12
    assert replica_batch(48, 4, "per_replica") == 48
    assert replica_batch(48, 2, "fixed_global", accumulation_steps=2) == 12
    assert replica_batch(2, 4) == 1  # never an empty pass
    # Both planners split the batch with it.
    costs = CostTable.from_param_counts(1.0, [1.0] * 4, 1.0)
    planner = PaperPlanner(4, costs, PlanSettings(batch_size=48, batch_policy="per_replica",
                                                  accumulation_steps=3))
    assert planner.replica_batch(2) == replica_batch(48, 2, "per_replica", 3) == 16


def test_feed_line_says_what_each_device_runs_and_warns_below_the_floor():
    # B = 64 over 4 replicas, 1 pass: 16 per replica; at K = 2 with M = 4, 4 per forward.
    pipe = Plan(generation=0, num_layers=4, num_frozen=0, pipeline_length=2, num_replicas=4,
                boundaries=(0, 2, 4), num_microbatches=4)
    flat = Plan(generation=1, num_layers=4, num_frozen=2, pipeline_length=1, num_replicas=8,
                boundaries=(2, 4), num_microbatches=1)
    fixed = PlanSettings(batch_size=64)
    line, short = feed_line(pipe, fixed, 32)
    assert short and line.startswith(
        "each device runs 4 samples per forward (16 samples per replica pass, 4 micro-batches)"
    )
    assert "batch_policy=per_replica" in line and "pipeline.min_device_batch" in line
    assert feed_line(flat, fixed, 32)[0].startswith("each device runs 8 samples per forward")
    assert feed_line(pipe, fixed, 0) == (
        "each device runs 4 samples per forward (16 samples per replica pass, 4 micro-batches)",
        False)
    # per_replica keeps each replica's 64 whatever R: 64 at K = 1, 16 per micro-batch at K = 2.
    kept = PlanSettings(batch_size=64, batch_policy="per_replica")
    assert feed_line(flat, kept, 32) == (
        "each device runs 64 samples per forward (64 samples per replica pass)", False)
    assert feed_line(pipe, kept, 16)[1] is False and feed_line(pipe, kept, 17)[1] is True


def _feed_state(min_device_batch, hardware):
    from pt_ray.control.state import build_control_state

    cfg = tiny_config(4, {"policy": "none"}, {"policy": "paper", "pipeline_length": 1,
                                              "min_device_batch": min_device_batch})
    state = build_control_state(run_settings(cfg).control, 4, 2, 4, hardware=hardware)
    for r in range(2):
        state.submit_costs(r, CostTable.from_param_counts(1.0, [1.0] * 4, 1.0))
    return state


@pytest.mark.parametrize("floor, hardware, warned", [
    ("auto", "local-cpu", False),   # auto never warns on CPU workers
    ("auto", "h100-nvlink", True),  # 8 per forward < 32 on GPU workers
    (8, "h100-nvlink", False),
    (9, "local-cpu", True),
    (0, "h100-nvlink", False),
])
def test_controller_logs_each_devices_batch_and_warns_when_short(floor, hardware, warned,
                                                                  caplog):
    caplog.set_level("INFO", logger="pt_ray.control.state")
    _feed_state(floor, hardware)
    lines = [r for r in caplog.records if "samples per forward" in r.getMessage()]
    assert len(lines) == 1 and "each device runs 8 samples per forward" in lines[0].getMessage()
    assert (lines[0].levelname == "WARNING") is warned


def test_min_device_batch_must_not_be_negative():
    from pt_ray.core.config import PipelineConfig

    with pytest.raises(ValueError, match="pipeline.min_device_batch=-1"):
        PipelineConfig(min_device_batch=-1)
