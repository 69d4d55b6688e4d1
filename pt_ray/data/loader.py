"""Batches for a list of index arrays, loaded in the training process or in background workers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch.utils.data

from pt_ray.data.base import Batch, SampleDataset, gather, gather_stored

__all__ = ["iterate_batches"]


class _ByStep(torch.utils.data.Dataset):
    """Position ``s`` is the whole batch of step ``s`` (so workers build batches, not samples)."""

    def __init__(self, dataset: SampleDataset, steps: Sequence[np.ndarray], read) -> None:
        self.dataset = dataset
        self.steps = steps
        self.read = read

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, s: int) -> Batch:
        return self.read(self.dataset, self.steps[s].tolist())


def iterate_batches(
    dataset: SampleDataset, steps: Sequence[np.ndarray], num_workers: int = 0,
    pin_memory: bool = False, stored: bool = False,
) -> Iterator[Batch]:
    """One :class:`Batch` per index array, in order. With workers, they start (and begin
    loading) when this is called, not at the first batch.

    Args:
        dataset: where samples come from.
        steps: the indices of each batch, in the order they are needed.
        num_workers: background loader processes (0: load inline; in-memory datasets need none);
            each keeps two batches ready ahead of the one in use.
        pin_memory: page-locked batches, for asynchronous copies to a CUDA device.
        stored: yield batches as stored (:func:`pt_ray.data.base.gather_stored`: uint8 images
            at their stored size), for :func:`pt_ray.data.base.finish_batch` to transform on
            the device they are copied to.
    """
    read = gather_stored if stored else gather
    if num_workers == 0:
        return (read(dataset, idx.tolist()) for idx in steps)
    loader = torch.utils.data.DataLoader(
        _ByStep(dataset, steps, read),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        persistent_workers=False,
        pin_memory=pin_memory,
        prefetch_factor=2,
    )
    return iter(loader)
