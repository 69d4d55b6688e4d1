"""The embedded cluster starts no Ray worker process that nothing uses: Ray would prestart one
idle worker per CPU for its first driver, with an empty runtime_env that no actor of a pt-ray
run has, so pt-ray turns that off and a run's first actor is the only worker process. Its
object store is the size Ray itself gives a node (``cache.object_store_bytes=auto``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]

EMBEDDED = textwrap.dedent("""
    import json, os, subprocess
    import ray
    from pt_ray.core.config import build_config
    from pt_ray.service.controller import ControllerActor
    from pt_ray.service.trainer import ensure_ray

    def workers():
        # This cluster's Ray worker processes: the children of the raylet this driver
        # started (its agents aside), by their process titles.
        rows = [line.split(None, 2) for line in subprocess.run(
            ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True
        ).stdout.splitlines()]
        raylets = {pid for pid, ppid, args in rows
                   if ppid == str(os.getpid()) and "raylet/raylet" in args}
        return sorted(args.split()[0] for pid, ppid, args in rows
                      if ppid in raylets and args.startswith("ray::")
                      and not args.split()[0].endswith("Agent"))

    from ray._private.utils import estimate_available_memory, resolve_object_store_memory

    cfg = build_config({"pipeline": {"num_workers": 2}})
    ray_default = resolve_object_store_memory(estimate_available_memory())
    assert ensure_ray(cfg.pipeline, cfg.cache)
    # Prestarted workers are launched as the driver connects, before any actor's process.
    controller = ControllerActor.remote(cfg.model_dump(mode="json"), None)
    ray.get(controller.__ray_ready__.remote(), timeout=90)
    print(json.dumps({"cpus": ray.cluster_resources()["CPU"], "workers": workers(),
                      "store": ray.cluster_resources()["object_store_memory"],
                      "ray_default": ray_default}))
    ray.shutdown()
""")


@pytest.mark.ray
def test_the_embedded_cluster_prestarts_no_idle_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    # Its own session: killing it on a timeout takes its Ray processes with it.
    done = subprocess.run([sys.executable, "-c", EMBEDDED], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=150, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cpus"] >= 2  # Ray would have prestarted this many
    assert seen["workers"] == ["ray::ControllerActor"]
    # cache.object_store_bytes=auto: the store Ray itself sizes from the host's free memory
    # (which moves a little between the two readings).
    assert seen["store"] == pytest.approx(seen["ray_default"], rel=0.05)
