"""The activation cache without processes: its blocks in the run's plain order, the block
store's bookkeeping, and stage 0's cached prefix against the plain one (when the cache turns on:
test_cache_policy.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pt_ray.core.config import build_config
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import CacheBlocks, GlobalSampler, training_sampler
from pt_ray.cache.rows import RowTable
from pt_ray.cache.store import BlockLedger, InMemoryStore, from_numpy, to_numpy
from pt_ray.cache.store import Segment, distinct_figures
from pt_ray.cache.prefix import (
    CachedPrefix,
    copied_whole,
    gather_rows_on_device,
    gather_rows_on_host,
)
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.precision import Precision

pytestmark = pytest.mark.unit


# -- blocks in the plain order -------------------------------------------------------------------


def test_blocks_are_random_groups_of_at_least_block_size_and_few():
    blocks = CacheBlocks(100_000, 64, seed=0)
    sizes = [blocks.size(b) for b in range(blocks.num_blocks)]
    assert blocks.num_blocks == 1562 <= 100_000 / 64  # the remainder is spread, not a block
    assert min(sizes) == 64 and max(sizes) == 65 and sum(sizes) == 100_000
    members = np.concatenate(blocks.members)
    assert sorted(members.tolist()) == list(range(100_000))
    assert all((blocks.block_of[m] == b).all() for b, m in enumerate(blocks.members))
    assert np.ptp(blocks.members[0]) > 10_000  # random membership, not index ranges
    assert CacheBlocks(10, 64, seed=0).num_blocks == 1


def cfg(**sections):
    base = {"freeze": {"policy": "schedule"}}
    base.update(sections)
    return build_config(base)


def test_the_order_is_the_plain_permutation_cache_on_or_off():
    plain = GlobalSampler(1000, 32, seed=3)
    for cache in ({"mode": "on"}, {"mode": "auto"}, {"mode": "off"}, {"block_size": 8}):
        c = cfg(data={"batch_size": 32}, seed=3, cache=cache)
        sampler = training_sampler(c.freeze, c.data.batch_size, c.seed, 1000)
        for epoch in range(3):
            np.testing.assert_array_equal(sampler.epoch_order(epoch), plain.epoch_order(epoch))
    # So a step's samples fall in many cache blocks: about min(batch, blocks) of the 15 here.
    blocks = CacheBlocks(1000, 64, seed=3)
    touched = [len(np.unique(blocks.block_of[plain.step_indices(0, s)]))
               for s in range(plain.steps_per_epoch)]
    assert min(touched) >= 8 and max(touched) <= blocks.num_blocks == 15


# -- the block ledger ---------------------------------------------------------------------------


def payload(ids, level=1, width=3):
    ids = np.asarray(ids, dtype=np.int64)
    rows = np.stack([np.full(width, i * 10 + level, dtype=np.float32) for i in ids])
    return ids, (rows,), ("float32",)


def test_pieces_become_one_object_per_block_and_depth():
    idx: BlockLedger = BlockLedger(10**6, put=lambda p: p, load=lambda p: p)
    assert idx.add(0, block=7, block_size=4, level=1, payload=payload([5, 1]))
    assert idx.stats.objects == 0 and idx.stats.pending_bytes > 0  # waits for its block
    idx.add(0, 7, 4, 1, payload([9, 3]))
    assert idx.stats.objects == 1 and idx.stats.pending_bytes == 0
    (_, lv, ref), = idx.lookup([7], 2)
    ids, (rows,), _ = idx.payload(ref)
    assert lv == 1 and ids.tolist() == [1, 3, 5, 9]
    assert rows[:, 0].tolist() == [11.0, 31.0, 51.0, 91.0]
    # An incomplete block is stored at flush; a later piece merges into the same object.
    idx.add(0, 8, 4, 1, payload([2]))
    idx.flush()
    idx.add(0, 8, 4, 1, payload([4, 2]))
    idx.flush()
    assert idx.stats.objects == 2
    (_, _, ref), = idx.lookup([8], 1)
    assert idx.payload(ref)[0].tolist() == [2, 4]


def test_a_deeper_depth_replaces_the_shallower_one():
    idx: BlockLedger = BlockLedger(10**6, put=lambda p: p, load=lambda p: p)
    idx.add(0, 0, 2, 1, payload([0, 1], level=1))
    idx.add(0, 0, 2, 2, payload([0], level=2))
    assert [lv for _, lv, _ in idx.lookup([0], 2)] == [1]  # depth 2 still waits for sample 1
    idx.add(0, 0, 2, 2, payload([1], level=2))
    assert [lv for _, lv, _ in idx.lookup([0], 2)] == [2]
    assert idx.stats.objects == 1 and idx.stats.released_objects == 1
    # At a flush an incomplete deeper object replaces the shallower one too (one object per
    # block); the rows it lacks are misses from then on.
    idx.add(0, 1, 2, 1, payload([2, 3], level=1))
    idx.add(0, 1, 2, 2, payload([2], level=2))
    idx.flush()
    (_, lv, ref), = idx.lookup([1], 2)
    assert lv == 2 and idx.payload(ref)[0].tolist() == [2] and idx.stats.objects == 2


def test_blocks_stored_together_share_one_object_until_the_last_is_released():
    puts = []

    def put(p):
        puts.append(p)
        return p

    idx: BlockLedger = BlockLedger(10**6, put=put, load=lambda p: p)
    # A flush of many incomplete blocks: one put, each block read back whole from it.
    for block in range(5):
        idx.add(0, block, 4, 1, payload([4 * block, 4 * block + 1]))
    assert puts == []
    idx.flush()
    assert len(puts) == 1 and idx.stats.objects == 5 and idx.stats.pending_bytes == 0
    one = idx.stats.bytes // 5
    for block in range(5):
        (_, lv, ref), = idx.lookup([block], 1)
        ids, (rows,), _ = idx.payload(ref)
        assert lv == 1 and ids.tolist() == [4 * block, 4 * block + 1]
        assert rows[:, 0].tolist() == [40.0 * block + 1, 40.0 * block + 11]
    # Blocks completed by one call go into one object too; one that merges a pack's rows reads
    # them from the pack.
    assert idx.add_many(0, [(0, 4, 1, payload([2, 3])), (1, 4, 1, payload([6, 7])),
                            (2, 4, 1, payload([8]))]) == 3
    assert len(puts) == 2 and len(puts[1]) == 2
    (_, _, ref), = idx.lookup([1], 1)
    assert idx.payload(ref)[0].tolist() == [4, 5, 6, 7]
    # The first pack's bytes (5 blocks of 2 rows) stay counted while any of its blocks is
    # stored in it, beside the second's (2 blocks of 4 rows).
    held = idx.stats.bytes
    assert held == 5 * one + 2 * 2 * one
    for block in (2, 3):
        idx.add(0, block, 1, 2, payload([4 * block], level=2))
    assert idx.stats.bytes == held + 2 * (one // 2)  # blocks 2 and 3 of pack 1 released
    idx.add(0, 4, 1, 2, payload([16], level=2))
    # Its last block released: pack 1 (5 blocks of 2 rows) no longer counts.
    assert idx.stats.bytes == held + 3 * (one // 2) - 5 * one
    assert idx.stats.objects == 5


def test_a_flush_stores_no_depth_that_a_deeper_one_of_its_block_replaces():
    idx: BlockLedger = BlockLedger(10**6, put=lambda p: p, load=lambda p: p)
    idx.add(0, 0, 4, 1, payload([0, 1], level=1))   # a freeze landed: depth 1, then 2
    idx.add(0, 0, 4, 2, payload([2], level=2))
    idx.add(0, 1, 4, 1, payload([4], level=1))
    idx.flush()
    assert [(b, lv) for b, lv, _ in idx.lookup([0, 1], 2)] == [(0, 2), (1, 1)]
    # Only what the pack's readers can read counts: block 0's depth 1 was never stored.
    ids, (rows,), _ = payload([2], level=2)
    assert idx.stats.bytes == 2 * (ids.nbytes + rows.nbytes)
    assert idx.stats.objects == 2 and idx.stats.pending_bytes == 0


def test_budget_refuses_and_restart_invalidates():
    one = sum(a.nbytes for a in payload([0, 1])[1]) + 16
    idx: BlockLedger = BlockLedger(one, put=lambda p: p, load=lambda p: p)
    assert idx.add(0, 0, 2, 1, payload([0, 1]))
    assert not idx.add(0, 1, 2, 1, payload([2, 3]))
    assert idx.stats.refused_rows == 2 and idx.lookup([1], 1) == []
    assert not idx.add(0, 2, 1, 3, payload([4], level=3))  # refused too: over budget
    lineage = idx.invalidate_above(1)
    assert lineage == 1 and [lv for _, lv, _ in idx.lookup([0], 5)] == [1]
    assert not idx.add(0, 3, 1, 1, payload([6]))  # written before the restart: stale
    assert idx.stats.stale_rows == 1

    def failing_put(p):
        raise MemoryError("store full")

    full: BlockLedger = BlockLedger(10**6, put=failing_put, load=lambda p: p)
    full.add(0, 0, 1, 1, payload([0]))  # a full store: refused, no exception
    assert full.stats.objects == 0 and full.stats.refused_rows == 1


def test_distinct_figures_count_each_row_once_however_many_stores_copy_it():
    def store(pieces):
        idx: BlockLedger = BlockLedger(10**6, put=lambda p: p, load=lambda p: p)
        for block, level, ids in pieces:
            idx.add(0, block, 4, level, payload(ids, level=level))
        idx.flush()
        return idx

    a = store([(0, 1, [0, 1, 2, 3]), (1, 1, [4, 5])])
    # A second node: a full copy of block 0, the other half of block 1, block 2 deeper.
    b = store([(0, 1, [0, 1, 2, 3]), (1, 1, [6, 7]), (2, 2, [8, 9])])
    row = a.stats.bytes // 6
    assert distinct_figures([a.contents(), b.contents()]) == (10 * row, 3)
    # Summing the stores' own figures counts block 0's copy twice (what the run reported).
    assert a.stats.bytes + b.stats.bytes == 14 * row and a.stats.objects + b.stats.objects == 5
    assert distinct_figures([a.contents(), a.contents()]) == (a.stats.bytes, a.stats.objects)
    assert distinct_figures([]) == (0, 0)


def test_bfloat16_round_trips_bit_for_bit():
    t = torch.randn(3, 4).to(torch.bfloat16)
    a, dtype = to_numpy(t)
    assert dtype == "bfloat16" and torch.equal(from_numpy(a, dtype), t)
    f = torch.randn(2, 2)
    assert torch.equal(from_numpy(*to_numpy(f)), f)


# -- stage 0's cached prefix -------------------------------------------------------------------


TINY = {
    "vit": {"model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
                      "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
            "data": {"name": "synthetic_image", "num_samples": 48, "image_size": 8,
                     "batch_size": 16}},
    "bert": {"model": {"family": "hf", "name": "bert", "depth": 4, "width": 32, "num_heads": 2,
                       "mlp_ratio": 2.0},
             "data": {"name": "synthetic_text", "num_samples": 48, "seq_len": 12,
                      "batch_size": 16}},
}


def plain_prefix(adapter, inputs, n):
    with torch.no_grad():
        state = adapter.embed(*inputs)
        for block in adapter.blocks[:n]:
            state = block(*state)
    return state


@pytest.fixture(params=["vit", "bert"])
def model(request):
    c = build_config({**TINY[request.param], "cache": {"block_size": 8}})
    splits = build_dataset(c.data, seed=0)
    adapter = build_model_for(c.model, c.seed, splits)
    adapter.model.eval()
    return c, splits, adapter


def run(prefix, splits, n, idx):
    loaded = []

    def load(rows):
        loaded.extend(idx[rows].tolist())
        return splits.train.batch(idx[rows].tolist()).inputs

    return prefix(n, idx, load), loaded


def test_hits_advances_and_misses_equal_the_prefix_bit_for_bit(model):
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    prefix = CachedPrefix(adapter, InMemoryStore(), blocks, torch.device("cpu"))
    order = training_sampler(c.freeze, c.data.batch_size, c.seed, len(splits.train)).epoch_order(0)
    idx = order[:16]
    expect = {n: plain_prefix(adapter, splits.train.batch(idx.tolist()).inputs, n)
              for n in (2, 3)}
    state, loaded = run(prefix, splits, 2, idx)           # misses at depth 2
    assert sorted(loaded) == sorted(idx.tolist())
    assert len(state) == len(expect[2]) == (1 if c.model.family == "timm" else 2)
    assert all(torch.equal(a, b) for a, b in zip(state, expect[2]))
    prefix.store.flush()
    shuffled = idx[::-1].copy()
    state, loaded = run(prefix, splits, 3, shuffled)      # advanced 2 -> 3, nothing loaded
    assert loaded == []
    want = plain_prefix(adapter, splits.train.batch(shuffled.tolist()).inputs, 3)
    assert all(torch.equal(a, b) for a, b in zip(state, want))
    prefix.store.flush()
    prefix.reset()                                        # rows written show in a new epoch
    state, loaded = run(prefix, splits, 3, idx)           # hits at depth 3
    assert loaded == [] and all(torch.equal(a, b) for a, b in zip(state, expect[3]))
    prefix.reset()
    c1 = prefix.total
    assert (c1.rows, c1.misses, c1.advanced, c1.hits) == (48, 16, 16, 16)
    # Depth 2 was released once depth 3 covered its blocks.
    assert all(lv == 3 for _, lv, _ in prefix.store.index.lookup(range(blocks.num_blocks), 3))


def test_full_store_and_evicted_entries_are_misses_with_the_right_rows(model):
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    sampler = training_sampler(c.freeze, c.data.batch_size, c.seed, len(splits.train))
    idx = sampler.epoch_order(0)[:16]
    want = plain_prefix(adapter, splits.train.batch(idx.tolist()).inputs, 2)
    tiny = CachedPrefix(adapter, InMemoryStore(budget_bytes=64), blocks, torch.device("cpu"))
    for _ in range(2):
        state, loaded = run(tiny, splits, 2, idx)
        assert sorted(loaded) == sorted(idx.tolist())   # nothing admitted: always recomputed
        assert all(torch.equal(a, b) for a, b in zip(state, want))
        tiny.store.flush()
    assert tiny.store.stats().refused_rows > 0 and tiny.store.stats().objects == 0
    store = InMemoryStore()
    prefix = CachedPrefix(adapter, store, blocks, torch.device("cpu"))
    run(prefix, splits, 2, idx)
    store.flush()
    evicted = int(blocks.block_of[idx[0]])
    store.index.forget(evicted, 2)
    state, loaded = run(prefix, splits, 2, idx)
    assert sorted(loaded) == sorted(i for i in idx.tolist() if blocks.block_of[i] == evicted)
    assert all(torch.equal(a, b) for a, b in zip(state, want))


def test_prefix_cost_accounting_splits_reads_compute_and_writes(model):
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    prefix = CachedPrefix(adapter, InMemoryStore(), blocks, torch.device("cpu"))
    sampler = training_sampler(c.freeze, c.data.batch_size, c.seed, len(splits.train))
    idx = sampler.epoch_order(0)[:16]
    run(prefix, splits, 2, idx)                            # misses: compute + writes
    prefix.store.flush()
    miss = prefix.reset()
    assert miss.compute_s > 0 and miss.write_s > 0
    assert miss.cost_s == pytest.approx(miss.io_s + miss.compute_s + miss.write_s)
    # Without the cache the prefix would have cost its measured forward for every row.
    assert miss.uncached_s == pytest.approx(miss.compute_s, rel=1e-9)
    run(prefix, splits, 2, idx)                            # hits: reads only
    hit = prefix.reset()
    assert hit.compute_s == 0 and hit.write_s == 0 and hit.cost_s == hit.io_s > 0
    assert hit.uncached_s == pytest.approx(miss.uncached_s)


def test_a_last_epoch_serves_what_is_cached_and_keeps_nothing_new(model):
    """No epoch after the last reads its rows: with ``keeps_rows`` off, hits are served,
    misses and advanced rows are computed right, and neither the store nor a tier gains a row."""
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    tier = RowTable(len(splits.train), 10**6, torch.device("cpu"), name="host")
    prefix = CachedPrefix(adapter, InMemoryStore(), blocks, torch.device("cpu"), tiers=[tier])
    order = training_sampler(c.freeze, c.data.batch_size, c.seed, len(splits.train)).epoch_order(0)
    first, rest = order[:16], order[16:32]
    run(prefix, splits, 2, first)                        # an earlier epoch caches 16 rows
    prefix.flush_pending()
    prefix.store.flush()
    prefix.reset()
    held = (prefix.store.stats().bytes, tier.used, tier.held(2))
    assert held[0] > 0 and held[1:] == (16, 16)
    prefix.keeps_rows = False
    both = np.concatenate([first, rest])
    for n in (2, 3):                                     # hits (n=2), advanced (n=3), misses
        state, loaded = run(prefix, splits, n, both)
        prefix.store.flush()
        assert sorted(loaded) == sorted(rest.tolist())
        want = plain_prefix(adapter, splits.train.batch(both.tolist()).inputs, n)
        assert all(torch.equal(a, b) for a, b in zip(state, want))
    prefix.flush_pending()
    prefix.store.flush()
    assert (prefix.store.stats().bytes, tier.used, tier.held(2), tier.held(3)) == (*held, 0)
    counters = prefix.reset()
    assert counters.write_s == 0 and counters.misses == 32
    assert (counters.hits, counters.advanced) == (16, 16)


class CountingStore(InMemoryStore):
    """An in-memory store that records which blocks each read asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[int]] = []

    def read(self, blocks, level):
        self.asked.append(list(blocks))
        return super().read(blocks, level)


def test_a_bf16_run_stores_two_bytes_an_element_and_serves_them_back(model):
    # The prefix runs under bf16 autocast (on the CPU here, as on a GPU) and its rows reach the
    # store in the compute dtype: 2 bytes per element, half the fp32 run's bytes, every state
    # tensor (BERT's mask too), and a hit serves bf16 rows bit for bit.
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    idx = np.arange(len(splits.train))
    stored = {}
    for name in ("fp32", "bf16"):
        store = InMemoryStore()
        prefix = CachedPrefix(adapter, store, blocks, torch.device("cpu"),
                              precision=Precision(name))
        computed, _ = run(prefix, splits, 2, idx)
        store.flush()
        prefix.reset()
        served, loaded = run(prefix, splits, 2, idx)
        assert loaded == [] and all(torch.equal(a, b) for a, b in zip(served, computed))
        segments = store.read(range(blocks.num_blocks), 2)
        stored[name] = (store.stats().bytes, segments, computed)
    size, segments, computed = stored["bf16"]
    assert all(t.dtype == torch.bfloat16 for t in computed)
    for seg in segments:
        assert set(seg.dtypes) == {"bfloat16"}
        assert all(a.itemsize == 2 for a in seg.arrays)
    elements = sum(t[0].numel() for t in computed)           # per row, every state tensor
    ids = 8 * len(splits.train)                               # int64 sample ids
    assert size == len(splits.train) * elements * 2 + ids
    assert stored["fp32"][0] == len(splits.train) * elements * 4 + ids


def test_complete_blocks_are_read_from_the_store_once_per_depth(model):
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    store = CountingStore()
    prefix = CachedPrefix(adapter, store, blocks, torch.device("cpu"))
    whole = np.concatenate([blocks.members[0], blocks.members[1]])   # two complete blocks
    run(prefix, splits, 2, whole)
    store.flush()
    for _ in range(3):
        state, loaded = run(prefix, splits, 2, whole[::-1].copy())
        assert loaded == []
    assert store.asked == [[0, 1], [0, 1]]       # the misses' read, then one read for both
    want = plain_prefix(adapter, splits.train.batch(whole[::-1].tolist()).inputs, 2)
    assert all(torch.equal(a, b) for a, b in zip(state, want))
    # A new depth asks the store again (and advances the rows); with the bytes per row known
    # and the whole cache within the memo's limit, that one read asks for every block.
    run(prefix, splits, 3, whole)
    assert store.asked[-1] == [0, 1, *range(2, blocks.num_blocks)]
    store.flush()
    asked = len(store.asked)
    state, loaded = run(prefix, splits, 3, whole)  # the same epoch: what it read at depth 2,
    assert len(store.asked) == asked and loaded == []  # advanced again, no store read
    want = plain_prefix(adapter, splits.train.batch(whole.tolist()).inputs, 3)
    assert all(torch.equal(a, b) for a, b in zip(state, want))
    assert prefix._complete == set()
    prefix.reset()                             # a new epoch sees the depth-3 rows
    run(prefix, splits, 3, whole)
    assert store.asked[-1] == [0, 1, *range(2, blocks.num_blocks)]
    assert prefix._complete == {0, 1}
    prefix.reset()                             # complete blocks outlive the epoch
    asked = len(store.asked)
    run(prefix, splits, 3, whole)
    assert len(store.asked) == asked
    capped = CachedPrefix(adapter, store, blocks, torch.device("cpu"), memo_bytes=1)
    run(capped, splits, 3, whole)
    run(capped, splits, 3, whole)
    assert store.asked[-2:] == [[0, 1], [0, 1]]  # no room: only what each step needs
    prefix.invalidate_above(2)
    assert prefix._memo == {} and store.index.lookup([0, 1], 3) == []


def test_the_memo_keeps_at_most_its_bytes_dropping_the_least_recently_read(model):
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)
    store = CountingStore()
    warm = CachedPrefix(adapter, store, blocks, torch.device("cpu"))
    three = np.concatenate(blocks.members[:3])
    run(warm, splits, 2, three)                                # writes three blocks
    store.flush()
    one = store.read([0], 2)[0]
    size = sum(a.nbytes for a in one.arrays) + one.ids.nbytes
    prefix = CachedPrefix(adapter, store, blocks, torch.device("cpu"), memo_bytes=2 * size)
    for b in (0, 1, 0, 2):                                     # block 1 is the least recent
        run(prefix, splits, 2, blocks.members[b].copy())
    assert list(prefix._memo) == [0, 2] and prefix._memo_held == 2 * size
    store.asked.clear()
    run(prefix, splits, 2, np.concatenate([blocks.members[1], blocks.members[2]]))
    assert store.asked == [[1]]                                # block 2 from the memo
    none = CachedPrefix(adapter, store, blocks, torch.device("cpu"), memo_bytes=0)
    run(none, splits, 2, blocks.members[0].copy())
    assert none._memo == {}


def test_a_plain_order_step_gathers_its_rows_from_many_blocks(model):
    # Pieces written by many steps assemble into whole blocks; the next epoch's steps each read
    # rows spread over most of the blocks and get the prefix bit for bit.
    c, splits, adapter = model
    blocks = CacheBlocks(len(splits.train), 8, seed=0)             # 6 blocks of 8
    store = InMemoryStore()
    prefix = CachedPrefix(adapter, store, blocks, torch.device("cpu"))
    # 3 steps of 16
    sampler = training_sampler(c.freeze, c.data.batch_size, c.seed, len(splits.train))
    steps = [sampler.step_indices(0, s) for s in range(sampler.steps_per_epoch)]
    assert min(len(np.unique(blocks.block_of[idx])) for idx in steps) >= 4
    for s, idx in enumerate(steps):
        run(prefix, splits, 2, idx)
        if s == 0:
            assert store.stats().objects == 0                     # no block is whole yet
    assert store.stats().objects == blocks.num_blocks and store.stats().pending_bytes == 0
    prefix.reset()
    used = []
    gather = prefix._gather
    prefix._gather = lambda segments, seg, pos: used.append(len(np.unique(seg))) or gather(
        segments, seg, pos)
    for s in range(sampler.steps_per_epoch):
        idx = sampler.step_indices(1, s)
        state, loaded = run(prefix, splits, 2, idx)
        assert loaded == []
        want = plain_prefix(adapter, splits.train.batch(idx.tolist()).inputs, 2)
        assert all(torch.equal(a, b) for a, b in zip(state, want))
        assert used[-1] == len(np.unique(blocks.block_of[idx])) >= 4
    assert prefix.reset().hits == len(splits.train)


def test_device_gather_picks_the_rows_the_host_gather_picks():
    # The GPU path copies dense segments whole and picks their rows on the device, and picks the
    # rows of sparse ones on the host; run it on the CPU here (bench/gpu_check.sh runs it on
    # CUDA) against the numpy path, on bf16 and fp32 states.
    rng = np.random.default_rng(0)
    segments = []
    for block, rows in enumerate([5, 3, 7, 40]):
        hidden = torch.randn(rows, 4, 6, dtype=torch.bfloat16)
        mask = torch.from_numpy(rng.integers(0, 2, (rows, 4)).astype(np.float32))
        arrays = tuple(to_numpy(t) for t in (hidden, mask))
        segments.append(Segment(block, 2, np.arange(rows, dtype=np.int64) + 10 * block,
                                tuple(a for a, _ in arrays), tuple(d for _, d in arrays)))
    # Segment 1 unused; 0 and 2 serve most of their rows (copied whole), 3 two of its 40 (the
    # plain order's case: picked on the host).
    seg = np.array([2, 3, 0, 2, 2, 0, 3, 0, 2], dtype=np.int64)
    pos = np.array([6, 31, 4, 0, 3, 0, 5, 2, 1], dtype=np.int64)
    assert copied_whole(segments, seg) == [0, 2]
    host = gather_rows_on_host(segments, seg, pos)
    device = gather_rows_on_device(segments, seg, pos, torch.device("cpu"))
    assert [t.dtype for t in device] == [torch.bfloat16, torch.float32]
    for a, b in zip(host, device):
        assert torch.equal(a, b)
    assert torch.equal(device[0][0], from_numpy(segments[2].arrays[0], "bfloat16")[6])
    assert torch.equal(device[0][1], from_numpy(segments[3].arrays[0], "bfloat16")[31])
    assert torch.equal(device[1][6], from_numpy(segments[3].arrays[1], "float32")[5])
    # The result owns its memory: writing to it leaves the store's arrays alone.
    before = segments[2].arrays[1].copy()
    device[1].fill_(-1.0)
    assert np.array_equal(segments[2].arrays[1], before)
