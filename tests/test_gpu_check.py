"""bench/gpu_check.sh --ray --dry-run: the prepared GPU check runs its steps on the CPU, so it
cannot rot on machines without a GPU (on a CUDA machine it runs the same steps for real). Its
--ray step starts its own embedded Ray cluster, hence the ray tier."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_writes_its_tables(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--ray",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = report["tests"]
    assert tests["failed"] == 0 and tests["skipped"] == 0 and tests["passed"] >= 9, tests
    rows = {r["arm"]: r for r in report["speed"]["rows"]}
    assert list(rows) == ["no freeze", "no freeze compiled", "freeze", "freeze compiled",
                          "freeze + cache", "freeze + store cache", "plain PyTorch",
                          "plain compiled"]
    assert rows["plain PyTorch"]["ratio_to_plain"] == 1.0
    assert rows["plain compiled"]["ratio_to_plain_compiled"] == 1.0
    assert rows["freeze compiled"]["frozen_by_epoch"] == [0, 2, 3, 3]
    assert rows["no freeze"]["ratio_to_no_freeze"] == 1.0
    assert rows["no freeze"]["frozen_by_epoch"] == [0, 0, 0, 0]
    # The paper's schedule at alpha 1/3 on 4 blocks: ceil(4 (1 - (2/3)^e)), at most L - 1.
    assert rows["freeze"]["frozen_by_epoch"] == [0, 2, 3, 3]
    # Both cache arms serve the last epoch whole from the cache: the first from its device
    # tier, the second through the store alone.
    assert rows["freeze + cache"]["cache_hit_rate_by_epoch"][-1] == 1.0
    assert rows["freeze + cache"]["rows_from_tiers"] > 0
    assert rows["freeze + store cache"]["cache_hit_rate_by_epoch"][-1] == 1.0
    assert rows["freeze + store cache"]["rows_from_tiers"] == 0
    assert all(r["samples_per_s"] > 0 for r in rows.values())
    # The rest of the ladder: every rung ran (nothing skipped on the dry run), every arm
    # trained, and the input rung read files (its uint8 and JPEG arms) through the loader.
    ladder = {rung["rung"]: rung for rung in report["speed"]["ladder"]}
    assert list(ladder) == ["vit-b16", "input", "vit-b16 b256", "bert-base", "bert-large"]
    assert not any(rung.get("skipped") for rung in ladder.values())
    assert [r["arm"] for r in ladder["input"]["rows"]] == ["on GPU", "uint8 files",
                                                            "JPEG folder"]
    for name in ("vit-b16 b256", "bert-base", "bert-large"):
        assert [r["arm"] for r in ladder[name]["rows"]] == ["no freeze", "no freeze compiled",
                                                             "plain compiled"]
    for rung in ladder.values():
        assert rung["model_flops_per_sample"] > 0
        assert all(r["samples_per_s"] > 0 and math.isfinite(r["final_train_loss"])
                   for r in rung["rows"])
    # The Ray step: pt-ray through the controller actor and Ray Train beside plain Ray Train.
    ray_rows = {r["arm"]: r for r in report["ray"]["rows"]}
    assert list(ray_rows) == ["pt-ray", "peer"]
    assert ray_rows["peer"]["frozen_by_epoch"] == [0, 0, 0] and ray_rows["peer"]["transitions"] == 0
    # The paper's schedule freezes on the dry run's 4 blocks, so the timeline re-plans.
    assert ray_rows["pt-ray"]["frozen_by_epoch"][-1] > 0 and ray_rows["pt-ray"]["transitions"] >= 1
    for r in ray_rows.values():
        assert r["samples_per_s"] > 0 and r["fit_call_s"] >= r["train_time_s"] > 0
        assert r["mfu"] is None  # no GPU, no datasheet peak
    assert report["ray"]["flops_per_sample"] > 0
    # The last lines are the tables a person reads.
    out_lines = proc.stdout.splitlines()
    assert "gpu tests: " in proc.stdout and any("plain PyTorch" in line for line in out_lines)
    assert out_lines[-2].startswith("pt-ray over plain Ray Train: training ")
