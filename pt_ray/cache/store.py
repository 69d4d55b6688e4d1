"""The activation cache's store: frozen-prefix outputs per sample, kept in blocks of samples.

Torch runtime layer (numpy and torch, never ray; torch loads only in the two conversions, so
the Ray cache owners that keep the ledger never pay its import). An entry is one sample's
prefix output (the state tuple: hidden states, plus the attention mask for BERT-family models)
keyed by ``(sample index, num_frozen)``; entries are grouped by cache block
(:class:`pt_ray.data.sampler.CacheBlocks`), so one object holds a whole block at one depth.

* :class:`ActivationStore` is the seam: stage 0 reads a step's blocks at once and writes
  behind (a write may be refused and is then a later miss, never an error).
* :class:`BlockLedger` is the bookkeeping every store shares: it assembles the pieces that
  replicas write into whole-block objects, enforces the byte budget, releases a depth once a
  deeper one covers its samples, and drops entries a restart made stale.
* :class:`InMemoryStore` keeps the objects in this process (tests, single-process runs); the
  Ray object-store implementation lives in :mod:`pt_ray.cache.owners`.

Rows are stored as numpy arrays in the compute dtype, bit for bit (bfloat16 travels as its
16-bit pattern), so a hit is exactly the prefix output it replaces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "ActivationStore",
    "BlockLedger",
    "CacheStats",
    "Contents",
    "InMemoryStore",
    "Payload",
    "Segment",
    "distinct_figures",
    "from_numpy",
    "to_numpy",
    "unpack",
]

logger = logging.getLogger(__name__)

Payload = tuple[np.ndarray, tuple[np.ndarray, ...], tuple[str, ...]]
"""What one cache object holds: ``(ids [n] int64 ascending, arrays [n, ...] each, dtypes)``."""

H = TypeVar("H")


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU numpy copy of ``t`` with its torch dtype's name (bfloat16 as raw 16-bit words).
    A tensor on another device is copied to the host once (that copy is the result)."""
    import torch

    on_host = t.device.type == "cpu"
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return (t.numpy().copy() if on_host else t.numpy()), name


def from_numpy(a: np.ndarray, dtype: str, copy: bool = True) -> torch.Tensor:
    """The tensor :func:`to_numpy` stored. With ``copy`` (for read-only views of the store)
    the result owns its memory, so no store buffer stays pinned; without, it shares ``a``."""
    import torch

    t = torch.from_numpy(np.array(a, copy=True) if copy else a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


@dataclass(frozen=True)
class Segment:
    """Cached prefix outputs of some samples of one block at one depth.

    Attributes:
        block: the cache block.
        level: the depth (``num_frozen``) the rows were computed at.
        ids: ``[n]`` int64 sample indices, ascending.
        arrays: one ``[n, ...]`` array per state tensor (read-only views when from Ray).
        dtypes: torch dtype name of each array (see :func:`from_numpy`).
    """

    block: int
    level: int
    ids: np.ndarray
    arrays: tuple[np.ndarray, ...]
    dtypes: tuple[str, ...]


@dataclass
class CacheStats:
    """A store's state and what it refused.

    Attributes:
        bytes: bytes held in stored objects (a pack's, until its last block is released).
        objects: stored blocks, one entry per block and depth at most (the blocks of a pack
            share one object).
        pending_bytes: bytes of rows waiting for the rest of their block.
        budget_bytes: most bytes the store admits (objects plus pending rows).
        refused_rows: rows not admitted because the budget was full.
        stale_rows: rows refused because a restart made them stale.
        released_objects: entries dropped because a deeper depth covered them.
        lost_objects: entries dropped because reading them failed.
    """

    bytes: int = 0
    objects: int = 0
    pending_bytes: int = 0
    budget_bytes: int = 0
    refused_rows: int = 0
    stale_rows: int = 0
    released_objects: int = 0
    lost_objects: int = 0


Contents = list[tuple[int, int, np.ndarray, int]]
"""A store's objects as ``(block, depth, sample ids, bytes)`` (:meth:`BlockLedger.contents`)."""


def distinct_figures(stores: Sequence[Contents]) -> tuple[int, int]:
    """The bytes and objects of several stores' contents with each row counted once, however
    many stores hold a copy: the size of the cache as a user means it (each store's own
    :class:`CacheStats` counts its copies, so their sum grows with the number of nodes).

    Args:
        stores: per store, its :meth:`BlockLedger.contents`.

    Returns:
        ``(bytes, objects)``: the distinct rows of each ``(block, depth)`` at that object's bytes
        per row (the rows of one depth share a shape), and the distinct ``(block, depth)``.
    """
    rows: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
    for contents in stores:
        for block, level, ids, nbytes in contents:
            held = rows.get((block, level))
            union = ids if held is None else np.union1d(held[0], ids)
            rows[(block, level)] = (union, nbytes // len(ids) if len(ids) else 0)
    return sum(len(ids) * per_row for ids, per_row in rows.values()), len(rows)


@runtime_checkable
class ActivationStore(Protocol):
    """Where stage 0 finds and leaves frozen-prefix outputs. Every method is safe to call when
    the backing store is gone: reads then return nothing and writes are dropped."""

    def read(self, blocks: Sequence[int], level: int) -> list[Segment]:
        """Every cached segment of ``blocks`` at depth ``level`` or shallower, deepest first.
        Lost objects are left out. Rows written since the last :meth:`drain` may be missing (an
        epoch reads each sample once, so a store may answer from a snapshot per epoch)."""
        ...

    def write(self, block: int, block_size: int, level: int, ids: np.ndarray,
              arrays: Sequence[np.ndarray], dtypes: Sequence[str]) -> None:
        """Queue rows ``ids`` (ascending) of ``block`` (``block_size`` samples in all) at depth
        ``level`` without waiting; the store may refuse them (budget, backlog)."""
        ...

    def drain(self) -> None:
        """Wait until this process's writes have reached the store, and make them readable
        (end of an epoch)."""
        ...

    def flush(self) -> None:
        """Store the rows of blocks still incomplete (at the end of an epoch, once every
        replica's writes have landed)."""
        ...

    def invalidate_above(self, level: int) -> None:
        """Drop entries deeper than ``level`` and refuse writes issued before this call (a
        resume from a checkpoint taken at ``level``: deeper entries came from a lost future)."""
        ...

    def attach(self) -> None:
        """Write under the store's current lineage (after another rank's
        :meth:`invalidate_above`)."""
        ...

    def stats(self) -> CacheStats:
        ...


@dataclass
class _Pending:
    pieces: list[Payload] = field(default_factory=list)
    ids: set[int] = field(default_factory=set)
    nbytes: int = 0


@dataclass
class _Pack:
    """One stored object holding several blocks: its bytes count in the budget until the last
    block in it is dropped (the object lives as long as any of them)."""

    nbytes: int
    blocks: int


@dataclass
class _Stored(Generic[H]):
    """A block at one depth: the object holding it, and its place in a pack (None: the object
    is this block's alone)."""

    handle: H
    index: int | None
    ids: np.ndarray
    nbytes: int
    pack: _Pack | None = None

    @property
    def ref(self) -> tuple[H, int | None]:
        return self.handle, self.index


def unpack(value: Payload | Sequence[Payload], index: int | None) -> Payload:
    """A block's payload from what its object holds: the payload itself, or a pack's
    ``index``-th (see :class:`BlockLedger`)."""
    return value if index is None else value[index]  # type: ignore[return-value]


def _nbytes(payload: Payload) -> int:
    return int(payload[0].nbytes + sum(a.nbytes for a in payload[1]))


def _merge(parts: Sequence[Payload]) -> Payload:
    """One payload from several, rows sorted by sample id, each id once (the first copy)."""
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    keep = np.ones(len(ids), dtype=bool)
    keep[1:] = ids[1:] != ids[:-1]
    arrays = tuple(np.concatenate([p[1][i] for p in parts])[order][keep]
                   for i in range(len(parts[0][1])))
    return ids[keep], arrays, parts[0][2]


class BlockLedger(Generic[H]):
    """The bookkeeping of a block store, over any object handle (an array tuple, a Ray ref).

    1. Rows arrive in pieces (each replica writes its share of a block). They wait, counted in
       the budget, until their block is complete at that depth (or :meth:`flush`), then are
       stored; an existing object of the same block and depth is merged in.
    2. The blocks completed by one :meth:`add_many` call, or stored by one :meth:`flush`, go
       into one object (a pack: a list of payloads), so a flush of many incomplete blocks (a
       freeze landing late in an epoch leaves every block incomplete) costs one ``put``, not
       one per block. :meth:`lookup` names a block by ``(handle, index in its pack)``.
    3. A newly stored block releases the shallower entries of its block, so a block has one
       entry; a pack's bytes stay counted until its last block is released.
    4. A piece that would pass the budget is refused (its rows stay misses).
    5. :meth:`invalidate_above` drops deeper entries and starts a new lineage; pieces written
       under an older lineage are refused.

    Args:
        budget_bytes: most bytes of objects plus waiting rows.
        put: stores a payload or a list of them, returns its handle (may raise: the rows are
            then refused).
        load: what a handle holds (for merging).
    """

    def __init__(self, budget_bytes: int, put: Callable[[Payload | list[Payload]], H],
                 load: Callable[[H], Payload | list[Payload]]) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be positive")
        self._put, self._load = put, load
        self.lineage = 0
        self.objects: dict[int, dict[int, _Stored[H]]] = {}
        """block -> depth -> where it is stored."""
        self._pending: dict[tuple[int, int], _Pending] = {}
        self.stats = CacheStats(budget_bytes=budget_bytes)

    @property
    def used_bytes(self) -> int:
        return self.stats.bytes + self.stats.pending_bytes

    def add(self, lineage: int, block: int, block_size: int, level: int,
            payload: Payload) -> bool:
        """Admit rows of one block at one depth, storing the block if they complete it;
        returns whether they were admitted."""
        admitted, complete = self._admit(lineage, block, block_size, level, payload)
        if complete:
            self._store([(block, level)])
        return admitted

    def add_many(self, lineage: int,
                 items: Sequence[tuple[int, int, int, Payload]]) -> int:
        """:meth:`add` for each ``(block, block_size, level, payload)``, storing the blocks
        they complete in one object; returns how many were admitted."""
        admitted, complete = 0, []
        for block, block_size, level, payload in items:
            ok, done = self._admit(lineage, block, block_size, level, payload)
            admitted += ok
            if done:
                complete.append((block, level))
        self._store(complete)
        return admitted

    def _admit(self, lineage: int, block: int, block_size: int, level: int,
               payload: Payload) -> tuple[bool, bool]:
        """Queue rows; returns whether they were admitted and whether their block is now
        complete at that depth."""
        rows = len(payload[0])
        if lineage != self.lineage:
            self.stats.stale_rows += rows
            return False, False
        nbytes = _nbytes(payload)
        if self.used_bytes + nbytes > self.stats.budget_bytes:
            self.stats.refused_rows += rows
            return False, False
        pend = self._pending.setdefault((block, level), _Pending())
        pend.pieces.append(payload)
        pend.ids.update(payload[0].tolist())
        pend.nbytes += nbytes
        self.stats.pending_bytes += nbytes
        stored = self.objects.get(block, {}).get(level)
        covered = len(pend.ids) if stored is None else len(pend.ids.union(stored.ids.tolist()))
        return True, covered >= block_size

    def flush(self) -> None:
        """Store every waiting piece, complete or not (in one object)."""
        self._store(list(self._pending))

    def payload(self, entry: tuple[H, int | None]) -> Payload:
        """What a :meth:`lookup` entry's ``(handle, index)`` holds."""
        return unpack(self._load(entry[0]), entry[1])

    def _store(self, keys: list[tuple[int, int]]) -> None:
        keys = list(dict.fromkeys(keys))
        deepest: dict[int, int] = {}
        for block, level in keys:
            deepest[block] = max(level, deepest.get(block, level))
        for block, level in [k for k in keys if k[1] < deepest[k[0]]]:
            # A deeper entry of the block stored with it would release it at once, and in a
            # pack its bytes would stay: its rows are dropped instead (then misses).
            self.stats.pending_bytes -= self._pending.pop((block, level)).nbytes
            self.stats.released_objects += 1
            keys.remove((block, level))
        if not keys:
            return
        merged: list[tuple[int, int, Payload, int]] = []
        for block, level in keys:
            pend = self._pending.pop((block, level))
            self.stats.pending_bytes -= pend.nbytes
            parts = list(pend.pieces)
            old = self.objects.get(block, {}).get(level)
            if old is not None:
                parts.insert(0, self.payload(old.ref))
            merged.append((block, level, _merge(parts), len(pend.ids)))
        payloads = [m[2] for m in merged]
        try:
            handle = self._put(payloads[0] if len(payloads) == 1 else payloads)
        except Exception as err:  # a full store or a dying backend: the rows stay misses
            logger.warning("cache: %d block(s) at depth %s not stored (%s)", len(merged),
                           sorted({m[1] for m in merged}), err)
            self.stats.refused_rows += sum(m[3] for m in merged)
            return
        pack = None
        if len(merged) > 1:
            pack = _Pack(nbytes=sum(_nbytes(p) for p in payloads), blocks=len(merged))
            self.stats.bytes += pack.nbytes
        for i, (block, level, payload, _) in enumerate(merged):
            self._drop(block, level)
            entry = _Stored(handle, None if pack is None else i, payload[0], _nbytes(payload),
                            pack)
            self.objects.setdefault(block, {})[level] = entry
            if pack is None:
                self.stats.bytes += entry.nbytes
            self.stats.objects += 1
            # A deeper object supersedes the block's shallower ones. Most often it covers them
            # (the block is complete); after a flush it may not, and the rows it lacks (a few
            # per epoch: the batch that drop_last skipped) become misses. So a block never has
            # more than one entry.
            for lower in [lv for lv in self.objects[block] if lv < level]:
                self._drop(block, lower)
                self.stats.released_objects += 1

    def _drop(self, block: int, level: int) -> None:
        depths = self.objects.get(block, {})
        entry = depths.pop(level, None)
        if entry is not None:
            self.stats.objects -= 1
            if entry.pack is None:
                self.stats.bytes -= entry.nbytes
            else:
                entry.pack.blocks -= 1
                if entry.pack.blocks == 0:
                    self.stats.bytes -= entry.pack.nbytes
        if not depths:
            self.objects.pop(block, None)

    def contents(self) -> Contents:
        """``(block, depth, sample ids, bytes)`` of every object (for :func:`distinct_figures`)."""
        return [(b, lv, e.ids, e.nbytes) for b, depths in self.objects.items()
                for lv, e in depths.items()]

    def lookup(self, blocks: Sequence[int], level: int
               ) -> list[tuple[int, int, tuple[H, int | None]]]:
        """``(block, level, (handle, index))`` of every entry of ``blocks`` at ``level`` or
        shallower, deepest first within each block (:func:`unpack` reads one)."""
        out = []
        for b in dict.fromkeys(int(x) for x in blocks):
            depths = self.objects.get(b, {})
            out.extend((b, lv, depths[lv].ref) for lv in sorted(depths, reverse=True)
                       if lv <= level)
        return out

    def forget(self, block: int, level: int) -> None:
        """Drop an object whose read failed (lost with its node, or evicted)."""
        if level in self.objects.get(block, {}):
            self._drop(block, level)
            self.stats.lost_objects += 1

    def invalidate_above(self, level: int) -> int:
        """Drop objects and waiting rows deeper than ``level``; returns the new lineage."""
        for block, lv in [(b, lv) for b, ds in self.objects.items() for lv in ds if lv > level]:
            self._drop(block, lv)
        for key in [k for k in self._pending if k[1] > level]:
            self.stats.pending_bytes -= self._pending.pop(key).nbytes
        self.lineage += 1
        return self.lineage


class InMemoryStore:
    """An :class:`ActivationStore` in this process's memory (tests; runs without Ray).

    Args:
        budget_bytes: most bytes held (default: unlimited for practical purposes, 64 GiB).
    """

    def __init__(self, budget_bytes: int = 64 * 2**30) -> None:
        self.index: BlockLedger[Payload | list[Payload]] = BlockLedger(
            budget_bytes, put=lambda p: p, load=lambda p: p)
        self._lineage = 0

    def read(self, blocks: Sequence[int], level: int) -> list[Segment]:
        out = []
        for block, lv, ref in self.index.lookup(blocks, level):
            ids, arrays, dtypes = self.index.payload(ref)
            out.append(Segment(block, lv, ids, arrays, dtypes))
        return out

    def write(self, block: int, block_size: int, level: int, ids: np.ndarray,
              arrays: Sequence[np.ndarray], dtypes: Sequence[str]) -> None:
        payload = (np.array(ids, dtype=np.int64), tuple(np.array(a) for a in arrays),
                   tuple(dtypes))
        self.index.add(self._lineage, block, block_size, level, payload)

    def drain(self) -> None:
        pass  # writes are synchronous here

    def flush(self) -> None:
        self.index.flush()

    def invalidate_above(self, level: int) -> None:
        self._lineage = self.index.invalidate_above(level)

    def attach(self) -> None:
        self._lineage = self.index.lineage

    def stats(self) -> CacheStats:
        return CacheStats(**vars(self.index.stats))

