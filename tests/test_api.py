"""The Python entry point: config resolution and errors before anything starts."""

import pytest

from pt_ray.api import fit, resolve_config
from pt_ray.core.config import ConfigError, RunConfig

pytestmark = pytest.mark.unit


def test_resolve_accepts_none_dict_path_and_runconfig(tmp_path):
    default = resolve_config()
    assert default.name == "default" and default.model.depth == 6
    assert resolve_config({"epochs": 3}).epochs == 3
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 4\n")
    assert resolve_config(path, ["seed=7"]).seed == 7
    cfg = RunConfig(epochs=2)
    assert resolve_config(cfg) is cfg
    assert resolve_config(cfg, ["epochs=5"]).epochs == 5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pipeline.pipeline_length=3"], r"pipeline\.pipeline_length=3 does not divide"),
        (["model.name=vit_nonexistent_tiny"], r"vit_nonexistent_tiny"),
        (["data.name=cifar10", "data.path=/nonexistent/cifar"], r"/nonexistent/cifar"),
        (["pipeline.num_workers=8", "data.batch_size=32", "pipeline.pipeline_length=8"],
         r"pipeline\.pipeline_length=8 exceeds the model's 6 blocks"),
    ],
)
def test_bad_config_fails_before_any_worker_starts(tmp_path, overrides, message, monkeypatch):
    """Whatever ran before (a session cluster may be up), the bad field is refused before Ray is
    asked for anything and before the run folder exists."""
    import ray

    asked = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: asked.append("ray.init"))
    was_up = ray.is_initialized()
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        fit(None, overrides=overrides, output_dir=out)
    assert asked == []
    assert ray.is_initialized() == was_up
    assert not out.exists()
