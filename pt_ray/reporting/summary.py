"""The run timeline and ``summary.json``: the contract benchmarks and reports read.

Pure module. ``summary.json`` is :class:`RunSummary`: ``wall_time_s``, ``epochs``,
``metric_name``, ``final_eval_metric``, ``timeline`` (one :class:`EpochRecord` per epoch),
``config`` (the resolved RunConfig), ``device`` (``cpu`` or ``cuda``: where the run trained),
``precision`` (the concrete compute precision: ``fp32``, ``bf16`` or ``fp16``, never ``auto``)
and what the engine adds (decisions, restarts, rollbacks, start-up). Each record's ``memory``
lists every rank's :class:`RankMemory` for the epoch (empty for the reference trainer).
:func:`write_summary` writes it and :func:`read_summary` is its one loader: both check it
against the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pt_ray.reporting.files import write_text_atomically

__all__ = [
    "EpochRecord",
    "RankMemory",
    "RunSummary",
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
        cache_objects: blocks the cache held at the end of the epoch (each block and depth
            once, however many nodes hold it; several may share one Ray object).
        cache_cost_ratio: what the frozen prefix cost per sample with the cache (reads, layers
            run for misses and advances, writes) over its measured forward per sample without
            it; 0 when the cache served nothing.
        memory: every rank's memory in the epoch, in rank order (:class:`RankMemory`).
        mean_frozen: frozen blocks averaged over the epoch's steps (differs from
            ``num_frozen`` when the prefix grew inside the epoch).
        probe_time_s: wall time the probe of ``freeze.policy=probe`` took since the previous
            record (its measure at an epoch's end counts in the next epoch's).
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
    probe_time_s: float = 0.0

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
                 f"{rec.cache_objects} blocks, saved {rec.cache_saved_s:.2f} s")
        if rec.cache_cost_ratio:
            line += f", prefix at {rec.cache_cost_ratio:.0%} of its uncached cost"
    return line


def ideal_speedup(timeline: list[EpochRecord] | list[dict], cached: bool = False,
                  from_epoch: int = 0) -> float:
    """The ideal bound for a freeze timeline against no freezing.

    Per sample an active block costs forward + backward (taken as 1 + 2 = 3 units) and a frozen
    one its forward (1 unit), or nothing where the cache can serve it. The bound is the ratio of
    the no-freeze cost to this run's cost, summed over epochs; an epoch whose prefix grew inside
    it counts its frozen blocks averaged over its steps.

    With ``cached``, the cache serves a sample's frozen blocks only as deep as the previous
    epoch ran them frozen for it: an epoch reads each sample once, so a row computed in epoch e
    is read first in epoch e + 1, and blocks frozen since cost their forward (the cache advances
    its rows through them). Epoch e is priced as serving ``min(n_e, n_{e-1})`` blocks, means
    over each epoch's steps; as the mean of a minimum is at most the minimum of the means, this
    stays an upper bound. The first epoch serves nothing. ``from_epoch`` prices only the epochs
    from that index on (a rate measured after a warm-up epoch); the earlier ones still say what
    the cache holds.
    """
    base = run = 0.0
    before = 0.0  # frozen blocks the previous epoch wrote rows at, on average
    for i, rec in enumerate(timeline):
        r = rec if isinstance(rec, dict) else asdict(rec)
        n, total = r.get("mean_frozen"), r["num_layers"]
        n = r["num_frozen"] if n is None else n
        served = min(n, before) if cached else 0.0
        before = n
        if i < from_epoch:
            continue
        base += 3.0 * total
        run += 3.0 * (total - n) + 1.0 * (n - served)
    return base / run if run else float("inf")


class RunSummary(BaseModel):
    """``summary.json``: what a finished run wrote (the fields every run has typed; the engine's
    own extras, such as the cache's figures, kept as they are). A run writes every field; a
    summary put together by hand (a notebook's, a test's) needs only the timeline.

    Attributes:
        wall_time_s: the run's wall time (dataset and model build, training, evaluation,
            checkpoints; the driver's preflight excluded).
        epochs: epochs in the timeline.
        metric_name: the eval metric's name (``accuracy``, ``f1``, ...).
        final_eval_metric: the last epoch's eval metric (None without epochs).
        timeline: one record per epoch trained (after a rollback, the epochs trained again).
        config: the resolved RunConfig, as JSON.
        device: ``cpu`` or ``cuda``: where the run trained.
        precision: the concrete compute precision (``fp32``, ``bf16`` or ``fp16``).
        engine: ``ray`` or ``reference``.
        run_id: the Ray run's id (None for the reference engine).
        checkpoint: the run's last checkpoint folder, if any.
        decisions: the controller's freeze decisions.
        restarts: worker-group restarts from a checkpoint.
        rollbacks: the accuracy guard's rollbacks.
        startup: where the start-up went, in seconds per part.
        start_trials: the first layouts timed before the first plan was chosen, each with its
            predicted and measured samples per second (empty: the prediction alone chose).
        resumed_from: the checkpoint a resumed run continued and the epoch after which it
            resumed.
        cache: the activation cache at the end of a run on Ray (bytes, objects, refused rows,
            per node) and the object store's figures (spilled bytes, ...); empty when the
            cache stayed off.
        data: how a run's Ray workers got the dataset: ``shipped_bytes`` (what the driver put
            into the object store; 0: each worker read the files) and ``read_by_workers``.

    ``epochs`` and ``final_eval_metric`` follow from the timeline where not given.
    """

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")

    timeline: list[EpochRecord]
    metric_name: str = "accuracy"
    wall_time_s: float | None = None
    epochs: int | None = None
    final_eval_metric: float | None = None
    config: dict[str, Any] = {}
    device: str | None = None
    precision: str | None = None
    engine: str = "ray"
    run_id: str | None = None
    checkpoint: str | None = None
    decisions: list[dict[str, Any]] = []
    restarts: int = 0
    rollbacks: list[dict[str, Any]] = []
    startup: dict[str, float] = {}
    start_trials: list[dict[str, Any]] = []
    resumed_from: dict[str, Any] | None = None
    cache: dict[str, Any] = {}
    data: dict[str, Any] = {}

    def model_post_init(self, __context: Any) -> None:
        if self.epochs is None:
            self.epochs = len(self.timeline)
        if self.final_eval_metric is None and self.timeline:
            self.final_eval_metric = self.timeline[-1].eval_metric


def write_summary(path: Path, summary: RunSummary) -> dict[str, Any]:
    """Write ``summary`` as ``summary.json`` and return what was written, as
    :func:`read_summary` returns it."""
    write_text_atomically(path, summary.model_dump_json(indent=2))
    return summary.model_dump()


def read_summary(source: Path | str | Mapping[str, Any], *,
                 need_epochs: bool = False) -> dict[str, Any]:
    """The one loader of ``summary.json``: from a run folder, the file, or a dict. The content
    is checked against :class:`RunSummary`; the result is plain data (each timeline record a
    dict).

    Raises:
        FileNotFoundError: no ``summary.json`` at the path (the message names it).
        ValueError: the file is not JSON or not a pt-ray summary (the message names the file
            and the first field that is wrong), or, with ``need_epochs``, has no epochs.
    """
    if isinstance(source, Mapping):
        data, where = dict(source), "the summary"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: pass a run folder (holding the summary.json that "
                f"`pt-ray train` writes) or a summary.json file")
        if path.is_dir():
            path = path / "summary.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: is {path.parent} a pt-ray run folder? `pt-ray train` "
                    f"writes summary.json when a run ends")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        where = str(path)
    if not isinstance(data.get("timeline"), list):
        raise ValueError(f"{where} has no 'timeline' list; is it a pt-ray summary.json?")
    if need_epochs and not data["timeline"]:
        raise ValueError(f"{where} has no epochs in its timeline; nothing to report")
    try:
        return RunSummary.model_validate(data).model_dump()
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {field}: {first['msg']}; is it a summary.json this "
                         "version of pt-ray wrote?") from None
