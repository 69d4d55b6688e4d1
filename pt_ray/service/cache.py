"""The activation cache in Ray's object store: one owner actor per run, and the workers' handle.

An object belongs to the process that ``ray.put`` it and dies with it (``_owner=`` is gone since
Ray 2.56), and Ray Train's workers die at every restart. So the driver creates one
:class:`CacheActor` per run, beside the controller; it owns every cache object:

1. stage-0 workers send the rows they computed without waiting, a few MiB per call
   (``put_many.remote``; a worker with too many sends in flight drops the next ones, so a slow
   actor never stalls a step), and the rest at the end of the epoch;
2. the actor assembles the rows of each block at each depth into one object
   (:class:`pt_ray.runtime.cache.BlockIndex`), ``ray.put`` it, and keeps the index
   ``(block, depth) -> ref``; a deeper object releases the shallower ones it covers, and past
   the byte budget new rows are refused;
3. a worker asks the actor for the refs of every block at its depth once per epoch (an epoch
   reads each sample once, so rows written during it are read in the next), then a step
   ``ray.get`` s the blocks it needs: numpy arrays, zero-copy from the node's store (fetched from
   another node's when written there).

Any failure (the actor gone, an object lost or evicted, a timeout) reads as a miss and the
prefix is recomputed: never a crash, never a wrong row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError

from pt_ray.logs import setup_logging
from pt_ray.runtime.cache import BlockIndex, CacheStats, Payload, Segment

__all__ = ["CacheActor", "RayStore", "cache_name", "object_store_report"]

logger = logging.getLogger(__name__)


def cache_name(run_id: str) -> str:
    """The actor name workers look the cache up by."""
    return f"pt-ray-cache:{run_id}"


def _node_store_bytes() -> int:
    """Capacity of this node's object store."""
    node = ray.get_runtime_context().get_node_id()
    for info in ray.nodes():
        if info.get("NodeID") == node:
            return int(info.get("Resources", {}).get("object_store_memory", 0))
    return 0


@ray.remote(num_cpus=0)
class CacheActor:
    """Owns a run's cache objects and their index (one per run, created by the driver).

    Args:
        budget_fraction: most of this node's object store the cache may fill.
        budget_bytes: a fixed budget instead (None: from the fraction).
    """

    def __init__(self, budget_fraction: float, budget_bytes: int | None = None) -> None:
        setup_logging()
        capacity = _node_store_bytes()
        budget = budget_bytes or int(budget_fraction * capacity) or 2**30
        self.index: BlockIndex[ray.ObjectRef] = BlockIndex(budget, put=ray.put, load=ray.get)
        logger.info("activation cache: budget %.0f MiB of a %.0f MiB object store",
                    budget / 2**20, capacity / 2**20)

    def put(self, lineage: int, block: int, block_size: int, level: int, ids: np.ndarray,
            arrays: list[np.ndarray], dtypes: list[str]) -> bool:
        """Admit rows (see :meth:`BlockIndex.add`); returns whether they were admitted."""
        # Copies: the arguments are views of the sender's objects, which die with it.
        payload: Payload = (np.array(ids), tuple(np.array(a) for a in arrays), tuple(dtypes))
        return self.index.add(lineage, block, block_size, level, payload)

    def put_many(self, lineage: int, items: list[tuple]) -> int:
        """:meth:`put` for each ``(block, block_size, level, ids, arrays, dtypes)``; returns
        how many were admitted."""
        return sum(self.put(lineage, *item) for item in items)

    def lookup(self, blocks: list[int] | None, level: int
               ) -> list[tuple[int, int, ray.ObjectRef]]:
        """``(block, depth, ref)`` of the objects of ``blocks`` (None: every block) at
        ``level`` or shallower; the caller borrows the refs."""
        if blocks is None:
            blocks = list(self.index.objects)
        return self.index.lookup(blocks, level)

    def flush(self) -> None:
        """Store the rows of incomplete blocks."""
        self.index.flush()

    def forget(self, keys: list[tuple[int, int]]) -> None:
        """Drop objects a worker could not read."""
        for block, level in keys:
            self.index.forget(block, level)

    def invalidate_above(self, level: int) -> int:
        """Drop entries deeper than ``level``; returns the new lineage."""
        return self.index.invalidate_above(level)

    def lineage(self) -> int:
        """The lineage writes must carry to be admitted."""
        return self.index.lineage

    def stats(self) -> CacheStats:
        """The index's figures."""
        return self.index.stats


class RayStore:
    """The worker side: :class:`pt_ray.runtime.cache.ActivationStore` over the named actor.

    Reads use a snapshot of the actor's index, taken at the first read of an epoch (or of a new
    depth) and dropped by :meth:`drain` at the epoch's end: one actor call per epoch instead of
    one per step. Writes are sent in batches of about ``batch_bytes``.

    Args:
        name: the cache actor's name (:func:`cache_name`).
        timeout_s: longest wait for a lookup or a read before it counts as a miss.
        max_inflight: most batches in flight; past it, writes are dropped (not waited for).
        batch_bytes: rows are sent once this many bytes wait (and at the end of an epoch).
    """

    def __init__(self, name: str, timeout_s: float = 10.0, max_inflight: int = 16,
                 batch_bytes: int = 4 * 2**20) -> None:
        self.actor = ray.get_actor(name)
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.batch_bytes = batch_bytes
        self.dropped_rows = 0
        self._inflight: list[ray.ObjectRef] = []
        self._batch: list[tuple] = []
        self._batch_bytes = 0
        self._snapshot: dict[int, list[tuple[int, int, ray.ObjectRef]]] | None = None
        self._snapshot_level: int | None = None
        self._warned = False
        self._lineage = self._call("lineage", default=0)

    def _call(self, method: str, *args: Any, default: Any = None) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except RayError as err:
            self._warn(f"{method} failed ({type(err).__name__})")
            return default

    def _warn(self, what: str) -> None:
        if not self._warned:
            logger.warning("activation cache: %s; serving misses", what)
            self._warned = True

    def _entries(self, blocks: Sequence[int], level: int) -> list[tuple[int, int, ray.ObjectRef]]:
        if self._snapshot is None or self._snapshot_level != level:
            snapshot: dict[int, list[tuple[int, int, ray.ObjectRef]]] = {}
            for entry in self._call("lookup", None, level, default=[]):
                snapshot.setdefault(entry[0], []).append(entry)
            self._snapshot, self._snapshot_level = snapshot, level
        return [e for b in dict.fromkeys(int(x) for x in blocks)
                for e in self._snapshot.get(b, ())]

    def read(self, blocks: Sequence[int], level: int) -> list[Segment]:
        entries = self._entries(blocks, level)
        if not entries:
            return []
        refs = [ref for _, _, ref in entries]
        try:
            values = ray.get(refs, timeout=self.timeout_s)
        except RayError:
            values = [self._get_one(ref) for ref in refs]
        out, lost = [], []
        for (block, lv, _), value in zip(entries, values):
            if value is None:
                lost.append((block, lv))
                continue
            ids, arrays, dtypes = value
            out.append(Segment(block, lv, ids, tuple(arrays), tuple(dtypes)))
        if lost:
            self._warn(f"{len(lost)} cached objects could not be read")
            self.actor.forget.remote(lost)
            gone = set(lost)
            for block in {b for b, _ in lost}:
                self._snapshot[block] = [e for e in self._snapshot.get(block, ())
                                         if (e[0], e[1]) not in gone]
        return out

    def _get_one(self, ref: ray.ObjectRef) -> Payload | None:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayError:  # ObjectLostError, OwnerDiedError, GetTimeoutError, ...
            return None

    def write(self, block: int, block_size: int, level: int, ids: np.ndarray,
              arrays: Sequence[np.ndarray], dtypes: Sequence[str]) -> None:
        self._batch.append((block, block_size, level, np.asarray(ids),
                            [np.asarray(a) for a in arrays], list(dtypes)))
        self._batch_bytes += sum(a.nbytes for a in arrays) + np.asarray(ids).nbytes
        if self._batch_bytes >= self.batch_bytes:
            self._send()

    def _send(self) -> None:
        """Hand the waiting rows to the actor without waiting (dropped past the backlog)."""
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if self._inflight:
            _, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight),
                                         timeout=0)
        if len(self._inflight) >= self.max_inflight:
            self.dropped_rows += sum(len(item[3]) for item in batch)
            return
        self._inflight.append(self.actor.put_many.remote(self._lineage, batch))

    def drain(self) -> None:
        """End of an epoch: send the waiting rows, wait until this worker's writes have landed,
        and drop the read snapshot (the next epoch sees what this one wrote)."""
        self._send()
        if self._inflight:
            ray.wait(self._inflight, num_returns=len(self._inflight), timeout=self.timeout_s)
            self._inflight = []
        self._snapshot = None

    def flush(self) -> None:
        self._send()
        self.actor.flush.remote()

    def invalidate_above(self, level: int) -> None:
        self._batch, self._batch_bytes, self._snapshot = [], 0, None
        self._lineage = self._call("invalidate_above", level, default=self._lineage)

    def attach(self) -> None:
        self._snapshot = None
        self._lineage = self._call("lineage", default=self._lineage)

    def stats(self) -> CacheStats:
        self._send()
        stats = self._call("stats", default=None) or CacheStats()
        stats.refused_rows += self.dropped_rows
        return stats


def object_store_report() -> dict[str, int]:
    """Object-store figures over the cluster: capacity, use and what was spilled to disk and
    restored (empty when Ray's internal memory API is unavailable)."""
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        s = get_memory_info_reply(state).store_stats
        return {
            "capacity_bytes": int(s.object_store_bytes_avail),
            "used_bytes": int(s.object_store_bytes_used),
            "spilled_bytes": int(s.spilled_bytes_total),
            "spilled_objects": int(s.spilled_objects_total),
            "restored_bytes": int(s.restored_bytes_total),
        }
    except Exception as err:  # internal API: report nothing rather than fail the run
        logger.debug("object store stats unavailable: %s", err)
        return {}
