"""The probe freeze policy: what it asks the workers to test, when the held-out figures let
blocks freeze, and the probe split the sampler never draws."""

from __future__ import annotations

import numpy as np
import pytest

from pt_ray.control.state import build_control_state, decision_interval
from pt_ray.core.config import build_config
from pt_ray.core.freeze import (
    PROBE_NOW,
    PROBE_REVERTED,
    PROBE_START,
    ProbeFreeze,
    build_freeze_policy,
)
from pt_ray.core.plan import CostTable
from pt_ray.data.sampler import probe_indices, training_sampler

pytestmark = pytest.mark.unit


def probe(now: float, reverted: float, start: float) -> dict[int, float]:
    return {0: 1.0, PROBE_NOW: now, PROBE_REVERTED: reverted, PROBE_START: start}


def test_it_asks_for_alpha_of_the_active_blocks_from_the_decision_before_the_warmup_ends():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=2)
    assert p.decide(0, 0).probe == 0  # too early: a test now would end inside the warm-up
    first = p.decide(1, 0)
    assert (first.num_frozen, first.probe) == (0, 4)  # ceil(12 / 3)


def test_blocks_freeze_when_reverting_them_gives_back_little_of_the_interval_gain():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=1, threshold=0.1)
    assert p.decide(0, 0).probe == 4
    # The interval gained 0.5 on the probe; reverting blocks 0-3 gives back 0.04 (8%).
    d = p.decide(1, 0, probe(now=1.0, reverted=1.04, start=1.5))
    assert d.num_frozen == 4 and "frozen 0 -> 4" in d.reason
    assert d.probe == 3  # ceil(8 / 3) of the 8 still active


def test_a_failed_test_halves_the_next_one_and_a_pass_restores_alpha_s_step():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=1, threshold=0.1)
    p.decide(0, 0)
    # Reverting blocks 0-3 gives back 0.2 of a 0.5 gain (40%): nothing freezes, test 2 next.
    d = p.decide(1, 0, probe(now=1.0, reverted=1.2, start=1.5))
    assert (d.num_frozen, d.probe) == (0, 2)
    d = p.decide(2, 0, probe(now=0.9, reverted=0.95, start=1.0))  # 50%: test 1 next
    assert (d.num_frozen, d.probe) == (0, 1)
    d = p.decide(3, 0, probe(now=0.9, reverted=0.9005, start=0.95))  # 1%: block 0 freezes
    assert (d.num_frozen, d.probe) == (1, 4)  # and alpha's step again: ceil(11 / 3)


def test_on_a_plateau_reverting_must_cost_at_most_a_floor_of_the_loss():
    p = ProbeFreeze(num_layers=6, alpha=0.5, max_frozen=5, warmup=1, threshold=0.1, floor=0.01)
    p.decide(0, 0)
    # No gain at all: allowed is 0.1 * 0.01 * 2.0 = 0.002 of give-back.
    assert p.decide(1, 0, probe(now=2.0, reverted=2.001, start=1.99)).num_frozen == 3
    assert p.decide(2, 3, probe(now=2.0, reverted=2.01, start=1.99)).num_frozen == 3


def test_figures_from_another_prefix_or_none_at_all_freeze_nothing():
    p = ProbeFreeze(num_layers=6, alpha=0.5, max_frozen=5, warmup=1)
    p.decide(0, 0)
    assert p.decide(1, 0, {0: 1.0}).num_frozen == 0  # no probe figures
    # The test under way was of prefix 0; figures arriving at prefix 2 (a rollback) are stale.
    assert p.decide(2, 2, probe(now=1.0, reverted=1.0, start=2.0)).num_frozen == 2


def test_the_cap_bounds_the_test_and_the_state_survives_a_checkpoint():
    p = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=2, warmup=1)
    assert p.decide(0, 0).probe == 2
    d = p.decide(1, 0, probe(now=1.0, reverted=1.0, start=2.0))
    assert (d.num_frozen, d.probe) == (2, 0)  # at the cap: nothing left to test
    q = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=5, warmup=1)
    q.decide(0, 0)
    q.decide(1, 0, probe(now=1.0, reverted=1.5, start=2.0))
    copy = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=5, warmup=1)
    copy.load_state_dict(q.state_dict())
    assert (copy.asked, copy.span) == (q.asked, q.span) == ([0, 2], 2)  # 5 failed: test 2
    with pytest.raises(ValueError, match="freeze.probe_threshold=1.5"):
        build_freeze_policy("probe", num_layers=6, alpha=0.5, threshold=1.5)


def cfg(**freeze):
    return build_config({"freeze": {"policy": "probe", **freeze}, "epochs": 20,
                         "data": {"batch_size": 8}, "pipeline": {"start_trial_margin": 0}})


def test_the_probe_split_is_fixed_by_the_seed_and_never_drawn():
    c = cfg(probe_samples=50)
    held = probe_indices(c, 1000)
    assert len(held) == 50 and np.array_equal(held, probe_indices(c, 1000))
    sampler = training_sampler(c, 1000)
    assert sampler.num_samples == 950 and sampler.steps_per_epoch == 950 // 8
    for epoch in range(3):
        order = sampler.epoch_order(epoch)
        assert len(order) == 950 and not np.intersect1d(order, held).size
        assert np.array_equal(np.sort(order), np.setdiff1d(np.arange(1000), held))
    assert len(probe_indices(c, 200)) == 20  # at most a tenth of the split
    other = build_config({"freeze": {"policy": "settled"}})
    assert len(probe_indices(other, 1000)) == 0
    assert training_sampler(other, 1000).num_samples == 1000


def test_probe_decides_16_times_a_run_of_any_length():
    assert decision_interval(cfg(), 100) is None  # 20 epochs: one decision opens each
    short = build_config({"freeze": {"policy": "probe"}, "epochs": 4})
    assert decision_interval(short, 100) == 25  # 4 a epoch
    long_settled = build_config({"freeze": {"policy": "settled"}, "epochs": 10})
    long_probe = build_config({"freeze": {"policy": "probe"}, "epochs": 10})
    assert decision_interval(long_settled, 100) is None
    assert decision_interval(long_probe, 100) == 50  # ceil(16 / 10) = 2 a epoch


def test_the_controller_carries_each_test_in_the_plan_of_its_interval():
    c = cfg(warmup_epochs=1, alpha=0.5)
    state = build_control_state(c, 4, 2, 10)
    for r in range(2):
        state.submit_costs(r, CostTable.from_param_counts(1.0, [1.0] * 4, 1.0))
    assert state.plan_for(0).probe_blocks == 2  # the warm-up is one decision
    state.submit_norms(0, probe(now=1.0, reverted=1.01, start=1.5))
    assert (state.plan_for(1).num_frozen, state.plan_for(1).probe_blocks) == (2, 1)
    state.submit_norms(1, probe(now=1.0, reverted=1.3, start=1.5))
    assert (state.plan_for(2).num_frozen, state.plan_for(2).probe_blocks) == (2, 1)
    assert state.plan_for(2).generation == state.plan_for(1).generation  # no transition
