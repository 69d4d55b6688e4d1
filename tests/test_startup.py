"""The driver's start-up: it imports neither the worker module nor ``torch._dynamo`` (Ray
Train's workers load them while they unpickle the training function), the cache owners' module
loads no torch, and the driver's device choice travels in the worker config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` are in ``sys.modules`` after a fresh interpreter runs ``code``."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(set({names!r}) & set(sys.modules))))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.proc
def test_the_driver_modules_do_not_load_the_worker_or_torch_dynamo():
    loaded = loaded_after("import pt_ray.api, pt_ray.service.trainer",
                          ("torch._dynamo", "pt_ray.service.worker"))
    assert loaded == []


@pytest.mark.proc
def test_the_cache_owners_module_loads_no_torch():
    # A cache owner whose cache never turns on pays for Ray and numpy only.
    assert loaded_after("import pt_ray.cache.owners", ("torch",)) == []


@pytest.mark.proc
def test_the_worker_loop_becomes_the_worker_function_where_it_is_unpickled():
    # As Ray Train ships it: cloudpickled on the driver, unpickled on a worker, which then
    # loads the worker module (and torch._dynamo) before the function runs.
    code = ("import pickle, ray.cloudpickle as cp\n"
            "from pt_ray.service.loop import WORKER_LOOP\n"
            "blob = cp.dumps(WORKER_LOOP)\n"
            "import sys; assert 'pt_ray.service.worker' not in sys.modules\n"
            "fn = pickle.loads(blob)\n"
            "from pt_ray.service.worker import train_loop_per_worker\n"
            "assert fn is train_loop_per_worker, fn")
    assert loaded_after(code, ("torch._dynamo",)) == ["torch._dynamo"]


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [0, 2])
def test_the_worker_config_carries_the_drivers_device_choice(gpus):
    from pt_ray.core.config import build_config
    from pt_ray.core.devices import choose_devices
    from pt_ray.service.trainer import _trainer

    cfg = build_config({"pipeline": {"num_workers": 2}})
    choice = choose_devices(cfg.pipeline, gpus, engine="ray", precision="auto")
    trainer, _ = _trainer(cfg.pipeline, cfg.model_dump(mode="json"), choice, Path("run"),
                          "run-1", {}, {}, False, None)
    assert trainer.train_loop_config["device"] == ("cuda" if gpus else "cpu")
