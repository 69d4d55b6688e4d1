"""What a rank tells the run about its training: the evaluation it scores, the epoch's record
(one gather over the ranks, the same on each), and the live step reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from pt_ray.cache.size import memo_limit
from pt_ray.core.config import CacheConfig
from pt_ray.data.base import (
    DatasetSplits,
    SampleDataset,
    finish_batch,
    gather_stored,
    gather_targets,
)
from pt_ray.data.sampler import eval_shards
from pt_ray.models.base import State
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.layout import Layout, to_device_batch
from pt_ray.runtime.memory import FIELDS, rank_memory
from pt_ray.runtime.norms import merge_block_norms, norm_row
from pt_ray.reporting.steplog import StepRecord, StepWindow
from pt_ray.reporting.summary import EpochRecord

__all__ = ["CacheFigures", "EpochFigures", "EvalPrefix", "PrefixStarts", "StepReports",
           "count_correct", "epoch_record", "pipe_score"]


class PrefixStarts:
    """Stage 0's states after its prefix (the embedding and the frozen blocks) for a fixed list
    of batches, kept so that a later pass over the same batches, with only later blocks
    changed, skips the prefix (:func:`pipe_score`). The owner drops them when the prefix may
    have changed.

    Args:
        budget_bytes: the most bytes held (None: no bound). Batches are held in order; the
            first one past the budget and every later one are computed on every pass.
        host: hold them in host memory and move each to the device when read (for CUDA,
            whose memory the planner budgets for training); else where they were computed.
    """

    def __init__(self, budget_bytes: int | None = None, host: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.host = host
        self.states: list[State] = []
        self.bytes = 0
        self.full = False  # a batch was refused: later ones are not held either

    def get(self, i: int, device: torch.device) -> State | None:
        """Batch ``i``'s state on ``device``, if held."""
        if i >= len(self.states):
            return None
        state = self.states[i]
        return tuple(t.to(device) for t in state) if self.host else state

    def put(self, i: int, state: State) -> None:
        """Hold batch ``i``'s state, if every batch before it is held and it fits."""
        if self.full or i != len(self.states):
            return
        size = sum(t.nbytes for t in state)
        if self.budget_bytes is not None and self.bytes + size > self.budget_bytes:
            self.full = True
            return
        self.states.append(tuple(t.cpu() for t in state) if self.host else state)
        self.bytes += size


class EvalPrefix:
    """Stage 0's eval batches after the frozen prefix, kept from one evaluation to the next
    while the plan stands. A frozen block never changes under a plan, and the eval set and its
    shards are fixed, so a later evaluation reads what an earlier one computed and scores
    exactly as if it had run the prefix again. Nothing is kept while nothing is frozen (the
    embedding still trains), off stage 0, or with ``cache.mode=off``; at most
    ``cache.worker_memo_bytes`` (as resolved) are held, in host memory on CUDA.

    Args:
        cache: the run's ``cache`` section.
        device: this rank's device.
    """

    def __init__(self, cache: CacheConfig, device: torch.device) -> None:
        self.on = cache.mode != "off"
        self.budget_bytes = memo_limit(cache)
        self.host = device.type == "cuda"
        self.generation: int | None = None
        self.starts: PrefixStarts | None = None

    def for_plan(self, layout: Layout) -> PrefixStarts | None:
        """What the plan in force keeps (empty at its first evaluation), or None."""
        plan = layout.plan
        if not (self.on and plan.num_frozen and layout.topo.is_first_stage):
            self.clear()
            return None
        if plan.generation != self.generation or self.starts is None:
            self.generation = plan.generation
            self.starts = PrefixStarts(self.budget_bytes, self.host)
        return self.starts

    def clear(self) -> None:
        """Drop what is kept (a rollback or a restore may have changed the prefix)."""
        self.generation, self.starts = None, None


@torch.no_grad()
def count_correct(layout: Layout, splits: DatasetSplits, batch_size: int,
                  comm: Comm, starts: PrefixStarts | None = None) -> tuple[int, float]:
    """Score this rank's share of the eval set: the set is split across replicas and piped
    through each replica's stages (stage 0 reading ``starts`` where it holds a batch's state
    after the prefix). Returns the correct predictions counted here (on last stages; 0
    elsewhere: the sum over every rank is the whole set's) and the seconds it took."""
    t0 = time.perf_counter()
    shards = eval_shards(len(splits.eval), batch_size, layout.topo.replica,
                         layout.plan.num_replicas)
    correct = pipe_score(layout, splits.eval, shards, comm,
                         lambda out, target: layout.adapter.correct(out, target).sum(), starts)
    return int(correct), time.perf_counter() - t0


@torch.no_grad()
def pipe_score(layout: Layout, dataset: SampleDataset, batches: list[np.ndarray], comm: Comm,
               score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               starts: PrefixStarts | None = None) -> torch.Tensor:
    """Pipe this replica's ``batches`` of ``dataset`` through its stages in eval mode and sum
    ``score(output, target)`` over them on the last stage (0 elsewhere); the modes of the layout
    are restored after. ``starts`` (stage 0): each batch's state after the stage's prefix, read
    where held, else computed and offered to it."""
    topo, device, adapter = layout.topo, layout.device, layout.adapter
    adapter.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    prev = topo.pipeline_ranks[topo.stage - 1] if not topo.is_first_stage else None
    nxt = topo.pipeline_ranks[topo.stage + 1] if not topo.is_last_stage else None
    for i, idx in enumerate(batches):
        if topo.is_first_stage:
            state = starts.get(i, device) if starts is not None else None
            if state is None:  # the prefix computed: the activation cache serves training only
                stored = to_device_batch(gather_stored(dataset, idx.tolist()), device)
                state = layout.stage.run_prefix(*finish_batch(dataset, stored).inputs)
                if starts is not None:
                    starts.put(i, state)
            out = layout.stage.run_from(*state)
        else:
            out = layout.stage(*comm.recv(prev, device))
        if nxt is not None:
            comm.send(out, nxt)
        else:
            total += score(out, gather_targets(dataset, idx.tolist()).to(device)).double()
    layout.set_modes()
    return total


@dataclass(frozen=True)
class CacheFigures:
    """The activation cache's figures of an epoch, summed over the ranks (zeros without a
    cache), in the order :func:`pt_ray.cache.prefix.epoch_counters` gives them.

    Attributes:
        rows: rows the cached prefix was asked for.
        served: rows served from the cache (hit, or advanced from a shallower copy).
        saved_s: seconds the cache saved over recomputing the prefix.
        readers: ranks that read the cache.
        cost_s: seconds spent serving from the cache.
        uncached_s: seconds the prefix would have taken, recomputed.
    """

    rows: float = 0.0
    served: float = 0.0
    saved_s: float = 0.0
    readers: float = 0.0
    cost_s: float = 0.0
    uncached_s: float = 0.0

    @classmethod
    def summed(cls, comm: Comm, counters: Sequence[float]) -> CacheFigures:
        """One rank's ``counters`` summed over every rank (one reduction)."""
        return cls(*comm.reduce_values(list(counters)))


@dataclass(frozen=True)
class EpochFigures:
    """One rank's figures of an epoch, gathered over the ranks as one row of numbers.

    Attributes:
        loss_sum: this rank's share of the epoch's summed step losses.
        correct: the correct predictions this rank counted in the evaluation.
        epoch_time: seconds of the epoch's training.
        transition: seconds spent entering plans.
        store_bytes: the activation store's bytes (rank 0 of a cached run; 0 elsewhere).
        store_objects: the activation store's objects (likewise).
        memory: this rank's memory row (:data:`pt_ray.runtime.memory.FIELDS`).
    """

    loss_sum: float
    correct: float
    epoch_time: float
    transition: float
    store_bytes: float
    store_objects: float
    memory: tuple[float, ...]

    @classmethod
    def _scalars(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "memory"]

    def row(self) -> list[float]:
        """The figures as the gather carries them: the numbers by name, then the memory row."""
        return [float(getattr(self, name)) for name in self._scalars()] + list(self.memory)

    @classmethod
    def from_row(cls, row: Sequence[float]) -> EpochFigures:
        """The figures of a gathered :meth:`row` (its first values; the rest is ignored)."""
        scalars = cls._scalars()
        n = len(scalars)
        return cls(**dict(zip(scalars, row[:n])), memory=tuple(row[n:n + len(FIELDS)]))


def epoch_record(comm: Comm, layout: Layout, epoch: int, mine: EpochFigures,
                 norms: dict[int, float], cache: CacheFigures,
                 evaluation: tuple[bool, int, float],
                 steps: int, samples: int) -> tuple[EpochRecord, dict[int, float]]:
    """The epoch's record and its last interval's block norms merged over the ranks, from one
    gather over them (the same on every rank).

    Args:
        comm: the run's communication.
        layout: the layout the epoch ended under.
        epoch: the epoch.
        mine: this rank's figures.
        norms: this rank's block norms of the epoch's last interval.
        cache: the activation cache's figures summed over the ranks.
        evaluation: whether the epoch ended with an evaluation, the eval set's size, and this
            rank's seconds scoring it.
        steps: the epoch's steps.
        samples: the epoch's training samples (over every replica).
    """
    plan, world = layout.plan, layout.world
    evaluated, eval_size, eval_time = evaluation
    width = len(mine.row())
    rows = comm.gather_values(mine.row() + norm_row(norms, plan.num_layers))
    ranks = [EpochFigures.from_row(r) for r in rows]
    epoch_time = max(f.epoch_time for f in ranks)
    rec = EpochRecord(
        epoch=epoch,
        num_frozen=plan.num_frozen,
        num_layers=plan.num_layers,
        pipeline_length=plan.pipeline_length,
        num_replicas=plan.num_replicas,
        num_microbatches=plan.num_microbatches,
        throughput_samples_per_s=samples / max(epoch_time, 1e-9),
        epoch_time_s=epoch_time,
        transition_time_s=max(f.transition for f in ranks),
        cache_hit_rate=float(cache.served / cache.rows) if cache.rows else 0.0,
        train_loss=sum(f.loss_sum for f in ranks) / max(steps, 1),
        eval_metric=(sum(f.correct for f in ranks) / max(eval_size, 1) if evaluated
                     else float("nan")),
        eval_time_s=eval_time,
        # Replicas run side by side: the wall time saved is the mean over them.
        cache_saved_s=float(cache.saved_s / cache.readers) if cache.readers else 0.0,
        cache_bytes=int(sum(f.store_bytes for f in ranks)),
        cache_objects=int(sum(f.store_objects for f in ranks)),
        cache_cost_ratio=float(cache.cost_s / cache.uncached_s) if cache.uncached_s else 0.0,
        memory=rank_memory([v for f in ranks for v in f.memory], world),
    )
    return rec, merge_block_norms([r[width:] for r in rows])


class StepReports:
    """Every ``logging.every_steps`` steps, the step's record handed to ``report`` on every
    rank (each report reduces the step's loss over WORLD, so every rank takes part).

    Args:
        every: steps between reports.
        report: where the records go.
        comm: the run's communication.
        rank: this rank.
    """

    def __init__(self, every: int, report: Callable[[StepRecord], None], comm: Comm,
                 rank: int) -> None:
        self.window = StepWindow(every)
        self.report = report
        self.comm = comm
        self.rank = rank

    def after_step(self, mark: float, samples: int, loss: torch.Tensor | float,
                   **fields) -> float:
        """Count the step just taken in the throughput window and report it when due.

        Args:
            mark: when the step's wall time began (the previous step's end).
            samples: the step's global batch.
            loss: this rank's share of the step's loss.
            fields: the record's other fields (``epoch``, ``global_step``, ``epoch_step``,
                ``epoch_steps``, ``lr``, ``num_frozen``).

        Returns:
            The next step's ``mark``.
        """
        window = self.window
        if not window.due(fields["global_step"]):
            now = time.perf_counter()
            window.add(samples, now - mark)
            return now
        # Only reporting steps read the loss back, which waits for the window's kernels: the
        # window's wall time is the device's.
        loss = float(loss)
        now = time.perf_counter()
        window.add(samples, now - mark)
        # Last stages hold their replica's mean loss / R, other ranks 0: the sum is the mean
        # over the global batch. Rank 0's window time comes along, so that every rank reports
        # the same record (and makes the same reporting calls).
        loss, seconds = self.comm.reduce_values(
            [loss, window.seconds if self.rank == 0 else 0.0])
        samples_per_s, window_s, window_steps = window.take(seconds)
        self.report(StepRecord(train_loss=loss, samples_per_s=samples_per_s,
                               window_s=window_s, window_steps=window_steps, **fields))
        return now
