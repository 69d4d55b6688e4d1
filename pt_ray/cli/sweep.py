"""``pt-ray sweep --alpha 0.2,0.25,0.33 [--grid key=v1,v2 ...]``: an alpha sweep on Ray Tune.

Every argument is checked, and every trial's config validated, before Ray starts.
"""

from __future__ import annotations

import argparse
import sys

from pt_ray.core.config import ConfigError

__all__ = ["add_sweep_parser", "run_sweep"]


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sweep`` command to a ``pt-ray`` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "sweep",
        help="run one training per freeze.alpha value (and a no-freeze baseline) on Ray Tune; "
        "table, sweep.json and a speedup-accuracy plot with the Pareto front",
        description="Sweep AutoFreeze's alpha: one full pt-ray run per value (times --grid), "
        "plus a freeze.policy=none baseline on the same data and seed, as Ray Tune trials, as "
        "many at once as the cluster's free CPUs (and GPUs) can run whole. Writes "
        "<output>/sweep.json, sweep.txt and sweep.png, and one run folder per trial.",
    )
    p.add_argument("--config", help="YAML file of RunConfig fields (default: the default job)")
    p.add_argument("--alpha", required=True, metavar="A1,A2,...",
                   help="freeze.alpha values in (0, 1], comma-separated, e.g. 0.2,0.25,0.33")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="also cross the alphas with these values of another field, e.g. "
                   "--grid pipeline.schedule=gpipe,1f1b (repeatable)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field for every trial, e.g. --set epochs=10 (repeatable)")
    p.add_argument("--output", help="the sweep folder (default: <output_dir>/<name>-sweep "
                   "from the config)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the freeze.policy=none baseline (no speedups then)")
    p.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                   help="run at most N trials at once (default and upper limit: as many as the "
                   "cluster fits)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted sweep in --output (finished trials are kept)")
    p.set_defaults(func=run_sweep)
    return p


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``pt-ray sweep``: 0 when every trial finished, 1 when some did not, 2 on bad input
    (nothing started)."""
    from pt_ray.reporting.logs import setup_logging
    from pt_ray.core.sweep import parse_alphas, parse_grid

    try:
        alphas = parse_alphas(args.alpha)
        grid = parse_grid(args.grid)
    except ConfigError as err:
        print(f"pt-ray: error: {err}", file=sys.stderr)
        return 2
    setup_logging()
    from pt_ray.tune import sweep  # imports Ray: only once the arguments are good

    try:
        result = sweep(args.config, alphas=alphas, grid=grid, overrides=args.overrides,
                       output_dir=args.output, baseline=args.baseline,
                       max_concurrent=args.max_concurrent, resume=args.resume)
    except ConfigError as err:
        print(f"pt-ray: error: {err}", file=sys.stderr)
        return 2
    files = f"{result.sweep_dir / 'sweep.json'}, sweep.txt, sweep.png"
    if result.ok:
        print(f"sweep done in {result.wall_time_s:.1f} s: {files}")
        return 0
    left = sum(r.status != "ok" for r in result.trials)
    print(f"sweep stopped after {result.wall_time_s:.1f} s with {left} of "
          f"{len(result.trials)} trials not finished: {files}; continue with the same "
          f"arguments and --resume")
    return 1
