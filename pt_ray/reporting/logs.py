"""Logging setup for pt-ray's own lines (one per decision or epoch), leaving other libraries'
loggers at their levels."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (so redirected output is honoured)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; ignore
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Send ``pt_ray.*`` records at ``level`` to stdout as plain lines (idempotent)."""
    logger = logging.getLogger("pt_ray")
    logger.setLevel(level)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
