"""WordNet glosses labelled by their lexicographer file: a text classification task read from
the WordNet 3.0 database files (``data.noun``, ``data.verb``, ...) in a local folder.

Each synset line of a ``data.<pos>`` file is ``offset lex_filenum ss_type w_cnt word lex_id
... p_cnt ... | gloss``; lines that start with two spaces are the licence. The text is the
gloss (after ``|``, stripped, examples in quotes kept); the class is the lexicographer file
(``noun.animal``, ``verb.motion``, ...), renumbered over the files present in the chosen parts
of speech in lexicographer-file order, so nouns alone give 26 classes.

The dev split is the same in every run: the :data:`WORDNET_DEV_SIZE` synsets with the smallest
hash of ``(pos, offset)``, never a seeded draw.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.core.datasets import WORDNET
from pt_ray.data.base import DatasetSplits, capped_rows, data_root
from pt_ray.data.text import classification_dataset, load_tokenizer

__all__ = ["LEXNAMES", "WORDNET_DEV_SIZE", "WORDNET_POS", "Gloss", "build_wordnet", "dev_keys",
           "load_wordnet", "read_glosses"]

logger = logging.getLogger(__name__)

LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance",
    "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion",
    "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative",
    "verb.weather", "adj.ppl",
)
"""WordNet 3.0's lexicographer files by number (its ``lexnames`` file, which Debian's
wordnet-base does not ship): 3-28 are the nouns', 29-43 the verbs'."""

WORDNET_POS = {"noun": "n", "verb": "v", "adj": "a", "adv": "r"}
"""Part of speech -> the letter the dev hash keys on; the file is ``data.<part>``."""

WORDNET_DEV_SIZE = 2000
"""Synsets in the dev split."""

_WHERE = ("WordNet 3.0 ships in the Debian package wordnet-base (/usr/share/wordnet); "
          "set data.path to the folder that holds data.noun")


class Gloss(NamedTuple):
    """One synset: its part of speech's letter, byte offset, lexicographer file and gloss."""

    pos: str
    offset: int
    lex_file: int
    text: str


def read_glosses(root: Path, parts_of_speech: Sequence[str]) -> list[Gloss]:
    """Every synset of ``root/data.<part>`` for each part in turn, in file order.

    Raises:
        ConfigError: a file is missing, or a line is not a synset line.
    """
    out: list[Gloss] = []
    for part in parts_of_speech:
        path = root / f"data.{part}"
        if not path.is_file():
            raise ConfigError(f"data.path={root} has no data.{part} (data.parts_of_speech "
                              f"includes {part}); {_WHERE}")
        with path.open(encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.startswith("  ") or not line.strip():
                    continue
                head, bar, gloss = line.partition("|")
                fields = head.split()
                if not bar or len(fields) < 3 or not (fields[0].isdigit() and fields[1].isdigit()
                                                      and int(fields[1]) < len(LEXNAMES)):
                    raise ConfigError(
                        f"{str(path)}:{number} is not a WordNet 3.0 synset line "
                        "(offset lex_filenum ss_type ... | gloss); " + _WHERE)
                out.append(Gloss(WORDNET_POS[part], int(fields[0]), int(fields[1]),
                                 gloss.strip()))
    return out


def _dev_rank(pos: str, offset: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{pos}:{offset}".encode()).digest()[:8], "big")


def dev_keys(glosses: Sequence[Gloss], size: int = WORDNET_DEV_SIZE) -> set[tuple[str, int]]:
    """The ``(pos, offset)`` of the dev split: the ``size`` synsets with the smallest SHA-256
    of ``"<pos>:<offset>"`` (a synset's draw does not depend on the seed, nor on the others)."""
    ranked = sorted(glosses, key=lambda g: _dev_rank(g.pos, g.offset))
    return {(g.pos, g.offset) for g in ranked[:size]}


def load_wordnet(
    root: str | Path,
    tokenizer_dir: str | Path | None,
    *,
    seq_len: int = 128,
    parts_of_speech: Sequence[str] = ("noun",),
    dev_size: int = WORDNET_DEV_SIZE,
    num_samples: int | None = None,
    seed: int = 0,
) -> DatasetSplits:
    """WordNet glosses classified by lexicographer file; see the module docstring.

    Args:
        root: folder holding ``data.noun`` (and ``data.verb``, ... as chosen).
        tokenizer_dir: local Hugging Face tokenizer directory.
        seq_len: padded/truncated sequence length.
        parts_of_speech: which ``data.<part>`` files to read (``noun``, ``verb``, ``adj``,
            ``adv``).
        dev_size: synsets in the dev split; every other one is a training example.
        num_samples: keep only the training rows ``data.num_samples`` keeps under ``seed``
            (:func:`pt_ray.data.base.capped_rows`), chosen before tokenising: the same rows
            in the same order as capping the whole split afterwards, without tokenising the
            other 70,000 glosses (None: every training gloss).
        seed: the run's seed, for ``num_samples``.

    Returns:
        Splits in file order (about 80,000 training and 2,000 dev glosses for the nouns).

    Raises:
        ConfigError: a file is missing (the message names the Debian package), a line is not
            a synset line, there are too few synsets for the dev split, or the tokenizer does
            not load.
    """
    root = Path(root)
    glosses = read_glosses(root, parts_of_speech)
    if len(glosses) <= dev_size:
        raise ConfigError(f"data.path={root} holds {len(glosses)} synsets in "
                          f"{', '.join(parts_of_speech)}; the dev split alone takes {dev_size}. "
                          + _WHERE)
    files = sorted({g.lex_file for g in glosses})
    label = {lex: i for i, lex in enumerate(files)}
    dev = dev_keys(glosses, dev_size)
    tokenizer = load_tokenizer(tokenizer_dir)
    splits = {}
    for part, in_dev in (("train", False), ("dev", True)):
        rows = [g for g in glosses if ((g.pos, g.offset) in dev) == in_dev]
        keep = None
        if part == "train" and num_samples is not None:
            keep = capped_rows(len(rows), num_samples, seed)
        if keep is not None:
            logger.info("wordnet: keeping %d of %d training glosses (data.num_samples)",
                        len(keep), len(rows))
            rows = [rows[i] for i in keep.tolist()]
        splits[part] = classification_dataset(tokenizer, [g.text for g in rows], None,
                                              [label[g.lex_file] for g in rows], seq_len)
    logger.info("wordnet %s (%s): %d train, %d dev glosses, %d classes (%s .. %s)", root,
                ", ".join(parts_of_speech), len(splits["train"]), len(splits["dev"]),
                len(files), LEXNAMES[files[0]], LEXNAMES[files[-1]])
    return DatasetSplits(name=WORDNET, task="classification", train=splits["train"],
                         eval=splits["dev"], num_classes=max(len(files), 2), seq_len=seq_len,
                         vocab_size=len(tokenizer))


def build_wordnet(cfg: DataConfig, seed: int, tok: Path | None) -> DatasetSplits:
    """``data.name=wordnet``. Without ``data.classes`` the training cap is taken before
    tokenising (the registry's cap then keeps everything); with them the registry caps what
    the classes leave, as for every dataset."""
    cap = cfg.num_samples if cfg.classes is None else None
    return load_wordnet(data_root(cfg), tok, seq_len=cfg.seq_len,
                        parts_of_speech=cfg.parts_of_speech, num_samples=cap, seed=seed)
