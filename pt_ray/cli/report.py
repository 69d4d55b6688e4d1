"""``pt-ray report RUN_DIR``: a finished run's timeline as a PNG and a per-epoch table.

No torch, no Ray: reads the run's ``summary.json`` (see :mod:`pt_ray.reporting.summary`), so it
works on a run folder copied off a cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_report_parser", "run_report"]


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``report`` command to a ``pt-ray`` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "report",
        help="plot a finished run's timeline (frozen blocks, K, R, throughput, loss) and "
        "print its per-epoch table",
        description="Render a finished run's timeline as a PNG (frozen blocks, pipeline "
        "length K and replicas R, throughput and cache hit rate, loss and the eval metric over "
        "epochs, with transitions marked) and print one table row per epoch with the ideal "
        "speedup bound.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run folder (holding summary.json) or a summary.json file")
    p.add_argument("--out", metavar="PNG", type=Path,
                   help="where to write the PNG (default: RUN_DIR/report.png)")
    p.add_argument("--no-table", dest="table", action="store_false",
                   help="do not print the per-epoch table")
    p.add_argument("--baseline", metavar="RUN_DIR",
                   help="a baseline run (e.g. --set freeze.policy=none on the same data): "
                   "prints the measured speedup and its fraction of the ideal bound, and draws "
                   "the baseline's throughput")
    p.add_argument("--tensorboard", metavar="LOGDIR", type=Path,
                   help="also write the timeline as TensorBoard scalars into LOGDIR")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    """Run ``pt-ray report``: print the table, write the PNG; 0 on success, 2 on a bad path."""
    from pt_ray.reporting.report import format_table, render_report
    from pt_ray.reporting.summary import read_summary

    try:
        summary = read_summary(args.run_dir, need_epochs=True)
        baseline = (read_summary(args.baseline, need_epochs=True)
                    if getattr(args, "baseline", None) else None)
    except (FileNotFoundError, ValueError) as err:
        print(f"pt-ray: error: {err}", file=sys.stderr)
        return 2
    source = Path(args.run_dir).expanduser()
    run_dir = source if source.is_dir() else source.parent
    out = args.out if args.out is not None else run_dir / "report.png"
    if args.table:
        print(format_table(summary, baseline))
    png = render_report(summary, out, baseline)
    print(f"report: {png}")
    if getattr(args, "tensorboard", None) is not None:
        from pt_ray.reporting.tensorboard import write_tensorboard

        print(f"tensorboard: {write_tensorboard(summary, args.tensorboard)}")
    return 0
