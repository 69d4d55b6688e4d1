"""Ray Jobs entry point: ``ray job submit --working-dir . -- python jobs/train.py [ARGS]``.

Takes the arguments of ``pt-ray train`` (``--config FILE``, ``--set key=value`` ..., ``--output
DIR``, or ``--resume RUN_DIR`` to continue a stopped run) and runs it on the cluster the job runs
in (the job supervisor sets ``RAY_ADDRESS``). A relative ``RUN_DIR`` inside a Ray job is found
under the base folder of 2 or 4 below, as a relative ``--output`` is.

A job's working directory is a temporary copy that Ray deletes, so the run's folder defaults to
an absolute path outside it, the first of:

1. ``--output DIR`` (a relative DIR inside a Ray job goes under the base folder of 2 or 4);
2. ``$PT_RAY_OUTPUT/<name>`` when the ``PT_RAY_OUTPUT`` environment variable is set;
3. ``<output_dir>/<name>`` when the config's ``output_dir`` is absolute;
4. ``~/pt-ray-runs/<name>``.

``<name>`` is the config's ``name``. The last line printed is ``summary: <absolute path>``.
Exit status: 0 on success; 2 on input it cannot use (a config value, or a dataset, weights,
tokenizer or output folder the config names), reported as one line ``pt-ray: error: ...``
before anything starts; 1 on a failed run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OUTPUT_ENV = "PT_RAY_OUTPUT"
"""Environment variable: base folder for runs without ``--output`` (the run goes in ``<name>``)."""

DEFAULT_BASE = "~/pt-ray-runs"
"""Base folder for runs when neither ``--output`` nor ``PT_RAY_OUTPUT`` is given."""

# Set by Ray's job supervisor in the entrypoint's environment (ray.dashboard.modules.job).
_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _make_importable() -> None:
    """Put a ``pt_ray`` package shipped beside this script (or in the cwd) first on sys.path.

    ``python jobs/train.py`` puts ``jobs/`` on sys.path, not the working directory. Ray puts the
    job's working directory first on the workers' PYTHONPATH, so the driver prefers the shipped
    copy too: driver and training workers then run the same code, installed or not.
    """
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "pt_ray" / "__init__.py").is_file() and str(root) not in sys.path:
            sys.path.insert(0, str(root))


def _known_args(argv: list[str], resumes: bool = True) -> argparse.Namespace:
    """The options this script needs before ``pt-ray train`` parses (and checks) them all;
    ``resumes``: whether ``--resume RUN_DIR`` is one (a sweep's ``--resume`` takes no value)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--output")
    if resumes:
        parser.add_argument("--resume")
    args, _ = parser.parse_known_args(argv)
    return args


def _base_dir(env: dict[str, str]) -> Path | None:
    base = env.get(OUTPUT_ENV)
    return Path(base).expanduser().resolve() if base else None


def output_dir(
    argv: list[str], env: dict[str, str] | None = None, suffix: str = ""
) -> Path | None:
    """The absolute run folder for ``argv``: ``--resume RUN_DIR``'s, else the first of the
    module docstring's list; ``suffix`` is appended to the run name (``jobs/sweep.py`` uses
    ``-sweep``, and its ``--resume`` names no folder).

    Returns None when the config does not resolve: ``pt-ray train`` then reports the error.
    """
    from pt_ray.api import resolve_config
    from pt_ray.core.config import ConfigError

    env = dict(os.environ if env is None else env)
    try:
        args = _known_args(argv, resumes=not suffix)
    except argparse.ArgumentError:
        return None
    fallback = _base_dir(env) or Path(DEFAULT_BASE).expanduser().resolve()
    given = getattr(args, "resume", None) or args.output
    if given:
        out = Path(given).expanduser()
        if not out.is_absolute() and _RAY_JOB_ENV in env:
            return fallback / out  # the job's cwd is deleted when the job ends
        return out.resolve()
    try:
        cfg = resolve_config(args.config, args.overrides)
    except ConfigError:
        return None
    if _base_dir(env) is None and cfg.output_dir.is_absolute():
        return cfg.output_dir / f"{cfg.name}{suffix}"
    return fallback / f"{cfg.name}{suffix}"


def main(argv: list[str] | None = None) -> int:
    """Run ``pt-ray train`` with ``argv`` into an absolute output folder; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _make_importable()
    import pt_ray
    from pt_ray.cli import main as cli_main

    print(f"pt-ray job: pt_ray from {Path(pt_ray.__file__).parent}", flush=True)

    out = output_dir(argv)
    if out is not None:
        # argparse keeps the last --output (--resume), so this one wins over a relative one.
        flag = "--resume" if _known_args(argv).resume else "--output"
        argv = [*argv, flag, str(out)]
    code = cli_main(["train", *argv])
    if code == 0 and out is not None:
        print(f"summary: {out / 'summary.json'}", flush=True)
    return code


if __name__ == "__main__":
    code = main()
    from pt_ray.cli import exit_quickly  # importable once main() has run

    exit_quickly(code)
