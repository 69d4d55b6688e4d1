"""Image files checked before training starts: a damaged file fails the run at once, by name,
instead of in the middle of an epoch when a batch first reads it.

Each file is opened and verified by Pillow (``Image.verify``: the header and the structure of
the file, its chunk checksums for PNG, without decoding the pixels), in a pool of threads since
the work is file reads. A folder with damaged files either fails in one line naming them, or,
with ``data.skip_damaged: true``, trains without them and says how many it left out.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pt_ray.core.config import ConfigError

__all__ = ["damaged_images", "readable_images"]

logger = logging.getLogger(__name__)

NAMED = 3
"""Damaged files an error message names (it counts the rest)."""


def _damage(source: Path | bytes) -> str | None:
    """Why ``source`` (a file, or an image's bytes) cannot be read as an image, or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            img.verify()
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError,
            Image.DecompressionBombError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def damaged_images(sources: Sequence[Path | bytes], threads: int | None = None
                   ) -> dict[int, str]:
    """The positions of the images among ``sources`` (files or bytes) that Pillow cannot
    verify, each with its reason, in order."""
    threads = threads or min(32, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        verdicts = list(pool.map(_damage, sources))
    return {i: why for i, why in enumerate(verdicts) if why is not None}


def _name(source: Path | bytes, index: int) -> str:
    return repr(str(source)) if isinstance(source, Path) else f"row {index}"


def readable_images(root: Path, sources: Sequence[Path | bytes], skip: bool) -> list[int]:
    """The positions of the readable images among ``sources``: all of them, or with ``skip``
    those left once the damaged ones are out (counted and logged).

    Raises:
        ConfigError: an image is damaged and ``skip`` is false (naming the first few and the
            count, and both fixes).
    """
    damaged = damaged_images(sources)
    if not damaged:
        return list(range(len(sources)))
    shown = ", ".join(f"{_name(sources[i], i)} ({why})" for i, why in list(damaged.items())[:NAMED])
    more = f" and {len(damaged) - NAMED} more" if len(damaged) > NAMED else ""
    if not skip:
        raise ConfigError(f"{len(damaged)} of {len(sources)} images under {str(root)!r} cannot "
                          f"be read: {shown}{more}; replace or remove them, or set "
                          f"data.skip_damaged=true to train without them")
    logger.warning("data.skip_damaged: leaving out %d of %d images under %s that cannot be read:"
                   " %s%s", len(damaged), len(sources), root, shown, more)
    return [i for i in range(len(sources)) if i not in damaged]
