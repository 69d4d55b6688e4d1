"""Image files checked before training starts: a damaged file fails the run at once, by name,
instead of in the middle of an epoch when a batch first reads it.

Each file is opened and verified by Pillow (``Image.verify``: the header and the structure of
the file, its chunk checksums for PNG, without decoding the pixels), in a pool of threads since
the work is file reads. A folder with damaged files either fails in one line naming them, or,
with ``data.skip_damaged: true``, trains without them and says how many it left out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pt_ray.core.config import ConfigError

__all__ = ["damaged_images", "drop_damaged"]

logger = logging.getLogger(__name__)

NAMED = 3
"""Damaged files an error message names (it counts the rest)."""


def _damage(path: Path) -> str | None:
    """Why ``path`` cannot be read as an image, or None when it can."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError,
            Image.DecompressionBombError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def damaged_images(files: Sequence[Path], threads: int | None = None) -> dict[Path, str]:
    """The files among ``files`` that Pillow cannot verify, each with its reason, in order."""
    threads = threads or min(32, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        verdicts = list(pool.map(_damage, files))
    return {f: why for f, why in zip(files, verdicts) if why is not None}


def drop_damaged(root: Path, files: list[Path], skip: bool) -> list[Path]:
    """``files`` without the damaged ones when ``skip``; otherwise ``files`` when none is.

    Raises:
        ConfigError: a file is damaged and ``skip`` is false (naming the first few and the
            count, and both fixes).
    """
    damaged = damaged_images(files)
    if not damaged:
        return files
    names = list(damaged)
    shown = ", ".join(f"{str(p)!r} ({damaged[p]})" for p in names[:NAMED])
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    if not skip:
        raise ConfigError(f"{len(names)} of {len(files)} images under {str(root)!r} cannot be "
                          f"read: {shown}{more}; replace or remove them, or set "
                          f"data.skip_damaged=true to train without them")
    logger.warning("data.skip_damaged: leaving out %d of %d images under %s that cannot be read:"
                   " %s%s", len(names), len(files), root, shown, more)
    bad = set(names)
    return [f for f in files if f not in bad]
