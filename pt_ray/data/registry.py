"""Turns a ``DataConfig`` into train and eval splits: one builder per dataset name."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.data.base import DatasetSplits, SubsetDataset, gather_targets
from pt_ray.data.idx import load_mnist_idx
from pt_ray.data.synthetic import synthetic_image, synthetic_text
from pt_ray.data.table_datasets import load_image_table, load_qa_table, load_text_table
from pt_ray.data.text import load_glue_tsv, load_squad_json
from pt_ray.data.vision import load_cifar, load_digits, load_imagefolder, load_mnist5k
from pt_ray.data.wordnet import load_wordnet

__all__ = ["DATASETS", "build_dataset", "cap_train", "keep_classes"]

logger = logging.getLogger(__name__)

_Builder = Callable[[DataConfig, int, Path | None], DatasetSplits]

SYNTHETIC_NUM_SAMPLES = 2048
"""Training samples a synthetic dataset generates when ``data.num_samples`` is unset."""
SYNTHETIC_NUM_EVAL = 512
"""Eval samples of every synthetic dataset."""


def _path(cfg: DataConfig) -> Path:
    if cfg.path is None:
        raise ConfigError(
            f"data.name={cfg.name} reads local files; set data.path to their folder "
            "(nothing is downloaded)"
        )
    return cfg.path


def _digits(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return load_digits(image_size=cfg.image_size, seed=seed)


def _mnist5k(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return load_mnist5k(image_size=cfg.image_size, seed=seed)


def _synthetic_image(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return synthetic_image(
        cfg.num_samples or SYNTHETIC_NUM_SAMPLES,
        SYNTHETIC_NUM_EVAL,
        image_size=cfg.image_size or 16,
        num_classes=cfg.num_classes or 10,
        seed=seed,
    )


def _synthetic_text(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return synthetic_text(
        cfg.num_samples or SYNTHETIC_NUM_SAMPLES,
        SYNTHETIC_NUM_EVAL,
        seq_len=cfg.seq_len,
        num_classes=cfg.num_classes or 4,
        seed=seed,
    )


def _cifar(classes: int) -> _Builder:
    def build(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
        return load_cifar(
            _path(cfg), classes, image_size=cfg.image_size, augment=cfg.augment, seed=seed
        )

    return build


def _imagefolder(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return load_imagefolder(
        _path(cfg), image_size=cfg.image_size, augment=cfg.augment, seed=seed,
        skip_damaged=cfg.skip_damaged,
    )


def _glue(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    return load_glue_tsv(_path(cfg), tok, seq_len=cfg.seq_len)


def _squad(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    return load_squad_json(_path(cfg), tok, seq_len=cfg.seq_len)


def _mnist_idx(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    return load_mnist_idx(_path(cfg), image_size=cfg.image_size)


def _wordnet(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    return load_wordnet(_path(cfg), tok, seq_len=cfg.seq_len,
                        parts_of_speech=cfg.parts_of_speech)


DATASETS: dict[str, _Builder] = {
    "digits": _digits,
    "mnist5k": _mnist5k,
    "synthetic_image": _synthetic_image,
    "synthetic_text": _synthetic_text,
    "cifar10": _cifar(10),
    "cifar100": _cifar(100),
    "imagefolder": _imagefolder,
    "glue_tsv": _glue,
    "squad_json": _squad,
    "text_table": lambda cfg, seed, tok: load_text_table(cfg, tok),
    "qa_table": lambda cfg, seed, tok: load_qa_table(cfg, tok),
    "image_table": lambda cfg, seed, tok: load_image_table(cfg, seed),
    "mnist_idx": _mnist_idx,
    "wordnet": _wordnet,
}
"""Builder per ``data.name``: ``(cfg, seed, tokenizer_dir) -> DatasetSplits``."""

_AUGMENTABLE = ("cifar10", "cifar100", "imagefolder", "image_table")
_GENERATED = ("synthetic_image", "synthetic_text")


def cap_train(splits: DatasetSplits, num_samples: int, seed: int) -> DatasetSplits:
    """Keep a seeded random ``num_samples`` of the training split (all of it if smaller).

    The kept samples are re-indexed ``0..num_samples-1`` in their original order.
    """
    n = len(splits.train)
    if num_samples >= n:
        return splits
    keep = np.sort(np.random.default_rng([seed, 7]).permutation(n)[:num_samples])
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
    builder = DATASETS.get(cfg.name)
    if builder is None:
        raise ConfigError(f"data.name={cfg.name!r} is unknown; choose one of {sorted(DATASETS)}")
    if cfg.augment and cfg.name not in _AUGMENTABLE:
        logger.warning(
            "data.augment=true has no effect on %s (only %s augment)", cfg.name,
            ", ".join(_AUGMENTABLE),
        )
    tok = cfg.tokenizer if cfg.tokenizer is not None else tokenizer_dir
    splits = builder(cfg, seed, Path(tok) if tok is not None else None)
    if cfg.classes is not None:
        splits = keep_classes(splits, cfg.classes)
    if cfg.num_samples is not None and cfg.name not in _GENERATED:
        splits = cap_train(splits, cfg.num_samples, seed)
    logger.info(
        "data %s: %d train, %d eval samples, task %s, deterministic transform %s",
        cfg.name, len(splits.train), len(splits.eval), splits.task,
        splits.train.deterministic_transform,
    )
    return splits
