"""Freeze policies: the paper's table, the paper rule on given norms, monotonicity and caps."""

import pytest

from pt_ray.freeze import PaperFreeze, build_freeze_policy, frozen_timeline, schedule_frozen

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("alpha", "expected"),
    [
        (1 / 5, [0, 3, 5, 6, 8, 9, 9, 10, 10, 11]),
        (1 / 4, [0, 3, 6, 7, 9, 10, 10, 11, 11, 12]),
        (1 / 3, [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]),
        (0.07, [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]),
    ],
)
def test_schedule_reproduces_paper_table_for_l12(alpha, expected):
    policy = build_freeze_policy("schedule", num_layers=12, alpha=alpha, max_frozen=12)
    assert frozen_timeline(policy, 10) == expected


def test_schedule_default_cap_keeps_one_block_training():
    policy = build_freeze_policy("schedule", num_layers=12, alpha=1 / 3)
    assert frozen_timeline(policy, 10) == [0, 4, 7, 9, 10, 11, 11, 11, 11, 11]


def test_schedule_uses_model_depth_not_twelve():
    policy = build_freeze_policy("schedule", num_layers=24, alpha=0.5, max_frozen=24)
    assert frozen_timeline(policy, 6) == [0, 12, 18, 21, 23, 24]
    assert schedule_frozen(3, 24, 0.5) == 21


def test_warmup_delays_freezing_and_never_decreases():
    policy = build_freeze_policy("schedule", num_layers=12, alpha=1 / 3, warmup=3)
    timeline = frozen_timeline(policy, 6)
    assert timeline[:3] == [0, 0, 0]
    assert timeline[3] == 9
    assert all(a <= b for a, b in zip(timeline, timeline[1:]))


def test_none_never_freezes():
    policy = build_freeze_policy("none", num_layers=6, alpha=1.0)
    assert frozen_timeline(policy, 5, [{i: 0.0 for i in range(6)}] * 5) == [0] * 5


def test_paper_rule_freezes_up_to_most_converged_block_under_bound():
    policy = build_freeze_policy("paper", num_layers=12, alpha=1 / 3)
    assert policy.decide(0, 0, None).num_frozen == 0
    # First norms only record a reference.
    first = {i: 10.0 for i in range(12)}
    assert policy.decide(1, 0, first).num_frozen == 0
    # Block 2 fell most relative to its history: freeze blocks 0..2.
    second = {i: 9.0 for i in range(12)} | {2: 1.0}
    d = policy.decide(2, 0, second)
    assert (d.num_frozen, d.bound) == (3, 4)
    # Block 10 converged most, but the bound is 3 + ceil((12 - 3) / 3) = 6.
    third = {i: 9.0 for i in range(3, 12)} | {10: 0.5}
    d = policy.decide(3, 3, third)
    assert (d.num_frozen, d.bound) == (6, 6)


def test_paper_rule_ignores_frozen_blocks_and_respects_cap():
    policy = PaperFreeze(num_layers=4, alpha=1.0, max_frozen=2, warmup=0)
    policy.decide(0, 0, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    # Block 0 has the smallest ratio but block 3 is the smallest among those still active.
    d = policy.decide(1, 1, {0: 0.01, 1: 1.0, 2: 1.0, 3: 0.1})
    assert d.num_frozen == 2  # wants 4, capped at max_frozen=2
    assert policy.decide(2, 2, {2: 5.0, 3: 5.0}).num_frozen == 2


def test_paper_state_round_trips():
    a = PaperFreeze(num_layers=4, alpha=0.5, max_frozen=3, warmup=0)
    a.decide(0, 0, {0: 2.0, 1: 4.0})
    b = PaperFreeze(num_layers=4, alpha=0.5, max_frozen=3, warmup=0)
    b.load_state_dict(a.state_dict())
    norms = {0: 1.0, 1: 1.0}
    assert b.decide(1, 0, norms) == a.decide(1, 0, norms)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_frozen=13"):
        build_freeze_policy("paper", num_layers=12, alpha=0.3, max_frozen=13)
    with pytest.raises(ValueError, match="alpha=1.5"):
        build_freeze_policy("paper", num_layers=12, alpha=1.5)
