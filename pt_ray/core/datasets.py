"""The dataset registry: each ``data.name`` with its traits and where its builder lives.

Pure module (stdlib only), so that the config can validate a dataset's name and its needs (a
path, a text model) before torch loads. The builder itself is torch code in ``pt_ray.data``:
an entry names it as ``module:function`` under ``pt_ray.data``, and
:mod:`pt_ray.data.registry` resolves it. A new dataset format is its loader module (with its
builder) and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "DATASETS",
    "DATASET_NAMES",
    "DIGITS",
    "DatasetEntry",
    "GLUE_TSV",
    "IMAGEFOLDER",
    "IMAGE_TABLE",
    "MNIST5K",
    "MNIST_IDX",
    "QA_TABLE",
    "SQUAD_JSON",
    "SYNTHETIC_IMAGE",
    "SYNTHETIC_TEXT",
    "TEXT_DATASETS",
    "TEXT_TABLE",
    "WORDNET",
    "dataset_entry",
]


@dataclass(frozen=True)
class DatasetEntry:
    """One ``data.name``.

    Attributes:
        name: the value of ``data.name``.
        builder: ``module:function`` in ``pt_ray.data``: a function
            ``(cfg: DataConfig, seed: int, tokenizer_dir: Path | None) -> DatasetSplits``.
        text: token sequences (it needs a text model, ``model.family=hf``); else images.
        reads_files: it reads local files under ``data.path`` (required).
        augmentable: ``data.augment`` gives its training split a random transform.
        generated: its samples are generated: ``data.num_samples`` sets how many, instead of
            capping the training split.
        table: it reads tables, so :func:`pt_ray.fit` can be handed its splits in memory.
        question_answering: its task is extractive question answering (else classification).
    """

    name: str
    builder: str
    text: bool = False
    reads_files: bool = True
    augmentable: bool = False
    generated: bool = False
    table: bool = False
    question_answering: bool = False


DIGITS = "digits"
MNIST5K = "mnist5k"
SYNTHETIC_IMAGE = "synthetic_image"
CIFAR10 = "cifar10"
CIFAR100 = "cifar100"
IMAGEFOLDER = "imagefolder"
GLUE_TSV = "glue_tsv"
SQUAD_JSON = "squad_json"
SYNTHETIC_TEXT = "synthetic_text"
TEXT_TABLE = "text_table"
QA_TABLE = "qa_table"
IMAGE_TABLE = "image_table"
MNIST_IDX = "mnist_idx"
WORDNET = "wordnet"

DATASETS: dict[str, DatasetEntry] = {e.name: e for e in (
    DatasetEntry(DIGITS, "vision:build_digits", reads_files=False),
    DatasetEntry(MNIST5K, "vision:build_mnist5k", reads_files=False),
    DatasetEntry(SYNTHETIC_IMAGE, "synthetic:build_synthetic_image", reads_files=False,
                 generated=True),
    DatasetEntry(CIFAR10, "vision:build_cifar10", augmentable=True),
    DatasetEntry(CIFAR100, "vision:build_cifar100", augmentable=True),
    DatasetEntry(IMAGEFOLDER, "vision:build_imagefolder", augmentable=True),
    DatasetEntry(GLUE_TSV, "text:build_glue_tsv", text=True),
    DatasetEntry(SQUAD_JSON, "text:build_squad_json", text=True, question_answering=True),
    DatasetEntry(SYNTHETIC_TEXT, "synthetic:build_synthetic_text", text=True,
                 reads_files=False, generated=True),
    DatasetEntry(TEXT_TABLE, "table_datasets:build_text_table", text=True, table=True),
    DatasetEntry(QA_TABLE, "table_datasets:build_qa_table", text=True, table=True,
                 question_answering=True),
    DatasetEntry(IMAGE_TABLE, "table_datasets:build_image_table", augmentable=True, table=True),
    DatasetEntry(MNIST_IDX, "idx:build_mnist_idx"),
    DatasetEntry(WORDNET, "wordnet:build_wordnet", text=True),
)}
"""Every dataset by name, the default first; ``data.name``'s choices derive from it (the name
constants above are for the code that names one dataset: its loader)."""

DATASET_NAMES = tuple(DATASETS)
"""The values ``data.name`` takes, the default first."""

TEXT_DATASETS = tuple(name for name, e in DATASETS.items() if e.text)
"""The datasets of token sequences (the others hold images)."""


def dataset_entry(name: str) -> DatasetEntry:
    """The entry of ``data.name=name``.

    Raises:
        ValueError: no dataset has that name.
    """
    if name not in DATASETS:
        raise ValueError(f"data.name={name!r} is unknown; choose one of {sorted(DATASETS)}")
    return DATASETS[name]
