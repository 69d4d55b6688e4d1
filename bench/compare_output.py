"""The table, plot and files of ``bench/compare.py``, from the figures of
:mod:`compare_report`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compare_report import (
    AIM_ACCURACY_POINTS,
    AIM_ENGINE_TAX,
    AIM_FRACTION,
    AIM_PREFIX_COST,
    STARTUP_PARTS,
    _med,
    _ref_arm,
    by_plan,
    per_epoch,
    summarise,
)

__all__ = ["plot", "table", "write_report"]

STYLES = {"baseline": ("tab:gray", "paper's baseline (no freeze, K=2)"),
          "freeze-only": ("tab:olive", "freeze only (K, R pinned)"),
          "pt-ray": ("tab:blue", "pt-ray (freezing)"),
          "cache": ("tab:purple", "pt-ray + cache"),
          "dp": ("tab:green", "pt-ray, no freeze, K=1"),
          "none": ("tab:cyan", "pt-ray, no freeze"),
          "peer": ("tab:red", "peer: Ray Train DDP")}
SHORT = {"baseline": "base", "freeze-only": "freeze only", "pt-ray": "pt-ray",
         "cache": "+ cache", "dp": "dp (K=1)", "none": "none", "peer": "peer"}


def plot(data: dict[str, Any], path: Path) -> None:
    """Per-epoch time of each arm with pt-ray's plan changes marked, and each arm's speedup
    over the peer (over the paper's baseline when no peer ran) against pt-ray's ideal bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8), width_ratios=[3, 1.8])
    _plot_epochs(ax, data)
    _plot_speedups(bx, data["summary"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_epochs(ax, data: dict[str, Any]) -> None:
    """Each arm's training time per epoch, pt-ray's plan changes marked."""
    rows = data["per_epoch"]
    epochs = [r["epoch"] + 1 for r in rows]
    for arm in data["arms"]:
        colour, label = STYLES[arm]
        ax.plot(epochs, [r[f"{arm}_s"] for r in rows], "o-", color=colour, label=label, ms=4)
    top = max(max(r[f"{a}_s"] for a in data["arms"]) for r in rows)
    prev, level = None, 0
    for r in rows:
        key = (r["num_frozen"], r["pipeline_length"], r["num_replicas"], r["num_microbatches"])
        if key != prev:
            ax.axvline(r["epoch"] + 0.5, color="tab:blue", alpha=0.25, lw=1)
            # Staggered heights so that changes in consecutive epochs stay readable.
            ax.annotate(f"n={key[0]} K={key[1]}\nR={key[2]} M={key[3]}",
                        (r["epoch"] + 0.6, top * (1.03 + 0.14 * (level % 3))), fontsize=7,
                        color="tab:blue", va="bottom")
            prev, level = key, level + 1
    ax.set_ylim(0, top * 1.5)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training time per epoch (s, median over repeats)")
    ax.set_title("per-epoch training time; pt-ray's plan (frozen n, K, R, M) marked")
    ax.legend(loc="lower left", fontsize=8)


def _plot_speedups(bx, s: dict[str, Any]) -> None:
    """Each arm's training-time speedup over the peer (or the paper's baseline), with
    pt-ray's wall-time ratio and the ideal bound."""
    peer = s.get("vs_peer")
    ref = "peer" if peer else "baseline" if "speedup" in s else None
    if ref is None:
        bx.set_axis_off()
        return
    arms = [r for r in s["ablation"] if r["arm"] != ref]
    names = [SHORT[r["arm"]].replace(" ", "\n") for r in arms]
    values = [r["vs_peer" if peer else "speedup"] for r in arms]
    colours = [STYLES[r["arm"]][0] for r in arms]
    wall = peer.get("wall_ratio_vs_peer") if peer else s["wall_time_ratio"]
    bound = peer.get("ideal_bound") if peer else s["ideal_bound"]
    for name, value, colour in (("pt-ray\n(wall)", wall, "tab:cyan"),
                                ("ideal\nbound", bound, "tab:orange")):
        if value is not None:
            names.append(name)
            values.append(value)
            colours.append(colour)
    bars = bx.bar(names, values, color=colours)
    for b, v in zip(bars, values):
        bx.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}x", ha="center", va="bottom",
                fontsize=8)
    if bound is not None:
        bx.axhline(AIM_FRACTION * bound, color="tab:orange", ls="--", lw=1,
                   label=f"{AIM_FRACTION:.0%} of bound")
        bx.legend(fontsize=8, loc="lower right")
    bx.axhline(1.0, color="black", lw=0.8)
    bx.set_ylabel(f"training-time speedup over the {'peer' if peer else 'paper baseline'}")
    if peer and "fraction_of_bound_vs_peer" in peer:
        bx.set_title(f"{peer['fraction_of_bound_vs_peer']:.0%} of bound; acc "
                     f"{peer['accuracy_diff_vs_peer_points']:+.2f} pt vs peer", fontsize=10)
    elif not peer:
        bx.set_title(f"{s['fraction_of_bound']:.0%} of bound; acc "
                     f"{s['accuracy_diff_points']:+.2f} pt", fontsize=10)


def _aim(met: bool) -> str:
    return "met" if met else "not met"


def peer_lines(p: dict[str, Any]) -> list[str]:
    """The headline against the peer, as text."""
    lines = ["headline: pt-ray against the peer (plain Ray Train DDP), medians of back-to-back "
             "pairs"]
    if "speedup_vs_peer" in p:
        lines += [
            f"  training time, peer / pt-ray             {p['speedup_vs_peer']:.2f}x"
            f"   per repeat {', '.join(f'{x:.2f}' for x in p['speedup_vs_peer_per_repeat'])}",
            f"  wall time (whole call), peer / pt-ray    {p['wall_ratio_vs_peer']:.2f}x"
            f"   (aim above 1: {_aim(p['meets_peer_wall_aim'])})",
            f"  of pt-ray's own ideal bound ({p['ideal_bound']:.2f}x)      "
            f"{p['fraction_of_bound_vs_peer']:.0%}"
            f"   (aim {AIM_FRACTION:.0%}: {_aim(p['meets_peer_fraction_aim'])})",
            f"  accuracy, pt-ray - peer                  "
            f"{p['accuracy_diff_vs_peer_points']:+.2f} points"
            f"   (aim within {AIM_ACCURACY_POINTS:g}: {_aim(p['meets_peer_accuracy_aim'])})",
        ]
    if "engine_tax_k1" in p:
        lines.append(
            f"  engine tax at K=1 (dp / peer - 1)        {p['engine_tax_k1']:+.1%} training, "
            f"{p['engine_tax_k1_wall']:+.1%} wall   (aim at most {AIM_ENGINE_TAX:.0%} training: "
            f"{_aim(p['meets_engine_tax_aim'])})")
    if "meets_overhead_aim" in p:
        lines.append("  pt-ray's start-up and per-epoch overhead within the peer's: "
                     + _aim(p["meets_overhead_aim"]))
    return lines


def none_lines(n: dict[str, Any]) -> list[str]:
    """pt-ray against itself without freezing, with each arm's first plan."""
    lines = [
        "pt-ray against the same run without freezing (none):",
        f"  training time, none / pt-ray             {n['speedup_vs_none']:.2f}x   per repeat "
        f"{', '.join(f'{x:.2f}' for x in n['speedup_vs_none_per_repeat'])}   (never slower: "
        f"{_aim(n['never_slower'])})",
        f"  wall time (whole call), none / pt-ray    {n['wall_ratio_vs_none']:.2f}x",
        f"  accuracy, pt-ray - none                  {n['accuracy_diff_vs_none_points']:+.2f} "
        "points"]
    for arm, plans in n["first_plans"].items():
        for p in plans:
            trials = "; ".join(f"{t['layout']} predicted {t['predicted_rate']:.1f}, measured "
                               f"{t['measured_rate']:.1f}" for t in p["start_trials"])
            lines.append(f"  {arm:<7} first plan {p['layout']}: {p['epoch_0_samples_per_s']:.1f} "
                         f"samples/s in epoch 0" + (f" (start trials: {trials})" if trials else ""))
    return lines


def breakdown_lines(data: dict[str, Any]) -> list[str]:
    """Each arm's wall time, part by part, beside its accuracy."""
    parts, acc = data["summary"]["breakdown"], data["metric_name"]
    lines = ["where the wall time goes (s, medians; per epoch: one epoch's evaluation, checkpoint "
             "and report):",
             f"{'arm':<12}{'start-up':>9}{'train':>8}{'eval':>7}{'between':>9}{'teardown':>10}"
             f"{'call':>8}{'per epoch':>11}{'fit wall':>10}{acc:>10}"]
    for arm in data["arms"]:
        recs = data["runs"][arm]
        q = parts.get(arm)

        def part(key: str, width: int, q: dict | None = q) -> str:
            if not q or q[key] is None:
                return f"{'?':>{width}}"
            return f"{q[key]:>{width}.{2 if key == 'per_epoch_overhead_s' else 1}f}"

        lines.append(
            f"{arm:<12}{part('startup_s', 9)}"
            f"{_med([r['train_time_s'] for r in recs]):>8.1f}"
            f"{_med([r['eval_time_sum_s'] for r in recs]):>7.1f}"
            f"{part('between_epochs_s', 9)}{part('teardown_s', 10)}"
            f"{_med([r['fit_call_s'] for r in recs]):>8.1f}{part('per_epoch_overhead_s', 11)}"
            f"{_med([r['wall_time_s'] for r in recs]):>10.1f}"
            f"{_med([r['final_accuracy'] for r in recs]):>10.4f}")
    noted = {arm: q["startup_parts"] for arm, q in parts.items() if q.get("startup_parts")}
    names = {"preflight_s": "checks", "worker_group_s": "workers", "dataset_s": "dataset",
             "model_s": "model", "setup_s": "set-up"}
    if noted:
        lines += ["", "start-up in parts (s, medians; checks: pt-ray's driver-side build of the "
                  "dataset and model; workers: Ray Train's worker group until rank 0 began; "
                  "set-up: pt-ray's profiling and first plan, the peer's DDP and loaders):",
                  f"{'arm':<12}" + "".join(f"{names[k]:>9}" for k in STARTUP_PARTS)]
        for arm, got in noted.items():
            lines.append(f"{arm:<12}" + "".join(
                f"{got[k]:>9.2f}" if k in got else f"{'-':>9}" for k in STARTUP_PARTS))
    cold = data.get("cold_start") or {}
    if cold:
        lines += ["", f"warm-up (each arm's unmeasured {data['warmup_epochs']}-epoch run, in "
                  f"this order; the first, {next(iter(cold))}, was the cluster's first run and "
                  "paid its first worker processes and the driver's first imports; s):",
                  f"{'arm':<12}{'start-up':>9}{'call':>8}"
                  + "".join(f"{names[k]:>9}" for k in STARTUP_PARTS)]
        for arm, got in cold.items():
            up = got.get("startup_s")
            lines.append(f"{arm:<12}" + (f"{up:>9.1f}" if up is not None else f"{'?':>9}")
                         + f"{got['fit_call_s']:>8.1f}" + "".join(
                             f"{got['startup'][k]:>9.2f}" if k in got["startup"] else f"{'-':>9}"
                             for k in STARTUP_PARTS))
    return lines


def baseline_lines(s: dict[str, Any]) -> list[str]:
    """pt-ray against the paper's baseline (K=2, no freezing), as text."""
    lines = [
        f"against the paper's baseline (K=2, no freezing; (K, R, M) {s['baseline_plan']}):",
        f"speedup (train time, baseline / pt-ray)  {s['speedup']:.2f}x"
        f"   per repeat {', '.join(f'{x:.2f}' for x in s['speedup_per_repeat'])}",
        f"speedup of fastest runs (min / min)      {s['speedup_of_minimums']:.2f}x",
        f"speedup, each epoch's fastest repeat     {s['speedup_best_epochs']:.2f}x",
        f"wall-time ratio                          {s['wall_time_ratio']:.2f}x",
        f"ideal bound                              {s['ideal_bound']:.2f}x"
        f"   (uncached {s['ideal_bound_uncached']:.2f}, ideal cache "
        f"{s['ideal_bound_cached']:.2f})",
        f"fraction of bound                        {s['fraction_of_bound']:.0%}"
        f"   (aim {AIM_FRACTION:.0%}: {_aim(s['meets_fraction_aim'])})",
        f"accuracy difference                      {s['accuracy_diff_points']:+.2f} points"
        f"   (aim within {AIM_ACCURACY_POINTS:g}: {_aim(s['meets_accuracy_aim'])})",
        "same-plan epochs ratio (noise; ideal 1)  "
        + (f"{s['same_plan_ratio']:.2f}   per repeat "
           f"{', '.join(f'{x:.2f}' for x in s['same_plan_ratio_per_repeat'])}"
           if s["same_plan_ratio"] is not None else "n/a"),
    ]
    if s.get("speedup_adjusted_for_same_plan") is not None:
        adj = s["speedup_adjusted_for_same_plan"]
        lines.append(f"speedup / same-plan ratio (heuristic)    {adj:.2f}x"
                     f"   ({adj / s['ideal_bound']:.0%} of bound)")
    if "speedup_vs_dp" in s:
        lines += [
            f"dp (K=1, no freeze) over baseline        {s['speedup_dp_over_baseline']:.2f}x",
            f"pt-ray over dp                           {s['speedup_vs_dp']:.2f}x"
            f"   ({s['fraction_of_bound_vs_dp']:.0%} of bound)",
        ]
    return lines


def table(data: dict[str, Any]) -> str:
    """The key figures as plain text."""
    s = data["summary"]
    acc = data["metric_name"]
    lines = [
        f"command: {data['command']}",
        f"pt_ray: {data['source']['pt_ray_path']}"
        + (f" (commit {data['source']['commit'][:10]}"
           + (", with uncommitted changes" if data["source"].get("uncommitted_changes") else "")
           + ")" if data["source"].get("commit") else "")
        + (f"; {data['source']['label']}" if data["source"].get("label") else ""),
        f"epochs {data['epochs']}, repeats {data['repeats']}, engine {data['engine']}, "
        f"N {data['num_workers']}, arms {', '.join(data['arms'])}",
        "",
    ]
    if "vs_peer" in s:
        lines += [*peer_lines(s["vs_peer"]), ""]
    if "vs_none" in s:
        lines += [*none_lines(s["vs_none"]), ""]
    lines += breakdown_lines(data)
    if "speedup" in s:
        lines += ["", *baseline_lines(s)]
    lines += ["", *_ablation_lines(s, acc)]
    if "prefix_cost" in s:
        lines += _prefix_cost_lines(s["prefix_cost"])
    lines += ["", *_by_plan_lines(data)]
    if s.get("note"):
        lines += ["", f"NOTE: {s['note']}"]
    return "\n".join(lines)


def _ablation_lines(s: dict[str, Any], acc: str) -> list[str]:
    """Each arm's training-time speedup over the paper's baseline and over the peer."""
    ref = "the paper's baseline" if "speedup" in s["ablation"][0] else ""
    cols = [(k, h) for k, h in (("speedup", "vs base"), ("vs_peer", "vs peer"))
            if k in s["ablation"][0]]
    over = " and over ".join(filter(None, [ref, "the peer" if "vs_peer" in s else ""]))
    lines = [f"ablation (training-time speedup of each arm over {over}):" if over
             else "ablation (each arm's freeze timeline):",
             f"{'':<42}" + "".join(f"{h:>9}" for _, h in cols)
             + (f"{'wall':>7}{'bound':>7}{'of bound':>9}" if ref else f"{'bound':>7}")
             + f"{acc:>10}{'frozen':>8}"]
    for r in s["ablation"]:
        lines.append(f"{r['label']:<42}" + "".join(f"{r[k]:>8.2f}x" for k, _ in cols)
                     + (f"{r['wall_time_ratio']:>6.2f}x{r['ideal_bound']:>6.2f}x"
                        f"{r['fraction_of_bound']:>9.0%}" if ref else f"{r['ideal_bound']:>6.2f}x")
                     + f"{r['accuracy']:>10.4f}{r['max_frozen']:>8}")
    return lines


def _prefix_cost_lines(pc: dict[str, Any]) -> list[str]:
    """The frozen prefix's cost per sample with the cache, over without."""
    per = ", ".join(f"e{p['epoch']} {p['ratio']:.0%} ({p['hit_rate']:.0%} hits)"
                    for p in pc["per_epoch"])
    lines = [
        "frozen prefix per sample with the cache, over without: "
        + (f"steady state median {pc['steady_median']:.1%}, max {pc['steady_max']:.1%} "
           f"over {pc['steady_epochs']} epochs (aim at most {AIM_PREFIX_COST:.0%}: "
           f"{_aim(pc['meets_aim'])})" if pc["steady_epochs"]
           else "no steady-state epoch (the cache never served a whole epoch)")]
    if per:
        lines.append(f"  per epoch: {per}")
    return lines


def _by_plan_lines(data: dict[str, Any]) -> list[str]:
    """Summed epoch times per pt-ray plan, with the arms' ratios and the ideal."""
    pt = _ref_arm(data["runs"])
    ratios = [(k, f"{SHORT[a]}/{SHORT[pt]}") for k, a in (("ratio", "baseline"),
                                                         ("peer_ratio", "peer"))
              if k in data["by_plan"][0]]
    lines = [f"by {pt} plan (summed epoch times, s):",
             f"{'n':>3}{'K':>3}{'R':>3}{'M':>4}{'epochs':>8}"
             + "".join(f"{a:>{max(len(a) + 2, 9)}}" for a in data["arms"])
             + "".join(f"{h:>{len(h) + 2}}" for _, h in ratios) + f"{'ideal':>8}"]
    for g in data["by_plan"]:
        lines.append(
            f"{g['num_frozen']:>3}{g['pipeline_length']:>3}{g['num_replicas']:>3}"
            f"{g['num_microbatches']:>4}{g['epochs']:>8}"
            + "".join(f"{g[f'{a}_s']:>{max(len(a) + 2, 9)}.2f}" for a in data["arms"])
            + "".join(f"{g[k]:>{len(h) + 2}.2f}" for k, h in ratios)
            + f"{g['ideal_ratio']:>8.2f}")
    return lines


def write_report(data: dict[str, Any], out: Path) -> None:
    """Derive the figures from ``data["runs"]``, write the JSON and PNG, print the table."""
    runs = data["runs"]
    data["per_epoch"] = per_epoch(runs)
    data["by_plan"] = by_plan(runs, data["per_epoch"])
    data["summary"] = summarise(runs, data.get("cache_mode", "off"))
    data = {k: v for k, v in data.items() if k != "runs"} | {"runs": runs}  # runs last
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(data, indent=2))
    plot(data, out / "compare.png")
    print()
    print(table(data))
    print(f"\nwrote {out / 'compare.json'} and {out / 'compare.png'}")
