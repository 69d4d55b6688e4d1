"""Replaying a recorded timeline with the cost model (pt_ray.costs.replay): the plans a timeline
records, their predicted epochs, the overhead's calibration and the report cadence."""

from dataclasses import replace

import pytest

from pt_ray.core.plan import CostTable, LayerCost, PlanSettings
from pt_ray.costs.costmodel import load_hardware, step_time, transition_time
from pt_ray.costs.costplan import CostModelPlanner
from pt_ray.costs.replay import epoch_ends, eval_time, recorded_plan, replay_epochs, solve_overhead

pytestmark = pytest.mark.unit


def costs(samples: int = 8) -> CostTable:
    layer = lambda f, act, par: LayerCost(f, 2 * f, act, par)  # noqa: E731
    return CostTable(layer(1e-3, 100.0, 1e4), tuple(layer(i * 1e-3, 100.0, 1e5)
                                                    for i in (1, 2, 3, 4)),
                     layer(5e-4, 10.0, 1e3), samples=samples)


def test_a_recorded_plan_is_cut_as_the_cost_planner_cuts_it():
    hw = load_hardware("local-cpu")
    planner = CostModelPlanner(2, costs(), hw, PlanSettings(
        batch_size=16, initial_pipeline_length=2, num_microbatches=2, memory_budget=1e12))
    for n, cache in ((0, False), (1, False), (1, True), (2, True)):
        got = recorded_plan(costs(), hw, n, 2, 1, 2, "1f1b", cache)
        want = planner._layout(n, 2, 2, cache, planner._partition(n, 2, cache))
        assert got == want


def test_each_recorded_epoch_is_predicted_from_its_own_plan():
    hw = load_hardware("local-cpu")
    table = costs()
    timeline = [dict(num_frozen=0, pipeline_length=2, num_replicas=1, num_microbatches=2),
                dict(num_frozen=0, pipeline_length=2, num_replicas=1, num_microbatches=2),
                dict(num_frozen=2, pipeline_length=1, num_replicas=2, num_microbatches=1)]
    epochs = replay_epochs(timeline, {8: table}, hw, batch_size=16, num_train=100,
                           eval_shards=lambda r: [[5, 5]] * r)
    first, same, moved = epochs
    assert [e.steps for e in epochs] == [100 // 16] * 3
    assert first.step_s == step_time(first.plan, table, hw, 16).step_s
    assert moved.step_s == step_time(moved.plan, table, hw, 8).step_s
    assert first.epoch_s == pytest.approx(6 * first.step_s)
    # A transition only where the plan changed.
    assert first.transition_s == same.transition_s == 0.0
    assert moved.transition_s == transition_time(same.plan, moved.plan, table, hw) > 0
    assert moved.eval_s == eval_time(moved.plan, table, hw, [[5, 5], [5, 5]]) > 0


def test_eval_time_of_one_stage_is_its_forward_per_sample_plus_the_overhead_per_batch():
    hw = replace(load_hardware("local-cpu"), per_microbatch_overhead_s=0.01)
    table = costs()
    plan = recorded_plan(table, hw, 0, 1, 1, 1)
    forward = (1e-3 + 1e-3 + 2e-3 + 3e-3 + 4e-3 + 5e-4) / 8  # per sample, the whole model
    assert eval_time(plan, table, hw, [[8, 4]]) == pytest.approx(12 * forward + 2 * 0.01)


def test_the_overhead_is_solved_so_the_prediction_meets_the_measurement():
    assert solve_overhead(lambda o: 2.0 + 10 * o, 3.0) == pytest.approx(0.1)
    assert solve_overhead(lambda o: 2.0 + 10 * o, 30.0) == pytest.approx(2.8)  # past hi=0.1
    assert solve_overhead(lambda o: 2.0 + 10 * o, 1.0) == 0.0  # o = 0 already predicts more


def test_reports_taken_at_every_poll_hold_fast_epochs_back():
    works = [0.5, 0.5, 0.5, 0.5]
    # Without polls an epoch follows the previous one's report at once.
    assert epoch_ends(works, 0.1, 0.0) == pytest.approx(3 * (0.5 + 0.1))
    # Polls more often than epochs end cost nothing.
    assert epoch_ends(works, 0.1, 0.5) == pytest.approx(3 * (0.5 + 0.1))
    # Polls slower than the epochs: once the one-slot queue is full, one epoch passes per poll.
    more = [0.5] * 6
    assert epoch_ends(more, 0.1, 2.0) - epoch_ends(works, 0.1, 2.0) == pytest.approx(2 * 2.0)
    assert epoch_ends(works[:1], 0.1, 2.0) == 0.0
