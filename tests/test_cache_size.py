"""How big the activation cache may grow: ``auto`` sizes resolved from the stores the cluster
reports, the figure reaching the planner and stage 0, and a whole epoch served from the cache
once it is sized from the store instead of fixed figures."""

from __future__ import annotations

import logging

import pytest
import torch

from pt_ray.control.state import build_control_state
from pt_ray.cache.size import (
    MEMO_FLOOR_BYTES,
    memo_limit,
    resolve_cache_sizes,
    store_budget,
)
from pt_ray.core.config import CacheConfig, ConfigError, RunConfig, build_config
from pt_ray.core.plan import CostTable, LayerCost
from pt_ray.costs.costmodel import cache_read_factor
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import training_sampler
from pt_ray.runtime.build import build_model_for
from pt_ray.cache.store import InMemoryStore
from pt_ray.runtime.precision import Precision
from pt_ray.cache.prefix import cached_prefix_for, epoch_counters, flush_rows, store_figures
from pt_ray.service.settings import run_settings
from test_cache import TINY

pytestmark = pytest.mark.unit

MiB, GiB = 2**20, 2**30


def sized_config(cfg: RunConfig, store_capacities: list[int]) -> RunConfig:
    """``cfg`` with its ``cache`` section sized as the driver sizes it."""
    return cfg.model_copy(update={"cache": resolve_cache_sizes(cfg.cache, store_capacities)})


def test_the_memo_is_the_smallest_nodes_store_budget_at_least_the_floor(caplog):
    caplog.set_level(logging.INFO, logger="pt_ray.cache.size")
    cfg = build_config({})
    assert cfg.cache.worker_memo_bytes == "auto" and memo_limit(cfg.cache) is None
    # Half (budget_fraction) of the smaller of two stores: 6 GiB -> 3 GiB, logged once.
    sized = sized_config(cfg, [8 * GiB, 6 * GiB])
    assert sized.cache.worker_memo_bytes == memo_limit(sized.cache) == 3 * GiB
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["activation cache: worker memo 3072 MiB (cache.worker_memo_bytes=auto: the "
                     "store budget, 0.5 of the object store of the smallest of 2 nodes, "
                     "6144 MiB; at least 256 MiB)"]
    # What the controller and the workers read back from the shipped config is that number.
    assert RunConfig.model_validate(sized.model_dump(mode="json")) == sized
    # A store whose half is under the floor, no size reported, a fixed store budget.
    assert resolve_cache_sizes(cfg.cache, [300 * MiB]).worker_memo_bytes == MEMO_FLOOR_BYTES
    assert resolve_cache_sizes(cfg.cache, [0]).worker_memo_bytes == GiB
    assert resolve_cache_sizes(cfg.cache, []).worker_memo_bytes == GiB
    fixed = build_config({"cache": {"budget_bytes": 5 * GiB}})
    assert resolve_cache_sizes(fixed.cache, [64 * GiB]).worker_memo_bytes == 5 * GiB
    # A number the user set stays, and nothing is logged for it.
    caplog.clear()
    mine = build_config({"cache": {"worker_memo_bytes": 123}})
    assert resolve_cache_sizes(mine.cache, [64 * GiB]) is mine.cache and caplog.records == []
    assert memo_limit(mine.cache) == 123


def test_a_nodes_store_budget_is_its_fraction_or_the_fixed_figure():
    assert store_budget(6 * GiB, 0.5) == 3 * GiB
    assert store_budget(6 * GiB, 0.5, budget_bytes=100) == 100
    assert store_budget(0, 0.5) == GiB  # Ray reported no size


def test_bad_cache_sizes_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"cache.worker_memo_bytes=-1 must be 0 \(none kept\), "
                                         r"a number of bytes, or 'auto'"):
        CacheConfig(worker_memo_bytes=-1)
    with pytest.raises(ConfigError, match=r"cache.object_store_bytes=1000 is below Ray's "
                                          r"smallest object store, 78643200 bytes \(75 MiB\); "
                                          r"set at least that, or 'auto'"):
        build_config({"cache": {"object_store_bytes": 1000}})
    assert CacheConfig(object_store_bytes=80 * MiB).object_store_bytes == 80 * MiB


def minilm_costs() -> CostTable:
    """MiniLM-L6 at sequence 32: rows of 32 x 384 fp32 values (48 KiB) at every depth."""
    row = 32 * 384 * 4
    block = LayerCost(1e-3, 2e-3, row, 1e6)
    return CostTable(LayerCost(1e-4, 1e-4, row, 1e6), (block,) * 6,
                     LayerCost(1e-4, 1e-4, 4, 1e4))


def test_the_issue_run_fits_the_memo_the_planner_predicts_from():
    # 9.6k sentences at sequence 32: 300 steps of 32, 450 MiB of rows per depth. The fixed
    # 256 MiB memo held about half, so the planner charged whole-block reads; a memo sized
    # from a 6.87 GiB store (Ray's default on a 24 GiB host) holds it all: reads move only
    # their own rows.
    def planner_layout(cfg):
        state = build_control_state(run_settings(cfg).control, 6, 2, 300)
        for rank in range(2):
            state.submit_costs(rank, minilm_costs())
        return state.planner.cache_layout

    cfg = build_config({"data": {"batch_size": 32}})
    fixed = planner_layout(build_config({"data": {"batch_size": 32},
                                         "cache": {"worker_memo_bytes": 256 * MiB}}))
    sized_cfg = sized_config(cfg, [int(6.87 * GiB)])
    sized = planner_layout(sized_cfg)
    assert sized.memo_bytes == sized_cfg.cache.worker_memo_bytes == int(6.87 * GiB) // 2
    row = 32 * 384 * 4
    assert fixed.cache_bytes(row) == 9600 * row and not fixed.fits(row)
    assert cache_read_factor(minilm_costs(), 5, 16, fixed) > 5
    assert sized.fits(row) and cache_read_factor(minilm_costs(), 5, 16, sized) == 1.0


def test_a_cache_sized_from_the_store_serves_every_read_after_its_first_epoch():
    # A larger run scaled down: 480 samples in 60 blocks. With fixed figures that hold a third
    # of an epoch's rows (as 256 MiB held half of the 9.6k-sentence run's), the store refuses
    # the rest and every later epoch misses them; with the store's budget and the memo sized
    # from a node's store (here four epochs' worth of rows), the second epoch on hits
    # everywhere, by the cache's own counters, and stage 0 reads the store at most twice in
    # the second epoch (its first step, then every block at once) and never after.
    base = {**TINY["bert"], "data": {**TINY["bert"]["data"], "num_samples": 480}}
    cfg = build_config({**base, "cache": {"block_size": 8}})
    splits = build_dataset(cfg.data, seed=0)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    adapter.model.eval()

    def epochs(cfg, budget, count=4):
        store = CountingStore(budget)
        prefix = cached_prefix_for(cfg.cache, cfg.freeze, cfg.seed, adapter, store,
                                   len(splits.train), True, torch.device("cpu"), None,
                                   Precision("fp32"))
        sampler = training_sampler(cfg.freeze, cfg.data.batch_size, cfg.seed, len(splits.train))
        rates, reads = [], []
        for epoch in range(count):
            asked = len(store.asked)
            for step in range(sampler.steps_per_epoch):
                idx = sampler.step_indices(epoch, step)
                prefix(2, idx, lambda rows, i=idx: splits.train.batch(i[rows].tolist()).inputs)
            rows, served, *_ = epoch_counters(prefix)   # the engine's end of an epoch
            flush_rows(prefix)
            store_figures(prefix, rank=0)
            rates.append(served / rows)
            reads.append(len(store.asked) - asked)
        return rates, reads, store.stats()

    whole = epochs(cfg, 2**40, count=1)[2].bytes       # one epoch's rows at depth 2
    assert whole > 0
    third = build_config({**base, "cache": {"block_size": 8, "worker_memo_bytes": whole // 3}})
    rates, reads, stats = epochs(third, whole // 3)
    assert rates[0] == 0 and all(0.2 < r < 0.4 for r in rates[1:]) and stats.refused_rows > 0
    assert min(reads[1:]) > 15                          # most of the 30 steps read the store

    node_store = 4 * whole
    sized = sized_config(cfg, [node_store])
    rates, reads, stats = epochs(sized, store_budget(node_store, cfg.cache.budget_fraction))
    assert rates == [0.0, 1.0, 1.0, 1.0] and stats.refused_rows == 0
    assert reads[1] <= 2 and reads[2:] == [0, 0]


class CountingStore(InMemoryStore):
    """An in-memory store that records the blocks each read asked for."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.asked: list[list[int]] = []

    def read(self, blocks, level):
        self.asked.append(list(blocks))
        return super().read(blocks, level)

