"""One pass on the driver: one device choice and at most one full model build per ``fit``
(the Ray engine's preflight builds on the meta device; its export is the one real build), and a
report drawn in a process of its own that never fails the run."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

import pt_ray.core.devices
import pt_ray.data.registry
import pt_ray.runtime.build
from pt_ray.api import fit, preflight
from pt_ray.core.config import ConfigError, build_config
from pt_ray.reporting.report_process import ERROR_FILE, main as report_main


def tiny_config(tmp_path, engine, **extra):
    return build_config({
        "name": "one-pass", "engine": engine,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 64, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 1, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "policy": "paper"},
        "epochs": 2,
        "output_dir": str(tmp_path),
        **extra,
    })


@pytest.fixture
def driver_counts(monkeypatch):
    """Counts, in this process only, the device choices, the dataset builds and the model
    builds by where their parameters are (``meta`` or a real device), wherever a module bound
    the functions."""
    counts: Counter[str] = Counter()
    choose = pt_ray.core.devices.choose_devices
    build = pt_ray.runtime.build.build_adapter
    build_data = pt_ray.data.registry.build_dataset

    def counted_choose(*args, **kwargs):
        counts["device choices"] += 1
        return choose(*args, **kwargs)

    def counted_build(*args, **kwargs):
        adapter = build(*args, **kwargs)
        meta = any(p.is_meta for p in adapter.model.parameters())
        counts["meta builds" if meta else "full builds"] += 1
        return adapter

    def counted_build_data(*args, **kwargs):
        counts["dataset builds"] += 1
        return build_data(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("pt_ray") and module is not None:
            for attr, original, counted in (("choose_devices", choose, counted_choose),
                                            ("build_adapter", build, counted_build),
                                            ("build_dataset", build_data, counted_build_data)):
                if getattr(module, attr, None) is original:
                    monkeypatch.setattr(module, attr, counted)
    return counts


@pytest.mark.proc
def test_the_reference_engine_chooses_once_builds_once_and_exports_that_model(
        tmp_path, driver_counts):
    result = fit(tiny_config(tmp_path, "reference"))
    assert driver_counts == {"device choices": 1, "dataset builds": 1, "full builds": 1}
    assert (result.run_dir / "model" / "config.json").is_file()
    # The report comes from a process of its own: bounded wait, then the file is there.
    assert result.wait_for_report(timeout_s=120) == result.run_dir / "report.png"
    assert (result.run_dir / "report.png").stat().st_size > 10_000
    assert not (result.run_dir / ERROR_FILE).exists()


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_the_ray_engine_driver_chooses_once_builds_the_data_once_and_the_model_for_the_export(
        ray_cluster, tmp_path, driver_counts):
    # cache.min_frozen=2 lets the cache turn on, but only past the one block that freezes.
    result = fit(tiny_config(tmp_path, "ray", logging={"report": False},
                             cache={"min_frozen": 2}))
    # The preflight's build holds shapes only; the export loads the last checkpoint into the
    # one real model. The workers (other processes) build their own and are not counted.
    assert driver_counts["full builds"] == 1
    assert driver_counts["meta builds"] == 1
    assert driver_counts["device choices"] == 1
    assert (result.run_dir / "model" / "config.json").is_file()
    # The dataset is built once, here: the workers read the preflight's from the object store.
    assert driver_counts["dataset builds"] == 1
    summary = json.loads((result.run_dir / "summary.json").read_text())
    data = summary["data"]
    assert data["read_by_workers"] is True
    assert data["shipped_bytes"] > 64 * 3 * 8 * 8  # the 64 training images at least
    # The config lets the cache turn on (a block freezes, cache.mode=auto), so the controller
    # started its owner; no plan read it (one frozen block, below cache.min_frozen), so the
    # summary has no cache figures.
    assert max(r["num_frozen"] for r in summary["timeline"]) == 1
    assert summary["cache"] == {}


@pytest.mark.unit
def test_a_meta_preflight_keeps_every_check(tmp_path):
    cfg = tiny_config(tmp_path, "ray")
    splits, adapter = preflight(cfg, meta=True)
    assert adapter.num_layers == 2 and splits.image_size == 8
    assert all(p.is_meta for p in adapter.model.parameters())
    # The layer count comes from the built model where the config leaves the depth to it.
    model = {"family": "timm", "name": "vit_tiny_patch16_224", "patch_size": 4}
    for field, value, words in (("pipeline", {"num_workers": 16, "pipeline_length": 16},
                                 "pipeline.pipeline_length=16 exceeds the model's 12 blocks"),
                                ("freeze", {"policy": "schedule", "max_frozen": 13},
                                 "freeze.max_frozen=13 exceeds the model's 12 blocks")):
        with pytest.raises(ConfigError, match=words):
            preflight(tiny_config(tmp_path, "ray", model=model, **{field: value}), meta=True)
    with pytest.raises(ConfigError, match="cannot be built with"):
        preflight(tiny_config(tmp_path, "ray", model={
            **model, "overrides": {"act_layer": "no_such_activation"}}), meta=True)


@pytest.mark.unit
def test_a_meta_preflight_reads_and_matches_the_weights_file(tmp_path):
    import torch

    from pt_ray.runtime.build import build_model_for

    cfg = tiny_config(tmp_path, "ray")
    splits, _ = preflight(cfg)
    weights = tmp_path / "w.pt"
    torch.save(build_model_for(cfg.model, 0, splits).model.state_dict(), weights)
    model = {**cfg.model.model_dump(), "weights": str(weights)}
    _, adapter = preflight(tiny_config(tmp_path, "ray", model=model), meta=True)
    assert all(p.is_meta for p in adapter.model.parameters())
    with pytest.raises(ConfigError, match="does not fit the model"):
        preflight(tiny_config(tmp_path, "ray", model={**model, "depth": 1}), meta=True)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        preflight(tiny_config(tmp_path, "ray", model={**model, "weights":
                                                      str(tmp_path / "bad.pt")}), meta=True)


@pytest.mark.unit
def test_a_report_that_cannot_be_drawn_writes_its_reason_and_raises_nothing(tmp_path):
    (tmp_path / "summary.json").write_text("{not json")
    assert report_main([str(tmp_path / "summary.json"), str(tmp_path / "report.png")]) == 1
    assert not (tmp_path / "report.png").exists()
    assert "report.png not written" in Path(tmp_path / ERROR_FILE).read_text()


@pytest.mark.unit
@pytest.mark.parametrize("given", ["real", "meta"])
def test_the_export_loads_the_checkpoint_into_the_preflights_model_or_builds_one(
        tmp_path, driver_counts, given):
    import torch
    from safetensors.torch import load_file

    from pt_ray.models.base import iter_layers
    from pt_ray.runtime.checkpoint import write_meta, write_shard
    from pt_ray.runtime.export import export_checkpoint

    cfg = tiny_config(tmp_path, "ray")
    splits, trained = preflight(cfg.model_copy(update={"seed": 7}))
    write_shard(tmp_path / "ckpt", 0, {name: {"params": module.state_dict(), "optim": []}
                                       for name, module in iter_layers(trained)})
    write_meta(tmp_path / "ckpt", {"epoch": 1})
    _, built = preflight(cfg, meta=given == "meta")
    driver_counts.clear()
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "model", model=cfg.model,
                            data=cfg.data, seed=cfg.seed, name=cfg.name, splits=splits,
                            adapter=built)
    # A real preflight model is the export's; a shapes-only one is replaced by one full build.
    assert driver_counts == ({} if given == "real" else {"full builds": 1})
    exported = load_file(out / "model.safetensors")
    for key, value in trained.model.state_dict().items():
        assert torch.equal(exported[key], value), key
