"""bench/gpu_bundle.py: the folder that carries Ray to a GPU machine builds under its size limit,
and the Ray it carries, unpacked by the bundle's own install script, starts a cluster and runs a
task (so the pruning took nothing a run needs). It starts that Ray in a subprocess: the ray tier.

Built for this machine's Python, so the carried Ray can be imported here; the GPU machine's
bundle differs only in the wheels' tags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"

CHECK = """
import json, sys, ray
ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False,
         object_store_memory=80 * 2**20)
@ray.remote
def square(x):
    return x * x
print(json.dumps({"file": ray.__file__, "version": ray.__version__,
                  "result": ray.get(square.remote(7))}))
ray.shutdown()
"""


def test_the_bundle_is_under_its_limit_and_its_ray_runs_a_task(tmp_path):
    out = tmp_path / "bundle"
    built = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bundle.py"), "--out",
                            str(out), "--python-version", PY], cwd=ROOT, capture_output=True,
                           text=True, timeout=800)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 60 * 2**20, manifest
    assert manifest["bytes"] == size - (out / "manifest.json").stat().st_size, manifest
    names = " ".join(manifest["wheels"])
    for dep in ("jsonschema", "pydantic_core", "tensorboardx", "rpds_py"):
        assert dep in names.lower(), manifest["wheels"]

    site = tmp_path / "site"
    unpacked = subprocess.run(["bash", str(out / "install.sh"), str(site)], capture_output=True,
                              text=True, timeout=300)
    assert unpacked.returncode == 0, unpacked.stderr[-2000:]
    for pruned in ("ray/jars", "ray/rllib", "ray/serve"):
        assert not (site / pruned).exists()
    env = {**os.environ, "PYTHONPATH": str(site), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    ran = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    # The carried Ray answered, not the one installed beside the tests.
    assert Path(report["file"]).resolve().is_relative_to(site.resolve()), report
    assert report["version"] == manifest["ray"] and report["result"] == 49
