"""The dataset seam: samples are ``(index, inputs, target)`` and batches are gathered by index.

Every dataset pt-ray trains on implements :class:`SampleDataset`. The global sampler decides
which indices a step covers; :func:`gather` turns those indices into one batch. The index travels
with the sample because it is the activation cache's key.

A dataset may also offer fast paths, each an optional protocol of its own:
:class:`BatchedSamples` (a whole batch at once), :class:`IndexedTargets` (targets without
inputs), :class:`StoredSamples` (batches as stored, transformed on the device) and
:class:`EpochAugmented` (a random transform keyed by the epoch). Callers use them through
:func:`gather`, :func:`gather_targets`, :func:`gather_stored`, :func:`finish_batch` and
:func:`set_epoch`, which fall back to the plain protocol; :func:`fast_paths` names those a
dataset offers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

from pt_ray.core.config import ConfigError, DataConfig

Task = Literal["classification", "question_answering"]


@dataclass(frozen=True)
class Batch:
    """A batch of samples.

    Attributes:
        indices: ``[B]`` int64 dataset indices (the cache key).
        inputs: model inputs in the order of the dataset's ``input_names``; each ``[B, ...]``.
        target: ``[B]`` int64 class ids, or ``[B, 2]`` start/end positions for QA.
    """

    indices: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of every tensor (a view, no copy)."""
        return Batch(
            self.indices[start:stop],
            tuple(t[start:stop] for t in self.inputs),
            self.target[start:stop],
        )


@runtime_checkable
class SampleDataset(Protocol):
    """A map-style dataset of ``(index, inputs, target)`` samples."""

    input_names: tuple[str, ...]
    """Names of the input tensors, matching the model adapter's ``input_names``."""
    deterministic_transform: bool
    """True when a sample's inputs are the same every epoch (no random augmentation); the
    activation cache is only valid for such datasets."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]: ...


@runtime_checkable
class BatchedSamples(Protocol):
    """Fast path: the samples at ``indices`` as one :class:`Batch`, vectorised (datasets held
    in memory), the same as stacking them one by one."""

    def batch(self, indices: Sequence[int]) -> Batch: ...


@runtime_checkable
class IndexedTargets(Protocol):
    """Fast path: the targets at ``indices`` (``[B]`` or ``[B, 2]``) without loading the
    inputs."""

    def targets(self, indices: Sequence[int]) -> torch.Tensor: ...


@runtime_checkable
class StoredSamples(Protocol):
    """Fast path: batches as the dataset stores them (before its transform) and the transform
    that finishes them on whichever device they are on:
    ``finish(stored_batch(i))`` equals :func:`gather`'s batch."""

    def stored_batch(self, indices: Sequence[int]) -> Batch: ...

    def finish(self, batch: Batch) -> Batch: ...


@runtime_checkable
class EpochAugmented(Protocol):
    """A dataset whose random augmentation depends on the epoch (see :func:`set_epoch`)."""

    def set_epoch(self, epoch: int) -> None: ...


FAST_PATHS: dict[str, type] = {"batch": BatchedSamples, "targets": IndexedTargets,
                               "stored": StoredSamples, "epoch": EpochAugmented}
"""The optional protocols by a short name (what :func:`fast_paths` reports)."""


def fast_paths(dataset: SampleDataset) -> tuple[str, ...]:
    """The short names (:data:`FAST_PATHS`) of the fast paths ``dataset`` offers."""
    return tuple(name for name, proto in FAST_PATHS.items() if isinstance(dataset, proto))


def capped_rows(n: int, num_samples: int, seed: int) -> np.ndarray | None:
    """The training rows ``data.num_samples`` keeps of ``n``: a seeded random ``num_samples``,
    ascending (None: it keeps all). The registry caps a built split with it; a builder that
    reads many more rows than it keeps may take the same rows before it tokenises them."""
    if num_samples >= n:
        return None
    return np.sort(np.random.default_rng([seed, 7]).permutation(n)[:num_samples])


def data_root(cfg: DataConfig) -> Path:
    """``data.path``, which a dataset of local files reads.

    Raises:
        ConfigError: it is unset.
    """
    if cfg.path is None:
        raise ConfigError(
            f"data.name={cfg.name} reads local files; set data.path to their folder "
            "(nothing is downloaded)"
        )
    return cfg.path


@dataclass(frozen=True)
class DatasetSplits:
    """A train and an eval split plus what a model builder needs to know about them.

    Attributes:
        name: dataset name as given in the config.
        task: ``"classification"`` or ``"question_answering"``.
        train: training split.
        eval: evaluation split (scored whole, never one rank's shard).
        num_classes: number of classes (classification), else None.
        image_size: side of the (square) input images, for image datasets.
        in_chans: image channels, for image datasets.
        seq_len: token sequence length, for text datasets.
        vocab_size: vocabulary size the inputs index into, for text datasets.
    """

    name: str
    task: Task
    train: SampleDataset
    eval: SampleDataset
    num_classes: int | None = None
    image_size: int | None = None
    in_chans: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None


def gather(dataset: SampleDataset, indices: Sequence[int]) -> Batch:
    """Load the samples at ``indices`` as one :class:`Batch`.

    Datasets held in memory offer :class:`BatchedSamples` for a vectorised fast path; others
    are read sample by sample and stacked.
    """
    if isinstance(dataset, BatchedSamples):
        return dataset.batch(indices)
    samples = [dataset[int(i)] for i in indices]
    idx = torch.tensor([s[0] for s in samples], dtype=torch.int64)
    inputs = tuple(torch.stack([s[1][j] for s in samples]) for j in range(len(samples[0][1])))
    target = torch.stack([torch.as_tensor(s[2]) for s in samples])
    return Batch(idx, inputs, target)


class TensorSampleDataset:
    """An in-memory dataset of stacked tensors, with a vectorised ``batch``.

    Args:
        inputs: input tensors, each ``[num_samples, ...]``.
        target: ``[num_samples]`` or ``[num_samples, 2]``.
        input_names: names of ``inputs``.
        deterministic_transform: see :class:`SampleDataset` (True: no augmentation here).
    """

    def __init__(
        self,
        inputs: tuple[torch.Tensor, ...],
        target: torch.Tensor,
        input_names: tuple[str, ...],
        deterministic_transform: bool = True,
    ) -> None:
        n = target.shape[0]
        for name, t in zip(input_names, inputs, strict=True):
            if t.shape[0] != n:
                raise ValueError(f"input {name!r} has {t.shape[0]} rows but target has {n}")
        self.inputs = inputs
        self.target = target
        self.input_names = input_names
        self.deterministic_transform = deterministic_transform

    def __len__(self) -> int:
        return int(self.target.shape[0])

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]:
        return index, tuple(t[index] for t in self.inputs), self.target[index]

    def batch(self, indices: Sequence[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return Batch(idx, tuple(t[idx] for t in self.inputs), self.target[idx])

    def targets(self, indices: Sequence[int]) -> torch.Tensor:
        return self.target[torch.as_tensor(indices, dtype=torch.int64)]


def gather_targets(dataset: SampleDataset, indices: Sequence[int]) -> torch.Tensor:
    """The targets of the samples at ``indices`` (``[B]`` or ``[B, 2]``), without loading their
    inputs where the dataset can (:class:`IndexedTargets`): what pipeline stages after the
    first read, since only the last one needs anything of the batch."""
    if isinstance(dataset, IndexedTargets):
        return dataset.targets(indices)
    return gather(dataset, indices).target


def gather_stored(dataset: SampleDataset, indices: Sequence[int]) -> Batch:
    """The samples at ``indices`` as the dataset stores them, before its transform (uint8
    images at their stored size for image datasets), so a loader copies the fewest bytes to the
    device and :func:`finish_batch` transforms them there (:class:`StoredSamples`). Datasets
    without a separate transform return :func:`gather`'s batch."""
    if isinstance(dataset, StoredSamples):
        return dataset.stored_batch(indices)
    return gather(dataset, indices)


def finish_batch(dataset: SampleDataset, batch: Batch) -> Batch:
    """Model inputs from a :func:`gather_stored` batch, computed on the device its tensors are
    on: ``finish_batch(d, gather_stored(d, i))`` is ``gather(d, i)`` (on the CPU, the same
    operations in the same order). Batches from datasets without a transform pass through."""
    return dataset.finish(batch) if isinstance(dataset, StoredSamples) else batch


def set_epoch(dataset: SampleDataset, epoch: int) -> None:
    """Tell ``dataset`` the epoch, for datasets whose random augmentation depends on it.

    Augmented datasets draw each sample's view from ``(seed, epoch, index)``, so every replica
    and the reference trainer see the same view of a sample in an epoch, and the view changes
    from one epoch to the next. Call this at the start of each epoch; datasets without
    augmentation ignore it (:class:`EpochAugmented` names the method).
    """
    if isinstance(dataset, EpochAugmented):
        dataset.set_epoch(epoch)


class SubsetDataset:
    """The samples of ``base`` at ``keep``, re-indexed ``0..len(keep)-1``, optionally with
    their class ids mapped through ``relabel``.

    The new index is the one a :class:`Batch` carries (the sampler and the activation cache
    work on the subset's own positions).

    Args:
        base: the dataset to take from.
        keep: ``[n]`` indices into ``base``, each in range.
        relabel: ``[num_classes]`` int64, the new class id of each of ``base``'s (a class
            subset); None: targets pass through.
    """

    def __init__(self, base: SampleDataset, keep: Sequence[int],
                 relabel: torch.Tensor | None = None) -> None:
        keep_t = torch.as_tensor(keep, dtype=torch.int64)
        if keep_t.ndim != 1:
            raise ValueError(f"keep must be a 1-d list of indices, got shape {tuple(keep_t.shape)}")
        if len(keep_t) and (int(keep_t.min()) < 0 or int(keep_t.max()) >= len(base)):
            raise ValueError(
                f"keep holds indices in [{int(keep_t.min())}, {int(keep_t.max())}] but the "
                f"dataset has {len(base)} samples; use indices in [0, {len(base) - 1}]"
            )
        self.base = base
        self.keep = keep_t
        self.relabel = relabel
        self.input_names = base.input_names
        self.deterministic_transform = base.deterministic_transform

    def __len__(self) -> int:
        return int(self.keep.shape[0])

    def _target(self, target: torch.Tensor) -> torch.Tensor:
        return target if self.relabel is None else self.relabel.to(target.device)[target]

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]:
        _, inputs, target = self.base[int(self.keep[index])]
        return index, inputs, self._target(torch.as_tensor(target))

    def batch(self, indices: Sequence[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        inner = gather(self.base, self.keep[idx].tolist())
        return Batch(idx, inner.inputs, self._target(inner.target))

    def targets(self, indices: Sequence[int]) -> torch.Tensor:
        return self._target(
            gather_targets(self.base, self.keep[torch.as_tensor(indices)].tolist()))

    def stored_batch(self, indices: Sequence[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        inner = gather_stored(self.base, self.keep[idx].tolist())
        return Batch(idx, inner.inputs, self._target(inner.target))

    def finish(self, batch: Batch) -> Batch:
        """The base's transform, keyed by the base's indices (its augmentation key); the
        targets are already this subset's."""
        inner = Batch(self.keep[batch.indices.cpu()], batch.inputs, batch.target)
        return Batch(batch.indices, finish_batch(self.base, inner).inputs, batch.target)

    def set_epoch(self, epoch: int) -> None:
        set_epoch(self.base, epoch)
