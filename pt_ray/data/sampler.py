"""The deterministic global sampler: which samples each step and each replica sees.

Pure module (numpy only; no torch.distributed, no ray). The epoch's order is a function of
``(seed, epoch)`` alone, step ``s`` takes positions ``[s*B, (s+1)*B)`` of that order, and replica
``r`` of ``R`` takes the ``r``-th contiguous slice of the step's ``B`` indices. The plan (K, R)
therefore never changes which samples a step covers, so a pipeline x data-parallel run sees the
same data as the single-process reference trainer, and each epoch reshuffles (the 2021 code
forgot ``set_epoch`` and repeated one order).

The activation cache does not change the order: it groups samples into fixed random blocks
(:class:`CacheBlocks`, one cached object per block and depth), and a step gathers its rows from
whichever blocks hold them, so a run trains on the same batches with the cache on or off.
"""

from __future__ import annotations

import math

import numpy as np

from pt_ray.core.config import FreezeConfig
from pt_ray.core.freeze import policy_traits

__all__ = [
    "CacheBlocks",
    "GlobalSampler",
    "accumulation_chunks",
    "eval_shards",
    "probe_indices",
    "split_for_replica",
    "training_sampler",
]

# Seeds the block membership apart from the per-epoch order's streams ``[seed, epoch]``.
_BLOCK_STREAM = 0xB10C


def _check_replica(replica: int, num_replicas: int) -> None:
    if num_replicas <= 0:
        raise ValueError(f"num_replicas={num_replicas} must be a positive integer")
    if not 0 <= replica < num_replicas:
        raise ValueError(
            f"replica={replica} is out of range for num_replicas={num_replicas}; "
            f"choose 0..{num_replicas - 1}"
        )


def split_for_replica(indices: np.ndarray, replica: int, num_replicas: int) -> np.ndarray:
    """Replica ``replica``'s contiguous share of ``indices``.

    Args:
        indices: ``[n]`` indices of one step (or any ordered block).
        replica: which replica, ``0 <= replica < num_replicas``.
        num_replicas: R, the number of data-parallel replicas.

    Returns:
        The ``replica``-th of ``num_replicas`` contiguous pieces; when ``n`` is not divisible
        by R the first ``n % R`` pieces hold one extra index (as ``np.array_split``).
    """
    _check_replica(replica, num_replicas)
    return np.array_split(np.asarray(indices), num_replicas)[replica]


def accumulation_chunks(size: int, accumulation_steps: int) -> list[slice]:
    """Positions of the consecutive chunks a step of ``size`` samples runs as, one per
    gradient-accumulation pass (``optimizer.accumulation_steps``).

    The reference trainer and every replica cut a step the same way, so chunk ``c`` covers the
    same samples under any plan; each replica then takes its share of each chunk
    (:func:`split_for_replica`).

    Args:
        size: the step's samples (over all replicas).
        accumulation_steps: A, passes per optimizer step.

    Returns:
        A slices in step order (fewer when ``size < A``: no chunk is empty); when ``size`` is not
        divisible by A the first ``size % A`` hold one extra sample (as ``np.array_split``).
    """
    if accumulation_steps <= 0:
        raise ValueError(f"accumulation_steps={accumulation_steps} must be a positive integer")
    q, extra = divmod(size, accumulation_steps)
    out, start = [], 0
    for c in range(accumulation_steps):
        stop = start + q + (c < extra)
        if stop > start:
            out.append(slice(start, stop))
        start = stop
    return out


class CacheBlocks:
    """The activation cache's blocks: fixed random groups of samples, one object each.

    ``num_samples // block_size`` blocks (at least one) of a seeded permutation, so every block
    holds ``block_size`` samples or a few more (the remainder is spread over the blocks, which
    keeps the object count at most ``num_samples / block_size``). Membership is random and fixed
    by the seed; it changes no batch (the order is :class:`GlobalSampler`'s), only which object
    holds a sample's cached rows, so a step's rows come from up to ``min(batch, num_blocks)``
    objects.

    Args:
        num_samples: size of the training split.
        block_size: least samples per block.
        seed: the run seed.
    """

    def __init__(self, num_samples: int, block_size: int, seed: int) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples} must be positive; the split is empty")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be a positive integer")
        self.num_samples = num_samples
        self.block_size = block_size
        self.num_blocks = max(1, num_samples // block_size)
        perm = np.random.default_rng([seed, _BLOCK_STREAM]).permutation(num_samples)
        self.members = [np.sort(m) for m in np.array_split(perm, self.num_blocks)]
        """Per block, its sample indices, ascending (int64)."""
        self.block_of = np.empty(num_samples, dtype=np.int64)
        """``[num_samples]``: the block of each sample."""
        for b, m in enumerate(self.members):
            self.block_of[m] = b

    def size(self, block: int) -> int:
        """Samples in ``block``."""
        return len(self.members[block])


class GlobalSampler:
    """The global sample order of a run, independent of the pipeline/data-parallel plan.

    Args:
        num_samples: size of the training split.
        batch_size: B, the global batch per step.
        seed: the run seed (non-negative); with the epoch it fixes the order.
        drop_last: drop the last incomplete batch of an epoch (default). Without it the last
            step is shorter and is split across replicas as evenly as possible.
        held_out: dataset indices the run never trains on (the probe split of
            ``freeze.policy=probe``); the order permutes the others, and ``num_samples``
            counts them.

    Raises:
        ValueError: a non-positive size, a negative seed, or (with ``drop_last``) a batch
            larger than the dataset, which would leave no step at all.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        drop_last: bool = True,
        held_out: np.ndarray | None = None,
    ) -> None:
        self.kept = None
        if held_out is not None and len(held_out):
            self.kept = np.setdiff1d(np.arange(num_samples, dtype=np.int64), held_out)
            num_samples = len(self.kept)
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples} must be positive; the split is empty")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be a positive integer")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative (it seeds numpy's SeedSequence)")
        if drop_last and batch_size > num_samples:
            raise ValueError(
                f"batch_size={batch_size} exceeds num_samples={num_samples}, so drop_last "
                f"leaves no step; choose a batch size of at most {num_samples} or "
                "drop_last=False"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples the steps of one epoch cover (``num_samples`` unless ``drop_last`` drops)."""
        if self.drop_last:
            return self.steps_per_epoch * self.batch_size
        return self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of ``range(num_samples)``, a function of (seed, epoch) only.

        Returns:
            ``[num_samples]`` int64 (read-only; copy before modifying).
        """
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be non-negative")
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        order = order.astype(np.int64, copy=False)
        if self.kept is not None:
            order = self.kept[order]
        order.flags.writeable = False
        self._cached = (epoch, order)
        return order

    def epoch_batches(self, epoch: int, size: int) -> list[np.ndarray]:
        """The epoch's whole batches of ``size`` samples (the global batch), in step order."""
        order = self.epoch_order(epoch)
        return [order[o:o + size] for o in range(0, len(order) - size + 1, size)]

    def step_indices(self, epoch: int, step: int) -> np.ndarray:
        """The indices step ``step`` of ``epoch`` trains on: ``order[s*B:(s+1)*B]``."""
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"step={step} is out of range; an epoch has {self.steps_per_epoch} steps "
                f"(num_samples={self.num_samples}, batch_size={self.batch_size}, "
                f"drop_last={self.drop_last})"
            )
        b = self.batch_size
        return self.epoch_order(epoch)[step * b : (step + 1) * b]

    def replica_indices(
        self, epoch: int, step: int, replica: int, num_replicas: int
    ) -> np.ndarray:
        """Replica ``replica``'s contiguous slice of the step's indices.

        Args:
            epoch: the epoch.
            step: the step within the epoch.
            replica: which replica, ``0 <= replica < num_replicas``.
            num_replicas: R; must divide the batch size so every replica takes ``B / R``.

        Raises:
            ValueError: R does not divide the batch size, or an index is out of range.
        """
        _check_replica(replica, num_replicas)
        if self.batch_size % num_replicas:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by num_replicas={num_replicas}; "
                f"every replica takes an equal share, so choose a batch size that is a "
                f"multiple of {num_replicas}"
            )
        return split_for_replica(self.step_indices(epoch, step), replica, num_replicas)

    def __repr__(self) -> str:
        return (
            f"GlobalSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, drop_last={self.drop_last})"
        )


def training_sampler(freeze: FreezeConfig, batch_size: int, seed: int,
                     num_samples: int) -> GlobalSampler:
    """The run's global sampler over a training split of ``num_samples``, in batches of
    ``batch_size`` (B), drawn from the run's ``seed`` (the reference trainer and every rank
    build the same one, cache on or off), the probe split of the ``freeze`` section's policy
    left out (:func:`probe_indices`)."""
    return GlobalSampler(num_samples, batch_size, seed,
                         held_out=probe_indices(freeze, seed, num_samples))


PROBE_MAX_FRACTION = 0.1
"""The probe split takes at most this share of the training split."""


def probe_indices(freeze: FreezeConfig, seed: int, num_samples: int) -> np.ndarray:
    """The training samples held out as the probe under ``freeze.policy=probe``: the first
    ``min(freeze.probe_samples, num_samples / 10)`` of a permutation drawn from the seed alone
    (every epoch, rank and engine holds out the same ones), sorted; empty under policies
    without a probe split (:attr:`pt_ray.core.freeze.PolicyTraits.probe_split`)."""
    f = freeze
    if not policy_traits(f.policy).probe_split:
        return np.zeros(0, dtype=np.int64)
    count = min(f.probe_samples, int(num_samples * PROBE_MAX_FRACTION))
    draw = np.random.default_rng([seed, 2**20]).permutation(num_samples)[:count]
    return np.sort(draw).astype(np.int64)


def eval_shards(
    num_samples: int, batch_size: int, replica: int, num_replicas: int
) -> list[np.ndarray]:
    """Replica ``replica``'s share of the whole eval set, as batches of indices.

    The eval set ``0..num_samples-1`` is cut in order into ``num_replicas`` contiguous pieces
    (sizes differ by at most one), and each piece into batches of at most ``batch_size``.
    Over all replicas every sample is scored exactly once: no padding duplicates, so summed
    metrics are exact (the 2021 code scored one rank's shard).

    Args:
        num_samples: size of the eval split.
        batch_size: the largest batch one replica evaluates at once.
        replica: which replica, ``0 <= replica < num_replicas``.
        num_replicas: R.

    Returns:
        A list of int64 index arrays; the last may be shorter, and replicas may differ by one
        batch. Empty when the replica has no samples (``num_samples < num_replicas``).
    """
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be non-negative")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be a positive integer")
    mine = split_for_replica(np.arange(num_samples, dtype=np.int64), replica, num_replicas)
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
