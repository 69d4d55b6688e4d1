"""Ray Jobs entry point for alpha sweeps:
``ray job submit --working-dir . -- python jobs/sweep.py --alpha 0.25,0.5 [ARGS]``.

Takes the arguments of ``pt-ray sweep`` (``--alpha A1,A2``, ``--grid key=v1,v2`` ..., ``--config
FILE``, ``--set key=value`` ..., ``--output DIR``, ``--no-baseline``, ``--max-concurrent N``,
``--resume``) and runs the sweep's Tune trials on the cluster the job runs in (the job
supervisor sets ``RAY_ADDRESS``).

A job's working directory is a temporary copy that Ray deletes, so the sweep folder defaults to
an absolute path outside it, the first of (as for ``jobs/train.py``, with ``<name>-sweep``):

1. ``--output DIR`` (a relative DIR inside a Ray job goes under the base folder of 2 or 4);
2. ``$PT_RAY_OUTPUT/<name>-sweep`` when the ``PT_RAY_OUTPUT`` environment variable is set;
3. ``<output_dir>/<name>-sweep`` when the config's ``output_dir`` is absolute;
4. ``~/pt-ray-runs/<name>-sweep``.

``<name>`` is the config's ``name``. To resume an interrupted sweep, submit the same command
with ``--resume`` (the folder must be the same: pass ``--output`` or ``PT_RAY_OUTPUT``). The
last line printed is ``sweep: <absolute path of sweep.json>``. Exit status: 0 when every
trial finished, 1 when some did not, 2 on bad input (nothing started).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# One set of rules for where a job's output goes and which pt_ray it imports: jobs/train.py's.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import OUTPUT_ENV, _make_importable  # noqa: E402,F401 (OUTPUT_ENV: documented here)
from train import output_dir as _run_output_dir  # noqa: E402


def output_dir(argv: list[str], env: dict[str, str] | None = None) -> Path | None:
    """The absolute sweep folder for ``argv``: the run folder rules of ``jobs/train.py`` with
    ``-sweep`` after the run name. None when the config does not resolve."""
    return _run_output_dir(argv, env, suffix="-sweep")


def main(argv: list[str] | None = None) -> int:
    """Run ``pt-ray sweep`` with ``argv`` into an absolute folder; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _make_importable()
    import pt_ray
    from pt_ray.cli.sweep import add_sweep_parser

    print(f"pt-ray job: pt_ray from {Path(pt_ray.__file__).parent}", flush=True)
    out = output_dir(argv)
    if out is not None:
        argv = [*argv, "--output", str(out)]  # argparse keeps the last --output
    parser = argparse.ArgumentParser(prog="jobs/sweep.py")
    add_sweep_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sweep", *argv])
    code = args.func(args)
    if code in (0, 1) and out is not None:
        print(f"sweep: {out / 'sweep.json'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
