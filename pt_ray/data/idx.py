"""MNIST-layout IDX files (MNIST, Fashion-MNIST, KMNIST): the four files of the original
distribution, read with numpy from a local folder (nothing is downloaded).

An IDX file is a big-endian header, ``0x00 0x00 <type> <ndim>`` then ``ndim`` uint32
dimensions, followed by the values in C order (http://yann.lecun.com/exdb/mnist/). Images are
kept as stored (uint8, 28 x 28) and converted per batch, as CIFAR's are
(:class:`pt_ray.data.vision.ImageArrayDataset`).
"""

from __future__ import annotations

import gzip
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from pt_ray.core.config import ConfigError, DataConfig, first_line
from pt_ray.core.datasets import MNIST_IDX
from pt_ray.data.base import DatasetSplits, data_root
from pt_ray.data.transforms import ImageTransform
from pt_ray.data.vision import ImageArrayDataset

__all__ = ["IDX_FILES", "build_mnist_idx", "load_mnist_idx", "read_idx"]

logger = logging.getLogger(__name__)

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "eval": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
"""The files of each split (images, labels), each raw or gzipped (``.gz``)."""

_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
"""IDX type byte -> numpy dtype (big-endian)."""

_WHERE = ("Fashion-MNIST ships in the Debian package dataset-fashion-mnist "
          "(/usr/share/datasets/fashion-mnist)")


def read_idx(path: Path) -> np.ndarray:
    """The array an IDX file holds (gzipped when its name ends in ``.gz``).

    Raises:
        ConfigError: the file cannot be read, or its header or size is not IDX.
    """
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:  # a missing, cut or damaged file
        raise ConfigError(f"{str(path)!r} cannot be read ({first_line(err)}); replace it with "
                          "the file as distributed") from err
    kind, ndim = (raw[2], raw[3]) if len(raw) >= 4 else (None, 0)
    if (len(raw) < 4 + 4 * ndim or raw[:2] != b"\0\0" or kind not in _IDX_TYPES
            or ndim == 0):
        raise ConfigError(f"{str(path)!r} is not an IDX file (its first bytes are "
                          f"{raw[:4].hex()}, not 0000 <type> <ndim>); replace it with the file "
                          "as distributed")
    dims = np.frombuffer(raw, ">u4", ndim, 4).astype(np.int64)
    dtype = np.dtype(_IDX_TYPES[kind])
    start, want = 4 + 4 * ndim, int(np.prod(dims)) * dtype.itemsize
    if len(raw) - start != want:
        raise ConfigError(f"{str(path)!r} holds {len(raw) - start} bytes of data, but its "
                          f"header ({' x '.join(map(str, dims))} {dtype.name}) says {want}; "
                          "the file is cut short or damaged: replace it")
    return np.frombuffer(raw, dtype, offset=start).reshape(dims).astype(dtype.newbyteorder("="))


def _find(root: Path, stem: str) -> Path:
    for name in (stem, f"{stem}.gz"):
        if (root / name).is_file():
            return root / name
    raise ConfigError(f"data.path={root} has no {stem}(.gz); set data.path to a folder holding "
                      f"{', '.join(n for pair in IDX_FILES.values() for n in pair)} (each "
                      f"raw or .gz); {_WHERE}")


def _split(root: Path, part: str) -> tuple[np.ndarray, np.ndarray]:
    """``([N, H, W] uint8, [N] int64)`` of one split."""
    image_path, label_path = (_find(root, stem) for stem in IDX_FILES[part])
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ConfigError(f"{str(image_path)!r} holds {images.dtype} of shape {images.shape}; "
                          "MNIST-layout images are uint8 [N, H, W]")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ConfigError(f"{str(label_path)!r} holds labels of shape {labels.shape} for "
                          f"{images.shape[0]} images in {str(image_path)!r}; each split's two "
                          "files must hold the same number of samples")
    return images, labels.astype(np.int64)


def _pixel_stats(images: np.ndarray) -> tuple[float, float]:
    """Mean and (population) standard deviation of uint8 ``images`` divided by 255, from
    their histogram (no float copy of the images)."""
    counts = np.bincount(images.ravel(), minlength=256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    n = counts.sum()
    mean = float(counts @ values / n)
    return mean, float(np.sqrt(max(counts @ values**2 / n - mean**2, 1e-12)))


def load_mnist_idx(root: str | Path, *, image_size: int | None = None) -> DatasetSplits:
    """MNIST-layout IDX files: ``train-*`` is the training split, ``t10k-*`` the eval split.

    Images are stored uint8 and converted per batch: divided by 255, resized to
    ``image_size`` (bilinear) if given, standardised with the training images' mean and
    standard deviation.

    Args:
        root: folder holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each raw or ``.gz``.
        image_size: output side in pixels (default: the stored side, 28 for MNIST).

    Returns:
        In-memory splits (60,000 and 10,000 images for MNIST and Fashion-MNIST), one channel,
        ``1 + `` the largest label classes.

    Raises:
        ConfigError: a file is missing (the message names it and where Fashion-MNIST ships),
            unreadable or not IDX, or the two files of a split disagree.
    """
    root = Path(root)
    (x_train, y_train), (x_eval, y_eval) = _split(root, "train"), _split(root, "eval")
    if x_train.shape[1:] != x_eval.shape[1:]:
        raise ConfigError(f"data.path={root}: training images are {x_train.shape[1:]} but eval "
                          f"images {x_eval.shape[1:]}; the two splits must share one size")
    native = x_train.shape[-1]
    mean, std = _pixel_stats(x_train)
    out_size = None if image_size in (None, native) else image_size
    num_classes = int(max(y_train.max(), y_eval.max())) + 1
    logger.info("mnist_idx %s: %d train, %d eval images, %d classes, mean %.4f std %.4f", root,
                len(y_train), len(y_eval), num_classes, mean, std)

    def make(x: np.ndarray, y: np.ndarray) -> ImageArrayDataset:
        return ImageArrayDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y),
                                 ImageTransform((mean,), (std,), out_size))

    return DatasetSplits(
        name=MNIST_IDX, task="classification", train=make(x_train, y_train),
        eval=make(x_eval, y_eval), num_classes=max(num_classes, 2),
        image_size=image_size or native, in_chans=1)


def build_mnist_idx(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=mnist_idx``."""
    return load_mnist_idx(data_root(cfg), image_size=cfg.image_size)
