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
import os
import sys
from pathlib import Path

OUTPUT_ENV = "PT_RAY_OUTPUT"
"""Environment variable: base folder for sweeps without ``--output``."""

DEFAULT_BASE = "~/pt-ray-runs"
"""Base folder when neither ``--output`` nor ``PT_RAY_OUTPUT`` is given."""

# Set by Ray's job supervisor in the entrypoint's environment (ray.dashboard.modules.job).
_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _make_importable() -> None:
    """Put a ``pt_ray`` package shipped beside this script (or in the cwd) first on sys.path,
    so the driver imports the same code as the job's workers (see ``jobs/train.py``)."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "pt_ray" / "__init__.py").is_file() and str(root) not in sys.path:
            sys.path.insert(0, str(root))


def _known_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--output")
    args, _ = parser.parse_known_args(argv)
    return args


def _base_dir(env: dict[str, str]) -> Path | None:
    base = env.get(OUTPUT_ENV)
    return Path(base).expanduser().resolve() if base else None


def output_dir(argv: list[str], env: dict[str, str] | None = None) -> Path | None:
    """The absolute sweep folder for ``argv`` (see the module docstring for the order).

    Returns None when the config does not resolve: ``pt-ray sweep`` then reports the error.
    """
    from pt_ray.api import resolve_config
    from pt_ray.config import ConfigError

    env = dict(os.environ if env is None else env)
    try:
        args = _known_args(argv)
    except argparse.ArgumentError:
        return None
    fallback = _base_dir(env) or Path(DEFAULT_BASE).expanduser().resolve()
    if args.output:
        out = Path(args.output).expanduser()
        if not out.is_absolute() and _RAY_JOB_ENV in env:
            return fallback / out  # the job's cwd is deleted when the job ends
        return out.resolve()
    try:
        cfg = resolve_config(args.config, args.overrides)
    except ConfigError:
        return None
    if _base_dir(env) is None and cfg.output_dir.is_absolute():
        return cfg.output_dir / f"{cfg.name}-sweep"
    return fallback / f"{cfg.name}-sweep"


def main(argv: list[str] | None = None) -> int:
    """Run ``pt-ray sweep`` with ``argv`` into an absolute folder; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _make_importable()
    import pt_ray
    from pt_ray.sweep_cli import add_sweep_parser

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
