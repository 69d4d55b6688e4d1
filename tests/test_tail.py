"""The driver's tail: a run on a cluster ``fit`` started itself writes its summary and exports its
model while that cluster shuts down, and returns once both are done, with Ray shut down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The shutdown is made 1 s slower than Ray's own, so that the test does not depend on how long
# the export takes: with the old order (shutdown, then summary and export) the export starts
# after the shutdown has ended.
EMBEDDED_TAIL = textwrap.dedent("""
    import json, sys, time
    import ray
    import pt_ray.api as api
    from pt_ray import fit

    seen = {}
    shutdown, export = ray.shutdown, api._export_model

    def slow_shutdown(*args, **kwargs):
        seen.setdefault("shutdown_start", time.perf_counter())
        shutdown(*args, **kwargs)
        time.sleep(1.0)
        seen.setdefault("shutdown_end", time.perf_counter())

    def timed_export(*args, **kwargs):
        seen["export_start"] = time.perf_counter()
        export(*args, **kwargs)
        seen["export_end"] = time.perf_counter()

    ray.shutdown, api._export_model = slow_shutdown, timed_export
    result = fit({
        "name": "tail", "engine": "ray", "output_dir": sys.argv[1],
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 64, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "none"}, "pipeline": {"num_workers": 2}, "epochs": 1,
        "logging": {"report": False},
    })
    seen["returned"] = time.perf_counter()
    seen["ray_up"] = ray.is_initialized()
    seen["run_dir"] = str(result.run_dir)
    print(json.dumps(seen))
""")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_an_embedded_run_writes_its_summary_and_model_while_its_cluster_shuts_down(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    # Its own session: killing it on a timeout takes its Ray processes with it.
    done = subprocess.run([sys.executable, "-c", EMBEDDED_TAIL, str(tmp_path / "runs")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=270,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The export ran beside the shutdown, not after it, and the call waited for both.
    assert seen["shutdown_start"] < seen["export_start"] < seen["shutdown_end"]
    assert seen["returned"] >= max(seen["shutdown_end"], seen["export_end"])
    assert seen["ray_up"] is False
    run_dir = Path(seen["run_dir"])
    assert (run_dir / "model" / "config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["epoch"] for r in summary["timeline"]] == [0]
