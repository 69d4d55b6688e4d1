"""The run's dataset, built once: the driver's preflight reads (and tokenises) it, puts it into
Ray's object store, and every worker reads it from there instead of from its files.

A dataset larger than :data:`SHIP_FRACTION` of the smallest node's object store (which also
holds the activation cache) is built by each worker from its files, as is one that cannot be
pickled."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import torch

from pt_ray.data.base import DatasetSplits

__all__ = ["SHIP_FRACTION", "held_bytes", "ship_splits", "ships"]

logger = logging.getLogger(__name__)

SHIP_FRACTION = 0.25
"""The largest dataset shipped through the object store, as a fraction of the smallest node's
store."""

_DEPTH = 6  # DatasetSplits -> a subset split -> its base split -> a tuple -> tensors, and one
# more


def held_bytes(obj: Any, depth: int = _DEPTH) -> int:
    """What pickling ``obj`` costs, estimated: the bytes of the tensors (their whole storage:
    a view pickles all of it), arrays, byte strings and strings it holds, through attributes,
    sequences and dicts, ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, os.PathLike):
        return len(os.fspath(obj))
    if depth == 0:
        return 0
    if isinstance(obj, Mapping):
        return sum(held_bytes(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v, depth - 1) for v in obj)
    fields = getattr(obj, "__dict__", None)  # an object and its attributes: one level
    return held_bytes(fields, depth) if isinstance(fields, dict) else 0


def ships(size: int, capacities: list[int]) -> bool:
    """Whether a dataset of ``size`` bytes goes through the object store of nodes with
    ``capacities`` (bytes each; 0 where not reported): at most :data:`SHIP_FRACTION` of the
    smallest one reported."""
    known = [c for c in capacities if c > 0]
    return bool(known) and size <= SHIP_FRACTION * min(known)


def ship_splits(splits: DatasetSplits, capacities: list[int]) -> tuple[Any, int]:
    """Put the driver's ``splits`` into the object store for the workers; returns the object's
    reference and its estimated size, or ``(None, 0)`` where each worker builds its own (too
    large for ``capacities``, or not picklable), in one logged line either way."""
    size = held_bytes(splits)
    if not ships(size, capacities):
        logger.info("data: each worker reads its files (%.0f MiB is more than %g of the "
                    "smallest object store)", size / 2**20, SHIP_FRACTION)
        return None, 0
    try:
        ref = ray.put(splits)
    except Exception as err:  # a dataset type that cannot be pickled: the old way still works
        logger.warning("data: each worker reads its files (the dataset cannot be shipped: %s)",
                       err)
        return None, 0
    logger.info("data: built once, shipped to the workers through the object store (%.1f MiB)",
                size / 2**20)
    return ref, size
