"""Freeze decisions inside epochs on Ray Train: the prefix grows at the exact steps the interval
names, the accuracy guard judges a freeze taken mid-epoch, and its rollback returns to the start
of that epoch and ends on the reference trainer's parameters."""

from __future__ import annotations

import json

import pytest

from pt_ray.api import fit
from pt_ray.models.base import iter_layers
from pt_ray.runtime.faults import FAULT_ENV
from pt_ray.runtime.reference import build_reference
from pt_ray.service.settings import run_settings
from test_ray_engine import max_difference, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# 128 training samples in batches of 16: 8 steps an epoch. A decision every 3 steps: each epoch
# opens with one and takes two more, before its steps 3 and 6, so decision d falls at step
# 3 (d mod 3) of epoch d // 3 (until a rollback reopens an epoch). The schedule
# n(d) = ceil(4 (1 - 0.8^d)) gives 0, 1, 2, 2, 3 for d = 0..4: the prefix grows at steps 3 and 6
# of epoch 0 (0 -> 1 -> 2), holds at epoch 1's start (n(3) = 2) and grows again at step 3 of
# epoch 1 (2 -> 3). Decided per epoch instead, it would grow only at epoch starts (n(1) = 1 as
# epoch 1 opens), and every number below would differ.
STEPS = {"interval": "steps", "interval_steps": 3, "warmup_epochs": 0}
FREEZE = {"policy": "schedule", "alpha": 0.2, "max_frozen": 3, "rollback": True, **STEPS}


def test_a_freeze_inside_an_epoch_is_judged_by_the_guard_and_rolled_back_to_its_start(
        ray_cluster, tmp_path):
    # Epoch 1's evaluation loses rank 1's share of the correct answers (the `eval` fault): its
    # prefix grew 2 -> 3 at its step 3, so the guard orders a rollback to the start of epoch 1,
    # with the 2 blocks frozen that epoch 0 froze, and stops freezing. Epochs 1 and 2 are
    # trained again with block 2 active: a reference run capped at 2 frozen blocks.
    marker = tmp_path / "fault-fired"
    result = fit(tiny_config(tmp_path, name="ray-decisions", freeze=FREEZE),
                 worker_env={FAULT_ENV: f"eval:1:0:1:{marker}"})
    assert marker.exists(), "the fault was never injected"
    assert result.restarts == 0

    # 1. Decisions inside epochs froze blocks. Epoch 0 trained steps 0-2 with 0 blocks frozen,
    # 3-5 with 1 and 6-7 with 2: a mean of (0 x 3 + 1 x 3 + 2 x 2) / 8 = 7/8, which only
    # transitions before its steps 3 and 6 give. The undone epoch 1: 2 x 3 + 3 x 5 = 21/8.
    frozen = [(d["decision"], d["num_frozen"]) for d in result.decisions]
    assert frozen[:5] == [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)]
    assert [(r.epoch, r.num_frozen, r.mean_frozen) for r in result.timeline] == [
        (0, 2, 7 / 8), (1, 2, 2.0), (2, 2, 2.0)]
    (rollback,) = result.rollbacks
    undone = [(r["epoch"], r["num_frozen"], r["mean_frozen"]) for r in rollback["discarded"]]
    assert undone == [(1, 3, 21 / 8)]

    # 2. The guard's verdict: epoch 1's metric fell from epoch 0's after the prefix grew
    # 2 -> 3; decision 6, which reopens epoch 1, rolls back, and every later one is held.
    assert (rollback["decision"], rollback["epoch"], rollback["rollback_to"],
            rollback["num_frozen"], rollback["undone"]) == (6, 1, 1, 2, 3)
    assert rollback["before"] == result.timeline[0].eval_metric
    assert rollback["after"] == rollback["discarded"][0]["eval_metric"]
    assert rollback["after"] < rollback["before"] - 0.01  # beyond guard_points=1.0
    assert frozen[5] == (6, 2) and result.decisions[5]["reason"].startswith("rollback: ")
    # Decisions 7-8 inside epoch 1 again, 9-11 in epoch 2, and 12 from its last interval.
    held = result.decisions[6:]
    assert [d["decision"] for d in held] == list(range(7, 13))
    assert all(d["num_frozen"] == 2 and d["reason"] == "guard: freezing stopped at epoch 1"
               for d in held)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert [(r["epoch"], r["rollback_to"], r["num_frozen"], r["undone"])
            for r in summary["rollbacks"]] == [(1, 1, 2, 3)]

    # 3. From the start of epoch 1 on, the run is the one that never froze block 2.
    capped = tiny_config(tmp_path / "ref", engine="reference",
                         freeze={**FREEZE, "max_frozen": 2, "rollback": False})
    trainer = build_reference(run_settings(capped).reference)
    expected = trainer.fit()
    assert [(r.epoch, r.num_frozen, r.mean_frozen) for r in expected] == [
        (r.epoch, r.num_frozen, r.mean_frozen) for r in result.timeline]
    for mine, ref in zip(result.timeline, expected):
        assert mine.train_loss == pytest.approx(ref.train_loss, abs=1e-4)
    reference = {name: m.state_dict() for name, m in iter_layers(trainer.adapter)}
    assert max_difference(result.checkpoint, reference) <= 1e-4
