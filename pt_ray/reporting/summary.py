"""The run timeline and ``summary.json``: the contract benchmarks and reports read.

Pure module. ``summary.json`` holds ``wall_time_s``, ``epochs``, ``metric_name``,
``final_eval_metric``, ``timeline`` (one :class:`EpochRecord` per epoch), ``config`` (the
resolved RunConfig), ``device`` (``cpu`` or ``cuda``: where the run trained) and ``precision``
(the concrete compute precision: ``fp32``, ``bf16`` or ``fp16``, never ``auto``). Each
record's ``memory`` lists every rank's :class:`RankMemory` for the epoch (empty in summaries
written before it existed, and for the reference trainer).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pt_ray.reporting.files import write_text_atomically

__all__ = [
    "EpochRecord",
    "RankMemory",
    "format_epoch",
    "ideal_speedup",
    "read_summary",
    "write_summary",
]


@dataclass(frozen=True)
class RankMemory:
    """What one rank held in an epoch, in bytes, measured at the end of its training steps
    (before evaluation), beside the planner's estimate for its stage under the same plan.

    Attributes:
        rank: the rank.
        stage: its pipeline stage under the epoch's plan.
        param_bytes: parameters of the stage's layers (the frozen prefix's too on stage 0).
        grad_bytes: their gradients (trained layers only; frozen ones have none).
        optimizer_bytes: the optimizer state of the stage's trained layers (for AdamW two fp32
            moments per parameter and a step counter per tensor).
        activation_bytes: the most bytes autograd kept for backward at once during the epoch's
            sampled step: distinct tensors saved by the stage's forward, parameters excluded
            (:class:`pt_ray.runtime.memory.SavedActivations`).
        peak_bytes: on CUDA the allocator's peak over the epoch's training steps
            (``torch.cuda.max_memory_allocated``: the whole process, every layer it holds
            included); on CPU the tracked sum ``param + grad + optimizer + activation``.
        held_param_bytes: parameters that have storage in the process. A rank holds only its
            stage's layers (the others' storage is freed), so this equals
            ``param_bytes``; summaries written before that held the whole model on every rank.
        cuda: whether ``peak_bytes`` is the CUDA allocator's figure (else the tracked sum).
        estimate_bytes: the planner's predicted peak for this rank's stage under the epoch's
            plan (``stage_memory``); filled in by the controller, 0 where it made none.
    """

    rank: int
    stage: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int
    held_param_bytes: int
    cuda: bool = False
    estimate_bytes: float = 0.0


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of a run.

    Attributes:
        epoch: 0-based epoch index.
        num_frozen: frozen blocks during the epoch (at its end, if it changed mid-epoch).
        num_layers: L.
        pipeline_length: K.
        num_replicas: R.
        num_microbatches: M.
        throughput_samples_per_s: training samples per second of training time.
        epoch_time_s: wall time of the epoch's training steps (evaluation excluded).
        transition_time_s: wall time spent in transitions during the epoch.
        cache_hit_rate: fraction of the frozen prefix's outputs the cache served: read at the
            current depth, or read at an older one and advanced through the blocks frozen
            since (0 when off).
        train_loss: mean training loss over the epoch's steps.
        eval_metric: the eval metric after the epoch (accuracy for classification).
        eval_time_s: wall time of the evaluation.
        cache_saved_s: estimated wall time the cache saved in the epoch against recomputing
            the frozen prefix (per replica, net of the time spent reading the cache).
        cache_bytes: bytes the cache held at the end of the epoch, each row once however
            many nodes' stores hold a copy (``summary.json``'s ``cache.stored_bytes`` and
            ``cache.nodes`` give the copies).
        cache_objects: objects the cache held at the end of the epoch (each block and depth
            once, however many nodes hold it).
        cache_cost_ratio: what the frozen prefix cost per sample with the cache (reads, layers
            run for misses and advances, writes) over its measured forward per sample without
            it; 0 when the cache served nothing.
        memory: every rank's memory in the epoch, in rank order (:class:`RankMemory`).
        mean_frozen: frozen blocks averaged over the epoch's steps (differs from
            ``num_frozen`` when the prefix grew inside the epoch).
    """

    epoch: int
    num_frozen: int
    num_layers: int
    pipeline_length: int
    num_replicas: int
    num_microbatches: int
    throughput_samples_per_s: float
    epoch_time_s: float
    transition_time_s: float
    cache_hit_rate: float
    train_loss: float
    eval_metric: float
    eval_time_s: float = 0.0
    cache_saved_s: float = 0.0
    cache_bytes: int = 0
    cache_objects: int = 0
    cache_cost_ratio: float = 0.0
    memory: tuple[RankMemory, ...] = ()
    mean_frozen: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochRecord:
        """The record :func:`dataclasses.asdict` (or ``summary.json``) gave; fields it lacks
        take their defaults, so older summaries load."""
        memory = tuple(m if isinstance(m, RankMemory) else RankMemory(**m)
                       for m in data.get("memory", ()))
        return cls(**{**data, "memory": memory})


def _metric(value: float) -> str:
    return "  -   " if math.isnan(value) else f"{value:.4f}"


def format_epoch(rec: EpochRecord, epochs: int, metric_name: str) -> str:
    """One line a person can follow: epoch, loss, metric, frozen blocks, K, R, throughput, and
    the cache's hit rate and size when it holds anything."""
    line = (
        f"epoch {rec.epoch + 1:>3}/{epochs}  loss {rec.train_loss:.4f}  "
        f"{metric_name} {_metric(rec.eval_metric)}  frozen {rec.num_frozen:>2}/{rec.num_layers}  "
        f"K {rec.pipeline_length} R {rec.num_replicas} M {rec.num_microbatches}  "
        f"{rec.throughput_samples_per_s:,.0f} samples/s  ({rec.epoch_time_s:.2f} s)"
    )
    if rec.cache_objects or rec.cache_hit_rate:
        line += (f"  cache {rec.cache_hit_rate:.0%} hits, {rec.cache_bytes / 2**20:.1f} MiB in "
                 f"{rec.cache_objects} objects, saved {rec.cache_saved_s:.2f} s")
        if rec.cache_cost_ratio:
            line += f", prefix at {rec.cache_cost_ratio:.0%} of its uncached cost"
    return line


def ideal_speedup(timeline: list[EpochRecord] | list[dict], cached: bool = False) -> float:
    """The ideal bound for a freeze timeline against no freezing.

    Per sample an active block costs forward + backward (taken as 1 + 2 = 3 units) and a frozen
    one its forward (1 unit), or nothing when the cache serves it. The bound is the ratio of the
    no-freeze cost to this run's cost, summed over epochs; an epoch whose prefix grew inside it
    counts its frozen blocks averaged over its steps.
    """
    base = run = 0.0
    for rec in timeline:
        r = rec if isinstance(rec, dict) else asdict(rec)
        n, total = r.get("mean_frozen"), r["num_layers"]
        n = r["num_frozen"] if n is None else n
        base += 3.0 * total
        run += 3.0 * (total - n) + (0.0 if cached else 1.0 * n)
    return base / run if run else float("inf")


def write_summary(
    path: Path,
    *,
    wall_time_s: float,
    metric_name: str,
    timeline: list[EpochRecord],
    config: dict[str, Any],
    device: str,
    precision: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` and return what was written."""
    summary = {
        "wall_time_s": wall_time_s,
        "epochs": len(timeline),
        "metric_name": metric_name,
        "final_eval_metric": timeline[-1].eval_metric if timeline else None,
        "timeline": [asdict(r) for r in timeline],
        "config": config,
        "device": device,
        "precision": precision,
        **(extra or {}),
    }
    write_text_atomically(path, json.dumps(summary, indent=2))
    return summary


def read_summary(path: Path) -> dict[str, Any]:
    """Read a ``summary.json`` (or the one inside a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    return json.loads(path.read_text())
