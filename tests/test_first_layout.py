"""The first plan when the cost model cannot tell layouts apart: each layer's fixed time per
micro-batch (profiled twice), the close layouts the planner lists, and the controller's choice
from what the workers measured."""

from dataclasses import replace

import pytest

from pt_ray.control.state import build_control_state
from pt_ray.core.config import build_config
from pt_ray.core.plan import CostTable, LayerCost, Plan, PlanSettings
from pt_ray.costs.costmodel import step_time
from pt_ray.costs.costplan import CostModelPlanner, close_first_layouts
from pt_ray.runtime.profile import _with_fixed_parts
from pt_ray.service.settings import run_settings
from test_costmodel import IDEAL  # only compute costs: free, instant links, no overheads

pytestmark = pytest.mark.unit


def table(fwd: float, bwd: float, samples: int, blocks: int = 4, embed_bwd: float = 0.0,
          params: float = 0.0) -> CostTable:
    free = LayerCost(0.0, 0.0, 10.0, 0.0)
    embed = LayerCost(0.0, embed_bwd, 10.0, 0.0)
    return CostTable(embed, tuple(LayerCost(fwd, bwd, 10.0, params) for _ in range(blocks)),
                     free, samples=samples)


def test_fixed_parts_come_from_the_two_profiles_through_both_points():
    # 16 samples: 10 ms forward; 2 samples: 3 ms -> t(b) = 2 ms + 0.5 ms x b.
    full, small = table(0.010, 0.020, 16), table(0.003, 0.020, 2)
    made = _with_fixed_parts(full, small)
    block = made.blocks[0]
    assert block.forward_fixed_s == pytest.approx(0.002)
    # A backward that costs the same at 2 samples as at 16 is all fixed.
    assert block.backward_fixed_s == pytest.approx(0.020)
    assert block.forward_at(2 / 16) == pytest.approx(0.003)
    assert block.forward_at(1.0) == pytest.approx(0.010)
    assert block.backward_at(1 / 16) == pytest.approx(0.020)


def test_noise_never_makes_a_fixed_part_negative_or_larger_than_a_measurement():
    # The small batch measured faster per sample than the large one: no fixed part.
    assert _with_fixed_parts(table(0.010, 0.02, 16), table(0.001, 0.001, 2)).blocks[0] \
        .forward_fixed_s == 0.0
    # The small batch measured slower than the large one: capped at the large one's time.
    assert _with_fixed_parts(table(0.010, 0.02, 16), table(0.030, 0.03, 2)).blocks[0] \
        .forward_fixed_s == pytest.approx(0.010)


def test_a_fixed_part_makes_many_small_microbatches_cost_what_they_do():
    plan = Plan(0, 4, 0, 2, 1, (0, 2, 4), 16, "gpipe", False)
    linear = table(0.016, 0.032, 16)
    fixed = replace(linear, blocks=tuple(replace(b, forward_fixed_s=0.008, backward_fixed_s=0.016)
                                         for b in linear.blocks))
    # Micro-batches of 2 samples: linear scaling gives 2 ms + 4 ms per block, the fixed part
    # 8 + 1 ms and 16 + 2 ms: 4.5x the work per micro-batch and stage.
    lin = step_time(plan, linear, IDEAL, 32, optimizer_traffic=0.0)
    fix = step_time(plan, fixed, IDEAL, 32, optimizer_traffic=0.0)
    assert lin.pipeline_s == pytest.approx((16 + 1) * 2 * (0.002 + 0.004))
    assert fix.pipeline_s == pytest.approx((16 + 1) * 2 * (0.009 + 0.018))


def test_a_dense_embedding_gradient_turns_the_first_plan_from_a_pipeline_to_replicas():
    # A 32-sample batch on 2 workers. Blocks in proportion to their samples; a reduce of
    # large gradients makes K = 1 pay, and an embedding backward of 20 ms whatever the
    # micro-batch makes every extra micro-batch of a pipeline pay it again.
    hw = replace(IDEAL, intra_node_bandwidth=1e9)
    linear = table(0.016, 0.032, 16, embed_bwd=0.020, params=2e7)
    fixed = replace(linear, embed=replace(linear.embed, backward_fixed_s=0.020))
    settings = PlanSettings(batch_size=32)
    assert CostModelPlanner(2, linear, hw, settings).initial_plan().pipeline_length == 2
    assert CostModelPlanner(2, fixed, hw, settings).initial_plan().pipeline_length == 1


def test_close_first_layouts_are_listed_fastest_first_and_numbered():
    costs = table(0.016, 0.032, 16, params=2e6)
    hw = replace(IDEAL, intra_node_bandwidth=1e9)
    planner = CostModelPlanner(2, costs, hw, PlanSettings(batch_size=32))
    rates = {k: planner.predict(planner._best(0, k, False)).throughput for k in (1, 2)}
    gap = max(rates.values()) / min(rates.values()) - 1
    trials = close_first_layouts(planner, gap + 0.01)
    assert [t.plan.generation for t in trials] == [0, 1]
    assert [t.predicted_rate for t in trials] == sorted(rates.values(), reverse=True)
    assert trials[0].plan == replace(planner.initial_plan(), generation=0)
    assert close_first_layouts(planner, gap * 0.99) == ()  # one layout stands alone
    assert close_first_layouts(planner, 0.0) == ()
    pinned = CostModelPlanner(2, costs, hw, PlanSettings(batch_size=32,
                                                         initial_pipeline_length=2))
    assert close_first_layouts(pinned, 10.0) == ()


def _state(margin: float):
    cfg = build_config({"freeze": {"policy": "schedule", "alpha": 0.5},
                        "pipeline": {"start_trial_margin": margin, "hardware": "local-cpu"},
                        "data": {"batch_size": 32}})
    return build_control_state(run_settings(cfg).control, 4, 2, 10)


def test_the_controller_starts_on_the_layout_the_workers_measured_fastest():
    state = _state(margin=100.0)  # every pipeline length is close enough to be timed
    costs = table(0.016, 0.032, 16, params=2e6)
    state.submit_costs(0, costs)
    assert state.trial_plans() is None  # not before every rank's costs
    state.submit_costs(1, costs)
    plans = state.trial_plans()
    assert [p.generation for p in plans] == [0, 1]
    assert state.plan_for(0) is None  # waits for the measurement
    # The layout the model ranked second measured 3x faster: it is the first plan, as the
    # generation after the trials' (every rank migrates to it from the last one timed).
    slow, fast = 0.9, 0.3
    state.submit_trial([slow, fast])
    first = state.plan_for(0)
    assert first == replace(plans[1], generation=2)
    assert [m["pass_s"] for m in state.start_trials] == [slow, fast]
    assert state.start_trials[1]["measured_rate"] > state.start_trials[0]["measured_rate"]
    assert state.trial_plans() == ()  # chosen: a restarted worker times nothing
    state.submit_trial([0.1, 5.0])  # and what it resubmits changes nothing
    assert state.plan_for(0) == first
    assert state.state_dict()["start_trials"] == state.start_trials


def test_one_standing_layout_is_planned_without_trials():
    state = _state(margin=0.0)
    for r in range(2):
        state.submit_costs(r, table(0.016, 0.032, 16, params=2e6))
    assert state.trial_plans() == ()
    assert state.plan_for(0) is not None and state.start_trials == []


def test_a_trial_with_the_wrong_number_of_timings_is_refused():
    state = _state(margin=100.0)
    for r in range(2):
        state.submit_costs(r, table(0.016, 0.032, 16, params=2e6))
    with pytest.raises(ValueError, match="1 timings for 2 trial layouts"):
        state.submit_trial([0.5])
