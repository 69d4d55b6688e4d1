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
    ProbeFreeze,
    build_freeze_policy,
)
from pt_ray.core.plan import CostTable
from pt_ray.data.sampler import probe_indices, training_sampler
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit


def probe(now: float, reverted: float) -> dict[int, float]:
    return {0: 1.0, PROBE_NOW: now, PROBE_REVERTED: reverted}


def test_it_asks_for_alpha_of_the_active_blocks_from_the_decision_before_the_warmup_ends():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=2, decisions=16)
    assert p.decide(0, 0).probe == 0  # too early: a test now would end inside the warm-up
    first = p.decide(1, 0)
    assert (first.num_frozen, first.probe) == (0, 4)  # ceil(12 / 3)
    assert p.decide(15, 0).probe == 0  # a test from the last decision would end after the run


def test_blocks_freeze_after_passing_twice_what_they_would_still_be_worth():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=1, threshold=0.01,
                    decisions=11)
    assert p.decide(0, 0).probe == 4
    # Blocks 0-3 were worth 0.0005 of probe loss this interval; over the 10 decisions left,
    # 0.005 <= 0.01 x 1.0: a pass, but the first; the same blocks are tested again.
    d = p.decide(1, 0, probe(now=1.0, reverted=1.0005))
    assert (d.num_frozen, d.probe) == (0, 4) and "passed 1 of 2" in d.reason
    d = p.decide(2, 0, probe(now=1.0, reverted=1.0009))  # 0.0009 x 9 <= 0.01: frozen
    assert d.num_frozen == 4 and "frozen 0 -> 4" in d.reason
    assert d.probe == 3  # ceil(8 / 3) of the 8 still active


def test_a_failed_test_halves_the_next_one_and_resets_the_passes():
    p = ProbeFreeze(num_layers=12, alpha=1 / 3, max_frozen=11, warmup=1, threshold=0.01,
                    decisions=21)
    p.decide(0, 0)
    d = p.decide(1, 0, probe(now=1.0, reverted=1.0001))  # 0.0001 x 20: a first pass
    assert (d.num_frozen, d.probe, p.passes) == (0, 4, 1)
    d = p.decide(2, 0, probe(now=1.0, reverted=1.02))  # 0.02 x 19 > 0.01: test 2 next
    assert (d.num_frozen, d.probe, p.passes) == (0, 2, 0)
    d = p.decide(3, 0, probe(now=1.0, reverted=1.01))  # fails again: test 1 next
    assert (d.num_frozen, d.probe) == (0, 1)
    # Updates that made the probe worse count as worth nothing: two such passes freeze.
    p.decide(4, 0, probe(now=1.0, reverted=0.99))
    d = p.decide(5, 0, probe(now=1.0, reverted=0.999))
    assert (d.num_frozen, d.probe) == (1, 4)  # and alpha's step again: ceil(11 / 3)


def test_figures_from_another_prefix_or_none_at_all_freeze_nothing():
    p = ProbeFreeze(num_layers=6, alpha=0.5, max_frozen=5, warmup=1, window=1)
    p.decide(0, 0)
    assert p.decide(1, 0, {0: 1.0}).num_frozen == 0  # no probe figures
    # The test under way was of prefix 0; figures arriving at prefix 2 (a rollback) are stale.
    assert p.decide(2, 2, probe(now=1.0, reverted=1.0)).num_frozen == 2


def test_the_cap_bounds_the_test_and_the_state_survives_a_checkpoint():
    p = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=2, warmup=1, window=1)
    assert p.decide(0, 0).probe == 2
    d = p.decide(1, 0, probe(now=1.0, reverted=1.0))
    assert (d.num_frozen, d.probe) == (2, 0)  # at the cap: nothing left to test
    q = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=5, warmup=1)
    q.decide(0, 0)
    q.decide(1, 0, probe(now=1.0, reverted=1.0))  # a first pass of blocks 0-4
    copy = ProbeFreeze(num_layers=6, alpha=1.0, max_frozen=5, warmup=1)
    copy.load_state_dict(q.state_dict())
    assert (copy.asked, copy.span, copy.passes) == (q.asked, q.span, q.passes) == ([0, 5], 5, 1)
    with pytest.raises(ValueError, match="freeze.probe_threshold=1.5"):
        build_freeze_policy("probe", num_layers=6, alpha=0.5, threshold=1.5)


def cfg(**freeze):
    return build_config({"freeze": {"policy": "probe", **freeze}, "epochs": 20,
                         "data": {"batch_size": 8}, "pipeline": {"start_trial_margin": 0}})


def test_the_probe_split_is_fixed_by_the_seed_and_never_drawn():
    c = cfg(probe_samples=50)
    held = probe_indices(c.freeze, c.seed, 1000)
    assert len(held) == 50 and np.array_equal(held, probe_indices(c.freeze, c.seed, 1000))
    sampler = training_sampler(c.freeze, c.data.batch_size, c.seed, 1000)
    assert sampler.num_samples == 950 and sampler.steps_per_epoch == 950 // 8
    for epoch in range(3):
        order = sampler.epoch_order(epoch)
        assert len(order) == 950 and not np.intersect1d(order, held).size
        assert np.array_equal(np.sort(order), np.setdiff1d(np.arange(1000), held))
    assert len(probe_indices(c.freeze, c.seed, 200)) == 20  # at most a tenth of the split
    other = build_config({"freeze": {"policy": "settled"}})
    assert len(probe_indices(other.freeze, other.seed, 1000)) == 0
    sampler = training_sampler(other.freeze, other.data.batch_size, other.seed, 1000)
    assert sampler.num_samples == 1000


def test_probe_decides_16_times_a_run_of_any_length():
    # 20 epochs: one decision opens each
    assert decision_interval(run_settings(cfg()).control.decisions, 100) is None
    short = build_config({"freeze": {"policy": "probe"}, "epochs": 4})
    assert decision_interval(run_settings(short).control.decisions, 100) == 25  # 4 a epoch
    long_settled = build_config({"freeze": {"policy": "settled"}, "epochs": 10})
    long_probe = build_config({"freeze": {"policy": "probe"}, "epochs": 10})
    assert decision_interval(run_settings(long_settled).control.decisions, 100) is None
    # ceil(16 / 10) = 2 a epoch
    assert decision_interval(run_settings(long_probe).control.decisions, 100) == 50


def test_the_controller_carries_each_test_in_the_plan_of_its_interval():
    c = cfg(warmup_epochs=1, alpha=0.5)
    state = build_control_state(run_settings(c).control, 4, 2, 10)
    for r in range(2):
        state.submit_costs(r, CostTable.from_param_counts(1.0, [1.0] * 4, 1.0))
    assert state.plan_for(0).probe_blocks == 2  # the warm-up is one decision
    for d in range(2):  # two passes of blocks 0-1 (worth nothing at all)
        state.submit_norms(d, probe(now=1.0, reverted=1.0))
    assert (state.plan_for(2).num_frozen, state.plan_for(2).probe_blocks) == (2, 1)
    state.submit_norms(2, probe(now=1.0, reverted=1.3))  # block 2 still worth a lot
    assert (state.plan_for(3).num_frozen, state.plan_for(3).probe_blocks) == (2, 1)
    assert state.plan_for(3).generation == state.plan_for(2).generation  # no transition
