"""Processes a benchmark or test started in a session of their own, and how to end them all.

A driver started with ``start_new_session=True`` leads a session that also holds the embedded
Ray cluster it starts; killing the session's processes ends that cluster with it and nothing
else on the host (never ``ray stop``, which ends every Ray process here).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["kill_session", "session_processes"]


def session_processes(sid: int) -> list[int]:
    """The processes alive in session ``sid`` (read from ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After ``pid (comm)``: state, ppid, pgrp, then the session id.
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_session(sid: int, tries: int = 50) -> None:
    """SIGKILL every process of session ``sid`` until none is left (or ``tries`` rounds of
    0.1 s have passed)."""
    for _ in range(tries):
        left = session_processes(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
