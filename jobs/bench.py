"""Ray Jobs entry point for the side-by-side benchmark:
``ray job submit --working-dir . -- python jobs/bench.py [ARGS of bench/compare.py]``.

Runs ``bench/compare.py`` (baseline without freezing against pt-ray, same data and seed; see
its ``--help``) with its own arguments. Two things differ from running it directly:

* Inside a job (``RAY_ADDRESS`` set by the job supervisor) the benchmark attaches to the job's
  cluster instead of starting a local one beside it, so it measures the cluster the job was
  sent to. Outside a job it starts its own local cluster, as ``bench/compare.py`` does.
* A job's working directory is a temporary copy that Ray deletes, so ``--out`` defaults to an
  absolute folder outside it: ``$PT_RAY_OUTPUT/bench`` when ``PT_RAY_OUTPUT`` is set, else
  ``~/pt-ray-runs/bench``; a relative ``--out`` inside a job goes under that base folder.

The last line printed is ``bench: <absolute path of compare.json>``; the exit status is
``bench/compare.py``'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

OUTPUT_ENV = "PT_RAY_OUTPUT"
DEFAULT_BASE = "~/pt-ray-runs"
_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
_ROOT = Path(__file__).resolve().parent.parent


def _make_importable() -> None:
    """``pt_ray`` from the shipped checkout and ``bench/`` (compare.py imports its sibling
    ``compare_report``) first on sys.path."""
    for root in (_ROOT, Path.cwd()):
        if (root / "pt_ray" / "__init__.py").is_file():
            for path in (root / "bench", root):
                if str(path) not in sys.path:
                    sys.path.insert(0, str(path))
            return


def out_dir(argv: list[str], env: dict[str, str] | None = None) -> Path:
    """The absolute ``--out`` folder for ``argv`` (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--out")
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:
        args = argparse.Namespace(out=None)
    base = Path(env.get(OUTPUT_ENV) or DEFAULT_BASE).expanduser().resolve()
    if args.out is None:
        if _RAY_JOB_ENV in env or OUTPUT_ENV in env:
            return base / "bench"
        return (_ROOT / "bench" / "out").resolve()  # compare.py's own default, run locally
    out = Path(args.out).expanduser()
    if not out.is_absolute() and _RAY_JOB_ENV in env:
        return base / out
    return out.resolve()


def _attach_to_job_cluster(compare) -> None:
    """Make ``compare.start_ray`` attach to the job's cluster (``RAY_ADDRESS``) instead of
    starting a second, local one on the same node."""

    def attach(num_cpus: int, object_store_mb: int, log_to_driver: bool) -> None:
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING,
                 log_to_driver=log_to_driver)
        free = ray.available_resources().get("CPU", 0.0)
        print(f"[bench job] on the job's cluster ({free:g} CPUs free; one arm needs "
              f"{num_cpus})", flush=True)

    compare.start_ray = attach


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _make_importable()
    import compare  # bench/compare.py

    out = out_dir(argv)
    argv = [*argv, "--out", str(out)]  # argparse keeps the last --out
    if os.environ.get("RAY_ADDRESS"):
        _attach_to_job_cluster(compare)
    code = compare.main(argv) or 0
    if code == 0:
        print(f"bench: {out / 'compare.json'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
