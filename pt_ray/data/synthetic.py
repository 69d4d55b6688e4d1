"""Generated datasets with learnable structure, for tests and benchmarks without files.

Every draw comes from ``np.random.default_rng([seed, part])``, so the same arguments give the
same tensors on every machine and in every process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.core.datasets import SYNTHETIC_IMAGE, SYNTHETIC_TEXT
from pt_ray.data.base import DatasetSplits, Task, TensorSampleDataset

__all__ = ["PAD_ID", "CLS_ID", "SEP_ID", "SYNTHETIC_NUM_EVAL", "SYNTHETIC_NUM_SAMPLES",
           "TEXT_INPUTS", "build_synthetic_image", "build_synthetic_text", "synthetic_image",
           "synthetic_text"]

PAD_ID, CLS_ID, SEP_ID = 0, 1, 2
"""Special token ids of the synthetic vocabulary (3 is reserved, as BERT's [MASK] would be)."""
_FIRST_FREE = 4
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
"""Input names of every text dataset (BERT-family order)."""

SYNTHETIC_NUM_SAMPLES = 2048
"""Training samples a synthetic dataset generates when ``data.num_samples`` is unset."""
SYNTHETIC_NUM_EVAL = 512
"""Eval samples of every synthetic dataset."""

_KEYWORDS_PER_CLASS = 4
_PLANTED = 3  # keywords of the true class in each sequence; a distractor class gets at most 1
_MARKERS = 8  # QA question markers


def synthetic_image(
    num_samples: int = 2048,
    num_eval: int = 512,
    *,
    image_size: int = 16,
    num_classes: int = 10,
    channels: int = 3,
    signal: float = 0.5,
    seed: int = 0,
) -> DatasetSplits:
    """Images of smooth class-specific patterns plus Gaussian noise.

    Each class has a random low-frequency template (a ``4 x 4`` Gaussian field upsampled to
    ``image_size``, scaled to unit standard deviation); a sample is
    ``signal * template[label] + N(0, 1)`` per pixel. Labels are balanced.

    Args:
        num_samples: training samples.
        num_eval: eval samples (same templates, fresh noise).
        image_size: side in pixels.
        num_classes: number of classes.
        channels: image channels.
        signal: template amplitude against unit noise (smaller is harder).
        seed: fixes templates, labels and noise.
    """
    for name, value in (("num_samples", num_samples), ("num_eval", num_eval),
                        ("image_size", image_size), ("channels", channels)):
        if value <= 0:
            raise ValueError(f"{name}={value} must be a positive integer")
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes} must be at least 2")
    coarse = np.random.default_rng([seed, 0]).standard_normal((num_classes, channels, 4, 4))
    templates = F.interpolate(
        torch.from_numpy(coarse.astype(np.float32)),
        size=(image_size, image_size),
        mode="bilinear",
        align_corners=False,
    )
    templates = templates / templates.flatten(1).std(dim=1).clamp_min(1e-6).view(-1, 1, 1, 1)

    def draw(n: int, part: int) -> TensorSampleDataset:
        rng = np.random.default_rng([seed, part])
        labels = torch.from_numpy(rng.permutation(np.arange(n) % num_classes).astype(np.int64))
        noise = rng.standard_normal((n, channels, image_size, image_size)).astype(np.float32)
        x = signal * templates[labels] + torch.from_numpy(noise)
        return TensorSampleDataset((x,), labels, ("pixel_values",))

    return DatasetSplits(
        name=SYNTHETIC_IMAGE,
        task="classification",
        train=draw(num_samples, 1),
        eval=draw(num_eval, 2),
        num_classes=num_classes,
        image_size=image_size,
        in_chans=channels,
    )


def _layout(rng: np.random.Generator, seq_len: int, min_len: int) -> tuple[int, int]:
    """A random total length and the length of segment A (``[CLS] A [SEP] B [SEP]``)."""
    total = int(rng.integers(max(min_len, seq_len // 2), seq_len + 1))
    len_a = int(rng.integers(1, total - 3))  # B keeps at least one token
    return total, len_a


def _encode(
    seg_a: np.ndarray, seg_b: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.full(seq_len, PAD_ID, dtype=np.int64)
    types = np.zeros(seq_len, dtype=np.int64)
    mask = np.zeros(seq_len, dtype=np.int64)
    la, lb = len(seg_a), len(seg_b)
    ids[: la + lb + 3] = np.concatenate([[CLS_ID], seg_a, [SEP_ID], seg_b, [SEP_ID]])
    types[la + 2 : la + lb + 3] = 1
    mask[: la + lb + 3] = 1
    return ids, mask, types


def _classification_sample(
    rng: np.random.Generator, label: int, seq_len: int, num_classes: int, filler: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    total, len_a = _layout(rng, seq_len, min_len=_PLANTED + 5)
    content = rng.choice(filler, size=total - 3)
    spots = rng.choice(len(content), size=_PLANTED + 1, replace=False)
    keywords = _FIRST_FREE + label * _KEYWORDS_PER_CLASS + np.arange(_KEYWORDS_PER_CLASS)
    content[spots[:_PLANTED]] = rng.choice(keywords, size=_PLANTED)
    if rng.random() < 0.5:  # one keyword of another class: counts, not presence, decide
        other = (label + int(rng.integers(1, num_classes))) % num_classes
        content[spots[_PLANTED]] = _FIRST_FREE + other * _KEYWORDS_PER_CLASS + int(
            rng.integers(_KEYWORDS_PER_CLASS)
        )
    return _encode(content[:len_a], content[len_a:], seq_len), np.int64(label)


def _qa_sample(
    rng: np.random.Generator, seq_len: int, filler: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    end_marker = _FIRST_FREE + _MARKERS
    markers = rng.permutation(_MARKERS) + _FIRST_FREE
    query = markers[0]
    seg_a = np.concatenate([[query], rng.choice(filler, size=2)])
    len_b = int(rng.integers(max(12, (seq_len - 6) // 2), seq_len - 6 + 1))
    seg_b = rng.choice(filler, size=len_b)
    span = int(rng.integers(1, 4))
    # The marker, the answer span and the end marker, somewhere inside B.
    at = int(rng.integers(0, len_b - span - 1))
    seg_b[at] = query
    seg_b[at + span + 1] = end_marker
    # Two distractor markers (other questions) outside the planted block.
    free = np.setdiff1d(np.arange(len_b), np.arange(at, at + span + 2))
    seg_b[rng.choice(free, size=2, replace=False)] = markers[1:3]
    start = len(seg_a) + 2 + at + 1  # [CLS] A [SEP] then B; the answer follows the marker
    return _encode(seg_a, seg_b, seq_len), np.array([start, start + span - 1], dtype=np.int64)


def synthetic_text(
    num_samples: int = 2048,
    num_eval: int = 512,
    *,
    seq_len: int = 128,
    vocab_size: int = 1000,
    num_classes: int = 4,
    task: Task = "classification",
    seed: int = 0,
) -> DatasetSplits:
    """Token sequences ``[CLS] A [SEP] B [SEP] [PAD]...`` with a planted, learnable signal.

    Lengths vary between ``seq_len // 2`` and ``seq_len`` (padding has ``attention_mask`` 0);
    ``token_type_ids`` are 0 for ``[CLS] A [SEP]`` and padding, 1 for ``B [SEP]``.

    * ``classification``: each class owns 4 keyword tokens; a sequence holds 3 keywords of its
      class and, half the time, 1 of another class, among random filler tokens. The class is
      the one whose keywords occur most.
    * ``question_answering``: A starts with one of 8 marker tokens; B holds that marker followed
      by a 1-3 token answer and an end marker, plus two other markers as distractors. The
      target ``[2]`` is the answer's first and last position in the whole sequence.

    Args:
        num_samples: training samples.
        num_eval: eval samples.
        seq_len: padded sequence length (at least 8; 16 for question answering).
        vocab_size: token ids are in ``[0, vocab_size)``.
        num_classes: classes (classification only).
        task: ``"classification"`` or ``"question_answering"``.
        seed: fixes every draw.
    """
    if task not in ("classification", "question_answering"):
        raise ValueError(f"task={task!r} must be 'classification' or 'question_answering'")
    qa = task == "question_answering"
    min_len = 16 if qa else _PLANTED + 5
    if seq_len < min_len:
        raise ConfigError(f"data.seq_len={seq_len} is too short for synthetic {task}; "
                          f"use >= {min_len}")
    if num_samples <= 0 or num_eval <= 0:
        raise ValueError(f"num_samples={num_samples} and num_eval={num_eval} must be positive")
    if not qa and num_classes < 2:
        raise ValueError(f"num_classes={num_classes} must be at least 2")
    reserved = _FIRST_FREE + (_MARKERS + 1 if qa else num_classes * _KEYWORDS_PER_CLASS)
    if vocab_size < reserved + 16:
        raise ValueError(
            f"vocab_size={vocab_size} leaves fewer than 16 filler tokens after {reserved} "
            f"special and keyword tokens; use vocab_size >= {reserved + 16}"
        )
    filler = np.arange(reserved, vocab_size)

    def draw(n: int, part: int) -> TensorSampleDataset:
        rng = np.random.default_rng([seed, part])
        labels = rng.permutation(np.arange(n) % num_classes)
        rows = [
            _qa_sample(rng, seq_len, filler)
            if qa
            else _classification_sample(rng, int(labels[i]), seq_len, num_classes, filler)
            for i in range(n)
        ]
        inputs = tuple(torch.from_numpy(np.stack([r[0][j] for r in rows])) for j in range(3))
        target = torch.from_numpy(np.stack([r[1] for r in rows]))
        return TensorSampleDataset(inputs, target, TEXT_INPUTS)

    return DatasetSplits(
        name=SYNTHETIC_TEXT,
        task=task,
        train=draw(num_samples, 1),
        eval=draw(num_eval, 2),
        num_classes=None if qa else num_classes,
        seq_len=seq_len,
        vocab_size=vocab_size,
    )


def build_synthetic_image(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=synthetic_image``: ``data.num_samples`` training samples (default
    :data:`SYNTHETIC_NUM_SAMPLES`)."""
    return synthetic_image(cfg.num_samples or SYNTHETIC_NUM_SAMPLES, SYNTHETIC_NUM_EVAL,
                           image_size=cfg.image_size or 16, num_classes=cfg.num_classes or 10,
                           seed=seed)


def build_synthetic_text(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=synthetic_text``: ``data.num_samples`` training samples (default
    :data:`SYNTHETIC_NUM_SAMPLES`)."""
    return synthetic_text(cfg.num_samples or SYNTHETIC_NUM_SAMPLES, SYNTHETIC_NUM_EVAL,
                          seq_len=cfg.seq_len, num_classes=cfg.num_classes or 4, seed=seed)
