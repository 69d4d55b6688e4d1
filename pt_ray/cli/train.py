"""The ``pt-ray`` command line: ``pt-ray train [--config FILE] [--set key=value ...]``, and
``plan``, ``report``, ``export`` and ``sweep``."""

from __future__ import annotations

import argparse
import sys

from pt_ray.cli.export import add_export_parser
from pt_ray.reporting.logs import setup_logging
from pt_ray.cli.plan import add_plan_parser
from pt_ray.cli.report import add_report_parser
from pt_ray.cli.sweep import add_sweep_parser
from pt_ray.core.config import ConfigError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pt-ray",
        description="PipeTransformer on Ray: train Transformers with elastic pipelining.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model (no arguments: the default job, a small ViT on digits)",
        description="Train a model with AutoFreeze. With no arguments runs the default job: "
        "a depth-6 ViT on scikit-learn's handwritten digits.",
    )
    train.add_argument("--config", help="YAML file of RunConfig fields (default: the default job)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set freeze.alpha=0.25 (repeatable)",
    )
    train.add_argument("--output", help="folder for config.yaml and summary.json "
                       "(default: <output_dir>/<name> from the config)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the stopped run in RUN_DIR from its newest complete "
                       "checkpoint, in that folder (--set may change pipeline.* and logging.*, "
                       "e.g. the number of workers)")
    add_plan_parser(sub)
    add_report_parser(sub)
    add_export_parser(sub)
    add_sweep_parser(sub)
    return parser


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (a quoted library message, e.g. YAML's, may span several)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pt-ray`` console script."""
    args = _parser().parse_args(argv)
    if args.command in ("plan", "report", "export", "sweep"):
        return args.func(args)
    setup_logging()
    from pt_ray.api import fit, resolve_config

    # fit raises ConfigError too, before anything starts: an output folder that cannot be made,
    # dataset or weights files that cannot be read, a model that cannot be built, a device
    # choice the cluster cannot meet (pipeline.use_gpu=true without the GPUs), workers a cluster
    # it attached to cannot place (pt_ray.core.placement.PlacementError); and, with --resume, a
    # folder holding no run that can go on (pt_ray.runtime.resume.resume_point).
    try:
        if args.resume is not None:
            if args.config is not None or args.output is not None:
                raise ConfigError("--resume continues a run with its own config.yaml in its own "
                                  "folder: drop --config and --output")
            result = fit(resume_from=args.resume, overrides=args.overrides)
        else:
            result = fit(resolve_config(args.config, args.overrides), output_dir=args.output)
    except ConfigError as err:
        print(f"pt-ray: error: {one_line(err)}", file=sys.stderr)
        return 2
    # The report is drawn in a process of its own while the run ends; the command waits for it
    # so that the folder is complete when the prompt returns.
    report = result.wait_for_report() if result.config.logging.report else None
    print(
        f"done in {result.wall_time_s:.1f} s: final {result.metric_name} "
        f"{result.final_eval_metric:.4f}; summary at {result.run_dir / 'summary.json'}"
        + (f", report at {report}" if report is not None else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
