"""The global sampler: plan-independent, epoch-seeded order; exact eval sharding."""

from __future__ import annotations

import numpy as np
import pytest

from pt_ray.data.sampler import (
    GlobalSampler,
    accumulation_chunks,
    eval_shards,
    split_for_replica,
)

pytestmark = pytest.mark.unit


def test_order_depends_only_on_seed_and_epoch() -> None:
    a = GlobalSampler(100, 10, seed=3)
    b = GlobalSampler(100, 20, seed=3, drop_last=False)  # other batching, same order
    for epoch in (0, 1, 7):
        np.testing.assert_array_equal(a.epoch_order(epoch), b.epoch_order(epoch))
        np.testing.assert_array_equal(
            a.epoch_order(epoch), np.random.default_rng([3, epoch]).permutation(100)
        )
    assert sorted(a.epoch_order(0).tolist()) == list(range(100))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), GlobalSampler(100, 10, seed=4).epoch_order(0))
    # Asking for another epoch in between does not disturb the order (no hidden state).
    first = a.epoch_order(2).copy()
    a.epoch_order(5)
    np.testing.assert_array_equal(a.epoch_order(2), first)


def test_step_indices_slice_the_epoch_order() -> None:
    s = GlobalSampler(50, 8, seed=0)
    order = s.epoch_order(4)
    for step in range(s.steps_per_epoch):
        np.testing.assert_array_equal(s.step_indices(4, step), order[step * 8 : (step + 1) * 8])


@pytest.mark.parametrize("drop_last", [True, False])
def test_steps_cover_the_epoch_without_repeats(drop_last: bool) -> None:
    s = GlobalSampler(103, 10, seed=1, drop_last=drop_last)
    seen = np.concatenate([s.step_indices(2, k) for k in range(s.steps_per_epoch)])
    assert len(seen) == len(set(seen.tolist())) == s.samples_per_epoch
    assert s.steps_per_epoch == (10 if drop_last else 11)
    assert s.samples_per_epoch == (100 if drop_last else 103)
    if not drop_last:
        assert sorted(seen.tolist()) == list(range(103))


@pytest.mark.parametrize("num_replicas", [1, 2, 4])
def test_replica_slices_partition_the_step(num_replicas: int) -> None:
    s = GlobalSampler(64, 16, seed=5)
    for step in range(s.steps_per_epoch):
        parts = [s.replica_indices(1, step, r, num_replicas) for r in range(num_replicas)]
        assert all(len(p) == 16 // num_replicas for p in parts)
        # Concatenated in replica order they are exactly the step: the plan never changes
        # which samples a step sees, nor their order.
        np.testing.assert_array_equal(np.concatenate(parts), s.step_indices(1, step))


def test_batch_not_divisible_by_replicas_names_both() -> None:
    s = GlobalSampler(64, 6, seed=0)
    with pytest.raises(ValueError, match=r"batch_size=6.*num_replicas=4"):
        s.replica_indices(0, 0, 0, 4)
    with pytest.raises(ValueError, match=r"replica=4 is out of range"):
        s.replica_indices(0, 0, 4, 2)


def test_bad_arguments_are_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"batch_size=20 exceeds num_samples=10"):
        GlobalSampler(10, 20, seed=0)
    assert GlobalSampler(10, 20, seed=0, drop_last=False).steps_per_epoch == 1
    with pytest.raises(ValueError, match="seed=-1"):
        GlobalSampler(10, 2, seed=-1)
    with pytest.raises(ValueError, match=r"step=5 is out of range; an epoch has 5 steps"):
        GlobalSampler(10, 2, seed=0).step_indices(0, 5)


@pytest.mark.timeout(30)
def test_accumulation_chunks_cut_a_step_in_order() -> None:
    assert accumulation_chunks(32, 4) == [slice(0, 8), slice(8, 16), slice(16, 24),
                                          slice(24, 32)]
    assert accumulation_chunks(32, 1) == [slice(0, 32)]
    # As np.array_split: the first size % A chunks hold one more; none is empty.
    assert accumulation_chunks(10, 4) == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]
    assert accumulation_chunks(2, 4) == [slice(0, 1), slice(1, 2)]
    with pytest.raises(ValueError, match="accumulation_steps=0 must be a positive integer"):
        accumulation_chunks(8, 0)


def test_split_for_replica_uneven() -> None:
    idx = np.arange(7)
    parts = [split_for_replica(idx, r, 3) for r in range(3)]
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "num_replicas"),
    [(100, 8, 1), (100, 8, 2), (101, 8, 4), (3, 8, 4), (0, 4, 2), (64, 16, 4)],
)
def test_eval_shards_cover_every_sample_once(
    num_samples: int, batch_size: int, num_replicas: int
) -> None:
    shards = [eval_shards(num_samples, batch_size, r, num_replicas) for r in range(num_replicas)]
    flat = [int(i) for shard in shards for batch in shard for i in batch]
    assert flat == list(range(num_samples))  # in order, no duplicates, no padding
    assert all(0 < len(b) <= batch_size for shard in shards for b in shard)
    sizes = [sum(len(b) for b in shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
