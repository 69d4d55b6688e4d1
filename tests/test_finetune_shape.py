"""Fine-tuning from a checkpoint takes the model's shape from the checkpoint: a base job's ViT
shape is dropped when the overrides switch to weights that carry their own (a Hugging Face
directory, a pt-ray timm export), shape fields the user set are kept and must match, and a timm
export loads by its folder or its weights file with the architecture its config.json records."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pt_ray.api import default_config_path, resolve_config
from pt_ray.core.config import ConfigError, ModelConfig, RunConfig, build_config, load_config
from pt_ray.models import build_adapter
from pt_ray.models.export import TIMM_WEIGHTS, export_model

pytestmark = pytest.mark.unit

DEFAULT = default_config_path()
SHAPE = {"depth": 6, "width": 64, "num_heads": 4, "mlp_ratio": 2.0, "patch_size": 4}
"""The default job's ViT shape (pt_ray/configs/default.yaml)."""
TINY = {"depth": 2, "width": 32, "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4}
"""A checkpoint's shape, other than the default job's in every field but the MLP ratio and
the patch."""


def shape(cfg: RunConfig) -> dict[str, object]:
    return {f: getattr(cfg.model, f) for f in SHAPE}


def hf_dir(tmp_path: Path) -> Path:
    """A tiny BERT checkpoint folder (config.json and weights, as save_pretrained writes)."""
    adapter = build_adapter(ModelConfig(family="hf", name="bert", depth=2, width=32,
                                        num_heads=2, mlp_ratio=2.0), num_classes=3,
                            vocab_size=100, seq_len=16)
    adapter.model.save_pretrained(str(tmp_path / "bert"))
    return tmp_path / "bert"


def timm_export(tmp_path: Path, image_size: int = 8) -> Path:
    """A pt-ray export of a tiny ViT for 1-channel images with 10 classes."""
    adapter = build_adapter(ModelConfig(name="vit_base_patch16_224", **TINY), num_classes=10,
                            image_size=image_size, in_chans=1, seed=5)
    return export_model(adapter, tmp_path / "export")


def test_switching_to_hf_weights_drops_the_files_shape_and_says_so(tmp_path, caplog):
    weights = hf_dir(tmp_path)
    with caplog.at_level(logging.INFO, logger="pt_ray.core.config"):
        cfg = load_config(DEFAULT, ["model.family=hf", "model.name=bert",
                                    "data.name=synthetic_text", f"model.weights={weights}"])
    assert shape(cfg) == dict.fromkeys(SHAPE)
    lines = [r.getMessage() for r in caplog.records if r.name == "pt_ray.core.config"]
    assert len(lines) == 1
    assert all(f"model.{f} (was {v})" in lines[0] for f, v in SHAPE.items())
    assert "default.yaml" in lines[0]
    # The checkpoint then builds with its own shape.
    adapter = build_adapter(cfg.model, num_classes=3, vocab_size=100, seq_len=16)
    assert adapter.num_layers == 2 and adapter.model.config.hidden_size == 32


def test_shape_the_user_sets_is_kept_and_must_match_the_checkpoint(tmp_path):
    weights = hf_dir(tmp_path)
    switch = ["model.family=hf", "model.name=bert", "data.name=synthetic_text",
              f"model.weights={weights}"]
    cfg = load_config(DEFAULT, [*switch, "model.width=32", "model.depth=1"])
    assert (cfg.model.width, cfg.model.depth, cfg.model.num_heads) == (32, 1, None)
    assert build_adapter(cfg.model, num_classes=3, vocab_size=100).num_layers == 1
    cfg = load_config(DEFAULT, [*switch, "model.num_heads=4"])
    with pytest.raises(ConfigError, match=r"model\.num_heads=4 differs from the checkpoint in "
                                          r".*\(2\); leave model\.num_heads unset"):
        build_adapter(cfg.model, num_classes=3, vocab_size=100)


def test_shape_set_in_the_same_layer_as_the_weights_is_kept(tmp_path):
    weights = hf_dir(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  family: hf\n  name: bert\n  weights: {weights}\n  depth: 1\n"
                   "data:\n  name: synthetic_text\n")
    cfg = load_config(job, ["epochs=2", f"model.weights={weights}"])  # the same weights
    assert cfg.model.depth == 1
    # Overrides that do not switch the model drop nothing.
    assert shape(load_config(DEFAULT, ["model.depth=3", "epochs=2"])) == {**SHAPE, "depth": 3}


def test_a_bare_timm_state_dict_keeps_the_files_shape(tmp_path):
    # It records no shape, so the file's is the only one there is.
    path = tmp_path / "weights.pt"
    torch.save({}, path)
    assert shape(load_config(DEFAULT, [f"model.weights={path}"])) == SHAPE


@pytest.mark.parametrize("target", ["folder", "weights file"])
def test_a_timm_export_loads_with_the_shape_its_config_records(tmp_path, target):
    export = timm_export(tmp_path)
    weights = export if target == "folder" else export / TIMM_WEIGHTS
    cfg = load_config(DEFAULT, [f"model.weights={weights}"])
    assert shape(cfg) == dict.fromkeys(SHAPE)
    adapter = build_adapter(cfg.model, num_classes=10, image_size=8, in_chans=1, seed=0)
    want = build_adapter(ModelConfig(name="vit_base_patch16_224", **TINY), num_classes=10,
                         image_size=8, in_chans=1, seed=5).model.state_dict()
    got = adapter.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # The arguments are recorded again, so a fine-tuned model exports on its own.
    assert {k: adapter.create_kwargs[k] for k in ("depth", "embed_dim", "num_heads")} == {
        "depth": 2, "embed_dim": 32, "num_heads": 2}


def test_the_api_takes_the_shape_from_the_checkpoint_over_a_config_object(tmp_path):
    export = timm_export(tmp_path)
    base = load_config(DEFAULT)
    cfg = resolve_config(base, [f"model.weights={export}"])
    assert shape(cfg) == dict.fromkeys(SHAPE)
    assert shape(resolve_config(base.model_dump(mode="json"), [f"model.weights={export}",
                                                              "model.depth=2"]))["depth"] == 2


@pytest.mark.parametrize(("fields", "image_size", "message"), [
    ({"width": 64}, 8, r"model\.width=64 differs from the checkpoint in .*\(32\); leave "
                       r"model\.width unset to use the checkpoint's"),
    ({"depth": 3}, 8, r"model\.depth=3 differs from the checkpoint .*\(2\)"),
    ({}, 16, r"was built for img_size=8 but the dataset gives img_size=16; set "
             r"data\.image_size=8"),
    ({"name": "deit_tiny_patch16_224"}, 8,
     r"model\.name='deit_tiny_patch16_224' but the checkpoint in .* is a "
     r"'vit_base_patch16_224' model; set model\.name=vit_base_patch16_224"),
])
def test_a_timm_export_that_the_config_contradicts_fails_in_one_line(tmp_path, fields,
                                                                     image_size, message):
    export = timm_export(tmp_path)
    cfg = ModelConfig(**{"name": "vit_base_patch16_224", **fields}, weights=export)
    with pytest.raises(ConfigError, match=message):
        build_adapter(cfg, num_classes=10, image_size=image_size, in_chans=1)


def test_a_folder_that_is_no_export_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder but not a pt-ray timm export"):
        build_adapter(ModelConfig(weights=tmp_path / "empty", **TINY), num_classes=10,
                      image_size=8, in_chans=1)


def test_an_exports_head_loads_when_the_classes_match_and_is_fresh_otherwise(tmp_path):
    export = timm_export(tmp_path)
    source = json.loads((export / "config.json").read_text())
    assert source["model_args"]["num_classes"] == 10
    cfg = build_config({"model": {"weights": str(export)}}).model
    same = build_adapter(cfg, num_classes=10, image_size=8, in_chans=1, seed=1)
    other = build_adapter(cfg, num_classes=7, image_size=8, in_chans=1, seed=1)
    from safetensors.torch import load_file

    saved = load_file(str(export / TIMM_WEIGHTS))
    assert torch.equal(same.model.head.weight, saved["head.weight"])
    assert other.model.head.weight.shape == (7, 32)
    assert torch.equal(other.model.blocks[1].mlp.fc1.weight, saved["blocks.1.mlp.fc1.weight"])
