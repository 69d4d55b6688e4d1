"""The activation cache's tiers beside stage 0: cached rows in preallocated tensors, by sample.

Torch runtime layer. A step that reads the cache through the store gathers its rows from
segments on the host and copies them to the device each time. A :class:`RowTable` keeps the
rows a replica has served in one tensor per state part, allocated once (at the first write,
when the row's shape is known) and indexed by sample, so a later epoch serves them with one
index on the device:

* the device tier (``cache.device_bytes``): on the GPU, read and written without leaving it;
* the host tier (``cache.host_bytes``): rows the device tier has no room for, in page-locked
  host memory, read with an asynchronous copy through two alternating staging buffers, and
  written with a synchronous one (once per sample and depth).

Each stage-0 replica holds its own tables: the rows it computed or read, at most one copy of a
sample, with the depth it was computed at. The store (Ray's object store under Ray) still holds
every row, for the other replicas, other nodes and restarts; the tiers only spare a step the
trip through it. A table never evicts: once full, further rows stay in the store alone.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pt_ray.core.config import CacheConfig
from pt_ray.models.base import State

__all__ = ["RowTable", "row_tiers"]

logger = logging.getLogger(__name__)

HOST_AUTO_BYTES = 4 * 2**30
"""``cache.host_bytes=auto`` on CUDA: page-locked host memory is the node's to share."""
DEVICE_AUTO_SHARE = 0.25
"""``cache.device_bytes=auto`` on CUDA: this share of the device's free memory at the first
write (after the model, the optimizer and a step's activations have taken theirs)."""


class RowTable:
    """Cached prefix rows of one replica in preallocated tensors, indexed by sample.

    Args:
        num_samples: the training set's samples (the index space).
        capacity_bytes: most bytes the table allocates; the rows it holds are this over the
            bytes of one row (at most ``num_samples``). None: decided at the first write
            (``auto`` on CUDA: :data:`DEVICE_AUTO_SHARE` of the free memory).
        device: where the rows live.
        pinned: page-locked host memory (a host tier feeding a CUDA device).
        name: ``device`` or ``host``, for logs.
    """

    def __init__(self, num_samples: int, capacity_bytes: int | None, device: torch.device,
                 pinned: bool = False, name: str = "device") -> None:
        self.num_samples = num_samples
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.pinned = pinned
        self.name = name
        self.slot_of = np.full(num_samples, -1, dtype=np.int64)
        self.level_of = np.zeros(0, dtype=np.int64)  # per slot; 0: empty
        self.used = 0
        self.tensors: tuple[torch.Tensor, ...] | None = None
        self._staging: list[tuple[torch.Tensor, ...]] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.served = 0  # rows served (for tests and logs)

    @property
    def capacity(self) -> int:
        return len(self.level_of)

    def find(self, indices: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, slots)``: where in ``indices`` a row is held at depth ``level``, and
        its slot."""
        slots = self.slot_of[indices]
        held = slots >= 0
        held[held] = self.level_of[slots[held]] == level
        positions = np.flatnonzero(held)
        return positions, slots[positions]

    def take(self, slots: np.ndarray, device: torch.device, serving: bool = True) -> State:
        """The rows in ``slots``, on ``device``: indexed where they live; from the host tier
        through a page-locked staging buffer and an asynchronous copy. ``serving``: a step's
        read (counted in :attr:`served`), not the store's copy."""
        assert self.tensors is not None
        self.served += len(slots) if serving else 0
        index = torch.from_numpy(slots).to(self.device)
        if not self.pinned or device.type == "cpu":  # a new tensor: nothing shares a buffer
            return tuple(t.index_select(0, index).to(device) for t in self.tensors)
        turn, staging = self._staging_for(len(slots))
        out = tuple(torch.index_select(t, 0, index, out=s).to(device, non_blocking=True)
                    for t, s in zip(self.tensors, staging))
        event = torch.cuda.Event()
        event.record()  # the buffer's next user waits for these copies
        self._events[turn] = event
        return out

    def put(self, ids: np.ndarray, state: State, level: int) -> np.ndarray:
        """Hold rows ``state`` of samples ``ids`` (distinct, in any order) at depth ``level``:
        in their slot when held, else in free slots while there are any. Returns the positions
        of ``ids`` it took. Writing from a GPU into the host tier copies synchronously."""
        if self.tensors is None:
            self._allocate(state)
        slots = self.slot_of[ids].copy()
        new = np.flatnonzero(slots < 0)[: self.capacity - self.used]
        slots[new] = np.arange(self.used, self.used + len(new))
        self.used += len(new)
        self.slot_of[ids[new]] = slots[new]
        taken = np.flatnonzero(slots >= 0)
        if not len(taken):
            return taken
        self.level_of[slots[taken]] = level
        index = torch.from_numpy(slots[taken]).to(self.device)
        rows = torch.from_numpy(taken).to(state[0].device)
        for t, part in zip(self.tensors, state):
            t.index_copy_(0, index, part.index_select(0, rows).to(self.device, t.dtype))
        return taken

    def room_for(self, ids: np.ndarray) -> bool:
        """Whether :meth:`put` could take any of ``ids`` (a free slot, or one of them held)."""
        return self.tensors is None or self.used < self.capacity or bool(
            (self.slot_of[ids] >= 0).any())

    def invalidate_above(self, level: int) -> None:
        """Forget rows deeper than ``level`` (their slots stay theirs)."""
        self.level_of[self.level_of > level] = 0

    def held(self, level: int) -> int:
        """Rows held at depth ``level``."""
        return int((self.level_of == level).sum())

    def _allocate(self, state: State) -> None:
        row = sum(t[0].numel() * t.element_size() for t in state)
        budget = self.capacity_bytes
        if budget is None:  # auto on CUDA
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(DEVICE_AUTO_SHARE * free)
        rows = min(self.num_samples, budget // max(row, 1))
        self.level_of = np.zeros(rows, dtype=np.int64)
        self.tensors = tuple(
            torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=self.device,
                        pin_memory=self.pinned) for t in state)
        logger.info("activation cache %s tier: %d of %d rows (%.1f MiB)", self.name, rows,
                    self.num_samples, rows * row / 2**20)

    def _staging_for(self, rows: int) -> tuple[int, tuple[torch.Tensor, ...]]:
        """One of two page-locked buffers of at least ``rows`` rows (its turn, and its first
        ``rows`` rows), once the copies that last read it have finished."""
        turn, self._turn = self._turn, 1 - self._turn
        event = self._events[turn]
        if event is not None:
            event.synchronize()
        if len(self._staging) <= turn or self._staging[turn][0].shape[0] < rows:
            buf = tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                        for t in self.tensors)
            self._staging[turn:turn + 1] = [buf]
        return turn, tuple(s[:rows] for s in self._staging[turn])


def row_tiers(cache: CacheConfig, num_samples: int, device: torch.device) -> list[RowTable]:
    """The tiers ``cache.device_bytes`` and ``cache.host_bytes`` ask for on ``device``, device
    first (``auto``: both on CUDA, none on the CPU, where the store's rows already are in host
    memory)."""
    cuda = device.type == "cuda"
    device_bytes, host_bytes = cache.device_bytes, cache.host_bytes
    tiers = []
    if device_bytes == "auto" and cuda or isinstance(device_bytes, int) and device_bytes > 0:
        tiers.append(RowTable(num_samples, None if device_bytes == "auto" else device_bytes,
                              device, name="device"))
    if host_bytes == "auto" and cuda:
        host_bytes = HOST_AUTO_BYTES
    if isinstance(host_bytes, int) and host_bytes > 0:
        tiers.append(RowTable(num_samples, host_bytes, torch.device("cpu"), pinned=cuda,
                              name="host"))
    return tiers
