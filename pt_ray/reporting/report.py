"""Run reports: a PNG timeline in the spirit of the paper's figures and a per-epoch table.

Reads the ``summary.json`` contract of :mod:`pt_ray.reporting.summary` (or the dict it holds).
No torch, no Ray: matplotlib with the Agg backend only, so reports render on a laptop, in CI, or
in a notebook from a run folder copied off a cluster.

The PNG has four panels over epochs, all sharing the x axis (epochs numbered from 1, as the
per-epoch log lines are):

1. frozen blocks (step plot, against L);
2. pipeline length K and replicas R (step plots);
3. training throughput (samples/s), with the cache hit rate as bars where the cache served;
4. training loss and the eval metric.

Transitions (epochs whose frozen count, K or R differ from the previous epoch's) are dashed
vertical lines on every panel, annotated on the first; a dotted cyan line marks where the
activation cache turned on, and epochs where it served samples are shaded.

The table ends with every rank's memory under each layout beside the planner's estimate
(:func:`memory_table`), where the run measured it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pt_ray.reporting.files import replaced_atomically
from pt_ray.reporting.summary import ideal_speedup, read_summary

__all__ = [
    "Transition",
    "cache_epochs",
    "cache_nodes_table",
    "format_comparison",
    "format_table",
        "memory_table",
    "render_report",
    "rollback_lines",
    "train_time_s",
    "transitions",
]

SummaryLike = Mapping[str, Any] | str | Path


@dataclass(frozen=True)
class Transition:
    """A layout change entering an epoch.

    Attributes:
        epoch: 0-based index of the first epoch under the new layout.
        changes: ``(field, before, after)`` for each of num_frozen, K, R that changed.
    """

    epoch: int
    changes: tuple[tuple[str, int, int], ...]

    def label(self, arrow: str = "->") -> str:
        """E.g. ``frozen 2->4, K 2->1, R 1->2``."""
        return ", ".join(f"{name} {a}{arrow}{b}" for name, a, b in self.changes)


_LAYOUT_FIELDS = (("frozen", "num_frozen"), ("K", "pipeline_length"), ("R", "num_replicas"))


def transitions(timeline: Sequence[Mapping[str, Any]]) -> list[Transition]:
    """Epochs whose frozen count, K or R differ from the previous epoch's."""
    out = []
    for prev, rec in zip(timeline, timeline[1:]):
        changes = tuple((name, int(prev[key]), int(rec[key])) for name, key in _LAYOUT_FIELDS
                        if prev[key] != rec[key])
        if changes:
            out.append(Transition(int(rec["epoch"]), changes))
    return out


def cache_epochs(timeline: Sequence[Mapping[str, Any]]) -> list[int]:
    """0-based epochs in which the activation cache served samples (hit rate > 0)."""
    return [int(r["epoch"]) for r in timeline if r.get("cache_hit_rate", 0.0) > 0]


def _cache_active(rec: Mapping[str, Any]) -> bool:
    """The cache held or served anything in the epoch (it fills before it serves)."""
    return rec.get("cache_hit_rate", 0.0) > 0 or rec.get("cache_objects", 0) > 0


def train_time_s(timeline: Sequence[Mapping[str, Any]]) -> float:
    """Sum of the epochs' training time (evaluation and start-up excluded)."""
    return float(sum(r["epoch_time_s"] for r in timeline))


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _fmt(value: Any, spec: str) -> str:
    x = _num(value)
    return "-" if math.isnan(x) else format(x, spec)


def _bounds(timeline: Sequence[Mapping[str, Any]]) -> tuple[float, float | None]:
    """The ideal speedup bound without the cache, and with it when the cache served."""
    cached = ideal_speedup(list(timeline), cached=True) if cache_epochs(timeline) else None
    return ideal_speedup(list(timeline)), cached


def _speedup_line(summary: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    ours, theirs = train_time_s(summary["timeline"]), train_time_s(baseline["timeline"])
    speedup = theirs / ours if ours else float("inf")
    bound, cached = _bounds(summary["timeline"])
    ideal = cached if cached is not None else bound
    return (f"measured speedup {speedup:.2f}x over the baseline's train time {theirs:.2f} s "
            f"({speedup / ideal:.0%} of the ideal {ideal:.2f}x)")


def format_table(summary: SummaryLike, baseline: SummaryLike | None = None) -> str:
    """A terminal table: one row per epoch, then totals and the ideal speedup bound.

    Columns: epoch (from 1), frozen/L, K, R, M, throughput (samples/s), epoch time and
    transition time (s), cache hit rate ("-" while the cache is off; it may hold rows and
    serve none in the epoch it fills), training loss, the eval metric, and the layout change
    entering the epoch. The footer gives the training time (sum of epochs), the wall time
    (start-up included) and the ideal bound of :func:`pt_ray.reporting.summary.ideal_speedup`;
    with a ``baseline`` run (e.g. ``freeze.policy=none`` on the same data), also the measured
    speedup of training time and its fraction of the bound.

    Raises:
        FileNotFoundError, ValueError: see :func:`pt_ray.reporting.summary.read_summary`.
    """
    s = read_summary(summary, need_epochs=True)
    tl = s["timeline"]
    metric = s.get("metric_name") or "metric"
    changes = {t.epoch: t.label() for t in transitions(tl)}
    head = ["epoch", "frozen/L", "K", "R", "M", "samples/s", "epoch s", "trans s", "cache",
            "loss", metric, "change"]
    rows = []
    for r in tl:
        hit = r.get("cache_hit_rate", 0.0)
        rows.append([
            str(r["epoch"] + 1), f"{r['num_frozen']}/{r['num_layers']}",
            str(r["pipeline_length"]), str(r["num_replicas"]), str(r["num_microbatches"]),
            _fmt(r["throughput_samples_per_s"], ",.0f"), _fmt(r["epoch_time_s"], ".2f"),
            _fmt(r.get("transition_time_s", 0.0), ".2f"),
            f"{hit:.0%}" if _cache_active(r) else "-",
            _fmt(r.get("train_loss"), ".4f"), _fmt(r.get("eval_metric"), ".4f"),
            changes.get(r["epoch"], ""),
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        # Right-align numbers; the last column (free text) left-aligned and not padded.
        return "  ".join(c.rjust(w) for c, w in zip(cells[:-1], widths[:-1])) + (
            "  " + cells[-1] if cells[-1] else "")

    title = (f"run {s.get('config', {}).get('name', '?')} ({s.get('engine', '?')} engine): "
             f"{len(tl)} epochs, final {metric} {_fmt(s.get('final_eval_metric'), '.4f')}")
    rule = "-" * len(line(head))
    bound, cached = _bounds(tl)
    foot = (f"train time {train_time_s(tl):.2f} s (sum of epochs); wall time "
            f"{_fmt(s.get('wall_time_s'), '.1f')} s (start-up and evaluation included)\n"
            f"ideal speedup bound from the freeze timeline: {bound:.2f}x vs no freezing")
    if cached is not None:
        foot += (f" ({cached:.2f}x with the cache, serving each frozen block from the "
                     "epoch after it froze)")
    for line_ in rollback_lines(s):
        foot += "\n" + line_
    if baseline is not None:
        foot += "\n" + _speedup_line(s, read_summary(baseline, need_epochs=True))
    memory = memory_table(s)
    nodes = cache_nodes_table(s)
    return "\n".join([title, line(head), rule, *(line(r) for r in rows), rule, foot]
                     + (["", memory] if memory else []) + (["", nodes] if nodes else []))


def cache_nodes_table(summary: SummaryLike) -> str:
    """The activation cache per node at the end of a run (``cache.nodes`` of the summary):
    bytes, objects, reads of the node's workers served on the node and from other nodes
    (objects), rows refused (budget or backlog) and bytes the node's store spilled to disk,
    under the cache's distinct size (each row once) beside what the nodes store together
    (copies included); ``""`` for a run without it."""
    s = read_summary(summary, need_epochs=True)
    cache = s.get("cache") or {}
    nodes = cache.get("nodes") or {}
    if not nodes:
        return ""
    head = ["node", "MiB", "objects", "local reads", "remote reads", "refused rows",
            "spilled MiB"]
    rows = [[node[:12], _fmt(n.get("bytes", float("nan")) / 2**20, ".1f"),
             str(n.get("objects", "-")), str(n.get("local_reads", "-")),
             str(n.get("remote_reads", "-")), str(n.get("refused_rows", "-")),
             _fmt(n.get("spilled_bytes", float("nan")) / 2**20, ".1f")]
            for node, n in sorted(nodes.items())]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    out = ["activation cache per node (reads in blocks)"]
    if "stored_bytes" in cache:  # summaries from before the copies were told apart lack it
        out.append(f"cache {cache['bytes'] / 2**20:.1f} MiB in {cache['objects']} blocks, "
                   f"stored as {cache['stored_bytes'] / 2**20:.1f} MiB in "
                   f"{cache['stored_objects']} blocks on {len(nodes)} nodes")
    out.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def memory_table(summary: SummaryLike) -> str:
    """Every rank's memory in the first epoch of each layout (the first epoch and each
    transition), beside the planner's estimate for its stage: ``""`` for a run without memory
    figures (the reference trainer, or a summary from before they existed).

    Columns (KiB, or MiB once a figure reaches 10 MiB): the stage's parameters, gradients and
    optimizer state, the activations saved for backward (peak of the epoch's sampled step),
    the peak (the CUDA allocator's, or the tracked sum on the CPU), the estimate, and its error
    against the measured peak (``estimate / peak - 1``). See
    :class:`pt_ray.reporting.summary.RankMemory`.
    """
    s = read_summary(summary, need_epochs=True)
    tl = [r for r in s["timeline"] if r.get("memory")]
    if not tl:
        return ""
    starts = {tl[0]["epoch"]} | {t.epoch for t in transitions(tl)}
    shown = [r for r in tl if r["epoch"] in starts]
    biggest = max(max(m["peak_bytes"], m.get("estimate_bytes", 0.0))
                  for r in shown for m in r["memory"])
    unit, scale = ("MiB", 2**20) if biggest >= 10 * 2**20 else ("KiB", 2**10)
    cuda = any(m.get("cuda") for r in shown for m in r["memory"])
    head = ["epoch", "layout", "rank", "stage", "params", "grads", "optim", "acts",
            "peak (CUDA)" if cuda else "peak (tracked)", "estimate", "error"]
    rows = []
    for r in shown:
        layout = f"{r['num_frozen']}/{r['num_layers']} K{r['pipeline_length']} R{r['num_replicas']}"
        for m in r["memory"]:
            est = m.get("estimate_bytes", 0.0)
            rows.append([str(r["epoch"] + 1), layout, str(m["rank"]), str(m["stage"]),
                         *(f"{m[k] / scale:,.1f}" for k in ("param_bytes", "grad_bytes",
                                                           "optimizer_bytes",
                                                           "activation_bytes", "peak_bytes")),
                         f"{est / scale:,.1f}" if est else "-",
                         f"{est / m['peak_bytes'] - 1:+.0%}" if est and m["peak_bytes"] else "-"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    rows_held = [m for r in shown for m in r["memory"]]
    if all(m["held_param_bytes"] == m["param_bytes"] for m in rows_held):
        note = "(each rank holds only its stage's parameters; the others' storage is freed)"
    else:  # a summary from before ranks released the layers they do not run
        held = max(m["held_param_bytes"] for m in rows_held)
        note = (f"(every rank holds all {held / scale:,.1f} {unit} of the model's parameters: "
                "each still builds the whole model)")
    title = (f"memory per rank ({unit}) in the first epoch of each layout: its stage's parameters, "
             "gradients, optimizer state and saved activations, its peak, the planner's estimate\n"
             + note)
    return "\n".join([title, line(head), "-" * len(line(head)), *(line(r) for r in rows)])


def rollback_lines(summary: Mapping[str, Any]) -> list[str]:
    """One line per rollback of the accuracy guard in a loaded summary (none without)."""
    out = []
    for r in summary.get("rollbacks") or []:
        undone = r.get("discarded", [])
        seconds = sum(d.get("epoch_time_s", 0.0) for d in undone)
        out.append(
            f"rollback: epoch {r['epoch'] + 1}'s {_fmt(r['after'], '.4f')} fell from "
            f"{_fmt(r['before'], '.4f')} after freezing {r['num_frozen']} -> {r['undone']} "
            f"blocks; returned to the start of epoch {r['rollback_to'] + 1} with "
            f"{r['num_frozen']} frozen ({len(undone)} epoch{'s' if len(undone) != 1 else ''} "
            f"undone, {seconds:.2f} s of "
            f"training not in the train time above)")
    return out


def format_comparison(runs: Mapping[str, SummaryLike]) -> str:
    """A table comparing runs (e.g. a sweep), one row each: final frozen/L, the last K and R,
    training time, wall time, mean throughput, the ideal speedup bound and the final metric.

    Args:
        runs: a label per run (e.g. ``"alpha=0.2"``) and its summary, summary path or run folder.
    """
    loaded = {label: read_summary(src, need_epochs=True) for label, src in runs.items()}
    metrics = {s.get("metric_name") or "metric" for s in loaded.values()}
    metric = metrics.pop() if len(metrics) == 1 else "metric"
    head = ["run", "epochs", "frozen/L", "K", "R", "train s", "wall s", "samples/s", "ideal",
            metric]
    rows = []
    for label, s in loaded.items():
        tl = s["timeline"]
        last = tl[-1]
        mean = sum(_num(r["throughput_samples_per_s"]) for r in tl) / len(tl)
        rows.append([label, str(len(tl)), f"{last['num_frozen']}/{last['num_layers']}",
                     str(last["pipeline_length"]), str(last["num_replicas"]),
                     f"{train_time_s(tl):.2f}", _fmt(s.get("wall_time_s"), ".1f"),
                     f"{mean:,.0f}", f"{ideal_speedup(tl):.2f}x",
                     _fmt(s.get("final_eval_metric"), ".4f")])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])]
                         + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

    return "\n".join([line(head), "-" * len(line(head)), *(line(r) for r in rows)])


def _describe(s: Mapping[str, Any]) -> str:
    cfg = s.get("config") or {}
    model, data, pipe = cfg.get("model", {}), cfg.get("data", {}), cfg.get("pipeline", {})
    freeze = cfg.get("freeze", {})
    parts = []
    if model:
        shape = ", ".join(f"{k} {model[k]}" for k in ("depth", "width") if model.get(k))
        parts.append(f"{model.get('family', '')} {model.get('name', '')}"
                     + (f" ({shape})" if shape else ""))
    if data:
        parts.append(f"data {data.get('name')}, batch {data.get('batch_size')}")
    if pipe and s.get("engine", cfg.get("engine")) != "reference":
        parts.append(f"N={pipe.get('num_workers')} workers")
    if freeze:
        parts.append(f"freeze {freeze.get('policy')} (alpha {_fmt(freeze.get('alpha'), '.3g')})")
    return "; ".join(parts)


def render_report(summary: SummaryLike, out_png: str | Path,
                  baseline: SummaryLike | None = None, dpi: int = 120) -> Path:
    """Render a run's timeline as a PNG (four panels; see the module docstring).

    Args:
        summary: a summary dict, a ``summary.json`` path or a run folder.
        out_png: where to write the PNG (parent folders are created).
        baseline: another run (e.g. without freezing) whose throughput is drawn dashed.
        dpi: resolution.

    Returns:
        The PNG's path.

    Raises:
        FileNotFoundError, ValueError: see :func:`pt_ray.reporting.summary.read_summary`.
    """
    # A bare Figure renders with Agg and leaves pyplot (and a notebook's backend) alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    s = read_summary(summary, need_epochs=True)
    base = read_summary(baseline, need_epochs=True) if baseline is not None else None
    tl = s["timeline"]
    x = [r["epoch"] + 1 for r in tl]
    L = max(r["num_layers"] for r in tl)
    metric = s.get("metric_name") or "metric"
    trans = transitions(tl)
    cached = cache_epochs(tl)

    # Figure() rather than pyplot: no global state, nothing left open in a long process.
    # Fixed margins rather than a constrained layout, which draws the whole figure once more
    # to measure it: that doubled the render, about a second at the end of every run.
    fig = Figure(figsize=(10, 10.5), dpi=dpi)
    ax_f, ax_kr, ax_t, ax_l = fig.subplots(4, 1, sharex=True,
                                           gridspec_kw={"height_ratios": [1, 1, 1.1, 1.2]})
    fig.subplots_adjust(left=0.075, right=0.925, top=0.925, bottom=0.05, hspace=0.08)
    name = (s.get("config") or {}).get("name", "run")
    bound, bound_cached = _bounds(tl)
    fig.suptitle(
        f"{name} ({s.get('engine', '?')} engine): wall {_fmt(s.get('wall_time_s'), '.1f')} s, "
        f"train {train_time_s(tl):.1f} s, final {metric} {_fmt(s.get('final_eval_metric'), '.4f')}"
        f", ideal bound {(bound_cached or bound):.2f}x\n{_describe(s)}", fontsize=11)

    edges = [x[0] - 0.5, *(e + 0.5 for e in x)]  # each epoch's layout spans [e - .5, e + .5]
    _frozen_panel(ax_f, tl, edges, L, s.get("rollbacks") or [])
    top = _layout_panel(ax_kr, tl, edges, MaxNLocator)
    _throughput_panel(ax_t, tl, x, base, cached)
    _loss_panel(ax_l, tl, x, metric, MaxNLocator)
    _marks((ax_f, ax_kr, ax_t, ax_l), tl, trans, cached, L, top)

    out = Path(out_png).expanduser()
    with replaced_atomically(out) as tmp:
        fig.savefig(tmp, dpi=dpi)
    return out


def _frozen_panel(ax, tl: list[dict], edges: list[float], L: int, rollbacks: list[dict]) -> None:
    """Panel 1: frozen blocks per epoch, the depth L, and any rollback."""
    frozen = [r["num_frozen"] for r in tl]
    ax.stairs(frozen, edges, fill=True, color="tab:blue", alpha=0.15)
    ax.stairs(frozen, edges, baseline=None, color="tab:blue", lw=2, label="frozen blocks")
    ax.axhline(L, color="gray", lw=1, ls=":", label=f"L = {L} blocks")
    for r in rollbacks:
        ax.axvline(r["rollback_to"] + 0.5, color="tab:red", lw=1.5,
                   label=f"rollback (epoch {r['epoch'] + 1} -> {r['rollback_to'] + 1})")
    ax.set_ylim(-0.2, L + 0.5)
    ax.set_ylabel("frozen blocks")
    ax.legend(loc="upper left", fontsize=8)


def _layout_panel(ax, tl: list[dict], edges: list[float], locator: Any) -> int:
    """Panel 2: pipeline length K and replicas R; returns the panel's top value."""
    ks = [r["pipeline_length"] for r in tl]
    rs = [r["num_replicas"] for r in tl]
    # K wide and pale under a thin dashed R, so both show where they are equal.
    ax.stairs(ks, edges, baseline=None, color="tab:purple", lw=5, alpha=0.45,
              label="pipeline length K")
    ax.stairs(rs, edges, baseline=None, color="tab:orange", lw=2, ls="--", label="replicas R")
    top = max(ks + rs)
    ax.set_ylim(0, top + 1)
    ax.yaxis.set_major_locator(locator(integer=True))
    ax.set_ylabel("K, R")
    ax.legend(loc="upper left", fontsize=8)
    return top


def _throughput_panel(ax, tl: list[dict], x: list[int], base: dict | None,
                      cached: list[int]) -> None:
    """Panel 3: throughput (a baseline's dashed), and the cache hit rate where it served."""
    ax.plot(x, [_num(r["throughput_samples_per_s"]) for r in tl], "o-", color="tab:green",
            ms=4, label="throughput")
    if base is not None:
        bx = [r["epoch"] + 1 for r in base["timeline"]]
        ax.plot(bx, [_num(r["throughput_samples_per_s"]) for r in base["timeline"]], "--",
                color="gray", label="baseline throughput")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    if cached:
        ax_c = ax.twinx()
        ax_c.bar(x, [100 * r.get("cache_hit_rate", 0.0) for r in tl], width=0.6,
                 color="tab:cyan", alpha=0.35, label="cache hit rate")
        ax_c.set_ylim(0, 105)
        ax_c.set_ylabel("cache hit rate (%)")
        ax.set_zorder(ax_c.get_zorder() + 1)  # the line over the bars
        ax.patch.set_visible(False)
        h, lab = ax_c.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, loc="upper left", fontsize=8)


def _loss_panel(ax, tl: list[dict], x: list[int], metric: str, locator: Any) -> None:
    """Panel 4: training loss (log scale when it spans decades) and the eval metric."""
    losses = [_num(r.get("train_loss")) for r in tl]
    ax.plot(x, losses, "o-", color="tab:red", ms=4, label="train loss")
    finite = [v for v in losses if not math.isnan(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")
    ax.set_ylabel("train loss")
    ax_m = ax.twinx()
    ax_m.plot(x, [_num(r.get("eval_metric")) for r in tl], "s-", color="tab:blue", ms=4,
              label=f"eval {metric}")
    ax_m.set_ylabel(f"eval {metric}")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax_m.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    ax.set_xlabel("epoch")
    ax.set_xlim(0.5, len(x) + 0.5)
    ax.xaxis.set_major_locator(locator(integer=True))


def _marks(axes: tuple, tl: list[dict], trans: list, cached: list[int], L: int,
           top: int) -> None:
    """Transitions, cache epochs and where the cache turned on, on every panel."""
    ax_f, ax_kr = axes[0], axes[1]
    for t in trans:
        for ax in axes:
            ax.axvline(t.epoch + 0.5, color="black", ls="--", lw=0.9, alpha=0.6)
        ax_f.annotate(t.label("→"), xy=(t.epoch + 0.5, L + 0.5), xytext=(3, -3),
                      textcoords="offset points", rotation=90, va="top", ha="left", fontsize=7,
                      bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    for e in cached:
        for ax in axes:
            ax.axvspan(e + 0.5, e + 1.5, color="tab:cyan", alpha=0.08, lw=0)
    active = [r["epoch"] for r in tl if _cache_active(r)]
    if active:
        # Where the cache turned on (it fills first, then serves: the shaded epochs).
        first = active[0]
        for ax in axes:
            ax.axvline(first + 0.5, color="tab:cyan", ls=":", lw=1.5)
        ax_kr.annotate("cache on", xy=(first + 0.5, top + 0.9), xytext=(3, -3),
                       textcoords="offset points", va="top", fontsize=8, color="tab:cyan")
    if trans:
        ax_f.plot([], [], color="black", ls="--", lw=0.9, label="transition")
        ax_f.legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
