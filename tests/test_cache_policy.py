"""When the activation cache turns on: the one policy (pt_ray/cache/policy.py) from the config
and the dataset, its choices at each frozen depth, and the planners and the simulator that ask it
rather than deciding themselves."""

from __future__ import annotations

import pytest

from pt_ray.cache.policy import CachePolicy, cache_policy, may_turn_on
from pt_ray.control.state import build_control_state
from pt_ray.core.config import ConfigError, build_config, load_config
from pt_ray.core.plan import CostTable, LayerCost, PaperPlanner, PlanSettings
from pt_ray.costs.costmodel import CacheLayout, cache_read_factor
from pt_ray.costs.costplan import CostModelPlanner, cache_break_even
from pt_ray.costs.hwprofile import load_hardware
from pt_ray.costs.simulate import build_planner
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit


def cfg(**sections):
    base = {"freeze": {"policy": "schedule"}}
    base.update(sections)
    return build_config(base)


def sections(c):
    """The sections the cache's policy reads: ``cache`` and ``freeze``."""
    return c.cache, c.freeze


# -- when the cache may turn on -----------------------------------------------------------------


def test_cache_policy_modes_and_reasons():
    on = cache_policy(*sections(cfg(cache={"mode": "on"})), deterministic_transform=True)
    assert on.mode == "on" and on.describe() == (
        "activation cache on: cache.mode=on: on whenever a block is frozen")
    assert cache_policy(*sections(cfg(cache={"mode": "off"})), True).describe() == (
        "activation cache off: cache.mode=off")
    never = cache_policy(*sections(cfg(freeze={"policy": "none"})), True)
    assert never.mode == "off" and "nothing ever freezes" in never.reason
    random = cache_policy(*sections(cfg()), deterministic_transform=False)
    assert random.mode == "off" and "cache.allow_random_transform=true" in random.reason
    opted = cache_policy(*sections(cfg(cache={"allow_random_transform": True})), False)
    assert opted.mode == "auto" and "allow_random" in opted.reason
    # The library default leaves the cache to the planner, plan by plan, in the plain order.
    assert cache_policy(*sections(build_config({})), True).describe() == (
        "activation cache auto: cache.mode=auto: on in the plans where the planner predicts "
        "a gain")


def test_cache_config_reads_yaml_on_off_and_rejects_bad_values():
    # YAML reads a bare on/off as a boolean: `pt-ray train --set cache.mode=on` must still work.
    assert load_config(None, ["cache.mode=on"]).cache.mode == "on"
    assert load_config(None, ["cache.mode=off"]).cache.mode == "off"
    with pytest.raises(ConfigError, match="cache.mode='sometimes'"):
        load_config(None, ["cache.mode=sometimes"])
    with pytest.raises(ConfigError, match="cache.block_size"):
        load_config(None, ["cache.block_size=0"])


def test_augmented_data_keeps_the_cache_off_and_the_log_says_why(caplog):
    c = cfg(data={"name": "synthetic_image", "num_samples": 64, "augment": True},
            pipeline={"policy": "paper"}, cache={"mode": "on"})
    caplog.set_level("INFO", logger="pt_ray.control.state")
    state = build_control_state(run_settings(c).control, 4, 2, 2, deterministic_transform=False)
    assert "training transform is random" in caplog.text
    for r in range(2):
        state.submit_costs(r, CostTable.from_param_counts(1.0, [1.0] * 4, 1.0))
    plan = state.planner.next_plan(state.plan_for(0), 2)
    assert not plan.cache


def costs(act_bytes, block_s=1e-3, n=6):
    return CostTable(LayerCost(block_s, 2 * block_s, act_bytes, 1.0),
                     tuple(LayerCost(block_s, 2 * block_s, act_bytes, 1.0) for _ in range(n)),
                     LayerCost(block_s, 2 * block_s, 8.0, 1.0))


def test_break_even_and_the_paper_planner_threshold():
    hw = load_hardware("local-cpu")  # 2 GB/s cache reads
    # A read of 5 MB takes 2.5 ms: beats the prefix from 2 frozen blocks (embed + 2 x 1 ms).
    assert cache_break_even(costs(5e6), hw) == 2
    assert cache_break_even(costs(1e12), hw) is None
    rule = CachePolicy("auto", min_frozen=2).for_rules(lambda: None)
    planner = PaperPlanner(2, costs(5e6), PlanSettings(batch_size=8), cache=rule)
    plan = planner.initial_plan()
    assert not plan.cache
    one = planner.next_plan(plan, 1)
    assert not one.cache and planner.next_plan(one, 3).cache
    assert planner.cache_reason(planner.next_plan(one, 3)) == (
        "cache on at 3 frozen blocks: pipeline.policy=paper, on from 2 frozen blocks")
    with pytest.raises(ValueError, match="min_frozen=0"):
        CachePolicy("auto", min_frozen=0)


def test_paper_policy_modes_reach_the_plans():
    def plans(**cache):
        c = cfg(pipeline={"policy": "paper"}, cache=cache)
        # 4 steps of 64: a cache of 256 rows of 5 MB
        state = build_control_state(run_settings(c).control, 6, 2, 4)
        for r in range(2):
            state.submit_costs(r, costs(5e6))
        p0 = state.plan_for(0)
        return [state.planner.next_plan(p0, n).cache for n in (1, 2, 4)]

    # the break-even: 2 frozen blocks, where the 1.28 GB cache fits a worker's 2 GiB memo
    memo = 2**31
    assert plans(mode="auto", worker_memo_bytes=memo) == [False, True, True]
    assert plans(mode="on") == [True, True, True]
    assert plans(mode="off") == [False, False, False]
    assert plans(mode="auto", min_frozen=4, worker_memo_bytes=memo) == [False, False, True]
    # With a 256 MiB memo a pass of 32 rows reads its 4 blocks of 64 whole, mostly from the
    # store: 7.3 times the bytes, which never beats the forward.
    assert plans(mode="auto", worker_memo_bytes=256 * 2**20) == [False, False, False]
    # Unresolved (no Ray: the in-process store's memo holds its arrays), the memo has no cap.
    assert plans(mode="auto") == [False, True, True]


def test_cache_read_factor_counts_whole_blocks_past_the_memo():
    c = costs(1e3)  # rows of 1 kB; 1000 samples in 100 blocks of 10: a 1 MB cache
    assert cache_read_factor(c, 2, 16, None) == 1.0
    assert cache_read_factor(c, 2, 16, CacheLayout(1000, 10, None)) == 1.0
    assert cache_read_factor(c, 2, 16, CacheLayout(1000, 10, 1e6)) == 1.0  # fits: 1x
    touched = 100 * (1 - 0.99**16)                      # 14.85 distinct blocks per 16 rows
    assert CacheLayout(1000, 10, 0).blocks_touched(16) == pytest.approx(touched)
    assert cache_read_factor(c, 2, 16, CacheLayout(1000, 10, 0)) == pytest.approx(
        1 + touched * 10 / 16)                          # every block read whole: 10.3x
    assert cache_read_factor(c, 2, 16, CacheLayout(1000, 10, 5e5)) == pytest.approx(
        1 + touched * 0.5 * 10 / 16)                    # the memo holds half of them


def test_cost_planner_keeps_the_cache_off_where_whole_block_reads_cost_more_and_says_so():
    hw = load_hardware("local-cpu")
    c = costs(5e5)  # a 0.25 ms read per row against 3 ms of prefix at 2 frozen blocks
    fits = CostModelPlanner(2, c, hw, PlanSettings(batch_size=8),
                            cache_layout=CacheLayout(1000, 64, 2**30))
    tight = CostModelPlanner(2, c, hw, PlanSettings(batch_size=8),
                             cache_layout=CacheLayout(1000, 64, 2**20))
    on = fits.next_plan(fits.initial_plan(), 2)
    off = tight.next_plan(tight.initial_plan(), 2)
    assert on.cache and not off.cache
    assert fits.cache_reason(on).startswith("cache on at 2 frozen blocks: predicted ")
    assert "; the whole cache (476.8 MiB) fits a worker's memo (1024 MiB)" in fits.cache_reason(on)
    reason = tight.cache_reason(off)
    assert reason.startswith("cache off at 2 frozen blocks: predicted ")
    assert "the cache (476.8 MiB) outgrows a worker's memo (1 MiB, cache.worker_memo_bytes)" \
        in reason and "blocks whole" in reason
    # Without a layout (reads of the rows alone) the same costs cache.
    assert CostModelPlanner(2, c, hw, PlanSettings(batch_size=8)).next_plan(on, 3).cache


def test_each_new_plan_logs_why_the_cache_is_on_or_off(caplog):
    caplog.set_level("INFO", logger="pt_ray.control.state")
    c = cfg(freeze={"policy": "schedule", "alpha": 0.5, "warmup_epochs": 1},
            cache={"worker_memo_bytes": 2**30}, pipeline={"start_trial_margin": 0})
    state = build_control_state(run_settings(c).control, 6, 2, 4)
    for r in range(2):
        state.submit_costs(r, costs(5e5))
    state.submit_norms(0, {b: 1.0 for b in range(6)})
    assert state.plan_for(1).num_frozen > 0 and state.plan_for(1).cache
    lines = [r.getMessage() for r in caplog.records if "frozen blocks: " in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("epoch 1: cache on at ")


def test_cost_planner_min_frozen_floor():
    hw = load_hardware("local-cpu")
    c = costs(8.0)  # reads nearly free: auto would cache from the first frozen block
    free = CostModelPlanner(2, c, hw, PlanSettings(batch_size=8), cache=CachePolicy("auto"))
    floor = CostModelPlanner(2, c, hw, PlanSettings(batch_size=8),
                             cache=CachePolicy("auto", min_frozen=3))
    p0 = free.initial_plan()
    assert free.next_plan(p0, 1).cache
    assert not floor.next_plan(p0, 2).cache and floor.next_plan(p0, 3).cache


def test_the_choices_each_depth_leaves_a_planner():
    # mode, min_frozen, predicted -> the choices at 0..4 frozen blocks
    table = {
        ("off", None, True): [(False,)] * 5,
        ("on", None, True): [(False,)] + [(True,)] * 4,
        ("auto", None, True): [(False,)] + [(False, True)] * 4,
        ("auto", 3, True): [(False,)] * 3 + [(False, True)] * 2,
        ("auto", 3, False): [(False,)] * 3 + [(True,)] * 2,
        ("auto", None, False): [(False,)] * 5,  # a rule planner with no depth: never
    }
    for (mode, floor, predicted), choices in table.items():
        policy = CachePolicy(mode, min_frozen=floor, predicted=predicted)
        assert [policy.choices(n) for n in range(5)] == choices, (mode, floor, predicted)
        assert [policy.serves(n) for n in range(5)] == [c == (True,) for c in choices]


def test_rule_planners_fix_the_depth_once_from_the_config_or_the_break_even():
    asked = []

    def even():
        asked.append(1)
        return 2

    assert CachePolicy("auto", min_frozen=4).for_rules(even).first == 4 and not asked
    assert CachePolicy("auto").for_rules(even).first == 2 and asked == [1]
    assert CachePolicy("auto").for_rules(lambda: None).first is None
    assert CachePolicy("on").for_rules(even).first == 1 and len(asked) == 1
    assert CachePolicy("off").for_rules(even).first is None


def test_the_driver_asks_the_policy_from_the_config_alone():
    assert may_turn_on(*sections(cfg()))
    assert may_turn_on(*sections(cfg(data={"augment": True})))  # the dataset may still keep it off
    assert not may_turn_on(*sections(cfg(cache={"mode": "off"})))
    assert not may_turn_on(*sections(cfg(freeze={"policy": "none"})))
    assert not may_turn_on(*sections(cfg(freeze={"max_frozen": 0})))


def test_the_simulator_s_rule_planners_ask_the_same_policy():
    c = costs(5e6)
    hw = load_hardware("local-cpu")
    for kind in ("paper", "2021"):
        for mode, first in (("auto", 3), ("on", 1), ("off", None)):
            plans = build_planner(kind, c, hw, 2, cache=mode, cache_from=3, batch_size=8)
            p0 = plans.initial_plan()
            served = [plans.next_plan(p0, n).cache for n in range(1, 5)]
            policy = CachePolicy(mode, min_frozen=3, predicted=False)
            assert served == [policy.serves(n) for n in range(1, 5)]
            assert served == [first is not None and n >= first for n in range(1, 5)], kind
