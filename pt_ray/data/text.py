"""Text datasets from local files: GLUE-style TSV classification and SQuAD v1.1 JSON.

Text is tokenised once at load with a local tokenizer (never downloaded), padded or truncated
to ``seq_len``; inputs are ``(input_ids, attention_mask, token_type_ids)``, all int64.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pt_ray.core.config import ConfigError, DataConfig, first_line
from pt_ray.core.datasets import GLUE_TSV, SQUAD_JSON
from pt_ray.data.base import DatasetSplits, TensorSampleDataset, data_root
from pt_ray.data.synthetic import TEXT_INPUTS

__all__ = ["PAIR_COLUMNS", "build_glue_tsv", "build_squad_json", "classification_dataset",
           "load_fast_tokenizer", "load_glue_tsv", "load_squad_json", "load_tokenizer",
           "qa_dataset"]

logger = logging.getLogger(__name__)

PAIR_COLUMNS = (
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("question", "passage"),
)
"""Column pairs recognised as sentence pairs, tried in order; else the single ``sentence``."""
_LABEL_COLUMNS = ("label", "gold_label")


def load_tokenizer(tokenizer_dir: str | Path | None) -> Any:
    """A Hugging Face tokenizer from a local directory (``local_files_only``).

    Raises:
        ConfigError: no directory was given, it does not exist, or it holds no tokenizer
            that loads.
    """
    if tokenizer_dir is None:
        raise ConfigError(
            "text datasets need a local tokenizer; set data.tokenizer (or model.weights) to a "
            "directory holding tokenizer.json or vocab.txt"
        )
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise ConfigError(
            f"tokenizer directory {str(path)!r} not found; set data.tokenizer to a local "
            "Hugging Face model directory (tokenizer.json / vocab.txt, tokenizer_config.json)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as err:
        # transformers reports a folder without tokenizer files, or with unreadable ones, so.
        raise ConfigError(
            f"tokenizer directory {str(path)!r} holds no tokenizer that loads "
            f"({first_line(err)}); set data.tokenizer (or model.weights) to a directory with "
            "tokenizer.json or vocab.txt and tokenizer_config.json, as save_pretrained writes"
        ) from err


def _encode(tokenizer: Any, first: list[str], second: list[str] | None, seq_len: int,
            **kwargs: Any) -> Any:
    return tokenizer(
        first,
        second,
        padding="max_length",
        max_length=seq_len,
        return_token_type_ids=True,
        **kwargs,
    )


def _inputs(enc: Any) -> tuple[torch.Tensor, ...]:
    ids = torch.as_tensor(enc["input_ids"], dtype=torch.int64)
    mask = torch.as_tensor(enc["attention_mask"], dtype=torch.int64)
    types = enc.get("token_type_ids")
    types = torch.zeros_like(ids) if types is None else torch.as_tensor(types, dtype=torch.int64)
    return ids, mask, types


def _read_tsv(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except (UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(
            f"{str(path)!r} cannot be read as tab-separated UTF-8 text ({first_line(err)}); "
            "save it as UTF-8 TSV with a header row"
        ) from err
    if not rows:
        raise ConfigError(f"{str(path)!r} is empty; expected a header row and one row per example")
    header, body = rows[0], rows[1:]
    good = [r for r in body if len(r) == len(header)]
    if len(good) < len(body):
        logger.warning("%s: skipped %d malformed rows", path, len(body) - len(good))
    return header, good


def _columns(header: Sequence[str], path: Path) -> tuple[str, str | None, str]:
    label = next((c for c in _LABEL_COLUMNS if c in header), None)
    pair = next((p for p in PAIR_COLUMNS if p[0] in header and p[1] in header), None)
    text = pair or (("sentence", None) if "sentence" in header else None)
    if label is None or text is None:
        pairs = ", ".join(f"{a}+{b}" for a, b in PAIR_COLUMNS)
        raise ConfigError(
            f"{str(path)!r} has columns {list(header)}; expected a header with a 'label' column "
            f"and either 'sentence' or a pair ({pairs})"
        )
    return text[0], text[1], label


def _label_map(values: Sequence[str], path: Path) -> dict[str, int]:
    names = sorted(set(values))
    try:
        numbers = {v: float(v) for v in names}
    except ValueError:
        return {v: i for i, v in enumerate(names)}  # named labels, e.g. MNLI's
    if any(x != int(x) or x < 0 for x in numbers.values()):
        raise ConfigError(
            f"{str(path)!r} has labels {names[:5]} that are not class ids (non-negative "
            "integers); regression tasks such as STS-B are not supported"
        )
    return {v: int(x) for v, x in numbers.items()}


def classification_dataset(tokenizer: Any, first: list[str], second: list[str] | None,
                           labels: list[int], seq_len: int) -> TensorSampleDataset:
    """Single sentences (or pairs, with ``second``) tokenised to ``seq_len``, with their class
    ids: the form every text classification source (GLUE TSV, a table) ends in."""
    enc = _encode(tokenizer, first, second, seq_len, truncation=True)
    return TensorSampleDataset(_inputs(enc), torch.tensor(labels, dtype=torch.int64),
                               TEXT_INPUTS)


def qa_dataset(tokenizer: Any, examples: list[tuple[str, str, int, int]], seq_len: int,
               where: str) -> TensorSampleDataset:
    """``(question, context, answer start char, answer end char)`` examples tokenised as pairs
    (``truncation="only_second"``) with their answer spans in tokens (``(0, 0)``, the CLS
    token, when the answer falls outside the window or there is none)."""
    enc = _encode(tokenizer, [e[0] for e in examples], [e[1] for e in examples], seq_len,
                  truncation="only_second", return_offsets_mapping=True)
    target = torch.tensor(
        [_span_target(enc, i, e[2], e[3]) for i, e in enumerate(examples)], dtype=torch.int64)
    lost = int((target[:, 0] == 0).sum())
    if lost:
        logger.info("%s: %d of %d answers outside the %d-token window -> CLS", where, lost,
                    len(examples), seq_len)
    return TensorSampleDataset(_inputs(enc), target, TEXT_INPUTS)


def load_fast_tokenizer(tokenizer_dir: str | Path | None) -> Any:
    """:func:`load_tokenizer`, refusing a tokenizer without offset mappings (extractive QA).

    Raises:
        ConfigError: it does not load, or is not a fast (Rust) tokenizer.
    """
    tokenizer = load_tokenizer(tokenizer_dir)
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"tokenizer in {str(tokenizer_dir)!r} is not a fast tokenizer; question answering "
            "needs offset mappings, so provide a directory with tokenizer.json"
        )
    return tokenizer


def load_glue_tsv(
    root: str | Path, tokenizer_dir: str | Path | None, *, seq_len: int = 128
) -> DatasetSplits:
    """GLUE-style classification from ``root/train.tsv`` and ``root/dev.tsv``.

    Each file has a header row; text is one ``sentence`` column or a pair of columns (see
    :data:`PAIR_COLUMNS`); the class is the ``label`` column (integers, or names mapped to ids
    in sorted order). ``dev_matched.tsv`` (MNLI) is used when ``dev.tsv`` is absent.

    Args:
        root: folder holding ``train.tsv`` and ``dev.tsv``.
        tokenizer_dir: local Hugging Face tokenizer directory.
        seq_len: padded/truncated sequence length.

    Raises:
        ConfigError: a file is missing (the message gives the expected layout) or unreadable,
            the columns or labels are not recognised, or the tokenizer does not load.
    """
    root = Path(root)
    train_path = root / "train.tsv"
    dev_path = next(
        (root / n for n in ("dev.tsv", "dev_matched.tsv") if (root / n).is_file()), root / "dev.tsv"
    )
    for p in (train_path, dev_path):
        if not p.is_file():
            raise ConfigError(
                f"GLUE file {str(p)!r} not found; set data.path to a folder holding train.tsv "
                "and dev.tsv, tab-separated with a header row (sentence or sentence1/sentence2 "
                "..., label)"
            )
    tokenizer = load_tokenizer(tokenizer_dir)
    tables = {"train": _read_tsv(train_path), "dev": _read_tsv(dev_path)}
    a, b, label = _columns(tables["train"][0], train_path)
    mapping = _label_map([r[tables["train"][0].index(label)] for r in tables["train"][1]],
                         train_path)
    splits = {}
    for split, path in (("train", train_path), ("dev", dev_path)):
        header, rows = tables[split]
        _columns(header, path)  # the same layout in both files
        col = {c: header.index(c) for c in (a, b, label) if c is not None}
        labels = [r[col[label]] for r in rows]
        unknown = sorted(set(labels) - set(mapping))
        if unknown:
            raise ConfigError(
                f"{str(path)!r} has labels {unknown[:5]} that never occur in {str(train_path)!r}"
            )
        splits[split] = classification_dataset(
            tokenizer, [r[col[a]] for r in rows],
            [r[col[b]] for r in rows] if b is not None else None,
            [mapping[v] for v in labels], seq_len)
    num_classes = max(max(mapping.values()) + 1, 2)
    logger.info("glue_tsv %s: %d train, %d dev, %d classes", root, len(splits["train"]),
                len(splits["dev"]), num_classes)
    return DatasetSplits(
        name=GLUE_TSV,
        task="classification",
        train=splits["train"],
        eval=splits["dev"],
        num_classes=num_classes,
        seq_len=seq_len,
        vocab_size=len(tokenizer),
    )


def _squad_examples(path: Path) -> list[tuple[str, str, int, int]]:
    """``(question, context, answer_start_char, answer_end_char)`` per question (first answer;
    ``(-1, -1)`` when it has none, as in SQuAD v2's impossible questions)."""
    out = []
    try:
        for article in json.loads(path.read_text(encoding="utf-8"))["data"]:
            for para in article["paragraphs"]:
                context = para["context"]
                for qa in para["qas"]:
                    answers = qa.get("answers") or []
                    if answers:
                        start = int(answers[0]["answer_start"])
                        out.append((qa["question"].lstrip(), context, start,
                                    start + len(answers[0]["text"])))
                    else:
                        out.append((qa["question"].lstrip(), context, -1, -1))
    # Invalid JSON or UTF-8 (ValueErrors), a missing field, a field of another type.
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        what = f"missing field {err}" if isinstance(err, KeyError) else first_line(err)
        raise ConfigError(
            f"{str(path)!r} is not SQuAD v1.1 JSON ({what}); expected "
            '{"data": [{"paragraphs": [{"context": ..., "qas": [{"question": ..., '
            '"answers": [{"text": ..., "answer_start": ...}]}]}]}]}'
        ) from None
    return out


def _span_target(enc: Any, i: int, start_char: int, end_char: int) -> tuple[int, int]:
    """Token positions of the answer characters, or ``(0, 0)`` (CLS) outside the window."""
    if start_char < 0:
        return 0, 0
    seq_ids = enc.sequence_ids(i)
    ctx = [t for t, s in enumerate(seq_ids) if s == 1]
    if not ctx:
        return 0, 0
    offsets = enc["offset_mapping"][i]
    if offsets[ctx[0]][0] > start_char or offsets[ctx[-1]][1] < end_char:
        return 0, 0
    start = max(t for t in ctx if offsets[t][0] <= start_char)
    end = min(t for t in ctx if offsets[t][1] >= end_char)
    return start, end


def load_squad_json(
    root: str | Path, tokenizer_dir: str | Path | None, *, seq_len: int = 384
) -> DatasetSplits:
    """SQuAD v1.1 question answering from ``root/train.json`` and ``root/dev.json``.

    Question and context are tokenised as a pair with ``truncation="only_second"`` (one window
    per question, no stride); the target ``[2]`` is the first answer's start and end token. An
    answer cut off by the window targets ``(0, 0)``, the ``[CLS]`` token, as Hugging Face does.

    Args:
        root: folder holding ``train.json`` and ``dev.json``.
        tokenizer_dir: local directory of a fast (Rust) tokenizer, for offset mappings.
        seq_len: padded/truncated sequence length.

    Raises:
        ConfigError: a file is missing (the message gives the expected layout), the JSON is not
            SQuAD-shaped, or the tokenizer does not load or is not a fast one.
    """
    root = Path(root)
    paths = {"train": root / "train.json", "dev": root / "dev.json"}
    for p in paths.values():
        if not p.is_file():
            raise ConfigError(
                f"SQuAD file {str(p)!r} not found; set data.path to a folder holding train.json "
                "and dev.json in SQuAD v1.1 format (rename train-v1.1.json, dev-v1.1.json)"
            )
    tokenizer = load_fast_tokenizer(tokenizer_dir)
    splits = {}
    for split, path in paths.items():
        examples = _squad_examples(path)
        if not examples:
            raise ConfigError(f"{str(path)!r} holds no questions; give at least one in each "
                              "file")
        splits[split] = qa_dataset(tokenizer, examples, seq_len, f"squad_json {path}")
    return DatasetSplits(
        name=SQUAD_JSON,
        task="question_answering",
        train=splits["train"],
        eval=splits["dev"],
        seq_len=seq_len,
        vocab_size=len(tokenizer),
    )


def build_glue_tsv(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    """``data.name=glue_tsv``."""
    return load_glue_tsv(data_root(cfg), tok, seq_len=cfg.seq_len)


def build_squad_json(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    """``data.name=squad_json``."""
    return load_squad_json(data_root(cfg), tok, seq_len=cfg.seq_len)
