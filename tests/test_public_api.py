"""The public names of ``pt_ray``: what a user calls, each one reachable, and importing the
package loads neither Ray nor the model libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pt_ray

PUBLIC = ["ConfigError", "EpochRecord", "Result", "RunConfig", "SweepResult",
          "default_config_path", "fit", "load_config", "read_summary", "resolve_config", "sweep"]


@pytest.mark.unit
def test_the_public_names_are_the_ones_users_call():
    assert sorted(pt_ray.__all__) == PUBLIC
    for name in ("fit", "resolve_config", "default_config_path", "load_config", "read_summary"):
        assert callable(getattr(pt_ray, name)), name
    with pytest.raises(AttributeError, match="has no attribute 'ReferenceTrainer'"):
        pt_ray.ReferenceTrainer  # noqa: B018  (an internal, reached through its module)


@pytest.mark.proc
@pytest.mark.timeout(120)
def test_importing_the_package_loads_no_ray_torch_or_model_library():
    code = ("import sys, pt_ray; print(sorted({'ray', 'torch', 'timm', 'transformers'} "
            "& set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, check=True)
    assert out.stdout.strip() == "[]"
    lazy = subprocess.run([sys.executable, "-c", "import pt_ray; print(pt_ray.sweep.__module__)"],
                          capture_output=True, text=True, timeout=100, check=True)
    assert lazy.stdout.strip() == "pt_ray.tune"
