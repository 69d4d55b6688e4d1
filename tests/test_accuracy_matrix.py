"""bench/accuracy_matrix.py: a tiny matrix trains every cell on the reference trainer and writes
the JSON and table; the generated sentiment task is deterministic, labelled by its rules, and
loads as GLUE TSV."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

# bench/ holds scripts, not a package: its modules import each other as top-level names.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy_matrix  # noqa: E402

TINY = ["--workloads", "default", "--seeds", "0", "--jobs", "1", "--epochs", "2",
        "--set", "model.depth=3", "--set", "model.width=32", "--set", "model.num_heads=2",
        "--set", "data.num_samples=256", "--set", "freeze.warmup_epochs=1"]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_tiny_matrix_writes_every_cell_and_the_table(tmp_path, capsys):
    doc = accuracy_matrix.main([*TINY, "--policies", "none,schedule", "--out", str(tmp_path)])

    # The JSON on disk is the document main returns, one cell per policy x seed.
    saved = json.loads((tmp_path / "accuracy_matrix.json").read_text())
    assert saved == doc
    assert set(doc["versions"]) == {"torch", "timm", "transformers"}
    cells = {(c["workload"], c["policy"], c["seed"]): c for c in doc["cells"]}
    assert list(cells) == [("default", "none", 0), ("default", "schedule", 0)]
    for cell in cells.values():
        assert "error" not in cell
        assert len(cell["metrics"]) == len(cell["num_frozen"]) == 2
        assert all(0.0 <= m <= 1.0 for m in cell["metrics"])
        assert cell["final_metric"] == cell["metrics"][-1]
        assert cell["num_layers"] == 3 and cell["seconds"] > 0
        assert "freeze.policy=" + cell["policy"] in cell["overrides"]

    none, schedule = cells["default", "none", 0], cells["default", "schedule", 0]
    assert none["num_frozen"] == [0, 0] and none["bound"] == 1.0
    frozen = schedule["num_frozen"]
    assert frozen == sorted(frozen) and frozen[0] == 0 and frozen[-1] > 0
    # The bound of this timeline: per epoch, 3 units per active block and 1 per frozen one.
    run = sum(3 * (3 - n) + n for n in frozen)
    assert schedule["bound"] == pytest.approx(9 * len(frozen) / run) and schedule["bound"] > 1

    table = (tmp_path / "accuracy_matrix.md").read_text()
    rows = [r for r in table.splitlines() if r.startswith("| default |")]
    assert [r.split("|")[2].strip() for r in rows] == ["none", "schedule"]
    assert f"{100 * none['final_metric']:.2f}" in rows[0]
    delta = 100 * (schedule["final_metric"] - none["final_metric"])
    assert f"{delta:+.2f}" in rows[1]
    assert "- default: schedule " in table
    out = capsys.readouterr().out
    assert "[2/2] default" in out and table in out

    # The table is rebuilt from the saved JSON alone.
    again = tmp_path / "again"
    accuracy_matrix.main(["--resummarise", str(tmp_path / "accuracy_matrix.json"),
                          "--out", str(again)])
    assert (again / "accuracy_matrix.md").read_text() == table


@pytest.mark.unit
def test_an_unknown_policy_fails_before_any_cell_trains(tmp_path):
    with pytest.raises(SystemExit, match="freeze.policy"):
        accuracy_matrix.main([*TINY, "--policies", "none,bogus", "--out", str(tmp_path)])
    assert not (tmp_path / "accuracy_matrix.json").exists()
    with pytest.raises(SystemExit):
        accuracy_matrix.main(["--workloads", "nope", "--out", str(tmp_path)])


@pytest.mark.unit
def test_vit_tiny_workload_is_the_shipped_benchmark_config_and_runs_only_when_named():
    from pt_ray.api import default_config_path
    from pt_ray.core.config import load_config

    bench = Path(accuracy_matrix.__file__).parent
    shipped = load_config(bench / "vit_tiny_digits32.yaml").model_dump(mode="json")
    workload = load_config(default_config_path(),
                           list(accuracy_matrix.WORKLOADS["vit-tiny"].overrides))
    ours = workload.model_dump(mode="json")
    assert shipped.pop("name") == "vit-tiny-digits32" and ours.pop("name") == "default"
    assert ours == shipped
    assert "vit-tiny" not in accuracy_matrix.parse_args([]).workloads
    assert accuracy_matrix.parse_args(["--workloads", "vit-tiny"]).workloads == ["vit-tiny"]


_FLIPPING = ("it is not true that ", "i doubt that ", "nobody would say ", "i would not say that ")
_KEEPING = ("i think ", "everyone agrees that ", "it is true that ", "i am sure ")


def _oracle(sentence: str) -> int:
    """The task's rules, read back from the words: a clause is positive when its adjective is
    positive and it has no negator; ``but``/``although`` keep the last clause; a doubting or
    denying frame flips it."""
    flip = 0
    for frame in (*_FLIPPING, *_KEEPING):
        if sentence.startswith(frame):
            flip = int(frame in _FLIPPING)
            sentence = sentence.removeprefix(frame)
            break
    clause = sentence.split(" but ")[-1].split(", ")[-1]
    words = clause.split()
    negated = any(n in f" {clause} " for n in (" not ", " never ", " hardly ", " far from ",
                                               " by no means "))
    positive = words[-1] in accuracy_matrix._POSITIVE
    assert positive or words[-1] in accuracy_matrix._NEGATIVE, sentence
    return int(positive != negated) ^ flip


@pytest.mark.unit
def test_sentiment_labels_follow_the_rules_and_both_occur():
    rng = random.Random(7)
    examples = [accuracy_matrix.sentiment_example(rng) for _ in range(2000)]
    assert all(label == _oracle(text) for text, label in examples)
    labels = [label for _, label in examples]
    assert 0.4 < sum(labels) / len(labels) < 0.6
    for marker in (" but ", "although ", *_FLIPPING, *_KEEPING):
        assert any(marker in t for t, _ in examples), marker


@pytest.mark.unit
def test_sentiment_tsv_is_deterministic_and_in_glue_layout(tmp_path):
    a = accuracy_matrix.write_sentiment_tsv(tmp_path / "a", train=64, dev=32, seed=3)
    b = accuracy_matrix.write_sentiment_tsv(tmp_path / "b", train=64, dev=32, seed=3)
    c = accuracy_matrix.write_sentiment_tsv(tmp_path / "c", train=64, dev=32, seed=4)
    for name in ("train.tsv", "dev.tsv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
    train = (a / "train.tsv").read_text().splitlines()
    dev = (a / "dev.tsv").read_text().splitlines()
    assert train[0] == dev[0] == "sentence\tlabel"
    assert len(train) == 65 and len(dev) == 33
    for rows in (train[1:], dev[1:]):
        assert {r.split("\t")[1] for r in rows} == {"0", "1"}
        assert all(r.count("\t") == 1 for r in rows)
    assert not set(train[1:]) >= set(dev[1:])  # dev is not a copy of train

    tokenizer = accuracy_matrix.minilm_dir()
    if tokenizer is None:
        pytest.skip(f"{accuracy_matrix.MINILM_PACKAGE} (the MiniLM tokenizer) is not installed")
    from pt_ray.data.text import load_glue_tsv, load_tokenizer

    splits = load_glue_tsv(a, tokenizer, seq_len=24)
    assert (len(splits.train), len(splits.eval), splits.num_classes) == (64, 32, 2)
    assert set(splits.train.target.tolist()) == {0, 1}
    # The minilm workload's own files fit its seq_len: no sentence is cut before its [SEP].
    ovr = dict(o.split("=", 1) for o in accuracy_matrix.WORKLOADS["minilm"].overrides)
    seq_len = int(ovr["data.seq_len"])
    splits = load_glue_tsv(accuracy_matrix.write_sentiment_tsv(tmp_path / "w"), tokenizer,
                           seq_len=seq_len)
    sep = load_tokenizer(tokenizer).sep_token_id
    for split in (splits.train, splits.eval):
        ids, mask, _ = split.inputs
        lengths = mask.sum(1)
        assert int(lengths.max()) <= seq_len
        assert bool((ids.gather(1, (lengths - 1)[:, None]) == sep).all())
