"""Datasets from tables (:mod:`pt_ray.data.tables`): text classification and sentence pairs
(``text_table``), extractive question answering (``qa_table``) and images with labels
(``image_table``: image bytes in Parquet, or a CSV of path and label).

Each ends in the same form as the file formats pt-ray reads otherwise (GLUE TSV, SQuAD JSON,
image folders), so the same rows give the same samples.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.core.datasets import IMAGE_TABLE, QA_TABLE, TEXT_TABLE
from pt_ray.data.base import DatasetSplits
from pt_ray.data.tables import EVAL_SPLITS, class_ids, column, label_names_of, read_split
from pt_ray.data.text import (PAIR_COLUMNS, classification_dataset, load_fast_tokenizer,
                              load_tokenizer, qa_dataset)

__all__ = ["build_image_table", "build_qa_table", "build_text_table", "load_image_table",
           "load_qa_table", "load_text_table"]

logger = logging.getLogger(__name__)


def _splits(cfg: DataConfig) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    if cfg.path is None:
        raise ConfigError(f"data.name={cfg.name} reads files: set data.path to their folder")
    return {"train": read_split(cfg.path, cfg.train_split, "data.train_split"),
            "eval": read_split(cfg.path, cfg.eval_split, "data.eval_split", EVAL_SPLITS)}


def _where(cfg: DataConfig, name: str) -> str:
    return f"split {name!r} under {str(cfg.path)!r}"


def _text_columns(table: Any, cfg: DataConfig) -> tuple[str, str | None, str]:
    """(text, text_pair or None, label): ``data.columns``, else GLUE's names."""
    given = cfg.columns
    header = table.column_names
    label = given.get("label", "label")
    if "text" in given:
        return given["text"], given.get("text_pair"), label
    pair = next((p for p in PAIR_COLUMNS if p[0] in header and p[1] in header), None)
    if pair is not None:
        return pair[0], pair[1], label
    return "sentence", given.get("text_pair"), label


def load_text_table(cfg: DataConfig, tokenizer_dir: str | Path | None) -> DatasetSplits:
    """Text classification (one text, or a pair) from tables; see the module docstring."""
    splits = _splits(cfg)
    tokenizer = load_tokenizer(tokenizer_dir)
    train_table, train_name, features = splits["train"]
    first, second, label = _text_columns(train_table, cfg)
    names = label_names_of(features, label, cfg.label_names)
    data = {}
    for part, (table, name, _) in splits.items():
        where = _where(cfg, name)
        labels, names = class_ids(column(table, label, "label", where), names, where)
        texts = [str(t) for t in column(table, first, "text", where)]
        pairs = ([str(t) for t in column(table, second, "text_pair", where)]
                 if second is not None else None)
        data[part] = classification_dataset(tokenizer, texts, pairs, labels, cfg.seq_len)
    num_classes = len(names) if names else int(max(data["train"].target.max(),
                                                     data["eval"].target.max())) + 1
    logger.info("text_table %s: %d train (%s), %d eval, %d classes", cfg.path,
                len(data["train"]), train_name, len(data["eval"]), num_classes)
    return DatasetSplits(name=TEXT_TABLE, task="classification", train=data["train"],
                         eval=data["eval"], num_classes=max(num_classes, 2),
                         seq_len=cfg.seq_len, vocab_size=len(tokenizer))


def _answer(value: Any, where: str) -> tuple[int, int]:
    """A SQuAD ``answers`` cell (``{"text": [...], "answer_start": [...]}``, or a list of
    ``{"text", "answer_start"}``) as the first answer's character span; (-1, -1) for none."""
    if isinstance(value, dict):
        texts, starts = value.get("text") or [], value.get("answer_start") or []
        pairs = list(zip(texts, starts))
    elif isinstance(value, list):
        pairs = [(a["text"], a["answer_start"]) for a in value]
    else:
        raise ConfigError(f"{where}: an answers cell is {type(value).__name__}; expected "
                          "SQuAD's {'text': [...], 'answer_start': [...]}")
    if not pairs:
        return -1, -1
    text, start = pairs[0]
    return int(start), int(start) + len(text)


def load_qa_table(cfg: DataConfig, tokenizer_dir: str | Path | None) -> DatasetSplits:
    """Extractive question answering from tables with SQuAD's columns (``question``,
    ``context``, ``answers``; others through ``data.columns``)."""
    splits = _splits(cfg)
    tokenizer = load_fast_tokenizer(tokenizer_dir)
    roles = {r: cfg.columns.get(r, r) for r in ("question", "context", "answers")}
    data = {}
    for part, (table, name, _) in splits.items():
        where = _where(cfg, name)
        cols = {r: column(table, c, r, where) for r, c in roles.items()}
        examples = [(str(q).lstrip(), str(c), *_answer(a, where))
                    for q, c, a in zip(cols["question"], cols["context"], cols["answers"])]
        if not examples:
            raise ConfigError(f"{where} holds no questions; give at least one")
        data[part] = qa_dataset(tokenizer, examples, cfg.seq_len, f"qa_table {where}")
    return DatasetSplits(name=QA_TABLE, task="question_answering", train=data["train"],
                         eval=data["eval"], seq_len=cfg.seq_len, vocab_size=len(tokenizer))


def _image_sources(table: Any, cfg: DataConfig, where: str) -> list[Any]:
    """Each row's image: its bytes (a binary column, or Hugging Face's ``{bytes, path}``
    image struct), or a path relative to ``data.path`` (a CSV of path and label)."""
    name = cfg.columns.get("image") or next(
        (c for c in ("image", "img", "path", "file") if c in table.column_names), "image")
    values = column(table, name, "image", where)
    out = []
    for v in values:
        if isinstance(v, dict):
            v = v.get("bytes") or v.get("path")
        if isinstance(v, str):
            v = Path(v) if Path(v).is_absolute() else Path(cfg.path) / v
        if v is None:
            raise ConfigError(f"{where} has a row without an image in column {name!r}")
        out.append(v)
    return out


def load_image_table(cfg: DataConfig, seed: int) -> DatasetSplits:
    """Images with labels from tables: Parquet with the images' bytes, or a CSV of file paths
    (relative to ``data.path``) and labels; every image is verified first, as image folders'
    are (``data.skip_damaged``)."""
    from pt_ray.data.vision import image_splits

    splits = _splits(cfg)
    label = cfg.columns.get("label", "label")
    names = label_names_of(splits["train"][2], label, cfg.label_names)
    parts = {}
    for part, (table, name, _) in splits.items():
        where = _where(cfg, name)
        labels, names = class_ids(column(table, label, "label", where), names, where)
        parts[part] = (_image_sources(table, cfg, where), labels)
    num_classes = len(names) if names else max(max(parts["train"][1]),
                                               max(parts["eval"][1])) + 1
    return image_splits(IMAGE_TABLE, Path(cfg.path), parts, max(num_classes, 2),
                        cfg.image_size, cfg.augment, seed, cfg.skip_damaged)


def build_text_table(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    """``data.name=text_table``."""
    return load_text_table(cfg, tok)


def build_qa_table(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    """``data.name=qa_table``."""
    return load_qa_table(cfg, tok)


def build_image_table(cfg: DataConfig, seed: int, _tok: Path | None) -> DatasetSplits:
    """``data.name=image_table``."""
    return load_image_table(cfg, seed)
