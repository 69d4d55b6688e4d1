"""Turns a ``DataConfig`` into train and eval splits: the builder each dataset's entry names.

The datasets, their traits and where each builder lives are one table in the pure core
(:data:`pt_ray.core.datasets.DATASETS`), so the config validates names without torch; this
module resolves each entry's builder (``module:function`` under ``pt_ray.data``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.core.datasets import DATASETS as ENTRIES
from pt_ray.data.base import (
    DatasetSplits,
    SubsetDataset,
    capped_rows,
    fast_paths,
    gather_targets,
)

__all__ = ["DATASETS", "build_dataset", "cap_train", "keep_classes"]

logger = logging.getLogger(__name__)

_Builder = Callable[[DataConfig, int, Path | None], DatasetSplits]


def _resolve(builder: str) -> _Builder:
    """The function ``module:function`` names under ``pt_ray.data``."""
    module, _, function = builder.partition(":")
    return getattr(importlib.import_module(f"pt_ray.data.{module}"), function)


DATASETS: dict[str, _Builder] = {name: _resolve(e.builder) for name, e in ENTRIES.items()}
"""Builder per ``data.name``: ``(cfg, seed, tokenizer_dir) -> DatasetSplits``."""


def cap_train(splits: DatasetSplits, num_samples: int, seed: int) -> DatasetSplits:
    """Keep a seeded random ``num_samples`` of the training split (all of it if smaller).

    The kept samples are re-indexed ``0..num_samples-1`` in their original order.
    """
    n = len(splits.train)
    keep = capped_rows(n, num_samples, seed)
    if keep is None:
        return splits
    logger.info("%s: keeping %d of %d training samples", splits.name, num_samples, n)
    return DatasetSplits(
        name=splits.name,
        task=splits.task,
        train=SubsetDataset(splits.train, keep.tolist()),
        eval=splits.eval,
        num_classes=splits.num_classes,
        image_size=splits.image_size,
        in_chans=splits.in_chans,
        seq_len=splits.seq_len,
        vocab_size=splits.vocab_size,
    )


def keep_classes(splits: DatasetSplits, classes: list[int]) -> DatasetSplits:
    """Keep only the samples labelled one of ``classes``, in both splits, relabelled
    ``classes[i] -> i``; samples keep their order and are re-indexed ``0..n-1``.

    Raises:
        ConfigError: the task is not classification, or a class is not one of the dataset's.
    """
    where = f"data.classes={classes}"
    if splits.task != "classification" or splits.num_classes is None:
        raise ConfigError(f"{where} selects classes, but {splits.name} is {splits.task}; "
                          "remove data.classes")
    n = splits.num_classes
    outside = [c for c in classes if not 0 <= c < n]
    if outside:
        raise ConfigError(f"{where} holds {outside}, but {splits.name} has {n} classes "
                          f"(0..{n - 1}); choose labels in 0..{n - 1}")
    relabel = torch.full((n,), -1, dtype=torch.int64)
    relabel[torch.tensor(classes)] = torch.arange(len(classes))
    parts = {}
    for part in ("train", "eval"):
        ds = getattr(splits, part)
        labels = gather_targets(ds, range(len(ds)))
        keep = torch.nonzero(relabel[labels] >= 0).flatten()
        if len(keep) == 0:
            raise ConfigError(f"{where} keeps no sample of {splits.name}'s {part} split; "
                              "choose classes it holds")
        parts[part] = SubsetDataset(ds, keep.tolist(), relabel=relabel)
    logger.info("%s: classes %s kept as 0..%d: %d of %d train, %d of %d eval samples",
                splits.name, classes, len(classes) - 1, len(parts["train"]), len(splits.train),
                len(parts["eval"]), len(splits.eval))
    return replace(splits, train=parts["train"], eval=parts["eval"],
                   num_classes=len(classes))


def build_dataset(
    cfg: DataConfig, *, seed: int = 0, tokenizer_dir: str | Path | None = None
) -> DatasetSplits:
    """Build the train and eval splits ``cfg`` names.

    Args:
        cfg: the data section of the run config.
        seed: the run seed; fixes the digits split, synthetic draws, the kept training subset
            and augmentation, so the same seed always gives the same data.
        tokenizer_dir: tokenizer directory for text files when ``cfg.tokenizer`` is unset
            (the caller passes ``model.weights``).

    Returns:
        The splits: only ``cfg.classes`` when given (:func:`keep_classes`).
        ``cfg.num_samples`` is the generated training size for synthetic datasets and caps the
        training split (a seeded random subset, after the classes are chosen) for the others.

    Raises:
        ConfigError: an unknown name; a missing ``data.path`` or tokenizer; dataset files that
            are missing (the message gives the expected layout) or cannot be read;
            ``data.classes`` outside the dataset's classes.
    """
    entry = ENTRIES.get(cfg.name)
    if entry is None:
        raise ConfigError(f"data.name={cfg.name!r} is unknown; choose one of {sorted(DATASETS)}")
    if cfg.augment and not entry.augmentable:
        logger.warning(
            "data.augment=true has no effect on %s (only %s augment)", cfg.name,
            ", ".join(n for n, e in ENTRIES.items() if e.augmentable),
        )
    tok = cfg.tokenizer if cfg.tokenizer is not None else tokenizer_dir
    splits = DATASETS[cfg.name](cfg, seed, Path(tok) if tok is not None else None)
    if cfg.classes is not None:
        splits = keep_classes(splits, cfg.classes)
    if cfg.num_samples is not None and not entry.generated:
        splits = cap_train(splits, cfg.num_samples, seed)
    logger.info(
        "data %s: %d train, %d eval samples, task %s, deterministic transform %s, fast paths %s",
        cfg.name, len(splits.train), len(splits.eval), splits.task,
        splits.train.deterministic_transform, ", ".join(fast_paths(splits.train)) or "none",
    )
    return splits
