"""bench/gpu_check.sh --dry-run: the prepared GPU check runs its steps on the CPU, so it cannot
rot on machines without a GPU (on a CUDA machine it runs the same steps for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_writes_its_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = report["tests"]
    assert tests["failed"] == 0 and tests["skipped"] == 0 and tests["passed"] >= 9, tests
    rows = {r["arm"]: r for r in report["speed"]["rows"]}
    assert list(rows) == ["no freeze", "freeze", "freeze + cache", "plain PyTorch"]
    assert rows["plain PyTorch"]["ratio_to_plain"] == 1.0
    assert rows["no freeze"]["ratio_to_no_freeze"] == 1.0
    assert rows["no freeze"]["frozen_by_epoch"] == [0, 0, 0, 0]
    # The paper's schedule at alpha 1/3 on 4 blocks: ceil(4 (1 - (2/3)^e)), at most L - 1.
    assert rows["freeze"]["frozen_by_epoch"] == [0, 2, 3, 3]
    assert rows["freeze + cache"]["cache_hit_rate_by_epoch"][-1] == 1.0
    assert all(r["samples_per_s"] > 0 for r in rows.values())
    # The last lines are the table a person reads.
    assert "gpu tests: " in proc.stdout and "plain PyTorch" in proc.stdout.splitlines()[-2]
