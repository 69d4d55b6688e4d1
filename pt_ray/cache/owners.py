"""The activation cache in Ray's object store: one owner actor per node, and the workers' handle.

An object belongs to the process that ``ray.put`` it and dies with it (``ray.put`` takes no
other owner: its ``_owner=`` argument raises), and Ray Train's workers die at every restart.
So the run's controller creates one :class:`CacheActor` per node that may run a worker
(:func:`create_owners`), pinned there (node affinity, not soft), as the controller itself
starts, while Ray Train's own controller starts (on an embedded cluster in start slots kept
for them; on an attached small one they can delay Ray Train's workers instead), where one
started when the cache first turns on took its CPU from the training steps on a small host.
A run whose config rules the cache out starts none; one whose cache never turns on keeps an
idle owner process per node. Each owns the cache objects of its node:

1. a stage-0 worker ``ray.put`` s the rows it computed, a few MiB per object, into its node's
   store, and hands the reference to its own node's owner without waiting (``put_refs``; a
   worker with too many sends in flight drops the next ones, so a slow owner never stalls a
   step), and the rest at the end of the epoch;
2. the owner reads them from the same node's store (shared memory, no network) and assembles
   the rows of each block at each depth (:class:`pt_ray.cache.store.BlockLedger`); the blocks
   one call completes, and those an epoch's end stores incomplete, go into one object it puts
   itself, keeping the index ``(block, depth) -> (ref, index in that object)``; a deeper entry
   releases the shallower ones it covers, and past the budget (a fraction of its own node's
   object store: :func:`pt_ray.cache.size.store_budget`) new rows are refused;
3. at the end of an epoch, once every replica's writes have landed, each node's owner copies
   in the objects that other nodes' owners hold and it lacks (``adopt``): one transfer per
   object and node, between epochs rather than inside steps;
4. a worker asks its owner (and, for blocks its node lacks, the other owners) for the refs of
   every block at its depth once per epoch (an epoch reads each sample once, so rows written
   during it are read in the next), then a step ``ray.get`` s the blocks it needs: numpy arrays,
   zero-copy from the node's store. Reads served by another node's owner are counted as remote.

Why the owner copies the worker's rows instead of keeping the worker's objects as the cache:
those would die with the worker (a restart would empty the node's cache) and there would be one
object per batch rather than one per block. The price is one extra copy inside the node's store
for a few MiB at a time, freed once the owner has assembled its block. Why every node's owner
holds every row (step 3) instead of each holding only what its replicas computed: the global
sampler gives a sample to a different replica each epoch, so a partitioned cache would read
about ``(R - 1) / R`` of its rows from other nodes in every epoch; the copy makes every read
after the first epoch at a depth local, at the cost of each node's store holding the whole
cache (its own budget refuses what does not fit, and those rows are read from the owner that
has them).

A worker asks the controller for the owners when it first reads or writes the cache, and
finds them once the controller names them, after they answer: until then its reads are
misses and its writes wait in its node's store, and at the epoch's end it waits for them
before it drains, so no row is lost to their start. A node without a live owner writes to
and reads from another node's owner (remote): a node that joined after the owners started,
or one whose owner died. The owners belong to the controller: a controller Ray restarts
starts them again, empty, under the same names. A worker whose call meets a dead owner asks
the controller for the owners again and finds the new ones (the rows the old ones held, and
what it wrote to them since they died, are misses).

The figures count each row once: ``bytes`` and ``objects`` are the cache's distinct contents
(:func:`pt_ray.cache.store.distinct_figures`), ``stored_bytes`` what every node's store holds
together, copies included.

Any failure (an owner gone, an object lost or evicted, a timeout) reads as a miss and the
prefix is recomputed: never a crash, never a wrong row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pt_ray.cache.size import store_budget
from pt_ray.reporting.logs import setup_logging
from pt_ray.cache.store import (
    BlockLedger,
    CacheStats,
    Contents,
    Payload,
    Segment,
    distinct_figures,
    unpack,
)

__all__ = [
    "CacheActor",
    "OwnerNames",
    "RayStore",
    "cache_name",
    "cache_nodes",
    "create_owners",
    "object_store_report",
    "owners_report",
    "store_capacities",
]

logger = logging.getLogger(__name__)

# One snapshot entry: (block, depth, (ref, index in its pack), the owner's name; None for this
# node's own owner).
_Entry = tuple[int, int, tuple[ray.ObjectRef, int | None], str | None]

# Names the run's owners once they answer (``{node id: actor name}``; ``{}`` before), waiting
# for owners already starting when called with True (:meth:`RayStore._ready`).
OwnerNames = Callable[[bool], Mapping[str, str]]


def cache_name(run_id: str, node_id: str | None = None) -> str:
    """The actor name workers look a cache owner up by (one per node when ``node_id`` is
    given)."""
    base = f"pt-ray-cache:{run_id}"
    return base if node_id is None else f"{base}:{node_id}"


def cache_nodes() -> list[str]:
    """Ids of the alive nodes that can host a training worker (any CPU or GPU): those that get
    a cache owner."""
    return [n["NodeID"] for n in ray.nodes()
            if n.get("Alive") and (n.get("Resources", {}).get("CPU", 0) > 0
                                   or n.get("Resources", {}).get("GPU", 0) > 0)]


def _store_capacity(info: Mapping[str, Any]) -> int:
    """A node's object store in bytes, as Ray reports it (0: not reported)."""
    return int(info.get("Resources", {}).get("object_store_memory", 0))


def store_capacities() -> list[int]:
    """The object store of each node of :func:`cache_nodes`, in bytes (0 where not reported):
    the facts :func:`pt_ray.cache.size.resolve_cache_sizes` sizes the cache from."""
    nodes = set(cache_nodes())
    return [_store_capacity(n) for n in ray.nodes() if n["NodeID"] in nodes]


def create_owners(run_id: str, budget_fraction: float, budget_bytes: int | None = None
                  ) -> dict[str, Any]:
    """One :class:`CacheActor` per node of :func:`cache_nodes`, pinned there; returns
    ``{node id: actor handle}`` (names: :func:`cache_name` with the node id; an owner of
    that name already alive is reused).

    The run's controller calls it as it starts (the owners belong to it, so they outlive
    worker restarts; it cannot know which nodes will run a stage 0): an owner costs an idle
    process and no CPU, and one created by a worker would die with it."""
    owners = {}
    for node in cache_nodes():
        owners[node] = CacheActor.options(
            name=cache_name(run_id, node), get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(budget_fraction, budget_bytes)
    return owners


def _node_info(node: str) -> dict[str, Any]:
    for info in ray.nodes():
        if info.get("NodeID") == node:
            return info
    return {}


def _node_spill(info: Mapping[str, Any]) -> dict[str, int]:
    """This node's object-store figures from its raylet (empty when unavailable)."""
    try:
        from ray._private.internal_api import node_stats

        s = node_stats(info["NodeManagerAddress"], info["NodeManagerPort"],
                       include_memory_info=False).store_stats
        return {"store_used_bytes": int(s.object_store_bytes_used),
                "spilled_bytes": int(s.spilled_bytes_total),
                "spilled_objects": int(s.spilled_objects_total)}
    except Exception as err:  # internal API: report nothing rather than fail the run
        logger.debug("node store stats unavailable: %s", err)
        return {}


@ray.remote(num_cpus=0)
class CacheActor:
    """Owns one node's cache objects and their index (one per node, created by the driver).

    Args:
        budget_fraction: most of this node's object store the cache may fill.
        budget_bytes: a fixed budget instead (None: from the fraction).
    """

    def __init__(self, budget_fraction: float, budget_bytes: int | None = None) -> None:
        setup_logging()
        self.node = ray.get_runtime_context().get_node_id()
        capacity = _store_capacity(_node_info(self.node))
        budget = store_budget(capacity, budget_fraction, budget_bytes)
        self.index: BlockLedger[ray.ObjectRef] = BlockLedger(budget, put=ray.put, load=ray.get)
        self.capacity = capacity
        self.reads = {"local_reads": 0, "remote_reads": 0, "dropped_rows": 0,
                      "adopted_objects": 0, "lost_pieces": 0}
        logger.info("activation cache on node %s: budget %.0f MiB of a %.0f MiB object store",
                    self.node[:8], budget / 2**20, capacity / 2**20)

    def put_many(self, lineage: int, items: list[tuple]) -> int:
        """Admit rows (:meth:`BlockLedger.add_many`) for each ``(block, block_size, level, ids,
        arrays, dtypes)``, the blocks they complete stored in one object; returns how many
        were admitted."""
        # Copies: the arguments are views of the sender's objects, which die with it.
        return self.index.add_many(lineage, [
            (block, block_size, level,
             (np.array(ids), tuple(np.array(a) for a in arrays), tuple(dtypes)))
            for block, block_size, level, ids, arrays, dtypes in items])

    def put_refs(self, lineage: int, refs: list[ray.ObjectRef]) -> int:
        """:meth:`put_many` for batches a worker of this node put in the node's store (read
        from shared memory; a batch whose worker died is lost: its rows stay misses)."""
        items: list[tuple] = []
        for ref in refs:
            try:
                items.extend(ray.get(ref))
            except RayError:
                self.reads["lost_pieces"] += 1
        return self.put_many(lineage, items)

    def lookup(self, blocks: list[int] | None, level: int, sized: bool = False
               ) -> list[tuple]:
        """``(block, depth, (ref, index))`` of the entries of ``blocks`` (None: every block)
        at ``level`` or shallower (:func:`pt_ray.cache.store.unpack` reads one), with ``sized``
        also their row count; the caller borrows the refs."""
        if blocks is None:
            blocks = list(self.index.objects)
        entries = self.index.lookup(blocks, level)
        if not sized:
            return entries
        return [(b, lv, ref, len(self.index.objects[b][lv].ids)) for b, lv, ref in entries]

    def holdings(self) -> list[tuple[int, int, tuple[ray.ObjectRef, int | None], np.ndarray]]:
        """``(block, depth, (ref, index), ids)`` of every entry (for another node's
        :meth:`adopt`)."""
        return [(b, lv, e.ref, e.ids) for b, depths in self.index.objects.items()
                for lv, e in depths.items()]

    def contents(self) -> Contents:
        """``(block, depth, ids, bytes)`` of every object (for :func:`distinct_figures`)."""
        return self.index.contents()

    def adopt(self, entries: list[tuple[int, int, tuple[ray.ObjectRef, int | None],
                                        np.ndarray]]) -> int:
        """Copy in other owners' entries ``(block, depth, (ref, index), ids)`` holding rows
        this node lacks at that depth or deeper (each object fetched across nodes once;
        refused past the budget), then store every waiting row; returns how many were
        admitted."""
        admitted = 0
        fetched: dict[ray.ObjectRef, Any] = {}
        for block, level, (ref, index), ids in entries:
            held = self.index.objects.get(block, {})
            if any(lv > level for lv in held) or (
                    level in held and np.isin(ids, held[level].ids).all()):
                continue
            try:
                if ref not in fetched:
                    fetched[ref] = ray.get(ref)
                ids, arrays, dtypes = unpack(fetched[ref], index)
            except RayError:
                continue  # the other node's object is gone: its rows stay misses here
            payload: Payload = (np.array(ids), tuple(np.array(a) for a in arrays),
                                tuple(dtypes))
            # Size unknown here: the rows wait until the flush below stores the block.
            if self.index.add(self.index.lineage, block, 2**62, level, payload):
                admitted += 1
                self.reads["adopted_objects"] += 1
        self.index.flush()
        return admitted

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

    def count(self, local_reads: int, remote_reads: int, dropped_rows: int) -> None:
        """Add a worker of this node's reads (objects) and the rows it dropped unsent."""
        self.reads["local_reads"] += local_reads
        self.reads["remote_reads"] += remote_reads
        self.reads["dropped_rows"] += dropped_rows

    def stats(self) -> CacheStats:
        """The index's figures."""
        return self.index.stats

    def node_stats(self) -> dict[str, Any]:
        """This node's figures: the index's, the reads of its workers, its store's spills."""
        s = self.index.stats
        return {"bytes": s.bytes, "objects": s.objects, "budget_bytes": s.budget_bytes,
                "capacity_bytes": self.capacity,
                "local_reads": self.reads["local_reads"],
                "remote_reads": self.reads["remote_reads"],
                "refused_rows": s.refused_rows + self.reads["dropped_rows"],
                "stale_rows": s.stale_rows, "lost_objects": s.lost_objects,
                "adopted_objects": self.reads["adopted_objects"],
                **_node_spill(_node_info(self.node))}


class RayStore:
    """The worker side: :class:`pt_ray.cache.store.ActivationStore` over the owner actors.

    Writes go to this node's owner, in batches of about ``batch_bytes`` put in the node's
    store. Reads use a snapshot of the owners' indexes, taken at the first read of an epoch
    (or of a new depth) and dropped by :meth:`drain` at the epoch's end: one call per owner
    per epoch instead of one per step. Another node's object is read only where this node's
    owner holds fewer rows of that block (at any depth). :meth:`flush` (end of an epoch)
    has this node's owner copy in what the others hold. Without a live owner on this node
    another node's owner stands in for it (its reads count as remote); with none at all,
    every read is a miss and every write is dropped.

    Args:
        owners: ``{node id: actor name}`` of the per-node owners (:func:`create_owners`), or
            one actor name serving every node (a single owner, as on one node): looked up
            now. Or a function that names the owners once they answer (``{}`` before;
            called with True it may wait for owners still starting): asked on first use,
            and again until it names them, at most every ``ask_every_s`` within an epoch.
            Owners not found or not answering within ``timeout_s`` (gone with their node)
            are left out.
        timeout_s: longest wait for a lookup or a read before it counts as a miss.
        max_inflight: most batches in flight (or held while the owners start); past it,
            writes are dropped (not waited for).
        batch_bytes: rows are sent once this many bytes wait (and at the end of an epoch).
        ask_every_s: within an epoch, how often a store whose owners are still starting asks
            for them again (a step never waits for them: its reads are misses, its writes are
            held until they answer).
    """

    def __init__(self, owners: str | Mapping[str, str] | OwnerNames, timeout_s: float = 10.0,
                 max_inflight: int = 16, batch_bytes: int = 4 * 2**20,
                 ask_every_s: float = 0.5) -> None:
        self.node = ray.get_runtime_context().get_node_id()
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.batch_bytes = batch_bytes
        self.ask_every_s = ask_every_s
        self.dropped_rows = 0
        self.local_reads = 0
        self.remote_reads = 0
        self._reported = (0, 0, 0)
        self._inflight: list[ray.ObjectRef] = []
        self._held: list[tuple[ray.ObjectRef, int]] = []  # (batch, rows) put before the owners
        self._batch: list[tuple] = []
        self._batch_bytes = 0
        self._snapshot: dict[int, list[_Entry]] | None = None
        self._snapshot_level: int | None = None
        self._warned = False
        self.actor: Any = None
        self._lineage = 0
        self.on_node = False
        self.peers: dict[str, Any] = {}
        self._peer_lineage: dict[str, int] = {}
        self._names = owners if callable(owners) else None
        self._next_ask = 0.0
        self._found = False
        self._used = False  # read or written: until then an epoch's end asks for no owner
        if self._names is None:
            self._connect({self.node: owners} if isinstance(owners, str) else owners)

    def _ready(self, wait: bool, force: bool = False) -> bool:
        """Whether the owners are found, asking for their names first where they were not
        given (``wait``: at an epoch's end, not within a step; asks then may wait for owners
        already starting). A store this worker has not read or written yet asks only with
        ``force`` (a restore: the owners may hold rows from before it)."""
        if self._found or self._names is None:
            return True
        if not (self._used or force):
            return False  # the cache has not served this worker: its owners are not needed
        now = time.monotonic()
        if not wait and now < self._next_ask:
            return False
        self._next_ask = now + self.ask_every_s
        try:
            names = self._names(wait)
        except RayError as err:  # the controller is away: ask again later
            logger.debug("activation cache: owners not named (%s)", type(err).__name__)
            return False
        if not names:
            return False
        self._connect(names)
        return True

    def _connect(self, owners: Mapping[str, str]) -> None:
        """Find the owners of ``owners`` (``{node id: actor name}``), then send the writes
        held while they started."""
        self._found = True
        live = self._live_owners([owners.get(self.node), *sorted(owners.values())])
        local = owners.get(self.node)
        if local not in live and live:
            # A node without a live owner (joined after the start, or its owner died): write
            # to another node's owner and read from it (remote).
            local = next(iter(live))
            logger.warning("activation cache: no owner on node %s; using %s", self.node[:8],
                           local)
        # None when no owner is left at all: every read is a miss, every write dropped.
        self.actor, self._lineage = live.pop(local, (None, 0))
        self.on_node = local == owners.get(self.node)  # reads from self.actor are local
        self.peers = {name: actor for name, (actor, _) in live.items()}
        self._peer_lineage = {name: lineage for name, (_, lineage) in live.items()}
        held, self._held = self._held, []
        if self.actor is None:
            self.dropped_rows += sum(n for _, n in held)
        elif held:
            self._inflight.append(self.actor.put_refs.remote(self._lineage,
                                                             [ref for ref, _ in held]))

    def _live_owners(self, names: Sequence[str | None]) -> dict[str, tuple[Any, int]]:
        """``{name: (actor, lineage)}`` of the owners of ``names`` that answer within the
        timeout, in the order given. An owner lost with its node may still be found by name
        (its handle then fails), so each is asked for its lineage, all at once."""
        handles: dict[str, Any] = {}
        for name in dict.fromkeys(n for n in names if n is not None):
            try:
                handles[name] = ray.get_actor(name)
            except ValueError:  # that node's owner is gone: its rows are misses
                logger.warning("activation cache: owner %s not found", name)
        refs = {name: actor.lineage.remote() for name, actor in handles.items()}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        live = {}
        for name, ref in refs.items():
            try:
                live[name] = (handles[name], ray.get(ref, timeout=0))
            except RayError as err:  # dead with its node, or too slow: left out
                logger.warning("activation cache: owner %s does not answer (%s)", name,
                               type(err).__name__)
        return live

    def _call(self, method: str, *args: Any, default: Any = None, actor: Any = None) -> Any:
        actor = self.actor if actor is None else actor
        if actor is None:
            self._warn("no cache owner found")
            return default
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=self.timeout_s)
        except ActorDiedError:
            self._lost()
            return default
        except RayError as err:
            self._warn(f"{method} failed ({type(err).__name__})")
            return default

    def _lost(self) -> None:
        """An owner died: with its controller (a restarted controller starts new, empty owners
        under the same names), or with its node. Where a function names the owners, it is
        asked again (within a step no more than every ``ask_every_s``; until they answer,
        reads are misses and writes are held); else reads are misses from here on."""
        if self._names is None:
            self._warn("a cache owner died")
            return
        logger.warning("activation cache: an owner died; asking for the owners again")
        self._found, self.actor, self.peers, self._peer_lineage = False, None, {}, {}
        self._snapshot, self._next_ask = None, 0.0

    def _warn(self, what: str) -> None:
        if not self._warned:
            logger.warning("activation cache: %s; serving misses", what)
            self._warned = True

    def _take_snapshot(self, level: int) -> dict[int, list[_Entry]]:
        """Every object readable at ``level``: this node's, and the other owners' where this
        node holds fewer rows of the block at any depth. Rows held here at a shallower depth
        are advanced here rather than fetched deeper from another node: a few frozen blocks'
        forward against a transfer across nodes (and a replica that ran ahead may already
        hold deeper rows of blocks this one will not read this epoch)."""
        snapshot: dict[int, list[_Entry]] = {}
        if not self.peers:  # one owner: its plain lookup (the single-node protocol)
            for block, lv, ref in self._call("lookup", None, level, default=[]):
                snapshot.setdefault(block, []).append((block, lv, ref, None))
            return snapshot
        held: dict[int, int] = {}
        for block, lv, ref, n in self._call("lookup", None, level, True, default=[]):
            snapshot.setdefault(block, []).append((block, lv, ref, None))
            held[block] = max(held.get(block, 0), n)
        for name, actor in self.peers.items():
            for block, lv, ref, n in self._call("lookup", None, level, True, default=[],
                                                actor=actor):
                if n > held.get(block, 0):
                    snapshot.setdefault(block, []).append((block, lv, ref, name))
        for entries in snapshot.values():
            entries.sort(key=lambda e: (-e[1], e[3] is not None))  # deepest, local first
        return snapshot

    def _entries(self, blocks: Sequence[int], level: int) -> list[_Entry]:
        if self._snapshot is None or self._snapshot_level != level:
            self._snapshot, self._snapshot_level = self._take_snapshot(level), level
        return [e for b in dict.fromkeys(int(x) for x in blocks)
                for e in self._snapshot.get(b, ())]

    def read(self, blocks: Sequence[int], level: int) -> list[Segment]:
        self._used = True
        if not self._ready(wait=False):
            return []  # the owners are still starting: they hold nothing yet
        entries = self._entries(blocks, level)
        if not entries:
            return []
        refs = list(dict.fromkeys(e[2][0] for e in entries))  # blocks of a pack share one
        try:
            values = dict(zip(refs, ray.get(refs, timeout=self.timeout_s)))
        except RayError:
            values = {ref: self._get_one(ref) for ref in refs}
        out: list[Segment] = []
        lost: dict[str | None, list[tuple[int, int]]] = {}
        for block, lv, (ref, index), owner in entries:
            value = values[ref]
            if value is None:
                lost.setdefault(owner, []).append((block, lv))
                continue
            if owner is None and self.on_node:
                self.local_reads += 1
            else:
                self.remote_reads += 1
            ids, arrays, dtypes = unpack(value, index)
            out.append(Segment(block, lv, ids, tuple(arrays), tuple(dtypes)))
        if lost:
            self._warn(f"{sum(map(len, lost.values()))} cached objects could not be read")
            for owner, keys in lost.items():
                actor = self.actor if owner is None else self.peers.get(owner)
                if actor is not None:
                    actor.forget.remote(keys)
                gone = set(keys)
                for block in {b for b, _ in keys}:
                    self._snapshot[block] = [e for e in self._snapshot.get(block, ())
                                             if e[3] != owner or (e[0], e[1]) not in gone]
        return out

    def _get_one(self, ref: ray.ObjectRef) -> Payload | None:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayError:  # ObjectLostError, OwnerDiedError, GetTimeoutError, ...
            return None

    def write(self, block: int, block_size: int, level: int, ids: np.ndarray,
              arrays: Sequence[np.ndarray], dtypes: Sequence[str]) -> None:
        self._used = True
        self._batch.append((block, block_size, level, np.asarray(ids),
                            [np.asarray(a) for a in arrays], list(dtypes)))
        self._batch_bytes += sum(a.nbytes for a in arrays) + np.asarray(ids).nbytes
        if self._batch_bytes >= self.batch_bytes:
            self._send()

    def _send(self) -> None:
        """Put the waiting rows in this node's store and hand their reference to this node's
        owner without waiting (dropped past the backlog)."""
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if self._inflight:
            _, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight),
                                         timeout=0)
        ready = self._ready(wait=False)
        rows = sum(len(item[3]) for item in batch)
        if len(self._inflight) + len(self._held) >= self.max_inflight or (
                ready and self.actor is None):
            self.dropped_rows += rows
            return
        try:
            if not ready:  # held in this node's store until the owners answer
                self._held.append((ray.put(batch), rows))
                return
            # In a list, so the owner gets the reference and reads it itself.
            self._inflight.append(self.actor.put_refs.remote(self._lineage, [ray.put(batch)]))
        except RayError as err:  # this node's store is full or going away
            self.dropped_rows += sum(len(item[3]) for item in batch)
            self._warn(f"rows not sent ({type(err).__name__})")

    def _report_counts(self) -> None:
        """Tell this node's owner the reads and dropped rows since the last report."""
        now = (self.local_reads, self.remote_reads, self.dropped_rows)
        delta = [a - b for a, b in zip(now, self._reported)]
        if any(delta) and self.actor is not None:
            try:
                self._inflight.append(self.actor.count.remote(*delta))
                self._reported = now
            except (RayError, AttributeError):  # an actor without the method (a test fake)
                pass

    def drain(self) -> None:
        """End of an epoch: send the waiting rows, wait until this worker's writes have landed,
        and drop the read snapshot (the next epoch sees what this one wrote). Writes held
        while the owners started wait for them (up to ``timeout_s``; then they stay held)."""
        self._ready(wait=bool(self._held or self._batch))
        self._send()
        self._report_counts()
        if self._inflight:
            ray.wait(self._inflight, num_returns=len(self._inflight), timeout=self.timeout_s)
            self._inflight = []
        self._snapshot = None

    def flush(self) -> None:
        """Store the rows of incomplete blocks on every owner; with other owners, wait for
        that, then have this node's owner copy in what they hold and it lacks."""
        if not self._ready(wait=True):
            return  # no owner started yet: nothing is stored
        self._send()
        if not self.peers:
            if self.actor is not None:
                self.actor.flush.remote()
            return
        for actor in [self.actor, *self.peers.values()]:
            self._call("flush", default=None, actor=actor)
        entries = [e for actor in self.peers.values()
                   for e in self._call("holdings", default=[], actor=actor)]
        if entries:
            self._call("adopt", entries, default=0)
        self._snapshot = None

    def invalidate_above(self, level: int) -> None:
        self._batch, self._batch_bytes, self._snapshot, self._held = [], 0, None, []
        if not self._ready(wait=True, force=True):
            return  # no owner started yet: nothing to drop
        self._lineage = self._call("invalidate_above", level, default=self._lineage)
        for name, actor in self.peers.items():
            self._peer_lineage[name] = self._call("invalidate_above", level,
                                                  default=self._peer_lineage[name], actor=actor)

    def attach(self) -> None:
        self._snapshot = None
        if not self._ready(wait=True, force=True):
            return
        self._lineage = self._call("lineage", default=self._lineage)

    def stats(self) -> CacheStats:
        """The figures summed over every owner, but ``bytes`` and ``objects`` count each row
        once however many nodes' stores hold a copy (:func:`distinct_figures`)."""
        self._ready(wait=bool(self._held or self._batch))
        self._send()
        stats, contents = CacheStats(), []
        if not self._found:  # no owner started yet
            stats.refused_rows += self.dropped_rows
            return stats
        for actor in [self.actor, *self.peers.values()]:
            more = self._call("stats", default=None, actor=actor)
            if more is None:
                continue
            _add(stats, more)
            if self.peers:  # one owner holds no copies: its own figures are distinct
                contents.append(self._call("contents", default=[], actor=actor))
        if self.peers:
            stats.bytes, stats.objects = distinct_figures(contents)
        stats.refused_rows += self.dropped_rows
        return stats


def _add(total: CacheStats, more: CacheStats) -> None:
    """Add ``more`` into ``total``, field by field."""
    for f in fields(CacheStats):
        setattr(total, f.name, getattr(total, f.name) + getattr(more, f.name))


def owners_report(owners: Mapping[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """The driver's final cache figures: the fields of :class:`CacheStats` summed over owners,
    but ``bytes`` and ``objects`` the cache's distinct contents (each row counted once,
    however many nodes hold a copy); ``stored_bytes`` and ``stored_objects``: what every
    node's store holds together (copies included); ``nodes``: per node id,
    :meth:`CacheActor.node_stats` (empty for an owner that did not answer)."""
    total = CacheStats()
    stored = {"stored_bytes": 0, "stored_objects": 0}
    contents: list[Contents] = []
    nodes: dict[str, dict[str, Any]] = {}
    for node, actor in owners.items():
        try:
            stats, figures, held = ray.get(
                [actor.stats.remote(), actor.node_stats.remote(), actor.contents.remote()],
                timeout=timeout_s)
        except RayError as err:
            logger.warning("activation cache on node %s: no final figures (%s)", node[:8],
                           type(err).__name__)
            nodes[node] = {}
            continue
        _add(total, stats)
        stored["stored_bytes"] += stats.bytes
        stored["stored_objects"] += stats.objects
        contents.append(held)
        nodes[node] = figures
    total.bytes, total.objects = distinct_figures(contents)
    return {**asdict(total), **stored, "nodes": nodes}


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
