"""The run folder's own files: written whole or not at all, and held by one live run.

``summary.json``, ``config.yaml`` and ``report.png`` are written to a temporary file beside
their place, synced to the disk and moved over it (``os.replace``, atomic on one file system;
the folder is synced after), so a reader, a crash or a power loss never meets half a file. A
run holds ``.pt-ray.lock`` in its folder while it runs (an ``fcntl`` lock, which the system
releases when the process ends, however it ends), so a second run given the same folder stops
at once and names the holder instead of writing over the first one's checkpoints and summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pt_ray.core.config import ConfigError

__all__ = ["LOCK_FILE", "RunFolderBusy", "hold_run_folder", "replaced_atomically", "sync_file",
           "write_text_atomically"]

LOCK_FILE = ".pt-ray.lock"


class RunFolderBusy(ConfigError):
    """Another live run holds the run folder."""


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) to write to; moved over ``path`` when the
    block ends without error, removed otherwise.

    The temporary file's bytes reach the disk (``fsync``) before the rename, and the folder's
    entry after it, so after a power loss ``path`` holds the old file or the whole new one,
    never a renamed empty file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        sync_file(tmp)
        os.replace(tmp, path)
        sync_file(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def sync_file(path: str | Path) -> None:
    """``fsync`` a file's bytes, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomically(path: str | Path, text: str) -> Path:
    """``path.write_text(text)``, all or nothing."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def hold_run_folder(run_dir: str | Path) -> Iterator[None]:
    """Hold ``run_dir`` for this run (creating it) until the block ends; a folder it created
    that holds nothing but the lock at the end is removed.

    Raises:
        RunFolderBusy: another live process holds it (naming its pid, host and start).
    """
    import fcntl

    run_dir = Path(run_dir).absolute()
    # The folders this makes, deepest first (removed again if the run writes nothing).
    created = [f for f in (run_dir, *run_dir.parents) if not f.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise RunFolderBusy(f"run folder {str(run_dir)!r} is in use by another run "
                                f"({_describe(handle.read())}); wait for it to end, or choose "
                                f"another --output (or output_dir/name in the config)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}))
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            # A run that stopped before writing anything (a check that needed the cluster)
            # leaves no folder behind, as the checks before it do.
            if created and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
                path.unlink()
                for folder in created:
                    with contextlib.suppress(OSError):  # not empty: another run's
                        folder.rmdir()
            fcntl.flock(handle, fcntl.LOCK_UN)


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
