"""A run's timeline as TensorBoard scalars (tensorboardX, which Ray Train and Tune depend on).

Imports no Ray and no torch itself (tensorboardX loads torch when it is installed). The step of
every scalar is the epoch number from 1, as in the per-epoch log lines and ``pt-ray report``.
Tags:

- ``train/loss``: mean training loss of the epoch;
- ``eval/<metric_name>``: the eval metric after the epoch (e.g. ``eval/accuracy``);
- ``throughput/samples_per_s``: training samples per second of training time;
- ``layout/num_frozen``, ``layout/pipeline_length``, ``layout/num_replicas``,
  ``layout/num_microbatches``: frozen blocks, K, R and M;
- ``cache/hit_rate``, ``cache/saved_s``, ``cache/bytes``: the fraction of frozen-prefix outputs
  the cache served, the time it saved, the bytes it held at the end of the epoch;
- ``time/epoch_s``, ``time/transition_s``, ``time/eval_s``: training, transition and
  evaluation time of the epoch;

plus the resolved configuration (YAML) and the run's totals as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pt_ray.reporting.report import train_time_s
from pt_ray.reporting.summary import ideal_speedup, read_summary

__all__ = ["SCALAR_TAGS", "scalar_tags", "write_tensorboard"]

# tag -> timeline field; ``eval/<metric_name>`` is added per run.
SCALAR_TAGS: dict[str, str] = {
    "train/loss": "train_loss",
    "throughput/samples_per_s": "throughput_samples_per_s",
    "layout/num_frozen": "num_frozen",
    "layout/pipeline_length": "pipeline_length",
    "layout/num_replicas": "num_replicas",
    "layout/num_microbatches": "num_microbatches",
    "cache/hit_rate": "cache_hit_rate",
    "cache/saved_s": "cache_saved_s",
    "cache/bytes": "cache_bytes",
    "cache/cost_ratio": "cache_cost_ratio",
    "time/epoch_s": "epoch_time_s",
    "time/transition_s": "transition_time_s",
    "time/eval_s": "eval_time_s",
}


def scalar_tags(metric_name: str) -> dict[str, str]:
    """Every scalar tag a run writes, mapped to its timeline field."""
    return {**SCALAR_TAGS, f"eval/{metric_name}": "eval_metric"}


def write_tensorboard(summary: Mapping[str, Any] | str | Path, logdir: str | Path) -> Path:
    """Write a run's timeline as TensorBoard scalars; view with ``tensorboard --logdir LOGDIR``.

    Each call adds a new event file, so give each run its own ``logdir`` (e.g.
    ``<run_dir>/tensorboard``); point TensorBoard at the parent folder to compare runs.

    Args:
        summary: a summary dict, a ``summary.json`` path or a run folder.
        logdir: the folder for the event file (created).

    Returns:
        ``logdir``.

    Raises:
        FileNotFoundError, ValueError: see :func:`pt_ray.reporting.summary.read_summary`.
    """
    from tensorboardX import SummaryWriter

    s = read_summary(summary, need_epochs=True)
    tl = s["timeline"]
    tags = scalar_tags(s.get("metric_name") or "metric")
    logdir = Path(logdir).expanduser()
    logdir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(logdir=str(logdir))
    try:
        for rec in tl:
            for tag, key in tags.items():
                value = rec.get(key)
                if value is not None:
                    writer.add_scalar(tag, float(value), global_step=int(rec["epoch"]) + 1)
        cfg = s.get("config")
        if cfg:
            writer.add_text("config", "```\n" + yaml.safe_dump(cfg, sort_keys=False) + "```")
        final = s.get("final_eval_metric")
        writer.add_text("summary", (
            f"{len(tl)} epochs, final {s.get('metric_name', 'metric')} "
            f"{'-' if final is None else f'{final:.4f}'}, wall time "
            f"{s.get('wall_time_s', float('nan')):.1f} s, train time {train_time_s(tl):.2f} s, "
            f"ideal speedup bound {ideal_speedup(tl):.2f}x"))
    finally:
        writer.close()
    return logdir
