"""Test tiers: every test carries exactly one tier marker, and a ``unit`` test starts no process.

The tiers, cheapest first: ``unit`` (no processes, milliseconds), ``proc`` (plain Python
interpreters, as subprocesses or a spawned pool: no Ray, no process group), ``dist`` (2-4 forked
gloo processes), ``ray`` (one local Ray cluster) and ``gpu`` (skipped without CUDA).
``conftest.py`` refuses a collection in which a test has none or several, and fails a ``unit`` test
that starts a process (seen through Python's audit events, so also one a library starts for it).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable

import pytest

TIERS = ("unit", "proc", "dist", "ray", "gpu")

# multiprocessing's spawn and forkserver methods start processes through _posixsubprocess and a
# server's own fork, which raise no audit event: SpawnGuard.install audits Process.start itself.
MP_START = "multiprocessing.Process.start"
# Audit events (https://docs.python.org/3/library/audit_events.html) of starting a process.
SPAWNS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                    "os.system", "os.exec", "os.startfile", MP_START})


def tiers_of(item: pytest.Item) -> list[str]:
    """The tier markers of ``item`` (its own, its class's and its module's), each once."""
    return sorted({m.name for m in item.iter_markers() if m.name in TIERS})


def tier_problems(items: Iterable[pytest.Item]) -> list[str]:
    """One line for each test that does not carry exactly one tier marker."""
    problems = []
    for item in items:
        tiers = tiers_of(item)
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: {' + '.join(tiers) if tiers else 'no tier'}")
    return problems


def check_tiers(items: Iterable[pytest.Item]) -> None:
    """Refuse the collection when a test has no tier marker or several.

    Raises:
        pytest.UsageError: naming each such test and the markers it has.
    """
    problems = tier_problems(items)
    if problems:
        raise pytest.UsageError(
            f"{len(problems)} test(s) need exactly one tier marker of {', '.join(TIERS)} "
            "(pyproject.toml describes them; a module's pytestmark counts):\n  "
            + "\n  ".join(problems))


class SpawnGuard:
    """An audit hook that records the processes started while a ``unit`` test runs.

    Only the main thread's events count: pytest runs tests there, while a Ray driver's own
    background threads (a session cluster may be up) are not the test's doing.
    """

    def __init__(self) -> None:
        self.test: str | None = None
        self.seen: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if (self.test is not None and event in SPAWNS
                and threading.current_thread() is threading.main_thread()):
            what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args[:1]
            self.seen.append(f"{event} {str(what)[:120]}")

    def begin(self, test: str) -> None:
        self.test, self.seen = test, []

    def end(self) -> list[str]:
        """Stop watching; the spawns seen since :meth:`begin`."""
        seen, self.test, self.seen = self.seen, None, []
        return seen

    def install(self) -> SpawnGuard:
        sys.addaudithook(self)  # for the rest of the process: audit hooks cannot be removed
        _audit_process_starts()
        return self


def _audit_process_starts() -> None:
    """Make ``multiprocessing``'s ``Process.start`` raise :data:`MP_START` first, whatever the
    start method (once per interpreter)."""
    import multiprocessing.process as mp_process

    original = mp_process.BaseProcess.start
    if getattr(original, "_audited", False):
        return

    def start(self) -> None:
        sys.audit(MP_START, getattr(self, "_start_method", None) or "default")
        original(self)

    start._audited = True
    mp_process.BaseProcess.start = start


GUARD = SpawnGuard()
"""The guard ``conftest.py`` installs for the session."""
