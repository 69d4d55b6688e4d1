"""How much the activation cache may hold: the one place its ``auto`` sizes are resolved.

Pure module: the facts (each node's object-store capacity) come in as arguments, read by the
caller from the cluster (:func:`pt_ray.cache.owners.store_capacities`). The rule:

1. Each node's cache owner may fill its store budget: ``cache.budget_bytes``, else
   ``cache.budget_fraction`` of that node's object store (:func:`store_budget`). A store is
   what its node was started with; the cluster a run starts itself gets Ray's own default
   (``cache.object_store_bytes=auto``: 30% of the host's available memory, at most 95% of
   ``/dev/shm``).
2. ``cache.worker_memo_bytes=auto`` is the store budget of the smallest node that may run a
   stage 0, at least :data:`MEMO_FLOOR_BYTES`. A memo holds zero-copy views of its node's
   store, so it costs no memory the store has not already taken, and it need never hold less
   than the store does: a whole epoch's rows that fit the store are read once per epoch.

The driver resolves the memo once, before the controller and the workers start, and ships the
figure in the config they all read (:func:`resolve_cache_sizes`). The planner's prediction of a
cache read (:class:`pt_ray.costs.costmodel.CacheLayout`) and stage 0's memo
(:class:`pt_ray.cache.prefix.CachedPrefix`) then use the same number, through
:func:`memo_limit`, on every rank and after every restart; a worker measuring its own node
could disagree with the controller, and a plan must be the same everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pt_ray.core.config import CacheConfig

__all__ = [
    "MEMO_FLOOR_BYTES",
    "UNKNOWN_STORE_BUDGET_BYTES",
    "memo_limit",
    "resolve_cache_sizes",
    "store_budget",
]

logger = logging.getLogger(__name__)

MEMO_FLOOR_BYTES = 256 * 2**20
"""The least ``worker_memo_bytes=auto`` resolves to (the fixed default it replaced), whatever
the stores report."""
UNKNOWN_STORE_BUDGET_BYTES = 2**30
"""A node's store budget when Ray does not report its object store's size."""


def store_budget(capacity_bytes: int, budget_fraction: float,
                 budget_bytes: int | None = None) -> int:
    """Bytes a node's cache owner may fill (objects and the rows waiting for their block).

    Args:
        capacity_bytes: the node's object store (0: not reported).
        budget_fraction: ``cache.budget_fraction``.
        budget_bytes: ``cache.budget_bytes`` (None: from the fraction).

    Returns:
        ``budget_bytes`` when set, else ``budget_fraction x capacity_bytes``, else (no
        capacity reported) :data:`UNKNOWN_STORE_BUDGET_BYTES`.
    """
    return budget_bytes or int(budget_fraction * capacity_bytes) or UNKNOWN_STORE_BUDGET_BYTES


def resolve_cache_sizes(cache: CacheConfig, store_capacities: Sequence[int]) -> CacheConfig:
    """The ``cache`` section with ``worker_memo_bytes=auto`` replaced by its figure (the
    module's rule, step 2), logged in one line; a number the user set stays.

    Args:
        cache: the run's ``cache`` section.
        store_capacities: the object store of each node that may run a stage 0, in bytes (0
            where Ray does not report it).
    """
    c = cache
    if c.worker_memo_bytes != "auto":
        return c

    def budget(capacity: int) -> int:
        return store_budget(capacity, c.budget_fraction, c.budget_bytes)

    # The node with the smallest budget (0: no capacity reported, or no node at all).
    store = min(store_capacities, key=budget, default=0)
    memo = max(MEMO_FLOOR_BYTES, budget(store))
    if c.budget_bytes is not None:
        source = f"cache.budget_bytes={c.budget_bytes}"
    elif store:
        source = (f"{c.budget_fraction:g} of the object store of the smallest of "
                  f"{len(store_capacities)} nodes, {store / 2**20:.0f} MiB")
    else:
        source = f"{UNKNOWN_STORE_BUDGET_BYTES / 2**20:.0f} MiB: no object store size reported"
    logger.info("activation cache: worker memo %.0f MiB (cache.worker_memo_bytes=auto: the "
                "store budget, %s; at least %.0f MiB)", memo / 2**20, source,
                MEMO_FLOOR_BYTES / 2**20)
    return c.model_copy(update={"worker_memo_bytes": memo})


def memo_limit(cache: CacheConfig) -> int | None:
    """The memo cap the planner and stage 0 both use: ``cache.worker_memo_bytes`` as resolved
    or set. None (no cap) where ``auto`` was never resolved: only a run without Ray (the
    process-group engine of tests and benchmarks), whose in-process store hands the memo the
    very arrays it keeps, so the memo holds no byte of its own."""
    value = cache.worker_memo_bytes
    return None if value == "auto" else value
