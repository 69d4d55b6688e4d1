"""The best fixed freeze timeline of a workload: what any freeze policy can reach there.

For each seed, one ``none`` run of the workload (``accuracy_matrix.WORKLOADS``) on the reference
trainer decides every ``--interval`` of the run's steps. At the decisions that first pass each
``--from`` fraction of the run, the process forks once per ``--frozen`` k: the child freezes the
first k blocks there and keeps them frozen to the end, the parent goes on without freezing. A
branch therefore shares the ``none`` run's every step before its freeze, at the cost of only the
steps after it. The accuracy guard is off in every branch (this measures what a freeze costs,
not what the guard would have undone).

Each cell (k blocks from fraction s) records its final eval metric and the ideal bound of its
timeline, with the cache (a frozen block costs nothing from the epoch after it froze, when
the rows that epoch cached are read) and without
(``pt_ray.reporting.summary.ideal_speedup``). The table gives, per cell, the mean over seeds and
the change against ``none`` in points; the best cell is the highest bound with the cache whose
mean stays within ``--tolerance`` points (0.5) of ``none``. Writes ``<out>/oracle.json`` (after
every finished branch) and ``<out>/oracle.md``. Usage:

    python bench/oracle.py --workload fashion-transfer [--seeds 0,1] [--frozen 2,3,4,5]
                           [--from 0.1,0.2,0.35,0.5] [--interval 0.05] [--jobs 1] [--out DIR]
                           [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_matrix import WORKLOADS, prepare_workload  # noqa: E402
from pt_ray.service.settings import run_settings

__all__ = ["FixedBranches", "best_cell", "summarise"]


class FixedBranches:
    """A freeze policy that never freezes, and forks a fixed-timeline branch per k at the
    decisions that first pass each branch point.

    Args:
        trainer_steps: reads the trainer's global step (the branch points are in steps).
        num_layers: L.
        branch_steps: the steps from which branches freeze, in order.
        frozen: the k of each branch.
        run_branch: called in each child as ``run_branch(k, step)`` after the fork; the child
            then trains on with k frozen blocks.
        jobs: most children alive at once (the parent waits for one to end before forking).
    """

    name = "oracle"

    def __init__(self, trainer_steps, num_layers: int, branch_steps: list[int],
                 frozen: list[int], run_branch, jobs: int) -> None:
        self.trainer_steps = trainer_steps
        self.num_layers = num_layers
        self.max_frozen = num_layers - 1
        self.pending = list(branch_steps)
        self.frozen = frozen
        self.run_branch = run_branch
        self.jobs = jobs
        self.children: set[int] = set()
        self.fixed: int | None = None  # set in a child: its k

    def decide(self, decision: int, num_frozen: int, grad_norms=None):
        from pt_ray.core.freeze import FreezeDecision

        if self.fixed is not None:
            return FreezeDecision(self.fixed, self.fixed, f"oracle branch: {self.fixed} frozen")
        step = self.trainer_steps()
        while self.pending and step >= self.pending[0]:
            self.pending.pop(0)
            for k in self.frozen:
                while len(self.children) >= self.jobs:
                    self.children.discard(os.wait()[0])
                pid = os.fork()
                if pid == 0:
                    self.fixed, self.pending = k, []
                    self.run_branch(k, step)
                    return FreezeDecision(k, k, f"oracle branch: {k} frozen from step {step}")
                self.children.add(pid)
        return FreezeDecision(num_frozen, num_frozen, "oracle: the none run")


def _cell_record(trainer, timeline, seed: int, k: int, step: int, wall: float) -> dict[str, Any]:
    from pt_ray.reporting.summary import ideal_speedup

    return {"seed": seed, "frozen": k, "from_step": step,
            "from_fraction": step / trainer.sampler.steps_per_epoch / trainer.settings.epochs,
            "metric": timeline[-1].eval_metric, "wall_s": wall,
            "bound_cached": ideal_speedup(timeline, cached=True),
            "bound": ideal_speedup(timeline),
            "frozen_by_epoch": [round(r.mean_frozen, 2) for r in timeline]}


def run_seed(overrides: list[str], seed: int, args: argparse.Namespace, out: Path) -> None:
    """The ``none`` run of one seed and every branch forked from it; each writes its cell under
    ``out/cells``."""
    import torch

    torch.set_num_threads(1)
    from pt_ray.api import default_config_path
    from pt_ray.core.config import load_config
    from pt_ray.runtime.reference import build_reference

    cells = out / "cells"
    cells.mkdir(parents=True, exist_ok=True)
    cfg = load_config(default_config_path(), [
        *overrides, *args.set, "freeze.policy=none", f"seed={seed}", "freeze.guard_points=null",
        "freeze.interval=steps"])
    trainer = build_reference(run_settings(cfg).reference)
    total = trainer.sampler.steps_per_epoch * cfg.epochs
    cfg = cfg.model_copy(update={"freeze": cfg.freeze.model_copy(
        update={"interval_steps": max(1, math.ceil(args.interval * total))})})
    from pt_ray.control.state import decision_interval

    trainer.interval = decision_interval(run_settings(cfg).control.decisions,
                                         trainer.sampler.steps_per_epoch)
    branch = {"k": None, "step": 0}

    def run_branch(k: int, step: int) -> None:
        branch.update(k=k, step=step)

    starts = sorted({max(1, round(f * total)) for f in args.from_fractions})
    depth = trainer.adapter.num_layers
    frozen = args.frozen or list(range(max(1, depth // 3), depth))
    trainer.policy = FixedBranches(lambda: trainer.global_step, depth, starts, frozen,
                                   run_branch, args.jobs)
    t0 = time.perf_counter()
    try:
        timeline = trainer.fit()
        k, step = branch["k"] or 0, branch["step"]
        rec = _cell_record(trainer, timeline, seed, k, step, time.perf_counter() - t0)
        (cells / f"seed{seed}-k{k}-s{step}.json").write_text(json.dumps(rec))
    except BaseException:
        if branch["k"] is None:
            raise
        traceback.print_exc()
        os._exit(1)  # a branch never returns into its parent's caller
    if branch["k"] is not None:
        os._exit(0)  # a branch: its parent collects the cells
    failed = [pid for pid in trainer.policy.children if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} oracle branches of seed {seed} failed (see above)")


def best_cell(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any] | None:
    """The row with the highest cached bound whose mean is within ``tolerance`` points of
    ``none`` (rows from :func:`summarise`)."""
    ok = [r for r in rows if r["frozen"] > 0 and r["vs_none_points"] >= -tolerance]
    return max(ok, key=lambda r: r["bound_cached"], default=None)


def summarise(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (k, from fraction): means over seeds, and the change against ``none``."""
    groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for c in cells:
        key = (c["frozen"], round(c["from_fraction"], 3) if c["frozen"] else 0.0)
        groups.setdefault(key, []).append(c)
    none = {c["seed"]: c["metric"] for c in groups.get((0, 0.0), [])}
    rows = []
    for (k, frac), group in sorted(groups.items()):
        paired = [100 * (c["metric"] - none[c["seed"]]) for c in group if c["seed"] in none]
        rows.append({
            "frozen": k, "from_fraction": frac, "seeds": sorted(c["seed"] for c in group),
            "mean_pct": 100 * sum(c["metric"] for c in group) / len(group),
            "vs_none_points": sum(paired) / len(paired) if paired else float("nan"),
            "bound_cached": sum(c["bound_cached"] for c in group) / len(group),
            "bound": sum(c["bound"] for c in group) / len(group)})
    return rows


def table(rows: list[dict[str, Any]], tolerance: float) -> str:
    best = best_cell(rows, tolerance)
    lines = ["| frozen | from | seeds | mean % | vs none (points) | bound (cache) | bound |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **best**" if r is best else ""
        lines.append(f"| {r['frozen']} | {100 * r['from_fraction']:.0f}% | "
                     f"{','.join(map(str, r['seeds']))} | {r['mean_pct']:.2f} | "
                     f"{r['vs_none_points']:+.2f} | {r['bound_cached']:.2f}x{mark} | "
                     f"{r['bound']:.2f}x |")
    return "\n".join(lines)


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--seeds", type=_csv(int), default=[0, 1])
    p.add_argument("--frozen", type=_csv(int), default=None,
                   help="blocks each branch freezes (default: L/3 .. L-1)")
    p.add_argument("--from", dest="from_fractions", type=_csv(float),
                   default=[0.1, 0.2, 0.35, 0.5], help="fractions of the run's steps")
    p.add_argument("--interval", type=float, default=0.05,
                   help="decisions every this fraction of the run")
    p.add_argument("--tolerance", type=float, default=0.5, help="points below none")
    p.add_argument("--jobs", type=int, default=1, help="branches alive beside the none run")
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--out", type=Path, default=Path("bench/out/oracle"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    made = prepare_workload(WORKLOADS[args.workload], args.out)
    if made is None:
        raise SystemExit(2)
    for seed in args.seeds:
        print(f"seed {seed}: the none run, branches of k={args.frozen or 'L/3..L-1'} blocks "
              f"from {args.from_fractions} of the run", flush=True)
        run_seed(list(made.overrides), seed, args, args.out)
    cells = [json.loads(p.read_text()) for p in sorted((args.out / "cells").glob("*.json"))]
    rows = summarise(cells)
    text = table(rows, args.tolerance)
    (args.out / "oracle.json").write_text(json.dumps({"cells": cells, "rows": rows}, indent=1))
    (args.out / "oracle.md").write_text(text + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main()
