"""Tables as datasets (``text_table``, ``qa_table``, ``image_table``): the same rows given as
Parquet, JSON Lines, CSV or a ``datasets.save_to_disk`` folder give the same samples as today's
formats (GLUE TSV, SQuAD JSON, an image folder), a run trains to the same parameters, and wrong
columns, splits or files end in one line naming the field and the fix."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from local_models import TOKENIZER, needs_tokenizer
from pt_ray.api import fit
from pt_ray.core.config import ConfigError, DataConfig
from pt_ray.data.registry import build_dataset

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PAIRS = {
    "train": [("a cat sat", "on a mat", 1), ("dogs bark", "cats purr", 0),
              ("the sun is hot", "ice is cold", 0), ("birds fly", "birds can fly", 1),
              ("rain falls", "water drops", 1), ("a red car", "a blue sky", 0)],
    "validation": [("fish swim", "fish are in water", 1), ("snow", "desert sand", 0)],
}


def write_glue(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.tsv"), ("validation", "dev.tsv")):
        lines = ["sentence1\tsentence2\tlabel"] + [f"{a}\t{b}\t{y}" for a, b, y in PAIRS[split]]
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def pair_table(split: str) -> pa.Table:
    rows = PAIRS[split]
    return pa.table({"sentence1": [r[0] for r in rows], "sentence2": [r[1] for r in rows],
                     "label": [r[2] for r in rows]})


def write_tables(root: Path, fmt: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split in PAIRS:
        table = pair_table(split)
        if fmt == "parquet":
            pq.write_table(table, root / f"{split}.parquet")
        elif fmt == "jsonl":
            (root / f"{split}.jsonl").write_text("".join(
                json.dumps(row) + "\n" for row in table.to_pylist()))
        elif fmt == "csv":
            pcsv.write_csv(table, root / f"{split}.csv")
        elif fmt == "save_to_disk":
            import datasets

            datasets.Dataset(table).save_to_disk(str(root / split))
    return root


def same_samples(a, b) -> None:
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs))
    assert torch.equal(a.target, b.target)


@needs_tokenizer
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "save_to_disk"])
def test_text_table_gives_the_samples_glue_tsv_gives(tmp_path, fmt):
    glue = build_dataset(DataConfig(name="glue_tsv", path=write_glue(tmp_path / "glue"),
                                    seq_len=16, tokenizer=TOKENIZER))
    table = build_dataset(DataConfig(name="text_table", path=write_tables(tmp_path / fmt, fmt),
                                     seq_len=16, tokenizer=TOKENIZER))
    assert (table.task, table.num_classes, table.vocab_size) == (glue.task, 2, glue.vocab_size)
    same_samples(table.train, glue.train)
    same_samples(table.eval, glue.eval)


BERT = {"family": "hf", "name": "bert", "depth": 2, "width": 32, "num_heads": 2,
        "mlp_ratio": 2.0}


def trained(tmp_path, name: str, model: dict, data: dict):
    """A 2-epoch reference run (one process) of ``model`` on ``data``."""
    return fit({"name": name, "engine": "reference", "epochs": 2, "model": model, "data": data,
                "logging": {"report": False}, "output_dir": str(tmp_path / "runs")})


def same_run(a, b) -> None:
    """Two runs that trained identically: losses, final metric and every parameter."""
    assert [r.train_loss for r in a.timeline] == [r.train_loss for r in b.timeline]
    assert a.final_eval_metric == b.final_eval_metric
    pa_, pb = a.load_model().state_dict(), b.load_model().state_dict()
    assert pa_.keys() == pb.keys() and all(torch.equal(pa_[k], pb[k]) for k in pa_)


@needs_tokenizer
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "save_to_disk"])
def test_a_run_on_each_table_format_ends_where_the_same_rows_as_tsv_end(tmp_path, fmt):
    data = {"seq_len": 16, "tokenizer": str(TOKENIZER), "batch_size": 2}
    tsv = trained(tmp_path, "tsv", BERT, {"name": "glue_tsv",
                                          "path": str(write_glue(tmp_path / "glue")), **data})
    table = trained(tmp_path, fmt, BERT, {"name": "text_table",
                                          "path": str(write_tables(tmp_path / fmt, fmt)), **data})
    same_run(table, tsv)


@needs_tokenizer
def test_named_labels_from_label_names_or_a_class_label(tmp_path):
    import datasets

    names = ["negative", "positive"]
    root = tmp_path / "named"
    root.mkdir()
    for split in PAIRS:
        rows = PAIRS[split]
        pq.write_table(pa.table({"text": [r[0] for r in rows],
                                 "y": [names[r[2]] for r in rows]}), root / f"{split}.parquet")
    cfg = DataConfig(name="text_table", path=root, seq_len=16, tokenizer=TOKENIZER,
                     columns={"text": "text", "label": "y"}, label_names=["positive", "negative"])
    got = build_dataset(cfg)
    # label_names gives the ids: "positive" is 0 here.
    assert got.train.target.tolist() == [1 - r[2] for r in PAIRS["train"]]
    # A save_to_disk folder's ClassLabel names the ids it stores.
    disk = tmp_path / "disk"
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["no", "yes", "maybe"])})
    for split in PAIRS:
        datasets.Dataset.from_dict({"sentence": [r[0] for r in PAIRS[split]],
                                    "label": [r[2] for r in PAIRS[split]]},
                                   features=features).save_to_disk(str(disk / split))
    got = build_dataset(DataConfig(name="text_table", path=disk, seq_len=16, tokenizer=TOKENIZER))
    assert got.num_classes == 3 and got.train.target.tolist() == [r[2] for r in PAIRS["train"]]


@needs_tokenizer
def test_qa_table_gives_the_samples_squad_json_gives(tmp_path):
    context = "The cat sat on the mat. It was warm and the sun was out."
    qas = [("Where did the cat sit?", "on the mat", context.index("on the mat")),
           ("What was out?", "the sun", context.index("the sun"))]
    squad = tmp_path / "squad"
    squad.mkdir()
    for name in ("train.json", "dev.json"):
        (squad / name).write_text(json.dumps({"data": [{"paragraphs": [{"context": context, "qas": [
            {"question": q, "answers": [{"text": t, "answer_start": s}]} for q, t, s in qas]}]}]}))
    table = tmp_path / "qa"
    table.mkdir()
    rows = pa.table({"question": [q for q, _, _ in qas], "context": [context] * 2,
                     "answers": [{"text": [t], "answer_start": [s]} for _, t, s in qas]})
    for split in ("train", "validation"):
        pq.write_table(rows, table / f"{split}.parquet")
    a = build_dataset(DataConfig(name="squad_json", path=squad, seq_len=32, tokenizer=TOKENIZER))
    b = build_dataset(DataConfig(name="qa_table", path=table, seq_len=32, tokenizer=TOKENIZER))
    assert b.task == "question_answering"
    same_samples(b.train, a.train)
    same_samples(b.eval, a.eval)
    assert b.train.target[0].tolist() != [0, 0]  # the answer is inside the window
    data = {"seq_len": 32, "tokenizer": str(TOKENIZER), "batch_size": 2}
    same_run(trained(tmp_path, "qa-table", BERT, {"name": "qa_table", "path": str(table), **data}),
             trained(tmp_path, "squad", BERT, {"name": "squad_json", "path": str(squad), **data}))


def png(colour: tuple[int, int, int], size=(10, 12)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def test_image_table_gives_the_batches_an_image_folder_gives(tmp_path):
    colours = {"cat": [(250, 0, 0), (200, 10, 0)], "dog": [(0, 0, 250), (0, 20, 200)]}
    folder, table, listed = tmp_path / "folder", tmp_path / "table", tmp_path / "listed"
    table.mkdir()
    listed.mkdir()
    rows = {"train": [], "validation": []}
    for split, sub in (("train", "train"), ("validation", "val")):
        for label, (cls, shades) in enumerate(colours.items()):
            (folder / sub / cls).mkdir(parents=True)
            for i, colour in enumerate(shades):
                blob = png(colour)
                (folder / sub / cls / f"{i}.png").write_bytes(blob)
                rows[split].append((blob, f"{sub}/{cls}/{i}.png", label))
    for split, items in rows.items():
        pq.write_table(pa.table({"image": [{"bytes": b, "path": None} for b, _, _ in items],
                                 "label": [y for _, _, y in items]}), table / f"{split}.parquet")
        (listed / f"{split}.csv").write_text(
            "path,label\n" + "".join(f"{folder / p},{y}\n" for _, p, y in items))
    ref = build_dataset(DataConfig(name="imagefolder", path=folder, image_size=8))
    for root in (table, listed):
        got = build_dataset(DataConfig(name="image_table", path=root, image_size=8))
        assert (got.num_classes, got.image_size) == (2, 8)
        for part in ("train", "eval"):
            a, b = getattr(ref, part), getattr(got, part)
            idx = list(range(len(a)))
            ba, bb = a.batch(idx), b.batch(idx)
            assert torch.equal(ba.inputs[0], bb.inputs[0]) and torch.equal(ba.target, bb.target)
    vit = {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 16,
           "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4}
    data = {"image_size": 8, "batch_size": 2}
    from_folder = trained(tmp_path, "folder", vit, {"name": "imagefolder", "path": str(folder),
                                                    **data})
    for root in (table, listed):
        same_run(trained(tmp_path, root.name, vit, {"name": "image_table", "path": str(root),
                                                    **data}), from_folder)


def test_a_damaged_image_in_a_table_is_named_by_its_row(tmp_path):
    items = [png((9, 9, 9)), b"\x89PNG broken", png((1, 2, 3))]
    for split in ("train", "validation"):
        pq.write_table(pa.table({"image": items, "label": [0, 1, 0]}),
                       tmp_path / f"{split}.parquet")
    with pytest.raises(ConfigError, match=r"2 of 6 images under .* cannot be read: row 1 .*"
                                          r"row 4 .*set data.skip_damaged=true"):
        build_dataset(DataConfig(name="image_table", path=tmp_path, image_size=8))
    got = build_dataset(DataConfig(name="image_table", path=tmp_path, image_size=8,
                                   skip_damaged=True))
    assert (len(got.train), len(got.eval)) == (2, 2)


@needs_tokenizer
@pytest.mark.parametrize(("change", "expected"), [
    ({"columns": {"text": "body"}}, "has no column 'body' for text; its columns are "
                                    "['sentence1', 'sentence2', 'label']; set data.columns.text"),
    ({"eval_split": "holdout"}, "data.eval_split: no split 'holdout' under"),
    ({"train_split": "everything"}, "data.train_split: no split 'everything' under"),
    ({"label_names": ["x", "y"]}, "has label ids [5] outside 0..1 (the label names)"),
])
def test_wrong_columns_splits_and_labels_end_in_one_line(tmp_path, change, expected):
    root = write_tables(tmp_path / "pq", "parquet")
    pq.write_table(pa.table({"sentence1": ["a"], "sentence2": ["b"], "label": [5]}),
                   root / "validation.parquet")  # a class id the two label names cannot name
    cfg = DataConfig(name="text_table", path=root, seq_len=16, tokenizer=TOKENIZER, **change)
    with pytest.raises(ConfigError) as err:
        build_dataset(cfg)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_unreadable_file_is_named(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "validation.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=r"train\.parquet' cannot be read as parquet \(.*\); "
                                          r"check the file, or write it again"):
        build_dataset(DataConfig(name="text_table", path=tmp_path, tokenizer=TOKENIZER))
