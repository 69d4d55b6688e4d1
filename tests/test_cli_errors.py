"""``pt-ray train`` on input it cannot use: exit status 2 and one line, ``pt-ray: error: ...``,
naming the field or file and the fix; no traceback, no Ray cluster, no run folder."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from local_models import TOKENIZER, needs_tokenizer
from pt_ray.cli import main

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]



VIT = {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
       "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4}
BERT = {"family": "hf", "name": "bert", "depth": 2, "width": 32, "num_heads": 2,
        "mlp_ratio": 2.0}


@pytest.fixture(autouse=True)
def nothing_may_start(monkeypatch):
    """A run that got past the checks would start Ray or the reference trainer: fail instead.
    (Another test module may have left a cluster up, so ``ray.init`` itself is the tripwire.)"""
    import ray

    from pt_ray.runtime import reference
    from pt_ray.service import trainer

    def started(*args, **kwargs):
        raise AssertionError("a run started: the error was not caught before it")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(trainer, "run_on_ray", started)
    monkeypatch.setattr(reference, "ReferenceTrainer", started)


def config_file(tmp_path: Path, model: dict | None = None, **fields) -> str:
    """A YAML config: a tiny model (ViT unless ``model``) and ``fields`` on top."""
    data = {"name": "bad", "model": model or VIT, "data": {"name": "digits"},
            "output_dir": str(tmp_path / "runs"), **fields}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def fails(capsys, tmp_path: Path, args: list[str], *expected: str):
    """Run ``pt-ray train args`` and check the one-line error; returns what it printed."""
    out = Path(args[args.index("--output") + 1]) if "--output" in args else tmp_path / "out"
    code = main(["train", *args, "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("pt-ray: error: ") and captured.err.count("\n") == 1, (
        captured.err)
    assert "Traceback" not in captured.err + captured.out
    for text in expected:
        assert text in captured.err, (text, captured.err)
    # Nothing was written: no run folder (a file given as --output is left alone).
    assert not (out.exists() and out.is_dir()) and not (tmp_path / "runs").exists()
    return captured


# -- the config ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_bad_value_and_bad_yaml(tmp_path, capsys):
    fails(capsys, tmp_path, ["--set", "freeze.alpha=1.5"], "freeze.alpha=1.5",
          "less than or equal to 1")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n  depth: 2\n")  # YAML's own message spans lines
    fails(capsys, tmp_path, ["--config", str(broken)], str(broken), "is not valid YAML")


# -- the dataset --------------------------------------------------------------------------------


@pytest.mark.unit
def test_dataset_path_unset_or_missing(tmp_path, capsys):
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, data={"name": "cifar10"})],
          "data.name=cifar10", "set data.path")
    nowhere = tmp_path / "nowhere"
    fails(capsys, tmp_path,
          ["--config", config_file(tmp_path, data={"name": "cifar10", "path": str(nowhere)})],
          str(nowhere / "cifar-10-batches-py" / "data_batch_1"), "set data.path to the folder")
    fails(capsys, tmp_path,
          ["--config", config_file(tmp_path, data={"name": "imagefolder", "path": str(nowhere)})],
          str(nowhere / "train"), "set data.path to a folder laid out as")


@pytest.mark.unit
def test_damaged_image_in_an_image_folder(tmp_path, capsys):
    from PIL import Image

    images = tmp_path / "images"
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (images / split / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8), (9, 9, 9)).save(images / split / cls / "0.png")
    broken = images / "train" / "b" / "1.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    fails(capsys, tmp_path,
          ["--config", config_file(tmp_path, data={"name": "imagefolder", "path": str(images)})],
          f"1 of 5 images under {str(images)!r} cannot be read: {str(broken)!r}",
          "set data.skip_damaged=true")


@pytest.mark.unit
def test_cifar_batch_that_is_not_a_pickle_or_not_a_batch(tmp_path, capsys):
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(b"not a pickle")
    args = ["--config", config_file(tmp_path, data={"name": "cifar10",
                                                     "path": str(tmp_path / "cifar")})]
    fails(capsys, tmp_path, args, str(folder / "data_batch_1"),
          "cannot be read as a CIFAR python batch", "set data.path")
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps([1, 2, 3]))
    fails(capsys, tmp_path, args, "holds a pickled list", "set data.path")


@pytest.mark.unit
@needs_tokenizer
def test_glue_and_squad_files_that_cannot_be_read(tmp_path, capsys):
    glue = tmp_path / "glue"
    glue.mkdir()
    (glue / "train.tsv").write_bytes(b"sentence\tlabel\n\xff\xfe bad bytes\t1\n")
    (glue / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    text = {"name": "glue_tsv", "path": str(glue), "tokenizer": str(TOKENIZER), "seq_len": 16}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, BERT, data=text)],
          str(glue / "train.tsv"), "save it as UTF-8 TSV")
    (glue / "train.tsv").write_text("text\tscore\nhi\t1\n")
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, BERT, data=text)],
          "'text', 'score'", "expected a header with a 'label' column")
    squad = tmp_path / "squad"
    squad.mkdir()
    (squad / "train.json").write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    (squad / "dev.json").write_text("{}")
    qa = {**text, "name": "squad_json", "path": str(squad)}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, BERT, data=qa)],
          str(squad / "train.json"), "missing field 'context'", 'expected {"data"')


# -- the model ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_models_timm_does_not_know_or_cannot_build(tmp_path, capsys):
    typo = {**VIT, "name": "vit_tinny_patch16_224"}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, typo)],
          "model.name='vit_tinny_patch16_224' is not a timm model",
          "close names: vit_tiny_patch16_224")
    # width 30 with vit_base's 12 heads: timm asserts; the user gets the field to change.
    no_heads = {**VIT, "width": 30, "num_heads": None}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, no_heads)],
          "embed_dim=30", "set model.num_heads to a divisor of the width")
    hf = {**BERT, "width": 30, "num_heads": None, "mlp_ratio": None}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, hf, data={
        "name": "synthetic_text", "seq_len": 16})],
        "hidden_size=30", "set model.num_heads to a divisor of the width")
    resnet = {"family": "timm", "name": "resnet10t"}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, resnet)],
          "'resnet10t'", "use a vit_* or deit_* model")


# -- weights files ------------------------------------------------------------------------------


@pytest.mark.unit
def test_timm_weights_missing_not_a_state_dict_or_corrupt(tmp_path, capsys):
    def with_weights(path: Path) -> list[str]:
        return ["--config", config_file(tmp_path, {**VIT, "weights": str(path)})]

    fails(capsys, tmp_path, with_weights(tmp_path / "absent.pt"),
          f"model.weights='{tmp_path / 'absent.pt'}' is not a file", "give a timm state-dict")
    torch.save([1, 2], tmp_path / "list.pt")
    fails(capsys, tmp_path, with_weights(tmp_path / "list.pt"),
          "does not hold a state dict", "torch.save(model.state_dict(), path)")
    for name, content in (("garbage.pt", b"garbage"), ("text.pth", b"hello world"),
                          ("empty.bin", b""), ("garbage.safetensors", b"garbage"),
                          ("objects.pt", pickle.dumps({"a": object}))):
        (tmp_path / name).write_bytes(content)
        fails(capsys, tmp_path, with_weights(tmp_path / name),
              f"model.weights='{tmp_path / name}' cannot be read", "save one with torch.save")


@pytest.mark.unit
def test_hf_weights_without_config_or_with_broken_files(tmp_path, capsys):
    from transformers import BertConfig

    bare = {**BERT, "depth": None, "width": None, "num_heads": None, "mlp_ratio": None}
    data = {"name": "synthetic_text", "seq_len": 16}

    def with_weights(path: Path) -> list[str]:
        return ["--config", config_file(tmp_path, {**bare, "weights": str(path)}, data=data)]

    empty = tmp_path / "empty"
    empty.mkdir()
    fails(capsys, tmp_path, with_weights(empty), f"model.weights='{empty}'",
          "must hold config.json", "save_pretrained")
    (empty / "config.json").write_text("{not json")
    fails(capsys, tmp_path, with_weights(empty), "config.json cannot be read",
          "a directory written by save_pretrained")
    ckpt = tmp_path / "ckpt"
    BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64).save_pretrained(ckpt)
    fails(capsys, tmp_path, with_weights(ckpt), f"model.weights='{ckpt}'",
          "the weights cannot be loaded", "model.safetensors or pytorch_model.bin")
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    fails(capsys, tmp_path, with_weights(ckpt), "the weights cannot be loaded")


# -- the output folder --------------------------------------------------------------------------


@pytest.mark.unit
def test_output_folder_that_cannot_be_created(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    printed = fails(capsys, tmp_path, ["--output", str(a_file / "run")],
                f"output folder '{a_file / 'run'}' cannot be created: '{a_file}' is a file",
                "choose another --output")
    assert a_file.read_text() == "x"
    fails(capsys, tmp_path, ["--output", str(a_file)], "is a file, not a folder",
          "choose another --output")
    assert "data digits" not in printed.out  # refused before the dataset was built


@pytest.mark.unit
def test_output_folder_in_a_read_only_folder(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anyway: answer as the kernel would for others
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    fails(capsys, tmp_path, ["--output", str(locked / "run")], f"'{locked}' is not writable",
          "choose another --output")


@pytest.mark.unit
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_output_folder_the_system_refuses(tmp_path, capsys):
    # /proc passes every permission check as root, yet refuses new folders: only trying tells.
    fails(capsys, tmp_path, ["--output", "/proc/forbidden/run"],
          "output folder '/proc/forbidden/run' cannot be created: No such file or directory "
          "('/proc/forbidden')", "choose another --output")
    assert not Path("/proc/forbidden").exists()


@pytest.mark.unit
def test_the_output_check_leaves_nothing_behind(tmp_path):
    from pt_ray.api import check_output_dir

    check_output_dir(tmp_path / "a" / "b" / "run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run").mkdir()
    check_output_dir(tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


# -- the tokenizer ------------------------------------------------------------------------------


@pytest.fixture
def glue(tmp_path) -> Path:
    root = tmp_path / "glue"
    root.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (root / name).write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    return root


@pytest.mark.unit
def test_text_data_without_a_tokenizer(tmp_path, capsys, glue):
    data = {"name": "glue_tsv", "path": str(glue), "seq_len": 16}
    fails(capsys, tmp_path, ["--config", config_file(tmp_path, BERT, data=data)],
          "text datasets need a local tokenizer", "set data.tokenizer (or model.weights)")
    missing = tmp_path / "no-such-tokenizer"
    fails(capsys, tmp_path, ["--config", config_file(
        tmp_path, BERT, data={**data, "tokenizer": str(missing)})],
        f"tokenizer directory '{missing}' not found", "set data.tokenizer")
    empty = tmp_path / "empty-tokenizer"
    empty.mkdir()
    fails(capsys, tmp_path, ["--config", config_file(
        tmp_path, BERT, data={**data, "tokenizer": str(empty)})],
        f"tokenizer directory '{empty}' holds no tokenizer that loads",
        "set data.tokenizer (or model.weights) to a directory with tokenizer.json")


# -- the other entry points ---------------------------------------------------------------------


@pytest.mark.unit
def test_ray_job_entry_reports_the_same_line(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("jobs_train", REPO / "jobs" / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    monkeypatch.setenv("PT_RAY_OUTPUT", str(tmp_path / "runs"))

    nowhere = tmp_path / "nowhere"
    assert entry.main(["--set", "data.name=imagefolder", "--set", f"data.path={nowhere}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pt-ray: error: image folder ")
    assert "set data.path" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.proc
def test_console_script_prints_no_traceback(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    weights = tmp_path / "absent.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "pt_ray.cli", "train", "--set", f"model.weights={weights}",
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=110, cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr == (f"pt-ray: error: model.weights='{weights}' is not a file; give a "
                           "timm state-dict file (.pt, .pth, .bin or .safetensors)\n")
    assert "Traceback" not in proc.stdout
    assert not (tmp_path / "out").exists()
