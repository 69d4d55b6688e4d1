"""Alpha sweep results: speedups over the baseline, the Pareto front, and the text table,
``sweep.json`` and ``sweep.png`` (speedup against accuracy).

Pure module (matplotlib's Agg backend through a bare Figure; no torch, no Ray), so a sweep's
figures can be re-rendered from literal rows or a copied ``sweep.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pt_ray.core.sweep import Variant

__all__ = [
    "DEFINITIONS",
    "TrialRow",
    "analyse",
    "format_sweep_table",
    "pareto_front",
    "render_sweep_png",
    "write_sweep_json",
]

DEFINITIONS = {
    "train_time_s": "sum over epochs of epoch_time_s + transition_time_s (training steps and "
                    "re-plans; evaluation, start-up and checkpoints excluded)",
    "wall_time_s": "the trial's fit() wall time (Ray Train start, profiling, training, "
                   "evaluation, checkpoints)",
    "speedup_train": "baseline train_time_s / this trial's train_time_s",
    "speedup_wall": "baseline wall_time_s / this trial's wall_time_s",
    "metric_diff_points": "100 * (final metric - the baseline's final metric)",
    "pareto": "no other finished trial has both a speedup_train and a final metric at least as "
              "high, one of them higher",
    "ideal_speedup": "the ideal bound from the freeze timeline (active block 3 units, frozen "
                     "1, or 0 when the cache served the run)",
}


@dataclass(frozen=True)
class TrialRow:
    """One trial's outcome and how it compares with its baseline.

    Attributes:
        name, label, alpha, baseline: see :class:`Variant`.
        grid: the grid fields of this trial.
        status: ``ok``, ``error`` (the run failed) or ``unfinished`` (the sweep stopped first).
        metric_name: e.g. ``accuracy``.
        final_metric: the eval metric after the last epoch.
        wall_time_s: the run's wall time.
        train_time_s: sum of epoch_time_s + transition_time_s.
        ideal_speedup: the bound of :func:`pt_ray.reporting.summary.ideal_speedup` for the timeline.
        num_frozen, num_layers, pipeline_length, num_replicas: the layout in the last epoch.
        summary_path: the run's ``summary.json``.
        error: why the run failed.
        speedup_train, speedup_wall: baseline time / this trial's (None without a baseline).
        metric_diff_points: 100 * (final metric - baseline's).
        pareto: on the front of (speedup_train, final_metric), both maximised.
    """

    name: str
    label: str
    alpha: float | None
    baseline: str | None = None
    grid: dict[str, str] = field(default_factory=dict)
    status: str = "ok"
    metric_name: str = "metric"
    final_metric: float | None = None
    wall_time_s: float | None = None
    train_time_s: float | None = None
    ideal_speedup: float | None = None
    num_frozen: int | None = None
    num_layers: int | None = None
    pipeline_length: int | None = None
    num_replicas: int | None = None
    summary_path: str | None = None
    error: str | None = None
    speedup_train: float | None = None
    speedup_wall: float | None = None
    metric_diff_points: float | None = None
    pareto: bool = False

    @property
    def is_baseline(self) -> bool:
        return self.alpha is None

    @classmethod
    def from_metrics(cls, variant: Variant, metrics: Mapping[str, Any] | None,
                     status: str = "ok", error: str | None = None) -> TrialRow:
        """A row from the figures a trial reported (``ray.tune.report``)."""
        m = dict(metrics or {})
        keys = ("metric_name", "final_metric", "wall_time_s", "train_time_s", "ideal_speedup",
                "num_frozen", "num_layers", "pipeline_length", "num_replicas", "summary_path")
        return cls(name=variant.name, label=variant.label, alpha=variant.alpha,
                   baseline=variant.baseline, grid=dict(variant.grid), status=status,
                   error=error, **{k: m[k] for k in keys if m.get(k) is not None})


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each ``(x, y)``, whether no other point is at least as high in both and higher in
    one (both maximised). Equal points are all on the front."""
    return [not any(qx >= px and qy >= py and (qx > px or qy > py) for qx, qy in points)
            for px, py in points]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def analyse(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Fill each row's speedups and metric difference against its baseline (a baseline's own
    are 1.0 and 0.0), then mark the Pareto front over the finished rows."""
    by_name = {r.name: r for r in rows}
    out = []
    for r in rows:
        base = r if r.is_baseline else by_name.get(r.baseline or "")
        if base is None or base.status != "ok" or r.status != "ok":
            out.append(replace(r, speedup_train=None, speedup_wall=None,
                               metric_diff_points=None, pareto=False))
            continue
        diff = (100.0 * (r.final_metric - base.final_metric)
                if r.final_metric is not None and base.final_metric is not None else None)
        out.append(replace(r, speedup_train=_ratio(base.train_time_s, r.train_time_s),
                           speedup_wall=_ratio(base.wall_time_s, r.wall_time_s),
                           metric_diff_points=diff))
    ranked = [i for i, r in enumerate(out) if r.status == "ok" and r.final_metric is not None
              and r.speedup_train is not None]
    if not ranked:  # no baseline: rank by 1 / train time, which orders the same way
        ranked = [i for i, r in enumerate(out) if r.status == "ok" and r.final_metric is not None
                  and r.train_time_s]
        xs = [1.0 / out[i].train_time_s for i in ranked]
    else:
        xs = [out[i].speedup_train for i in ranked]
    front = pareto_front([(x, out[i].final_metric) for x, i in zip(xs, ranked)])
    for i, on in zip(ranked, front):
        out[i] = replace(out[i], pareto=on)
    return out


def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        format(value, spec) + suffix)


def format_sweep_table(rows: Sequence[TrialRow], footer: Sequence[str] = ()) -> str:
    """A terminal table, one row per trial: alpha and grid values, the last layout, train and
    wall time, the speedups over the baseline, the final metric and its difference in points,
    and ``*`` on the Pareto front."""
    metric = next((r.metric_name for r in rows if r.status == "ok"), "metric")
    grid_keys = list(dict.fromkeys(k for r in rows for k in r.grid))
    head = ["trial", "alpha", *grid_keys, "frozen/L", "K", "R", "train s", "wall s",
            "speedup", "wall x", "ideal", metric, "diff pts", "pareto"]
    body = []
    for r in rows:
        layout = (f"{r.num_frozen}/{r.num_layers}" if r.num_layers is not None else "-")
        body.append([
            r.name, _f(r.alpha, "g") if not r.is_baseline else "none",
            *(r.grid.get(k, "") for k in grid_keys), layout,
            _f(r.pipeline_length, "d"), _f(r.num_replicas, "d"),
            _f(r.train_time_s, ".2f"), _f(r.wall_time_s, ".1f"),
            _f(r.speedup_train, ".2f", "x"), _f(r.speedup_wall, ".2f", "x"),
            _f(r.ideal_speedup, ".2f", "x"), _f(r.final_metric, ".4f"),
            _f(r.metric_diff_points, "+.2f"),
            "*" if r.pareto else ("" if r.status == "ok" else r.status),
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0]),
                          *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))]).rstrip()

    rule = "-" * len(line(head))
    notes = ["speedup = baseline train time / trial train time (train time: sum of epoch and "
             "transition times); wall x: the same for wall time; diff pts: 100 x (metric - "
             "baseline's); * = Pareto-optimal (speedup and metric both maximised)"]
    errors = [f"{r.name}: {r.status}" + (f" ({r.error})" if r.error else "")
              for r in rows if r.status != "ok"]
    return "\n".join([line(head), rule, *(line(b) for b in body), rule, *notes, *errors,
                      *footer])


def write_sweep_json(path: Path, rows: Sequence[TrialRow], **extra: Any) -> dict[str, Any]:
    """Write ``sweep.json``: the trials (every :class:`TrialRow` field), the Pareto front's
    names, the definitions of the figures, and ``extra`` (sweep settings, timings)."""
    data = {
        **extra,
        "metric_name": next((r.metric_name for r in rows if r.status == "ok"), None),
        "pareto": [r.name for r in rows if r.pareto],
        "definitions": DEFINITIONS,
        "trials": [{**asdict(r), "is_baseline": r.is_baseline} for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    return data


def render_sweep_png(rows: Sequence[TrialRow], out_png: str | Path, title: str = "",
                     dpi: int = 120) -> Path:
    """Speedup over the baseline (train time) against the final metric, one point per finished
    trial labelled with its alpha (or ``baseline``); Pareto-optimal points are ringed in red and
    joined by the front's staircase. Without a baseline the x axis is 1 / train time."""
    from matplotlib.figure import Figure

    done = [r for r in rows if r.status == "ok" and r.final_metric is not None]
    with_base = any(r.speedup_train is not None for r in done)
    if with_base:
        done = [r for r in done if r.speedup_train is not None]

    def x_of(r: TrialRow) -> float:
        return r.speedup_train if with_base else 1.0 / r.train_time_s

    metric = next((r.metric_name for r in done), "metric")
    fig = Figure(figsize=(7.5, 5.5), dpi=dpi, layout="constrained")
    ax = fig.subplots()
    for r in done:
        if r.is_baseline:
            style = dict(marker="s", s=70, color="tab:gray", edgecolor="black", zorder=3)
        else:
            style = dict(marker="o", s=60, color="tab:blue", edgecolor="black", zorder=3)
        ax.scatter([x_of(r)], [r.final_metric], **style)
        if r.pareto:
            ax.scatter([x_of(r)], [r.final_metric], marker="o", s=260, facecolors="none",
                       edgecolors="tab:red", linewidths=2, zorder=4)
        text = r.label if (r.is_baseline or r.grid) else f"α={r.alpha:g}"
        ax.annotate(text.replace("alpha=", "α="), (x_of(r), r.final_metric),
                    xytext=(9, 7), textcoords="offset points", fontsize=8)
    front = sorted((x_of(r), r.final_metric) for r in done if r.pareto)
    if len(front) > 1:
        # Sorted by speedup, the front's metric falls; the staircase bounds what it dominates.
        ax.step([p[0] for p in front], [p[1] for p in front], where="pre",
                color="tab:red", lw=1.5, alpha=0.7, zorder=2)
    ax.scatter([], [], marker="o", color="tab:blue", edgecolor="black",
               label="alpha trial (label: alpha)")
    if any(r.is_baseline for r in done):
        ax.scatter([], [], marker="s", color="tab:gray", edgecolor="black",
                   label="baseline (no freezing)")
        ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.scatter([], [], marker="o", s=120, facecolors="none", edgecolors="tab:red",
               linewidths=2, label="Pareto-optimal")
    ax.set_xlabel("speedup over the baseline (train time)" if with_base
                  else "1 / train time (1/s)")
    ax.set_ylabel(f"final eval {metric}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title or "alpha sweep: speedup against accuracy", fontsize=10)
    ax.margins(x=0.15, y=0.15)
    out = Path(out_png).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out
