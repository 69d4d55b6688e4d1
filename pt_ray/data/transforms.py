"""Image batch transforms: resize, normalise, and epoch-keyed random crop and flip.

Augmentation is drawn per sample from a hash of ``(seed, epoch, index)`` rather than from a
stateful generator, so a sample's view in an epoch is the same on every replica, in every
loader process and in the single-process reference trainer, whatever the plan; and it changes
from one epoch to the next (see :func:`pt_ray.data.base.set_epoch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "CIFAR10_STATS",
    "CIFAR100_STATS",
    "IMAGENET_STATS",
    "ImageTransform",
    "random_crop_flip",
    "resize",
]

CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
"""Per-channel (mean, std) of the CIFAR-10 training images in ``[0, 1]``."""
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
"""Per-channel (mean, std) of the CIFAR-100 training images in ``[0, 1]``."""
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
"""Per-channel (mean, std) of ImageNet, the usual choice for image folders."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array (wrap-around arithmetic is intended)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def sample_hash(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """64 random bits per sample, a pure function of ``(seed, epoch, index)``."""
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    h = _splitmix(np.full(idx.shape, np.uint64(seed % 2**64), dtype=np.uint64))
    h = _splitmix(h ^ np.uint64(epoch % 2**64))
    return _splitmix(h ^ idx)


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize of ``[B, C, H, W]`` float images to ``[B, C, size, size]``."""
    if images.shape[-2:] == (size, size):
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)


def random_crop_flip(
    images: torch.Tensor,
    indices: Sequence[int] | np.ndarray,
    *,
    seed: int,
    epoch: int,
    padding: int = 4,
    flip: bool = True,
) -> torch.Tensor:
    """Random crop after zero padding, and random horizontal flip, keyed by sample.

    Args:
        images: ``[B, C, H, W]`` float images.
        indices: ``[B]`` dataset indices of the rows (the augmentation key).
        seed: the run seed.
        epoch: the epoch; each epoch draws new views.
        padding: pixels of zero padding on each side before cropping back to ``H x W``.
        flip: also flip half of the samples left-right.

    Returns:
        ``[B, C, H, W]`` augmented images (a new tensor).
    """
    b, _, h, w = images.shape
    bits = sample_hash(seed, epoch, np.asarray(indices))
    span = np.uint64(2 * padding + 1)
    dev = images.device
    oy = torch.from_numpy((bits % span).astype(np.int64)).to(dev)
    ox = torch.from_numpy(((bits >> np.uint64(16)) % span).astype(np.int64)).to(dev)
    padded = F.pad(images, (padding, padding, padding, padding))
    rows = oy[:, None] + torch.arange(h, device=dev)  # [B, H]
    cols = ox[:, None] + torch.arange(w, device=dev)  # [B, W]
    if flip:
        flipped = torch.from_numpy(((bits >> np.uint64(32)) & np.uint64(1)).astype(bool))
        cols = torch.where(flipped.to(dev)[:, None], cols.flip(1), cols)
    out = padded[torch.arange(b, device=dev)[:, None, None], :, rows[:, :, None],
                 cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()  # advanced indexing put channels last


class ImageTransform:
    """Turns stored images into model inputs: scale, augment, resize, normalise.

    Args:
        mean: per-channel mean of the scaled images.
        std: per-channel standard deviation of the scaled images.
        image_size: output side in pixels (None: keep the stored size).
        augment: apply :func:`random_crop_flip` (training split only).
        seed: the run seed (augmentation key).
        scale: the stored images are divided by this first (255 for uint8).
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        image_size: int | None = None,
        augment: bool = False,
        seed: int = 0,
        scale: float = 255.0,
    ) -> None:
        if any(s <= 0 for s in std):
            raise ValueError(f"std={list(std)} must be positive in every channel")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.image_size = image_size
        self.augment = augment
        self.seed = seed
        self.scale = scale
        self.epoch = 0

    def __call__(self, images: torch.Tensor, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """``[B, C, H, W]`` stored images of samples ``indices`` -> float32 model inputs, on
        the device ``images`` are on (uint8 images copied to a GPU are scaled, augmented,
        resized and normalised there)."""
        x = images.to(torch.float32) / self.scale
        if self.augment:
            x = random_crop_flip(x, indices, seed=self.seed, epoch=self.epoch)
        if self.image_size is not None:
            x = resize(x, self.image_size)
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return (x - mean) / std
