"""The cost model: schedules whose bubble emerges, communication formulas, analytic costs,
hardware profiles, calibration, and the planner that chooses by prediction."""

from dataclasses import fields, replace

import pytest

from pt_ray.cache.policy import CachePolicy
from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.costs.costmodel import (
    PT_2021,
    PT_RAY,
    HardwareProfile,
    allreduce_time,
    analytic_costs,
    calibrate,
    fit_efficiency,
    list_hardware,
    load_hardware,
    step_time,
    transition_time,
)
from pt_ray.costs.costplan import CostModelPlanner
from pt_ray.costs.pipesim import run_schedule, stage_order
from pt_ray.core.plan import CostTable, LayerCost, PaperPlanner, Plan, PlanSettings
from pt_ray.core.shapes import layer_shapes, model_shape, saved_activation_factor
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit

# A cluster where only compute costs: free, instant links and no fixed overheads.
IDEAL = HardwareProfile(
    name="ideal", device_flops=1e12, efficiency=1.0, device_memory_bytes=1e12,
    memory_bandwidth=1e30, devices_per_node=8, intra_node_bandwidth=1e30, intra_node_latency=0.0,
    inter_node_bandwidth=1e30, inter_node_latency=0.0, per_microbatch_overhead_s=0.0,
    cache_bandwidth=1e30, group_setup_s=0.0,
)


def uniform(num_layers=8, f=1.0, b=2.0, act=100.0, params=1000.0) -> CostTable:
    free = LayerCost(0.0, 0.0, act, 0.0)
    return CostTable(free, tuple(LayerCost(f, b, act, params) for _ in range(num_layers)), free)


def even_plan(k, r=1, m=4, layers=8, schedule="gpipe", num_frozen=0, cache=False) -> Plan:
    per = (layers - num_frozen) // k
    bounds = tuple(num_frozen + i * per for i in range(k + 1))
    return Plan(0, layers, num_frozen, k, r, bounds, m, schedule, cache)


# -- the schedules ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k,m", [(1, 4), (2, 1), (2, 8), (4, 4), (4, 16), (8, 16), (8, 3)])
def test_bubble_emerges_as_the_paper_formula(schedule, k, m):
    res = run_schedule([1.0] * k, [2.0] * k, m, schedule)
    assert res.makespan_s == pytest.approx((m + k - 1) * 3.0)
    assert res.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_time_bubble_for_balanced_stages(schedule):
    for k, m in [(2, 4), (4, 8), (8, 16)]:
        st = step_time(even_plan(k, m=m, schedule=schedule), uniform(), IDEAL, batch_per_replica=m)
        assert st.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
        assert st.step_s == pytest.approx((m + k - 1) * 3.0 * 8 / k)


def test_1f1b_order_warms_up_then_alternates():
    assert stage_order("1f1b", 0, 4, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0),
                                           ("F", 4), ("B", 1), ("F", 5), ("B", 2), ("B", 3),
                                           ("B", 4), ("B", 5)]
    assert stage_order("1f1b", 3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert stage_order("gpipe", 1, 4, 2) == [("F", 0), ("F", 1), ("B", 1), ("B", 0)]
    with pytest.raises(ValueError, match="schedule"):
        stage_order("zb", 0, 2, 2)


def test_unbalanced_stage_bounds_the_step():
    # GPipe: fill + M turns of the slowest stage, each phase.
    res = run_schedule([1.0, 3.0], [2.0, 6.0], 4, "gpipe")
    assert res.makespan_s == pytest.approx(1 + 4 * 3 + 4 * 6 + 2)


def test_frozen_stages_skip_their_backward():
    res = run_schedule([1.0, 1.0], [0.0, 2.0], 2, "gpipe")
    assert res.stage_busy_s == (2.0, 6.0)


# -- communication --------------------------------------------------------------------------------


# A ring all-reduce of 1 GB over R ranks at 10 GB/s: 2 (R - 1) steps (reduce-scatter, then
# all-gather), each sending one chunk of 1/R GB (0.1/R s) and paying the link latency once.
@pytest.mark.parametrize("r,steps,seconds", [(2, 2, 0.1), (4, 6, 0.15), (8, 14, 0.175),
                                             (16, 30, 0.1875)])
def test_ring_allreduce_is_2_r_minus_1_chunk_steps(r, steps, seconds):
    assert allreduce_time(1e9, r, 1e10, 0.0) == pytest.approx(seconds)
    assert allreduce_time(1e9, r, 1e10, 1e-3) == pytest.approx(seconds + steps * 1e-3)
    assert allreduce_time(1e9, 1, 1e10, 1e-3) == 0.0  # nothing to reduce


def test_replicas_across_nodes_reduce_over_the_inter_node_link():
    hw = replace(IDEAL, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0,
                 memory_bandwidth=1e30)
    plan = even_plan(1, r=2, m=1)
    params = 8 * 1000.0 + 0.0
    one_node = step_time(plan, uniform(), replace(hw, devices_per_node=2), 1)
    two_nodes = step_time(plan, uniform(), replace(hw, devices_per_node=1), 1)
    assert one_node.allreduce_s == pytest.approx(params / 100.0)
    assert two_nodes.allreduce_s == pytest.approx(params / 10.0)


def test_activation_transfers_cost_more_between_nodes():
    hw = replace(IDEAL, intra_node_bandwidth=1000.0, intra_node_latency=0.01,
                 inter_node_bandwidth=100.0, inter_node_latency=0.05)
    plan = even_plan(2, m=1)
    intra = step_time(plan, uniform(), replace(hw, devices_per_node=2), 10).pipeline_s
    inter = step_time(plan, uniform(), replace(hw, devices_per_node=1), 10).pipeline_s
    # One micro-batch of 10 samples x 100 bytes goes forward and its gradient back.
    assert inter - intra == pytest.approx(2 * ((1000 / 100 + 0.05) - (1000 / 1000 + 0.01)))


def test_serial_prefix_delays_the_pipeline_but_not_a_single_stage():
    costs = uniform(act=1.0)
    serial_rt = replace(PT_2021, per_microbatch_overhead_s=None)  # the profile's: none
    k1 = even_plan(1, m=4, num_frozen=4)
    assert step_time(k1, costs, IDEAL, 4, runtime=serial_rt).step_s == pytest.approx(
        step_time(k1, costs, IDEAL, 4, runtime=PT_RAY).step_s)
    # Stage 0 trains one block and carries the prefix: balanced only when the prefix runs in
    # its turns (pipelined); run first over the whole batch, it delays every stage.
    k2 = Plan(0, 8, 4, 2, 1, (4, 5, 8), 4, "gpipe")
    serial = step_time(k2, costs, IDEAL, 4, runtime=serial_rt)
    pipelined = step_time(k2, costs, IDEAL, 4, runtime=PT_RAY)
    assert serial.prefix_s == pipelined.prefix_s == pytest.approx(4 * 4 * 1.0)
    assert pipelined.step_s == pytest.approx(49.0)
    assert serial.step_s == pytest.approx(55.0)


def test_cache_reads_replace_the_prefix_forward():
    hw = replace(IDEAL, cache_bandwidth=1000.0)
    costs = uniform(act=100.0)
    off = step_time(even_plan(1, m=1, num_frozen=6), costs, hw, 10)
    plan = even_plan(1, m=1, num_frozen=6, cache=True)
    hit = step_time(plan, costs, hw, 10)
    miss = step_time(plan, costs, hw, 10, cache_state="miss")
    advance = step_time(plan, costs, hw, 10, cached_level=4)
    io = 10 * 100.0 / 1000.0
    assert off.prefix_s == pytest.approx(6 * 10)
    assert hit.prefix_s == pytest.approx(io)
    assert miss.prefix_s == pytest.approx(6 * 10 + io)
    assert advance.prefix_s == pytest.approx(io + 2 * 10 + io)
    with pytest.raises(ValueError, match="cached_level"):
        step_time(plan, costs, hw, 10, cached_level=7)


def test_transition_time_counts_moved_bytes_and_links():
    hw = replace(IDEAL, intra_node_bandwidth=1e4, inter_node_bandwidth=1e3, group_setup_s=0.5)
    old = even_plan(4, r=1)
    new = even_plan(2, r=2, num_frozen=4)
    assert transition_time(old, old, uniform(), hw) == 0.0
    near = transition_time(old, new, uniform(), replace(hw, devices_per_node=4))
    far = transition_time(old, new, uniform(), replace(hw, devices_per_node=1))
    assert 0.5 < near < far


# -- shapes, profiles, calibration ----------------------------------------------------------------


def test_vit_b16_counts_match_the_paper():
    embed, block, head = layer_shapes(model_shape("vit_base_patch16_224"))
    assert block.params / 1e6 == pytest.approx(7.088, abs=1e-3)
    assert embed.params / 1e6 == pytest.approx(0.743, abs=1e-3)
    assert head.params / 1e6 == pytest.approx(0.770, abs=1e-3)
    assert block.flops / 1e9 == pytest.approx(2.908, abs=1e-3)
    vit_base = model_shape("vit_base_patch16_224")
    assert saved_activation_factor(vit_base) == pytest.approx(24.7, abs=0.1)
    costs = analytic_costs(model_shape("vit_base_patch16_224"), IDEAL, micro_batch=4)
    assert costs.samples == 4 and costs.num_layers == 12
    assert costs.blocks[0].backward_s == pytest.approx(2 * costs.blocks[0].forward_s)
    assert costs.blocks[0].forward_s == pytest.approx(4 * block.flops / 1e12)
    assert costs.blocks[0].activation_bytes == 197 * 768 * 4


def test_model_shape_errors_name_what_exists():
    with pytest.raises(ValueError, match="did you mean vit_base_patch16_224"):
        model_shape("vit_base_patch16")
    with pytest.raises(ValueError, match="not divisible"):
        model_shape("bert-base-uncased", heads=7)
    assert model_shape("bert-large-uncased", tokens=384).tokens == 384


def test_shipped_profiles_load_and_bad_names_list_them(tmp_path):
    assert {"paper-rtx5000", "a100-80g-nvlink", "h100-nvlink", "local-cpu"} <= set(list_hardware())
    for name in list_hardware():
        hw = load_hardware(name)
        assert hw.name == name and 0 < hw.efficiency <= 1
    paper = load_hardware("paper-rtx5000")
    assert (paper.devices_per_node, paper.inter_node_bandwidth) == (8, 5e9)
    with pytest.raises(ValueError, match="paper-rtx5000"):
        load_hardware("rtx9000")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nflops: 1\n")
    with pytest.raises(ValueError, match="unknown fields"):
        load_hardware(bad)
    mine = tmp_path / "mine.yaml"
    mine.write_text(load_hardware("local-cpu").to_dict().__repr__().replace("'", '"'))
    assert load_hardware(mine).efficiency == load_hardware("local-cpu").efficiency


def test_calibrate_recovers_the_efficiency_of_a_profile():
    shape = model_shape("vit_tiny_patch16_224", num_layers=2)
    measured = analytic_costs(shape, replace(IDEAL, efficiency=0.37), micro_batch=8)
    assert calibrate(measured, shape, IDEAL).efficiency == pytest.approx(0.37, rel=1e-6)


def test_fit_efficiency_hits_a_target_step_time():
    shape = model_shape("vit_tiny_patch16_224")
    plan = even_plan(4, layers=12, m=8)

    def predict(hw):
        return step_time(plan, analytic_costs(shape, hw), hw, 64).step_s

    fitted = fit_efficiency(IDEAL, predict, target=2 * predict(IDEAL))
    assert fitted.efficiency == pytest.approx(0.5, rel=1e-4)


# -- the planner by prediction --------------------------------------------------------------------


PLAN_FIELDS = {f.name for f in fields(PlanSettings)}


def vit_planner(n=8, **kw):
    hw = load_hardware("paper-rtx5000")
    shape = model_shape("vit_base_patch16_224")
    args = dict(batch_size=128, batch_policy="per_replica", schedule="gpipe",
                initial_pipeline_length=n, memory_budget=1e12)
    args.update(kw)
    settings = PlanSettings(**{k: v for k, v in args.items() if k in PLAN_FIELDS})
    own = {k: v for k, v in args.items() if k not in PLAN_FIELDS}
    return CostModelPlanner(n, analytic_costs(shape, hw), hw, settings, **own), hw


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_model_choice_is_never_slower_than_the_paper_rule(schedule):
    hw = load_hardware("paper-rtx5000")
    shape = model_shape("vit_base_patch16_224")
    costs = analytic_costs(shape, hw)
    settings = PlanSettings(batch_size=400, batch_policy="per_replica", schedule=schedule,
                            initial_pipeline_length=8)
    cost = CostModelPlanner(16, costs, hw, settings, cache=CachePolicy("off"),
                            activation_memory_factor=saved_activation_factor(shape))
    rule = PaperPlanner(16, costs, settings)
    mine, paper = cost.initial_plan(), rule.initial_plan()
    gains = []
    for n in range(12):
        mine, paper = cost.next_plan(mine, n), rule.next_plan(paper, n)
        # On equal terms: the paper's plan predicted by the same model, when it fits memory.
        if max(cost.stage_memory(paper)) <= cost.memory_budget:
            gains.append(cost.predict(mine).throughput / cost.predict(paper).throughput)
    assert len(gains) == 12 and min(gains) >= 1 - 1e-9
    assert max(gains) > 1.3  # and it finds better layouts than the rule somewhere


def test_planner_invariants_memory_and_shrinking_k():
    cost, hw = vit_planner(memory_budget=None)
    plan = cost.initial_plan()
    assert plan.pipeline_length == 8 and plan.num_workers == 8
    for n in range(1, 12):
        nxt = cost.next_plan(plan, n)
        assert nxt.generation == plan.generation + 1
        assert nxt.pipeline_length <= plan.pipeline_length
        assert nxt.num_workers == 8 and 8 % nxt.pipeline_length == 0
        assert all(hi > lo for lo, hi in zip(nxt.boundaries, nxt.boundaries[1:]))
        assert max(cost.stage_memory(nxt)) <= cost.memory_budget * (1 + 1e-9)
        plan = nxt
    assert cost.next_plan(plan, plan.num_frozen) is plan
    with pytest.raises(ValueError, match="only grow"):
        cost.next_plan(plan, 0)


def test_pinned_planner_chooses_m_and_cache_but_keeps_k():
    pinned, _ = vit_planner(elastic=False, cache=CachePolicy("auto"))
    free, _ = vit_planner(cache=CachePolicy("auto"))
    plan = pinned.initial_plan()
    for n in (1, 3, 4):
        plan = pinned.next_plan(plan, n)
        assert (plan.pipeline_length, plan.num_replicas) == (8, 1)
        assert plan.boundaries[0] == n
        # Same M and cache as the elastic planner would pick at K = 8.
        best = free._best(n, 8, plan.cache)
        assert plan.num_microbatches == best.num_microbatches
    assert free.next_plan(free.initial_plan(), 4).pipeline_length < 8
    with pytest.raises(ValueError, match="pinned at K=8"):
        pinned.next_plan(plan, 5)


def test_a_tight_budget_keeps_the_pipeline_long():
    roomy, _ = vit_planner(memory_budget=1e12)
    start = roomy.initial_plan()
    tight, _ = vit_planner(memory_budget=max(roomy.stage_memory(start)))
    assert tight.pipeline_length_for(4, 8) >= roomy.pipeline_length_for(4, 8)
    assert roomy.pipeline_length_for(4, 8) < 8


def test_cache_modes():
    off, _ = vit_planner(cache=CachePolicy("off"))
    on, _ = vit_planner(cache=CachePolicy("on"))
    auto, _ = vit_planner(cache=CachePolicy("auto"))
    assert not off.next_plan(off.initial_plan(), 6).cache
    assert on.next_plan(on.initial_plan(), 6).cache
    assert not on.initial_plan().cache
    a = auto.next_plan(auto.initial_plan(), 6)
    flipped = replace(a, cache=not a.cache)
    assert auto.predict(a).throughput >= auto.predict(flipped).throughput


def test_microbatches_are_searched_divisors_or_forced():
    cost, _ = vit_planner()
    m = cost.microbatches_for(8, 1)
    assert 128 % m == 0 and 1 < m <= 128
    forced, _ = vit_planner(num_microbatches=16)
    assert forced.initial_plan().num_microbatches == 16


@pytest.mark.timeout(30)
def test_accumulation_passes_repeat_the_schedule_then_reduce_once():
    # Two replicas whose all-reduce costs a latency: three passes of 4 samples are three
    # schedules back to back, then the one all-reduce and optimizer step of a single pass.
    hw = replace(IDEAL, intra_node_latency=0.5)
    plan = even_plan(2, r=2, m=4)
    one = step_time(plan, uniform(), hw, 4)
    three = step_time(plan, uniform(), hw, 4, passes=3)
    assert one.allreduce_s > 0 and three.allreduce_s == one.allreduce_s
    assert three.step_s == pytest.approx(2 * one.pipeline_s + one.step_s)
    assert three.pipeline_s == pytest.approx(3 * one.pipeline_s)
    assert three.samples == 3 * one.samples == 24
    # The planner predicts a step of B = 64 over 2 replicas in 2 passes of 16 samples each.
    planner = CostModelPlanner(4, uniform(), hw, PlanSettings(
        batch_size=64, schedule="gpipe", initial_pipeline_length=2, accumulation_steps=2,
        memory_budget=1e12))
    first = planner.initial_plan()
    assert 16 % first.num_microbatches == 0
    assert planner.predict(first) == step_time(first, uniform(), hw, 16, passes=2)
    assert planner.predict(first).samples == 64
    with pytest.raises(ValueError, match="passes=0 must be at least 1"):
        step_time(plan, uniform(), hw, 4, passes=0)


@pytest.mark.timeout(30)
def test_control_state_sizes_plans_for_one_pass():
    # K = 2 of N = 2 (R = 1); B = 32 in 4 passes: either planner sizes a pass of 8 samples.
    for policy in ("paper", "cost"):
        cfg = build_config({
            "pipeline": {"num_workers": 2, "pipeline_length": 2, "policy": policy},
            "data": {"batch_size": 32}, "optimizer": {"accumulation_steps": 4}})
        state = build_control_state(run_settings(cfg).control, 4, 2, 10)
        state.submit_costs(0, uniform(4))
        state.submit_costs(1, uniform(4))
        assert state.planner.settings.accumulation_steps == 4
        assert state.planner.replica_batch(1) == 8
        assert 8 % state.plan_for(0).num_microbatches == 0


def test_replan_and_bad_initial_length():
    cost, _ = vit_planner()
    plan = cost.next_plan(cost.initial_plan(), 4)
    again = cost.replan(plan, 4)
    assert again.num_workers == 4 and again.num_frozen == 4
    assert again.generation == plan.generation + 1
    with pytest.raises(ValueError, match="choose one of"):
        vit_planner(initial_pipeline_length=3)


def test_1f1b_plans_never_have_fewer_microbatches_than_stages():
    hw = load_hardware("local-cpu")
    costs = analytic_costs(model_shape("vit_tiny_patch16_224", num_layers=6), hw)
    for schedule in ("1f1b", "gpipe"):
        planner = CostModelPlanner(4, costs, hw, PlanSettings(
            batch_size=16, schedule=schedule, initial_pipeline_length=4, memory_budget=1e12),
            cache=CachePolicy("on"))
        plan = planner.initial_plan()
        for n in range(1, 6):
            plan = planner.next_plan(plan, n)
            if schedule == "1f1b" and plan.pipeline_length > 1:
                assert plan.num_microbatches >= plan.pipeline_length
    # A replica batch too small to fill the stages is refused with the fix named.
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages.*schedule=gpipe"):
        CostModelPlanner(4, costs, hw, PlanSettings(batch_size=2, schedule="1f1b",
                                                    initial_pipeline_length=4))
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        PaperPlanner(4, costs, PlanSettings(batch_size=2, schedule="1f1b")).initial_plan()


# -- activation checkpointing -----------------------------------------------------------------


def test_recompute_adds_one_forward_to_each_block_backward_only():
    table = CostTable(LayerCost(0.5, 1.0, 10, 5), (LayerCost(1.0, 2.0, 10, 5),) * 2,
                      LayerCost(0.25, 0.5, 3, 1))
    ckpt = table.with_recompute()
    assert [b.backward_s for b in ckpt.blocks] == [3.0, 3.0] and ckpt.recompute
    assert (ckpt.embed, ckpt.head) == (table.embed, table.head)  # never checkpointed
    assert [b.forward_s for b in ckpt.blocks] == [1.0, 1.0]
    assert ckpt.with_recompute() is ckpt  # applying it twice changes nothing


def test_checkpointing_lowers_the_memory_estimate_and_raises_the_step_time():
    # K = 2 over 4 uniform blocks, GPipe, M = 4 micro-batches of 2 samples; 24 outputs' worth
    # of activations a block, 100 bytes an output, 1000 parameter bytes (x4 with AdamW).
    planners = {
        on: CostModelPlanner(2, uniform(4), IDEAL, PlanSettings(
            batch_size=8, schedule="gpipe", initial_pipeline_length=2, num_microbatches=4,
            memory_budget=1e12, activation_checkpointing=on), activation_memory_factor=24.0)
        for on in (False, True)}
    plans = {on: p.initial_plan() for on, p in planners.items()}
    assert plans[True].activation_checkpointing and not plans[False].activation_checkpointing
    assert plans[True].boundaries == plans[False].boundaries == (0, 2, 4)
    # Without: each block keeps 4 micro-batches x 2 samples x 24 x 100 bytes. With: its input
    # (4 x 2 x 100), plus one block's 24 x 100 bytes of one micro-batch while recomputed.
    # Stage 0 also holds the embedding's 19200 activation bytes, stage 1 the head's 800.
    assert planners[False].stage_memory(plans[False]) == [2 * (4000 + 19200) + 19200,
                                                          2 * (4000 + 19200) + 800]
    assert planners[True].stage_memory(plans[True]) == [2 * (4000 + 800) + 4800 + 19200,
                                                        2 * (4000 + 800) + 4800 + 800]
    # Per micro-batch (2 samples; the table's times are per sample) a stage of 2 blocks runs
    # forward 4 and backward 8, 12 with the recompute; GPipe's makespan is M + K - 1 of those.
    assert planners[False].predict(plans[False]).step_s == pytest.approx(5 * (4 + 8))
    assert planners[True].predict(plans[True]).step_s == pytest.approx(5 * (4 + 12))
    # step_time takes the recompute from the plan itself, whatever table it is given.
    assert step_time(plans[True], uniform(4), IDEAL, 8).step_s == pytest.approx(5 * (4 + 12))


def test_checkpointing_reaches_both_planners_from_the_config():
    for policy in ("paper", "cost"):
        cfg = build_config({"pipeline": {"num_workers": 2, "pipeline_length": 2,
                                         "policy": policy, "activation_checkpointing": True}})
        state = build_control_state(run_settings(cfg).control, 4, 2, 10)
        state.submit_costs(0, uniform(4))
        state.submit_costs(1, uniform(4))
        assert state.planner.costs.recompute
        plan = state.plan_for(0)
        assert plan.activation_checkpointing and plan.describe().endswith(", checkpointed")


def test_measured_saved_bytes_replace_the_factor_in_the_memory_estimate():
    # The same table as above, but each layer says what it keeps for backward per sample:
    # 700 bytes a block, 300 the embedding, 50 the head (the factor no longer applies).
    measured = uniform(4)
    measured = replace(
        measured, embed=replace(measured.embed, saved_bytes=300.0),
        blocks=tuple(replace(b, saved_bytes=700.0) for b in measured.blocks),
        head=replace(measured.head, saved_bytes=50.0))
    planners = {
        on: CostModelPlanner(2, measured, IDEAL, PlanSettings(
            batch_size=8, schedule="gpipe", initial_pipeline_length=2, num_microbatches=4,
            memory_budget=1e12, activation_checkpointing=on), activation_memory_factor=24.0)
        for on in (False, True)}
    plans = {on: p.initial_plan() for on, p in planners.items()}
    # 8 samples in flight per stage (GPipe, 4 micro-batches of 2).
    assert planners[False].stage_memory(plans[False]) == [2 * (4000 + 8 * 700) + 8 * 300,
                                                          2 * (4000 + 8 * 700) + 8 * 50]
    # Checkpointed: each block keeps its input (100 bytes an output), plus one block's saved
    # bytes for one micro-batch of 2 while it recomputes.
    assert planners[True].stage_memory(plans[True]) == [2 * (4000 + 800) + 1400 + 8 * 300,
                                                        2 * (4000 + 800) + 1400 + 8 * 50]
