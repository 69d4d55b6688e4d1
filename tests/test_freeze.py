"""Freeze policies: the paper's table, the paper rule on given norms, monotonicity and caps."""

import pytest

from pt_ray.core.freeze import (
    LOSS_KEY,
    FreezeDecision,
    FreezeGuard,
    PaperFreeze,
    build_freeze_policy,
    frozen_timeline,
    schedule_frozen,
)

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


# -- converged: freeze only what has converged -------------------------------------------------


def _feed(policy, series):
    """Feed ``series[d]`` (norms gathered during interval d) to decisions 1.. and return the
    frozen count after each."""
    n, out = 0, []
    for d, norms in enumerate(series, start=1):
        n = policy.decide(d, n, norms).num_frozen
        out.append(n)
    return out


def test_converged_block_needs_its_norm_below_ratio_of_peak_for_window_decisions():
    policy = build_freeze_policy("converged", num_layers=4, alpha=1.0, warmup=0, ratio=0.25,
                                 window=2)
    # Block 0 rises to a peak of 4, then falls to 1.0 (= 0.25 of peak) and 0.5: it passes at
    # the second low decision, not the first. Block 1 stays at half its peak: never passes.
    policy.decide(0, 0, None)
    assert policy.decide(1, 0, {0: 2.0, 1: 2.0}).num_frozen == 0
    assert policy.decide(2, 0, {0: 4.0, 1: 2.0}).num_frozen == 0
    assert policy.decide(3, 0, {0: 1.0, 1: 1.0}).num_frozen == 0
    assert not policy.converged(1)
    d = policy.decide(4, 0, {0: 0.5, 1: 1.0})
    assert d.num_frozen == 1 and "blocks 0..0 converged" in d.reason
    assert policy.converged(0) and not policy.converged(1)


def test_converged_a_rebound_above_ratio_resets_the_window():
    policy = build_freeze_policy("converged", num_layers=3, alpha=1.0, warmup=0, ratio=0.25,
                                 window=2)
    # 10 -> 2 (low) -> 3 (above 0.25 of 10) -> 2 (low): only one low decision in a row.
    assert _feed(policy, [{0: 10.0}, {0: 2.0}, {0: 3.0}, {0: 2.0}]) == [0, 0, 0, 0]
    assert _feed(policy, [{0: 2.0}]) == [1]


def test_converged_prefix_stays_contiguous_when_a_deeper_block_converges_first():
    # The case that misleads the paper's rule: the deepest block's norm falls fastest.
    series = [{0: 3.0, 1: 2.0, 2: 1.0}, {0: 2.4, 1: 1.2, 2: 0.2}, {0: 2.0, 1: 0.4, 2: 0.1}]
    conv = build_freeze_policy("converged", num_layers=3, alpha=1.0, max_frozen=3, warmup=0,
                               ratio=0.25, window=2)
    paper = build_freeze_policy("paper", num_layers=3, alpha=1.0, max_frozen=3, warmup=0)
    assert _feed(conv, series) == [0, 0, 0]  # block 0 is still at 2/3 of its peak
    assert _feed(paper, series) == [0, 3, 3]  # block 2 "converged most": freeze all


def test_converged_freezes_at_most_alpha_of_the_active_blocks_per_decision():
    policy = build_freeze_policy("converged", num_layers=12, alpha=1 / 3, warmup=0, ratio=0.5,
                                 window=1)
    high = {b: 1.0 for b in range(12)}
    low = {b: 0.1 for b in range(12)}
    # Every block passes from decision 2 on; bounds 0 + 4, 4 + 3, 7 + 2, 9 + 1, cap 11.
    assert _feed(policy, [high, low, low, low, low, low, low]) == [0, 4, 7, 9, 10, 11, 11]


def test_converged_warmup_and_state_round_trip():
    policy = build_freeze_policy("converged", num_layers=2, alpha=1.0, warmup=3, ratio=0.5,
                                 window=1)
    assert _feed(policy, [{0: 1.0}, {0: 0.1}]) == [0, 0]  # decisions 1, 2 are in warm-up
    clone = build_freeze_policy("converged", num_layers=2, alpha=1.0, warmup=3, ratio=0.5,
                                window=1)
    clone.load_state_dict(policy.state_dict())
    assert clone.decide(3, 0, {0: 0.1}).num_frozen == policy.decide(3, 0, {0: 0.1}).num_frozen == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ratio": 1.0}, "freeze.converge_ratio=1.0"),
    ({"window": 0}, "freeze.converge_window=0"),
])
def test_converged_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_freeze_policy("converged", num_layers=4, alpha=0.5, **kwargs)


# -- the accuracy guard -------------------------------------------------------------------------


def test_guard_stops_freezing_after_a_drop_beyond_its_points():
    guard = FreezeGuard(points=1.0)
    # Epochs 0-2 at n=0 climbing; epoch 3 froze 2 blocks and fell 0.5 points: tolerated.
    for epoch, n, metric in [(0, 0, 0.80), (1, 0, 0.85), (2, 0, 0.90), (3, 2, 0.895)]:
        assert guard.observe(epoch, n, metric) is None
    # Epoch 4 froze 2 more and fell 1.5 points below epoch 3: stop.
    verdict = guard.observe(4, 4, 0.88)
    assert verdict is not None and guard.stopped
    assert (verdict.before, verdict.after, verdict.freeze_epoch, verdict.num_frozen) == (
        0.895, 0.88, 4, 2)
    assert not verdict.rollback
    held = guard.hold(FreezeDecision(6, 6, "policy wants more"), 4)
    assert held.num_frozen == 4 and "guard" in held.reason
    assert guard.hold(FreezeDecision(4, 4, "no change"), 4).num_frozen == 4
    # One verdict per run.
    assert guard.observe(5, 4, 0.5) is None


def test_guard_ignores_drops_without_a_freeze_and_unevaluated_epochs():
    guard = FreezeGuard(points=1.0, rollback=True)
    assert guard.observe(0, 0, 0.9) is None
    assert guard.observe(1, 0, 0.8) is None  # fell 10 points, but nothing froze
    assert guard.observe(2, 1, float("nan")) is None  # froze, not evaluated
    assert guard.observe(3, 3, float("nan")) is None
    verdict = guard.observe(4, 3, 0.7)  # first evaluation after the freezes of epochs 2 and 3
    assert verdict.freeze_epoch == 2 and verdict.num_frozen == 0 and verdict.rollback
    off = FreezeGuard(points=None)
    assert off.observe(0, 0, 0.9) is None and off.observe(1, 5, 0.1) is None


def test_guard_state_round_trips():
    guard = FreezeGuard(points=0.5, rollback=True)
    guard.observe(0, 0, 0.9)
    guard.observe(1, 1, 0.8)
    clone = FreezeGuard(points=0.5, rollback=True)
    clone.load_state_dict(guard.state_dict())
    assert clone.epochs == guard.epochs and clone.verdict == guard.verdict and clone.stopped


# -- settled: converged, or settled once the loss has reached a plateau -------------------------


def _fine_tuning(losses, rises=None):
    """Norms of four blocks as a fine-tuned pretrained model shows them (rising for three
    decisions while the fresh head grows, then holding their level), with ``losses[d]`` as
    interval d's mean loss; ``rises`` maps a block to a factor its norm grows by per decision
    after that."""
    series = []
    for d, loss in enumerate(losses):
        level = [0.2, 0.6, 1.0][d] if d < 3 else 1.0
        norms = {b: level * (2.0 - 0.3 * b) * (1 + (rises or {}).get(b, 0.0)) ** max(d - 2, 0)
                 for b in range(4)}
        series.append({**norms, LOSS_KEY: loss})
    return series


def test_settled_freezes_nothing_while_the_loss_still_falls():
    # The norms hold their level from decision 3 on, but the loss falls 0.1 a decision (5% of
    # its first value): the run still learns, so nothing settles and nothing converged.
    policy = build_freeze_policy("settled", num_layers=4, alpha=1.0, warmup=0)
    losses = [2.0 - 0.1 * d for d in range(12)]
    assert _feed(policy, _fine_tuning(losses)) == [0] * 12
    assert not policy.plateaued()
    assert "neither converged nor settled" in policy.decide(13, 0, None).reason


def test_settled_freezes_the_leading_blocks_once_the_loss_reaches_a_plateau():
    # The same norms; the loss stops falling after decision 5 (it moves by 0.005, 0.25% of its
    # first value). Two decisions later both windows hold the flat loss: a plateau, and every
    # block has held its level, so the prefix grows by at most ceil(alpha x active) per decision.
    policy = build_freeze_policy("settled", num_layers=4, alpha=0.5, warmup=0, max_frozen=3)
    losses = [2.0, 1.6, 1.3, 1.1, 1.0, 0.9] + [0.9 - 0.005 * i for i in range(6)]
    frozen = _feed(policy, _fine_tuning(losses))
    assert frozen == [0] * 8 + [2, 3, 3, 3]
    assert policy.plateaued() and policy.settled(3)


def test_settled_stops_the_prefix_at_a_block_whose_norm_still_rises():
    # After the plateau block 1's norm grows 20% a decision (more than the 10% tolerance): block
    # 0 freezes, block 1 does not, and the prefix stays contiguous (blocks 2 and 3 wait).
    policy = build_freeze_policy("settled", num_layers=4, alpha=1.0, warmup=0, max_frozen=3)
    losses = [2.0, 1.6, 1.3, 1.1, 1.0, 0.9] + [0.9] * 6
    frozen = _feed(policy, _fine_tuning(losses, rises={1: 0.2}))
    assert frozen[-1] == 1 and not policy.settled(1) and policy.settled(2)


def test_settled_freezes_a_converged_block_before_any_plateau():
    # From scratch: block 0's norm falls to 0.2 of its peak while the loss still falls by a
    # third a decision. It passes the converged test; block 1 (at half its peak) does not.
    policy = build_freeze_policy("settled", num_layers=3, alpha=1.0, warmup=0, max_frozen=2)
    series = [{0: n0, 1: n1, 2: 1.0, LOSS_KEY: loss} for n0, n1, loss in
              [(1.0, 1.0, 2.3), (3.0, 2.0, 1.5), (0.6, 1.0, 1.0), (0.5, 1.0, 0.7)]]
    assert _feed(policy, series[:3]) == [0, 0, 0]
    d = policy.decide(4, 0, series[3])
    assert d.num_frozen == 1 and "(converged 1; loss 0.7, still falling)" in d.reason


def test_settled_memory_survives_a_checkpoint():
    policy = build_freeze_policy("settled", num_layers=4, alpha=0.5, warmup=0, max_frozen=3)
    losses = [2.0, 1.6, 1.3, 1.1, 1.0, 0.9] + [0.9] * 2
    series = _fine_tuning(losses)
    _feed(policy, series)
    clone = build_freeze_policy("settled", num_layers=4, alpha=0.5, warmup=0, max_frozen=3)
    clone.load_state_dict(policy.state_dict())
    assert clone.losses == policy.losses and clone.history == policy.history
    more = _fine_tuning(losses + [0.9] * 3)[len(losses):]
    n = 0
    for d, norms in enumerate(more, start=len(losses) + 1):
        a, b = policy.decide(d, n, norms), clone.decide(d, n, norms)
        assert a == b
        n = a.num_frozen
