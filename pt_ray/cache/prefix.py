"""Stage 0's frozen prefix served from the activation cache (AutoCache).

Torch runtime layer. Before the pipeline schedule runs, stage 0 turns its replica batch's sample
indices into the frozen prefix's output (the paper's ``pipe(frozen(x))``, with the cache). For
each sample:

1. hit: the store holds it at the current depth ``n``: the cached state is used as is;
2. hit at an older depth ``l < n``: the cached state runs through the newly frozen blocks
   ``l..n-1`` only, and the result is written at depth ``n``;
3. miss (never cached, refused, evicted, lost with its owner): the whole prefix (embedding and
   blocks ``0..n-1``) runs on the sample's inputs, loaded only now, and the result is written.

The prefix runs in eval mode under ``no_grad`` and every row is independent of the others, so a
hit is the output it replaces. Writes go behind (the store queues them); the blocks a step needs
are looked up once. A row is read at the earliest in the epoch after the one that computed it
(each sample comes once per epoch), so in a run's last epoch nothing is written
(:attr:`CachedPrefix.keeps_rows`): those rows would only cost their writes.
"""

from __future__ import annotations

import time
import warnings
import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

from pt_ray.cache.policy import cache_policy
from pt_ray.cache.rows import RowTable, row_tiers
from pt_ray.cache.size import memo_limit
from pt_ray.cache.store import ActivationStore, Segment, from_numpy, to_numpy
from pt_ray.core.config import CacheConfig, FreezeConfig
from pt_ray.core.plan import CostTable
from pt_ray.data.sampler import CacheBlocks
from pt_ray.models.base import ModelAdapter, State

__all__ = [
    "CacheCounters",
    "CachedPrefix",
    "PrefixPrecision",
    "cached_prefix_for",
    "copied_whole",
    "epoch_counters",
    "gather_rows_on_device",
    "gather_rows_on_host",
    "flush_rows",
    "store_figures",
]

Loader = Callable[[np.ndarray], tuple[torch.Tensor, ...]]


class PrefixPrecision(Protocol):
    """What the prefix needs of the run's precision (:class:`pt_ray.runtime.precision.Precision`
    meets it): the forward's autocast, and the state in the compute dtype it is cached in."""

    def autocast(self) -> AbstractContextManager[object]: ...

    def cast_state(self, state: State) -> State: ...


class _FullPrecision:
    """fp32: no autocast, the state as it is."""

    def autocast(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def cast_state(self, state: State) -> State:
        return state


_FP32 = _FullPrecision()


@dataclass
class CacheCounters:
    """What stage 0's cache did since the last reset (one rank).

    Attributes:
        rows: samples whose prefix output was needed.
        hits: served at the current depth.
        advanced: served at an older depth and advanced through the newly frozen blocks.
        misses: recomputed from the inputs.
        io_s: seconds spent looking up, reading and gathering cached rows.
        write_s: seconds spent handing rows to the store (the store writes behind).
        saved_s: estimated seconds of prefix forward the cache saved, net of ``io_s`` and
            ``write_s``.
        compute_s: seconds spent running frozen layers (misses, and advancing older depths).
        uncached_s: estimated seconds the prefix forward would have taken for these rows
            without the cache (its measured forward time per sample at the current depth).
        tier_hits: hits served from a tier (:mod:`pt_ray.cache.rows`), without the
            store.
    """

    rows: int = 0
    hits: int = 0
    advanced: int = 0
    misses: int = 0
    io_s: float = 0.0
    write_s: float = 0.0
    saved_s: float = 0.0
    compute_s: float = 0.0
    uncached_s: float = 0.0
    tier_hits: int = 0

    @property
    def cost_s(self) -> float:
        """Seconds the prefix cost with the cache: reads, layers run, and writes handed off."""
        return self.io_s + self.compute_s + self.write_s


class CachedPrefix:
    """Computes stage 0's frozen-prefix output for a batch of samples through the cache.

    Args:
        adapter: the model (its embedding and frozen blocks are used, in eval mode).
        store: where cached rows are read and written.
        blocks: the sample -> cache block map.
        device: where the prefix runs.
        costs: profiled per-layer costs, to estimate the time saved until this process has
            timed the prefix itself (None: no estimate until then).
        memo_bytes: most bytes of read blocks kept between reads (least recently read
            dropped first; None: no limit).
        precision: the run's precision: the prefix runs under its autocast and rows are
            cached in its compute dtype (default: fp32).
        tiers: tables beside the store, device first (:mod:`pt_ray.cache.rows`): rows
            they hold at the current depth are served from them; rows computed here go into
            them, and reach the store at the end of the epoch (:meth:`flush_pending`).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ActivationStore,
        blocks: CacheBlocks,
        device: torch.device,
        costs: CostTable | None = None,
        memo_bytes: int | None = None,
        precision: PrefixPrecision | None = None,
        tiers: list[RowTable] | None = None,
    ) -> None:
        self.adapter = adapter
        self.tiers = tiers or []
        self._pending: list[tuple[int, np.ndarray]] = []  # rows held in a tier, not yet stored
        self.precision = precision or _FP32
        self.memo_bytes = memo_bytes
        self.store = store
        self.blocks = blocks
        self.device = device
        self.counters = CacheCounters()
        # What this process read of each block at the current depth (deepest segment first),
        # served from here without asking the store again: cached rows never change (frozen
        # layers, deterministic inputs). From Ray these are zero-copy views on the object store.
        # A block complete at the current depth stays until the depth changes; anything else
        # (rows missing, or at an older depth) until the epoch ends, since rows written during
        # an epoch are read in the next one.
        self._memo: dict[int, tuple[Segment, ...]] = {}  # in order of last read
        self._complete: set[int] = set()
        self._memo_level: int | None = None
        self._memo_held = 0
        self._row_bytes = 0.0  # cached bytes per sample, once a read has returned a row
        self._ahead_level: int | None = None  # depth of this epoch's read of every block
        self.total = CacheCounters()
        """Everything since the start (:meth:`reset` adds the epoch's counters here)."""
        self.keeps_rows = True
        """Whether rows computed now are kept (tiers and store). The engine turns this off for
        the run's last epoch, where no later epoch reads them; what is cached is still served."""
        # Forward seconds per sample of the embedding (0) and of block i (i + 1): profiled,
        # until the prefix has run here (then seconds over samples of every run so far).
        self._profiled: dict[int, float] = {}
        self._measured: dict[int, list[float]] = {}
        if costs is not None:
            self.set_costs(costs)

    def set_costs(self, costs: CostTable) -> None:
        """Take per-sample forward times from a profile (until this process measures them)."""
        per = 1.0 / costs.samples
        self._profiled[0] = costs.embed.forward_s * per
        self._profiled.update({i + 1: b.forward_s * per for i, b in enumerate(costs.blocks)})

    def reset(self) -> CacheCounters:
        """Return the counters and start new ones (adding them to :attr:`total`)."""
        out, self.counters = self.counters, CacheCounters()
        self._ahead_level = None  # a new epoch may find blocks written in this one
        for block in [b for b in self._memo if b not in self._complete]:
            self._forget(block)
        for f in fields(out):
            setattr(self.total, f.name, getattr(self.total, f.name) + getattr(out, f.name))
        return out

    @torch.no_grad()
    def __call__(self, num_frozen: int, indices: np.ndarray, load: Loader) -> State:
        """The prefix output for samples ``indices`` at depth ``num_frozen``.

        Args:
            num_frozen: n > 0, the frozen blocks.
            indices: ``[B]`` sample indices of the replica batch, in batch order.
            load: ``load(rows) -> inputs`` on this device for the batch rows ``rows`` (called
                for misses only, so a step that hits everywhere loads no input).

        Returns:
            The state tuple, each tensor ``[B, ...]`` in the order of ``indices``.
        """
        n = num_frozen
        indices = np.asarray(indices, dtype=np.int64)
        t0 = time.perf_counter()
        parts, rest = serve_from_tiers(self.tiers, indices, n, self.device)
        served, io_s = len(indices) - len(rest), time.perf_counter() - t0
        c = self.counters
        c.rows += served
        c.hits += served
        c.tier_hits += served
        c.io_s += io_s
        c.saved_s += served * self._prefix_row_s(n) - io_s
        c.uncached_s += served * self._prefix_row_s(n)
        if len(rest):
            sub = indices[rest]
            parts.append((rest, self._through_store(n, sub, lambda rows: load(rest[rows]))))
        return _assemble(parts, len(indices))

    def _through_store(self, n: int, indices: np.ndarray, load: Loader) -> State:
        """The prefix output of ``indices`` (none held in a tier at depth ``n``) through the
        store: hits as they are, older depths advanced, misses computed, each written."""
        t0 = time.perf_counter()
        segments = self._read(np.unique(self.blocks.block_of[indices]).tolist(), n)
        seg, pos, level = _locate(indices, segments)
        cached: dict[int, tuple[np.ndarray, State]] = {}
        for lv in sorted(set(level.tolist()) - {0}, reverse=True):
            rows = np.flatnonzero(level == lv)
            cached[lv] = (rows, self._gather(segments, seg[rows], pos[rows]))
        io_s = time.perf_counter() - t0

        parts: list[tuple[np.ndarray, State]] = []
        for lv, (rows, state) in cached.items():
            if lv < n:  # advance through the blocks frozen since, then store the new depth
                state = self._write(n, indices[rows], self._run(lv, n, state))
            elif self.keeps_rows:  # into a faster tier for the next epoch's read
                self._hold(n, indices[rows], state)
            parts.append((rows, state))
        miss = np.flatnonzero(level == 0)
        if len(miss):
            state = self._run(0, n, load(miss))
            parts.append((miss, self._write(n, indices[miss], state)))

        c = self.counters
        c.rows += len(indices)
        c.hits += int((level == n).sum())
        c.advanced += int(((level > 0) & (level < n)).sum())
        c.misses += len(miss)
        c.io_s += io_s
        c.saved_s += sum(self._prefix_row_s(lv) for lv in level[level > 0].tolist()) - io_s
        c.uncached_s += len(indices) * self._prefix_row_s(n)
        return _assemble(parts, len(indices))

    def invalidate_above(self, level: int) -> None:
        """Forget everything deeper than ``level``, here, in the tiers and in the store."""
        if self._memo_level is not None and self._memo_level > level:
            self._clear_memo(None)
        for tier in self.tiers:
            tier.invalidate_above(level)
        self._pending = [(n, ids) for n, ids in self._pending if n <= level]
        self.store.invalidate_above(level)

    def flush_pending(self) -> None:
        """Write to the store the rows computed into a tier since the last flush (once per
        epoch, off the step path: the other replicas read the epoch's rows in the next one)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for n, ids in pending:
            for tier in self.tiers:
                found, slots = tier.find(ids, n)
                if len(found):
                    rows = tier.take(slots, torch.device("cpu"), serving=False)
                    store_rows(self.store, self.blocks, n, ids[found], rows)
        spent = time.perf_counter() - t0
        self.counters.write_s += spent
        self.counters.saved_s -= spent

    # -- pieces ----------------------------------------------------------------------------

    def _read(self, blocks: list[int], n: int) -> list[Segment]:
        """Segments of ``blocks`` at depth ``n`` or shallower, deepest first within a block:
        from the memo where this process read them before, else from the store."""
        if self._memo_level != n:
            self._clear_memo(n)
        out = {b: self._touch(b) for b in blocks if b in self._memo}
        need = [b for b in blocks if b not in out]
        if need:
            fetched: dict[int, list[Segment]] = {}
            for segment in self.store.read(need + self._ahead(need, n), n):
                fetched.setdefault(segment.block, []).append(segment)
                if segment.ids.size:
                    self._row_bytes = sum(a.nbytes for a in segment.arrays) / segment.ids.size
            for block, segments in fetched.items():
                self._remember(block, tuple(segments), n)
            out.update((b, tuple(fetched.get(b, ()))) for b in need)
        return [segment for b in blocks for segment in out[b]]

    def _ahead(self, need: list[int], n: int) -> list[int]:
        """Blocks to read with ``need``: every other one not yet held, once per epoch and
        depth, when the whole cache fits the memo. Each block is read once per epoch, so asking
        block by block would cost a store read per step until the memo is warm."""
        whole = self._row_bytes * self.blocks.num_samples
        if not self._row_bytes or self._ahead_level == n or (
                self.memo_bytes is not None and whole > self.memo_bytes):
            return []
        self._ahead_level = n
        asked = set(need)
        return [b for b in range(self.blocks.num_blocks) if b not in self._memo and b not in asked]

    def _touch(self, block: int) -> tuple[Segment, ...]:
        """A memo entry, now the most recently read."""
        segments = self._memo.pop(block)
        self._memo[block] = segments
        return segments

    def _remember(self, block: int, segments: tuple[Segment, ...], n: int) -> None:
        size = _nbytes(segments)
        limit = self.memo_bytes
        if limit is not None and size > limit:
            return
        if block in self._memo:
            self._forget(block)
        self._memo[block] = segments
        self._memo_held += size
        top = segments[0]
        if top.level == n and len(top.ids) == self.blocks.size(block):
            self._complete.add(block)
        while limit is not None and self._memo_held > limit:
            self._forget(next(iter(self._memo)))

    def _forget(self, block: int) -> None:
        self._memo_held -= _nbytes(self._memo.pop(block))
        self._complete.discard(block)

    def _clear_memo(self, level: int | None) -> None:
        self._memo, self._complete, self._memo_level, self._memo_held = {}, set(), level, 0

    def _gather(self, segments: list[Segment], seg: np.ndarray, pos: np.ndarray) -> State:
        """Rows ``pos[i]`` of segments ``seg[i]``, as tensors on this device (copies, so no
        store buffer stays pinned)."""
        if self.device.type == "cpu":
            return gather_rows_on_host(segments, seg, pos)
        return gather_rows_on_device(segments, seg, pos, self.device)

    def _run(self, lo: int, n: int, state: State) -> State:
        """The frozen layers from depth ``lo`` (0: the embedding, on model inputs) to ``n``,
        timing each per sample for the saved-time estimate."""
        rows = int(state[0].shape[0])
        modules = ([self.adapter.embed] if lo == 0 else []) + list(self.adapter.blocks[lo:n])
        for i, module in enumerate(modules, start=0 if lo == 0 else lo + 1):
            t = time.perf_counter()
            with self.precision.autocast():
                state = module(*state)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            spent = time.perf_counter() - t
            seconds_rows = self._measured.setdefault(i, [0.0, 0])
            seconds_rows[0] += spent
            seconds_rows[1] += rows
            self.counters.compute_s += spent
        return self.precision.cast_state(state)

    def _prefix_row_s(self, level: int) -> float:
        """Estimated forward seconds per sample of the prefix up to depth ``level``."""
        total = 0.0
        for i in range(level + 1):
            seconds, rows = self._measured.get(i, (0.0, 0))
            total += seconds / rows if rows else self._profiled.get(i, 0.0)
        return total

    def _hold(self, n: int, ids: np.ndarray, state: State) -> np.ndarray:
        """Put rows ``state`` of samples ``ids`` at depth ``n`` into the tiers, device first;
        returns the positions of ``ids`` some tier took."""
        left = np.arange(len(ids))
        for tier in self.tiers:
            if not len(left):
                break
            if not tier.room_for(ids[left]):
                continue
            part = tuple(t[torch.from_numpy(left).to(t.device)] for t in state)
            taken = tier.put(ids[left], part, n)
            left = np.delete(left, taken)
        return np.setdiff1d(np.arange(len(ids)), left)

    def _write(self, n: int, ids: np.ndarray, state: State) -> State:
        """Keep the new rows ``state`` (samples ``ids``) at depth ``n``: in the tiers, stored
        at the epoch's end; those no tier took, queued to the store now. Nothing is kept while
        :attr:`keeps_rows` is off."""
        if not self.keeps_rows:
            return state
        t0 = time.perf_counter()
        held = self._hold(n, ids, state) if self.tiers else np.zeros(0, dtype=np.int64)
        if len(held):
            self._pending.append((n, ids[held]))
        if not len(held):
            store_rows(self.store, self.blocks, n, ids, state)
        elif len(held) < len(ids):
            rest = np.setdiff1d(np.arange(len(ids)), held)
            index = torch.from_numpy(rest).to(state[0].device)
            store_rows(self.store, self.blocks, n, ids[rest], tuple(t[index] for t in state))
        spent = time.perf_counter() - t0
        self.counters.write_s += spent
        self.counters.saved_s -= spent
        return state

def serve_from_tiers(tiers: list[RowTable], indices: np.ndarray, n: int, device: torch.device
                     ) -> tuple[list[tuple[np.ndarray, State]], np.ndarray]:
    """The rows of ``indices`` the tiers hold at depth ``n``, on ``device``, as ``(positions,
    state)`` pieces (first tier first), and the positions none holds."""
    rest = np.arange(len(indices))
    parts: list[tuple[np.ndarray, State]] = []
    for tier in tiers:
        found, slots = tier.find(indices[rest], n)
        if len(found):
            parts.append((rest[found], tier.take(slots, device)))
            rest = np.delete(rest, found)
    return parts, rest


def store_rows(store: ActivationStore, blocks: CacheBlocks, n: int, ids: np.ndarray,
               state: State) -> None:
    """Queue rows ``state`` of samples ``ids`` to ``store`` at depth ``n``, block by block."""
    arrays = [to_numpy(t) for t in state]
    block_of = blocks.block_of[ids]
    for b in np.unique(block_of).tolist():
        sel = np.flatnonzero(block_of == b)
        sel = sel[np.argsort(ids[sel])]
        store.write(b, blocks.size(b), n, ids[sel], [a[sel] for a, _ in arrays],
                    [d for _, d in arrays])


def cached_prefix_for(cache: CacheConfig, freeze: FreezeConfig, seed: int,
                      adapter: ModelAdapter, store: ActivationStore | None, num_samples: int,
                      deterministic: bool, device: torch.device, costs: CostTable | None,
                      precision: PrefixPrecision) -> CachedPrefix | None:
    """Stage 0's cached prefix for a run, with the tiers its ``cache`` section asks for on
    ``device`` and its blocks drawn from ``seed``; None without a store or when the cache is
    off (:func:`cache_policy`, which reads ``freeze`` too)."""
    if store is None or cache_policy(cache, freeze, deterministic).mode == "off":
        return None
    blocks = CacheBlocks(num_samples, cache.block_size, seed)
    return CachedPrefix(adapter, store, blocks, device, costs,
                        memo_bytes=memo_limit(cache), precision=precision,
                        tiers=row_tiers(cache, num_samples, device))


def epoch_counters(prefix: CachedPrefix | None) -> list[float]:
    """At the end of an epoch, once this rank's writes have landed: its share of the epoch's
    cache figures, to be summed over ranks: ``[rows, rows served from the cache (hit or
    advanced), saved_s, 1 if it read the cache, cost_s, uncached_s]`` (zeros without a cache).

    Args:
        prefix: this rank's cached prefix (None: no cache in this run).
    """
    if prefix is None:
        return [0.0] * 6
    prefix.flush_pending()
    prefix.store.drain()
    c = prefix.reset()
    return [float(c.rows), float(c.hits + c.advanced), c.saved_s, float(c.rows > 0), c.cost_s,
            c.uncached_s]


def flush_rows(prefix: CachedPrefix | None) -> None:
    """After every rank's :func:`epoch_counters`: store the rows of incomplete blocks (with one
    owner the call returns at once, so the owner's work overlaps the evaluation that follows;
    :func:`store_figures` waits for it)."""
    if prefix is not None:
        prefix.store.flush()


def store_figures(prefix: CachedPrefix | None, rank: int) -> list[float]:
    """After :func:`flush_rows`: (rank 0, always a stage 0) the store's ``[bytes, objects]``;
    zeros elsewhere."""
    if prefix is None or rank != 0:
        return [0.0, 0.0]
    stats = prefix.store.stats()
    return [float(stats.bytes), float(stats.objects)]


def _nbytes(segments: tuple[Segment, ...]) -> int:
    return sum(sum(a.nbytes for a in seg.arrays) + seg.ids.nbytes for seg in segments)


def _locate(indices: np.ndarray, segments: list[Segment]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each sample: the segment holding its deepest cached copy, the row there (``-1``
    where none does) and that copy's depth (0 where none)."""
    seg = np.full(len(indices), -1, dtype=np.int64)
    pos = np.full(len(indices), -1, dtype=np.int64)
    best = np.zeros(len(indices), dtype=np.int64)
    for s, sg in enumerate(segments):
        if not len(sg.ids):
            continue
        at = np.minimum(np.searchsorted(sg.ids, indices), len(sg.ids) - 1)
        found = (sg.ids[at] == indices) & (sg.level > best)
        seg[found], pos[found], best[found] = s, at[found], sg.level
    return seg, pos, best


def _assemble(parts: list[tuple[np.ndarray, State]], size: int) -> State:
    """One state of ``size`` rows from pieces that each fill the rows ``positions``."""
    if len(parts) == 1:  # one source (all hits, say): its rows are 0..size-1 in order
        return parts[0][1]
    first = parts[0][1]
    out = tuple(torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in first)
    for positions, state in parts:
        idx = torch.from_numpy(positions).to(first[0].device)
        for o, t in zip(out, state):
            o[idx] = t
    return out


def _pick(segments: list[Segment], seg: np.ndarray, pos: np.ndarray, j: int) -> np.ndarray:
    """State array ``j``'s rows ``pos[i]`` of ``segments[seg[i]]``, picked with numpy into one
    new host array."""
    like = segments[int(seg[0])].arrays[j]
    out = np.empty((len(seg), *like.shape[1:]), dtype=like.dtype)
    for s in np.unique(seg).tolist():
        sel = np.flatnonzero(seg == s)
        out[sel] = segments[s].arrays[j][pos[sel]]
    return out


def gather_rows_on_host(segments: list[Segment], seg: np.ndarray, pos: np.ndarray) -> State:
    """Rows ``pos[i]`` of ``segments[seg[i]]`` picked with numpy, as CPU tensors."""
    first = segments[int(seg[0])]
    return tuple(from_numpy(_pick(segments, seg, pos, j), d, copy=False)
                 for j, d in enumerate(first.dtypes))


_COPY_WHOLE_FROM = 0.25
"""A segment that serves at least this share of its rows to a step is copied to the device whole;
the rows of sparser ones are picked on the host first. In the run's plain order a step takes a
row or two from each of up to ``batch`` blocks: copying those whole would move about
``block_size`` times the bytes it uses (not measured on a GPU yet; the threshold is a guess
between the slow host gather and that waste)."""


def copied_whole(segments: list[Segment], seg: np.ndarray) -> list[int]:
    """The segments :func:`gather_rows_on_device` copies whole for rows from ``seg``: those
    serving at least :data:`_COPY_WHOLE_FROM` of their rows, ascending."""
    used, counts = np.unique(seg, return_counts=True)
    return [s for s, c in zip(used.tolist(), counts.tolist())
            if c >= _COPY_WHOLE_FROM * segments[s].ids.size]


def gather_rows_on_device(
    segments: list[Segment], seg: np.ndarray, pos: np.ndarray, device: torch.device
) -> State:
    """Rows ``pos[i]`` of ``segments[seg[i]]``, on ``device``.

    1. Each segment that serves at least :data:`_COPY_WHOLE_FROM` of its rows is copied whole
       (one host-to-device transfer per segment and state tensor; a segment is one block of a
       few dozen samples) and its rows are picked there: a gather on the host is bound by host
       memory bandwidth, far below a GPU's, and can cost more than recomputing the frozen
       blocks it replaces.
    2. The rows of the other segments are picked on the host into one array, copied at once.
    """
    whole = copied_whole(segments, seg)
    in_whole = np.isin(seg, whole)
    picked = np.flatnonzero(~in_whole)
    # Where each row lands on the device: the whole segments back to back, then the picked rows.
    start = np.zeros(len(segments), dtype=np.int64)
    sizes = np.array([segments[s].ids.size for s in whole], dtype=np.int64)
    start[whole] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if whole else []
    rows = np.empty(len(seg), dtype=np.int64)
    rows[in_whole] = start[seg[in_whole]] + pos[in_whole]
    rows[picked] = int(sizes.sum()) + np.arange(len(picked))
    index = torch.from_numpy(rows).to(device)
    first = segments[int(seg[0])]
    out = []
    for j, dtype in enumerate(first.dtypes):
        host = [segments[s].arrays[j] for s in whole]
        if len(picked):
            host.append(_pick(segments, seg[picked], pos[picked], j))
        with warnings.catch_warnings():  # zero-copy views of the store are read-only
            warnings.simplefilter("ignore", UserWarning)
            parts = [from_numpy(a, dtype, copy=False).to(device) for a in host]
        out.append((parts[0] if len(parts) == 1 else torch.cat(parts))[index])
    return tuple(out)
