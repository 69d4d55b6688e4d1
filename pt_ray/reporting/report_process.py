"""A run's ``report.png`` rendered in a process of its own, so that ``fit`` returns once the
model and the summary are written.

Drawing the report (importing matplotlib, laying out four panels, encoding the PNG) is CPU
work the caller need not wait for. ``fit`` starts
``python -m pt_ray.reporting.report_process SUMMARY PNG`` as soon as ``summary.json`` is
written; it draws while the driver exports the model and shuts Ray down, and outlives the
call (its own session: an interrupt of the caller does not stop it). A failure never reaches
the run: the process writes its reason into ``report.error.txt`` beside the PNG and logs one
line. :func:`wait_for_reports` waits, bounded, for the processes this one started (the
``pt-ray`` command line does so before it exits; an MLflow run before it logs the PNG).

No torch, no Ray.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

__all__ = ["ERROR_FILE", "main", "start_report", "wait_for_reports"]

logger = logging.getLogger(__name__)

ERROR_FILE = "report.error.txt"
"""Written beside the PNG, in place of it, when the report cannot be drawn."""

_PENDING: dict[Path, subprocess.Popen[bytes]] = {}
"""The report processes this process started, by the PNG each one writes."""


def start_report(summary: Path, out: Path) -> None:
    """Start drawing the report of the run whose ``summary.json`` is ``summary`` into ``out``,
    in a process of its own (see the module docstring); returns at once. Where no process can
    start, the report is drawn here instead."""
    (out.parent / ERROR_FILE).unlink(missing_ok=True)
    # The child imports this very copy of pt_ray, even where it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        _PENDING[out] = subprocess.Popen(
            [sys.executable, "-m", __name__, str(summary), str(out)], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as err:
        logger.info("report drawn in this process (no process of its own: %s)", err)
        _render(summary, out)


def wait_for_reports(timeout_s: float = 120.0, out: Path | None = None) -> bool:
    """Wait up to ``timeout_s`` for the report processes this process started (only the one
    writing ``out``, if given); True when all of them have ended, whether or not they drew
    their PNG (a failure is in :data:`ERROR_FILE` beside it)."""
    deadline = time.monotonic() + timeout_s
    for png, proc in list(_PENDING.items()):
        if out is not None and png != out:
            continue
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("report %s not drawn within %.0f s; it goes on in process %d",
                           png, timeout_s, proc.pid)
            return False
        del _PENDING[png]
    return True


def _render(summary: Path, out: Path) -> bool:
    """Draw the report; a failure is written into :data:`ERROR_FILE` beside ``out`` and logged,
    never raised. True when the PNG was written."""
    try:
        from pt_ray.reporting.report import render_report

        render_report(summary, out)
    except Exception as err:  # a plot must not fail a finished run
        logger.warning("run report not written: %s (see %s)", err, out.parent / ERROR_FILE)
        try:
            (out.parent / ERROR_FILE).write_text(
                f"{out} not written: {err}\n\n{traceback.format_exc()}")
        except OSError:
            pass
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m pt_ray.reporting.report_process SUMMARY PNG``: 0 when the PNG was written,
    1 otherwise (the reason in :data:`ERROR_FILE` beside it)."""
    summary, out = (Path(a) for a in (sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="pt-ray report: %(message)s")
    return 0 if _render(summary, out) else 1


if __name__ == "__main__":
    sys.exit(main())
