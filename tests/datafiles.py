"""Small data files in the layouts pt-ray reads, written by the tests that need them."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar10(root: Path, per_batch: int = 6) -> Path:
    """CIFAR-10's python-pickle layout under ``root``: five training batches and a test batch
    of ``per_batch`` random uint8 images each; sample 0 of each file is pure red and the labels
    of file ``k`` are ``(k + i) % 10``."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        data[0] = 0
        data[0, :1024] = 255  # sample 0 of each file: pure red
        batch = {b"batch_label": name.encode(), b"labels": [(k + i) % 10 for i in range(per_batch)],
                 b"data": data, b"filenames": [b"x.png"] * per_batch}
        with (folder / name).open("wb") as f:
            pickle.dump(batch, f, protocol=2)
    return folder
