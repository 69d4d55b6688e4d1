"""Tables in the formats users keep their data in, read with pyarrow.

A table dataset lives under ``data.path``, one split per name (``data.train_split``, default
``train``; ``data.eval_split``, default the first of ``validation``, ``dev``, ``test`` there):

- ``<split>.parquet``, ``<split>.jsonl`` (JSON Lines), ``<split>.csv``, or a folder ``<split>/``
  of such files (read in name order, as one table);
- a folder written by Hugging Face ``datasets``' ``save_to_disk``: ``<split>/`` holding
  ``data-*.arrow`` (Arrow IPC streams) and ``dataset_info.json``, whose ``ClassLabel`` names
  become the label names.

``data.columns`` maps roles to columns; unset roles take GLUE's and SQuAD's names. Rows keep
their order, so a row's index is its sample index (the sample order, the activation cache and
the reference trainer key on it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError, first_line

__all__ = ["EVAL_SPLITS", "SUFFIXES", "class_ids", "column", "find_split", "label_names_of",
           "read_split"]

SUFFIXES = (".parquet", ".jsonl", ".csv")
EVAL_SPLITS = ("validation", "dev", "test")
_LAYOUT = ("<split>.parquet, <split>.jsonl, <split>.csv, a folder <split>/ of those, or a "
           "datasets.save_to_disk folder")


def _read_file(path: Path):
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        if path.suffix == ".jsonl":
            return pjson.read_json(path)
        if path.suffix == ".csv":
            return pcsv.read_csv(path)
        with pa.memory_map(str(path)) as source:  # a save_to_disk shard: an Arrow IPC stream
            return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ConfigError(f"{str(path)!r} cannot be read as {path.suffix.lstrip('.') or 'Arrow'}"
                          f" ({first_line(err)}); check the file, or write it again") from None


def find_split(root: Path, split: str) -> list[Path] | None:
    """The files of split ``split`` under ``root``, in order, or None when there are none."""
    for suffix in SUFFIXES:
        if (root / f"{split}{suffix}").is_file():
            return [root / f"{split}{suffix}"]
    folder = root / split
    if folder.is_dir():
        arrow = sorted(folder.glob("data-*.arrow"))
        if arrow:
            return arrow
        files = sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES)
        if files:
            return files
    return None


def read_split(root: str | Path, split: str | None, field: str,
               fallbacks: tuple[str, ...] = ()) -> tuple[Any, str, dict[str, Any]]:
    """Split ``split`` (or, when None, the first of ``fallbacks`` present) as one pyarrow
    table, with the split's name and its ``save_to_disk`` features (empty otherwise).

    Raises:
        ConfigError: no such split (naming ``field`` and the layouts), or a file that cannot be
            read, or files of one split with different columns.
    """
    import pyarrow as pa

    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"data.path {str(root)!r} is not a folder; set it to the folder that "
                          f"holds the splits ({_LAYOUT})")
    names = [split] if split is not None else list(fallbacks)
    for name in names:
        files = find_split(root, name)
        if files is None:
            continue
        tables = [_read_file(p) for p in files]
        try:
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as err:
            raise ConfigError(f"the files of split {name!r} under {str(root)!r} have different "
                              f"columns ({first_line(err)}); give them one schema") from None
        info = files[0].parent / "dataset_info.json"
        features = json.loads(info.read_text()).get("features", {}) if info.is_file() else {}
        return table, name, features
    wanted = split if split is not None else " or ".join(fallbacks)
    raise ConfigError(f"{field}: no split {wanted!r} under {str(root)!r}; expected {_LAYOUT}, "
                      f"or set {field} to the split's name")


def column(table: Any, name: str, role: str, where: str) -> list[Any]:
    """The values of column ``name`` (the ``role`` of ``data.columns``) as Python objects.

    Raises:
        ConfigError: the column is missing (naming the table's columns and the fix).
    """
    if name not in table.column_names:
        raise ConfigError(f"{where} has no column {name!r} for {role}; its columns are "
                          f"{table.column_names}; set data.columns.{role} to one of them")
    return table.column(name).to_pylist()


def class_ids(values: list[Any], names: list[str] | None, where: str
              ) -> tuple[list[int], list[str] | None]:
    """Labels as class ids, and the class names when known.

    Integers are ids already (``names``, when given, name them); strings are looked up in
    ``names`` (``data.label_names`` or a ``ClassLabel``'s), else numbered in sorted order.

    Raises:
        ConfigError: a missing label, an id outside ``names``, or a name not among them.
    """
    if any(v is None for v in values):
        raise ConfigError(f"{where} has rows without a label; drop them or fill them in")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        bad = sorted({v for v in values if v < 0 or (names is not None and v >= len(names))})
        if bad:
            raise ConfigError(f"{where} has label ids {bad[:5]} outside 0..{len(names or []) - 1}"
                              f" (the label names); fix the labels or data.label_names")
        return list(values), names
    text = [str(v) for v in values]
    names = names if names is not None else sorted(set(text))
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ConfigError(f"{where} has labels {unknown[:5]} not in data.label_names {names}; "
                          "add them there")
    return [index[t] for t in text], names


def label_names_of(features: Mapping[str, Any], label: str, given: list[str] | None
                   ) -> list[str] | None:
    """``data.label_names``, else the names of a ``save_to_disk`` ``ClassLabel`` column."""
    if given is not None:
        return list(given)
    feature = features.get(label) or {}
    return list(feature["names"]) if feature.get("_type") == "ClassLabel" else None
