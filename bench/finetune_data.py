"""Real, offline fine-tuning data for the benchmarks: Python's own documentation topics.

``pydoc_data.topics`` (shipped with every CPython) holds the text of the language reference
sections that ``help()`` shows. :func:`write_topics_tsv` cuts it into short passages labelled
with the part of the reference they come from (eight classes: statements, compound statements,
expressions, the data model, built-in types, strings, the execution model, the debugger) and
writes them as GLUE-style TSV, the layout ``data.name=glue_tsv`` reads.

Passages are windows of ``window`` words over de-duplicated paragraphs: a paragraph that appears
under topics of two classes (the reference repeats some) is dropped, one that appears twice in
one class is kept once. Each paragraph goes wholly to the training or the dev split, by a hash
of its text, and a dev passage that a training one repeats word for word (7 of 621, from
paragraphs the reference repeats nearly verbatim) is dropped, so no dev passage is a training
one. The result depends only on the Python version's documentation text (CPython 3.11: 3,623
training and 614 dev passages, so one dev passage is worth 0.16 points).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

__all__ = ["TOPIC_CLASSES", "topic_passages", "write_topics_tsv"]

TOPIC_CLASSES: dict[str, tuple[str, ...]] = {
    "statements": ("assert", "assignment", "augassign", "break", "continue", "del", "global",
                   "import", "nonlocal", "pass", "raise", "return", "exprlists"),
    "compound": ("compound", "if", "while", "for", "try", "with", "async", "class",
                 "function", "else"),
    "expressions": ("atom-identifiers", "atom-literals", "attribute-references", "await",
                    "binary", "bitwise", "booleans", "calls", "comparisons", "conversions",
                    "in", "lambda", "operator-summary", "power", "shifting", "slicings",
                    "subscriptions", "unary", "yield"),
    "data-model": ("attribute-access", "callable-types", "context-managers", "customization",
                   "numeric-types", "objects", "sequence-types", "specialattrs",
                   "specialnames", "types"),
    "builtin-types": ("bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
                      "bltin-type-objects", "dict", "lists", "truth", "typesfunctions",
                      "typesmapping", "typesmethods", "typesmodules", "typesseq",
                      "typesseq-mutable"),
    "strings": ("formatstrings", "string-methods", "strings"),
    "execution-model": ("dynamic-features", "exceptions", "execmodel", "id-classes",
                        "identifiers", "naming", "floating", "imaginary", "integers",
                        "numbers"),
    "debugger": ("debugger",),
}
"""The class of each ``pydoc_data.topics`` key (topics not listed are not used)."""


def _paragraphs() -> dict[str, str]:
    """Each de-duplicated paragraph (at least 8 words, white space folded) -> its class."""
    from pydoc_data.topics import topics

    owner: dict[str, set[str]] = {}
    for label, keys in TOPIC_CLASSES.items():
        for key in keys:
            for para in re.split(r"\n\s*\n", topics.get(key, "")):
                text = " ".join(para.split())
                if len(text.split()) >= 8:
                    owner.setdefault(text, set()).add(label)
    return {text: labels.pop() for text, labels in owner.items() if len(labels) == 1}


def _in_dev(text: str, dev_fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < dev_fraction


def topic_passages(
    *, window: int = 16, stride: int = 8, dev_fraction: float = 0.2, seed: int = 0
) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(passage, class)], "dev": [...]}`` from the documentation topics.

    Args:
        window: words per passage.
        stride: words between the starts of consecutive training passages of one paragraph
            (dev passages never overlap: their stride is ``window``).
        dev_fraction: share of paragraphs that go to the dev split.
        seed: which paragraphs go to dev (the same seed gives the same files).
    """
    out: dict[str, list[tuple[str, str]]] = {"train": [], "dev": []}
    for text, label in sorted(_paragraphs().items()):
        words = text.split()
        split = "dev" if _in_dev(text, dev_fraction, seed) else "train"
        step = window if split == "dev" else stride
        starts = range(0, max(len(words) - window, 0) + 1, step)
        out[split] += [(" ".join(words[s:s + window]), label) for s in starts]
    # Paragraphs the reference repeats nearly word for word can share a window: a dev passage
    # the training split holds verbatim would be scored on text the model trained on.
    seen = {text for text, _ in out["train"]}
    out["dev"] = [(text, label) for text, label in out["dev"] if text not in seen]
    return out


def write_topics_tsv(root: Path, **kwargs) -> Path:
    """Write ``root/train.tsv`` and ``root/dev.tsv`` (columns ``sentence``, ``label``; labels
    are class names) from :func:`topic_passages` (keyword arguments pass through).

    Returns:
        ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in topic_passages(**kwargs).items():
        body = "".join(f"{text}\t{label}\n" for text, label in rows)
        (root / f"{split}.tsv").write_text("sentence\tlabel\n" + body, encoding="utf-8")
    return root


if __name__ == "__main__":
    passages = topic_passages()
    for split, rows in passages.items():
        counts = Counter(label for _, label in rows)
        print(split, len(rows), dict(sorted(counts.items())))
