"""``pt-ray export RUN_DIR [--out DIR]``: a finished run's model in its library's own format.

timm models become a safetensors state dict plus their ``timm.create_model`` arguments; Hugging
Face models a ``save_pretrained`` folder. Either loads without pt-ray (see the README.txt written
beside it). The work is :func:`pt_ray.runtime.export.export_run`'s; this module imports no torch
until the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` command to a ``pt-ray`` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "export",
        help="write a finished run's model in timm's or transformers' own format",
        description="Write a finished run's trained model so that timm or transformers loads "
        "it without pt-ray: timm models as model.safetensors plus config.json (the "
        "timm.create_model arguments), Hugging Face models as a save_pretrained folder with "
        "the run's tokenizer. A Ray run is exported from its last checkpoint; every run also "
        "exports into RUN_DIR/model when it ends. README.txt in the folder shows the Python "
        "that loads it.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's folder (summary.json)")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="the folder to write (default: RUN_DIR/model)")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    """Run ``pt-ray export``: 0 on success, 2 on a run that cannot be exported."""
    from pt_ray.reporting.logs import setup_logging

    setup_logging()
    from pt_ray.runtime.export import export_run

    try:
        out = export_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"pt-ray: error: {err}", file=sys.stderr)
        return 2
    print(f"model: {out} (README.txt there shows how to load it)")
    return 0
