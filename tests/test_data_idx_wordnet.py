"""MNIST-layout IDX files, class subsets and WordNet glosses: exact contents read back from
tiny files the tests write (the Debian packages are not needed), the hashed dev split, and
the errors on missing or damaged files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from datafiles import WORDNET_LICENCE, write_idx, write_mnist_idx, write_wordnet
from local_models import TOKENIZER, needs_tokenizer
from pt_ray.core.config import ConfigError, DataConfig, RunConfig
from pt_ray.data import (
    build_dataset,
    finish_batch,
    gather,
    gather_stored,
    gather_targets,
    keep_classes,
    load_wordnet,
    read_idx,
    synthetic_text,
)
import pt_ray.data.wordnet as wordnet
from pt_ray.data.registry import cap_train
from pt_ray.data.wordnet import LEXNAMES, dev_keys, read_glosses

pytestmark = pytest.mark.unit


def _all(ds):
    return gather(ds, range(len(ds)))


# --- IDX ----------------------------------------------------------------------------------


def test_read_idx_returns_the_array_written_raw_and_gzipped(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ints = np.array([[1, -2], [70000, 3]], dtype=np.int32)
    for name, array in (("a-idx3-ubyte", images), ("a-idx3-ubyte.gz", images),
                        ("b-idx2-int.gz", ints)):
        back = read_idx(write_idx(tmp_path / name, array))
        assert back.dtype == array.dtype and back.shape == array.shape
        assert np.array_equal(back, array)
    # The header is big-endian: 0x00 0x00 0x08 0x03, then 2, 3, 4 as uint32.
    assert (tmp_path / "a-idx3-ubyte").read_bytes()[:16].hex() == (
        "00000803" "00000002" "00000003" "00000004")


def test_mnist_idx_pixels_and_labels_read_back(tmp_path: Path) -> None:
    written = write_mnist_idx(tmp_path)
    s = build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    assert (len(s.train), len(s.eval), s.num_classes, s.image_size, s.in_chans) == (
        12, 6, 4, 6, 1)
    x_train = written["train"][0].astype(np.float64) / 255
    mean, std = x_train.mean(), x_train.std()
    for part in ("train", "eval"):
        images, labels = written[part]
        ds = getattr(s, part)
        stored = gather_stored(ds, range(len(ds)))
        # Kept as stored (uint8, [N, 1, H, W]); finished into the standardised floats.
        assert stored.inputs[0].dtype == torch.uint8
        assert np.array_equal(stored.inputs[0][:, 0].numpy(), images)
        want = torch.from_numpy((images / 255 - mean) / std).float().unsqueeze(1)
        torch.testing.assert_close(finish_batch(ds, stored).inputs[0], want)
        torch.testing.assert_close(_all(ds).inputs[0], want)
        assert _all(ds).target.tolist() == labels.tolist()
        assert gather_targets(ds, [1, 0]).tolist() == labels[[1, 0]].tolist()
    resized = build_dataset(DataConfig(name="mnist_idx", path=tmp_path, image_size=4))
    assert resized.image_size == 4 and _all(resized.eval).inputs[0].shape == (6, 1, 4, 4)


def test_a_missing_idx_file_names_it_the_folder_and_the_package(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError) as err:
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"data.path={tmp_path} has no t10k-labels-idx1-ubyte(.gz); ")
    assert message.endswith("Fashion-MNIST ships in the Debian package dataset-fashion-mnist "
                            "(/usr/share/datasets/fashion-mnist)")
    with pytest.raises(ConfigError, match=r"has no train-images-idx3-ubyte\(\.gz\)"):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path / "nowhere"))


def test_damaged_idx_files_are_named(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path)
    bad = tmp_path / "t10k-images-idx3-ubyte"
    bad.write_bytes(b"PK\x03\x04 a zip, not IDX")
    with pytest.raises(ConfigError, match=r"'.*t10k-images-idx3-ubyte' is not an IDX file "
                                          r"\(its first bytes are 504b0304"):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    write_idx(bad, np.zeros((6, 6, 6), np.uint8))
    bad.write_bytes(bad.read_bytes()[:-5])
    with pytest.raises(ConfigError, match=r"holds 211 bytes of data, but its header "
                                          r"\(6 x 6 x 6 uint8\) says 216"):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    cut = tmp_path / "train-labels-idx1-ubyte.gz"
    cut.write_bytes(cut.read_bytes()[:-12])  # a download cut short
    with pytest.raises(ConfigError, match=r"'.*train-labels-idx1-ubyte\.gz' cannot be read \("):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    write_mnist_idx(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((5, 6, 6), np.uint8))
    with pytest.raises(ConfigError, match=r"shape \(6,\) for 5 images"):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path))


# --- class subsets ------------------------------------------------------------------------


def test_classes_keep_those_labels_renumbered_in_the_order_given(tmp_path: Path) -> None:
    written = write_mnist_idx(tmp_path)
    full = build_dataset(DataConfig(name="mnist_idx", path=tmp_path))
    s = build_dataset(DataConfig(name="mnist_idx", path=tmp_path, classes=[3, 1]))
    assert s.num_classes == 2
    for part in ("train", "eval"):
        labels = written[part][1]
        rows = [i for i, y in enumerate(labels) if y in (3, 1)]  # the original order
        ds, base = getattr(s, part), getattr(full, part)
        b = _all(ds)
        assert b.target.tolist() == [{3: 0, 1: 1}[int(labels[i])] for i in rows]
        torch.testing.assert_close(b.indices, torch.arange(len(rows)))
        torch.testing.assert_close(b.inputs[0], gather(base, rows).inputs[0])
        # The loader's path (stored, then finished) and labels alone say the same.
        stored = gather_stored(ds, [1, 0])
        assert stored.target.tolist() == b.target[[1, 0]].tolist()
        torch.testing.assert_close(finish_batch(ds, stored).inputs[0], b.inputs[0][[1, 0]])
        assert gather_targets(ds, [1, 0]).tolist() == b.target[[1, 0]].tolist()
        assert ds[0][2].item() == b.target[0].item()
    # data.num_samples caps what the classes leave (train: 6 of 12).
    capped = build_dataset(DataConfig(name="mnist_idx", path=tmp_path, classes=[3, 1],
                                      num_samples=4))
    assert len(capped.train) == 4 and len(capped.eval) == len(s.eval)
    assert set(_all(capped.train).target.tolist()) <= {0, 1}


def test_bad_classes_name_the_field_and_the_fix(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.classes=\[1, 4\] holds \[4\], but mnist_idx "
                                          r"has 4 classes \(0\.\.3\); choose labels in 0\.\.3$"):
        build_dataset(DataConfig(name="mnist_idx", path=tmp_path, classes=[1, 4]))
    for bad, rule in (([2, 2, 3], r"data\.classes=\[2, 2, 3\] names \[2\] more than once"),
                      ([1], r"at least 2 items"),
                      ([-1, 2], r"data\.classes=\[-1, 2\] holds \[-1\]; labels are class ids")):
        with pytest.raises(pydantic.ValidationError, match=rule):
            DataConfig(name="mnist_idx", path=tmp_path, classes=bad)
    qa = synthetic_text(8, 4, seq_len=40, task="question_answering")
    with pytest.raises(ConfigError, match=r"synthetic_text is question_answering; remove "
                                          r"data\.classes"):
        keep_classes(qa, [0, 1])


# --- WordNet --------------------------------------------------------------------------------

_NOUNS = [(1740, 3, 'that which is perceived; "an entity"'), (5930, 5, "a small animal"),
          (6024, 18, "a person who depends on others"), (6150, 5, "an animal's parent"),
          (6269, 3, "living things collectively; \"the oceans are teeming with life\""),
          (7347, 18, "a scholar")]
_VERBS = [(1740, 29, "breathe in"), (2325, 38, "move fast")]


def _rank(pos: str, offset: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{pos}:{offset}".encode()).digest()[:8], "big")


def test_wordnet_glosses_read_back_with_their_lexicographer_files(tmp_path: Path) -> None:
    write_wordnet(tmp_path, {"noun": _NOUNS, "verb": _VERBS})
    glosses = read_glosses(tmp_path, ["noun", "verb"])
    assert [(g.pos, g.offset, g.lex_file, g.text) for g in glosses] == [
        *(("n", o, lex, text) for o, lex, text in _NOUNS),
        *(("v", o, lex, text) for o, lex, text in _VERBS)]
    assert (LEXNAMES[3], LEXNAMES[28], LEXNAMES[29], LEXNAMES[43]) == (
        "noun.Tops", "noun.time", "verb.body", "verb.weather")
    assert len(LEXNAMES) == 45
    # The dev split is the smallest hashes of (pos, offset): noun 1740 and verb 1740 differ.
    ranked = sorted([("n", o) for o, _, _ in _NOUNS] + [("v", o) for o, _, _ in _VERBS],
                    key=lambda k: _rank(*k))
    assert dev_keys(glosses, 3) == set(ranked[:3])


@needs_tokenizer
def test_wordnet_splits_hold_the_hashed_dev_pick_and_renumbered_files(tmp_path: Path) -> None:
    write_wordnet(tmp_path, {"noun": _NOUNS, "verb": _VERBS})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    s = load_wordnet(tmp_path, TOKENIZER, seq_len=24, parts_of_speech=["noun", "verb"],
                     dev_size=3)
    assert (s.name, s.task, s.num_classes, s.seq_len) == ("wordnet", "classification", 5, 24)
    rows = [("n", o, lex, t) for o, lex, t in _NOUNS] + [("v", o, lex, t) for o, lex, t in _VERBS]
    dev = set(sorted((r[:2] for r in rows), key=lambda k: _rank(*k))[:3])
    label = {3: 0, 5: 1, 18: 2, 29: 3, 38: 4}  # lexicographer files present, in file order
    for ds, want in ((s.train, [r for r in rows if r[:2] not in dev]),
                     (s.eval, [r for r in rows if r[:2] in dev])):
        b = _all(ds)
        assert b.target.tolist() == [label[r[2]] for r in want]
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in b.inputs[0]]
        assert texts == [tok.decode(tok(r[3])["input_ids"], skip_special_tokens=True)
                         for r in want]
    nouns = load_wordnet(tmp_path, TOKENIZER, seq_len=24, dev_size=2)
    assert nouns.num_classes == 3 and len(nouns.train) + len(nouns.eval) == 6


@needs_tokenizer
def test_wordnet_dev_is_the_same_2000_for_every_seed(tmp_path: Path) -> None:
    nouns = [(1000 + 37 * i, 3 + i % 26, f"gloss number {i}") for i in range(2100)]
    write_wordnet(tmp_path, {"noun": nouns})
    cfg = DataConfig(name="wordnet", path=tmp_path, tokenizer=TOKENIZER, seq_len=8,
                     num_samples=40)
    runs = [build_dataset(cfg, seed=seed) for seed in (0, 1)]
    want = sorted(range(2100), key=lambda i: _rank("n", nouns[i][0]))[:2000]
    want_labels = [nouns[i][1] - 3 for i in sorted(want)]
    for s in runs:
        assert (len(s.train), len(s.eval), s.num_classes) == (40, 2000, 26)
        assert _all(s.eval).target.tolist() == want_labels
    assert torch.equal(_all(runs[0].eval).inputs[0], _all(runs[1].eval).inputs[0])
    # num_samples caps the training split by seed; the dev split never moves.
    assert not torch.equal(_all(runs[0].train).inputs[0], _all(runs[1].train).inputs[0])


@needs_tokenizer
def test_wordnet_caps_the_training_glosses_before_tokenising_them(tmp_path: Path,
                                                                  monkeypatch) -> None:
    # The rows and their order are those of capping the whole split afterwards (the
    # registry's cap_train), but only the kept glosses and the dev split are tokenised.
    nouns = [(1000 + 37 * i, 3 + i % 5, f"gloss {i} of noun {i * 7 % 13}") for i in range(300)]
    write_wordnet(tmp_path, {"noun": nouns})
    tokenised: list[int] = []
    encode = wordnet.classification_dataset
    monkeypatch.setattr(wordnet, "classification_dataset", lambda tok, texts, *a: (
        tokenised.append(len(texts)) or encode(tok, texts, *a)))
    full = load_wordnet(tmp_path, TOKENIZER, seq_len=12, dev_size=20)
    assert tokenised == [280, 20]
    tokenised.clear()
    capped = load_wordnet(tmp_path, TOKENIZER, seq_len=12, dev_size=20, num_samples=50, seed=3)
    assert tokenised == [50, 20]
    want = cap_train(full, 50, 3)
    _assert_same_samples(capped, want)
    # Through the registry (its dev split is 2,000): the rows of capping afterwards, its own
    # cap keeping them all. With data.classes the registry caps what the classes leave, so
    # every training gloss is tokenised.
    more = [(90000 + 37 * i, 7, f"more {i}") for i in range(2000)]
    write_wordnet(tmp_path, {"noun": nouns + more})
    cfg = DataConfig(name="wordnet", path=tmp_path, tokenizer=TOKENIZER, seq_len=12,
                     num_samples=40)
    tokenised.clear()
    built = build_dataset(cfg, seed=1)
    assert tokenised == [40, 2000]
    _assert_same_samples(built, cap_train(load_wordnet(tmp_path, TOKENIZER, seq_len=12), 40, 1))
    tokenised.clear()
    build_dataset(cfg.model_copy(update={"classes": [0, 1]}), seed=1)
    assert tokenised == [300, 2000]


def _assert_same_samples(got, want) -> None:
    for a_split, b_split in ((got.train, want.train), (got.eval, want.eval)):
        a, b = _all(a_split), _all(b_split)
        assert len(a_split) == len(b_split)
        assert all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs, strict=True))
        assert torch.equal(a.target, b.target)


def test_wordnet_missing_or_damaged_files_name_the_package(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build_dataset(DataConfig(name="wordnet", path=tmp_path), tokenizer_dir=tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"data.path={tmp_path} has no data.noun")
    assert "Debian package wordnet-base (/usr/share/wordnet)" in message
    write_wordnet(tmp_path, {"noun": _NOUNS})
    with pytest.raises(ConfigError, match=r"has no data\.verb \(data\.parts_of_speech includes "
                                          r"verb\).*wordnet-base"):
        read_glosses(tmp_path, ["noun", "verb"])
    with pytest.raises(ConfigError, match=r"holds 6 synsets in noun; the dev split alone takes "
                                          r"2000.*wordnet-base"):
        build_dataset(DataConfig(name="wordnet", path=tmp_path), tokenizer_dir=tmp_path)
    (tmp_path / "data.noun").write_text(WORDNET_LICENCE + "not a synset line\n")
    with pytest.raises(ConfigError, match=r"data\.noun:3 is not a WordNet 3\.0 synset line"):
        read_glosses(tmp_path, ["noun"])


def test_wordnet_is_text_and_reads_files() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"data\.name=wordnet is text"):
        RunConfig(data={"name": "wordnet", "path": "/x"})
    with pytest.raises(pydantic.ValidationError, match=r"data\.name=wordnet reads local files"):
        RunConfig(model={"family": "hf", "name": "bert"}, data={"name": "wordnet"})
    with pytest.raises(pydantic.ValidationError, match=r"names \['verb'\] more than once"):
        DataConfig(name="wordnet", parts_of_speech=["verb", "noun", "verb"])
