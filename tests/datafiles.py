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


def write_idx(path: Path, array: np.ndarray) -> Path:
    """``array`` (uint8, or int32 for a test of other types) as an IDX file at ``path``,
    gzipped when the name ends in ``.gz``: ``0x00 0x00 <type> <ndim>``, big-endian uint32 dims,
    big-endian values."""
    import gzip

    kind = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}[array.dtype]
    header = bytes([0, 0, kind, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


def write_mnist_idx(root: Path, n_train: int = 12, n_eval: int = 6, side: int = 6,
                    num_classes: int = 4) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four MNIST-layout files under ``root``, the training pair gzipped and the eval pair
    raw, of random uint8 images; labels ``i % num_classes`` (train) and
    ``(i + 1) % num_classes`` (eval).

    Returns:
        ``{"train": (images [n, side, side], labels [n]), "eval": ...}`` as written.
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    out = {}
    for part, prefix, n, shift, ext in (("train", "train", n_train, 0, ".gz"),
                                        ("eval", "t10k", n_eval, 1, "")):
        images = rng.integers(0, 256, size=(n, side, side), dtype=np.uint8)
        labels = ((np.arange(n) + shift) % num_classes).astype(np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte{ext}", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{ext}", labels)
        out[part] = (images, labels)
    return out


WORDNET_LICENCE = ("  1 This software and database is being provided to you, the LICENSEE, by  \n"
                   "  2 Princeton University under the following license.  \n")


def write_wordnet(root: Path, parts: dict[str, list[tuple[int, int, str]]]) -> Path:
    """``root/data.<part>`` in WordNet 3.0's layout (two licence lines, then one synset line per
    ``(offset, lex_filenum, gloss)``, with a made-up word and pointer)."""
    root.mkdir(parents=True, exist_ok=True)
    for part, synsets in parts.items():
        letter = {"noun": "n", "verb": "v"}[part]
        lines = [f"{offset:08d} {lex:02d} {letter} 01 word_{offset} 0 001 @ 00001740 {letter} "
                 f"0000 | {gloss}  \n" for offset, lex, gloss in synsets]
        (root / f"data.{part}").write_text(WORDNET_LICENCE + "".join(lines), encoding="utf-8")
    return root
