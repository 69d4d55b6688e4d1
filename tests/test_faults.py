"""Faults at the worst moments, injected by name (``pt_ray.runtime.faults``): each run either
recovers to the state a fault-free run reaches (the reference trainer's parameters, within 1e-4) or
stops with a clear error, and none can wait forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pt_ray.api import fit
from pt_ray.runtime.engine import EngineHooks
from pt_ray.runtime.faults import FAULT_ENV, FaultSwitch, fault_hooks
from pt_ray.models.base import iter_layers
from pt_ray.runtime.checkpoint import damage
from pt_ray.runtime.reference import build_reference
from pt_ray.service.settings import run_settings
from test_ray_engine import max_difference, reference_layers, tiny_config


@pytest.fixture(scope="module")
def reference_params(tmp_path_factory):
    """The fault-free run's layers (test_ray_engine's reference), once for this module."""
    return reference_layers(tmp_path_factory)


@pytest.mark.unit
def test_the_switch_fires_once_at_its_point_for_its_rank(tmp_path):
    marker = tmp_path / "fired"
    spec = {FAULT_ENV: f"hang:1:3:1:{marker}"}
    assert FaultSwitch.from_env(0, env=spec) is None  # another rank's fault
    assert FaultSwitch.from_env(1, env={}) is None
    switch = FaultSwitch.from_env(1, env=spec)
    assert not switch.due("step", 1, 3) and not switch.due("hang", 1, 2)
    assert not switch.due("hang", 0, 3)
    assert switch.due("hang", 1, 3) and marker.exists()
    assert not switch.due("hang", 1, 3)  # once: the restarted run goes through

    # Points without a step ignore it.
    switch = FaultSwitch.from_env(0, env={FAULT_ENV: f"migration:2:0:0:{tmp_path / 'm'}"})
    assert switch.due("migration", 2, 5)

    with pytest.raises(ValueError, match="unknown point 'migrate'; choose one of step, "):
        FaultSwitch.from_env(0, env={FAULT_ENV: f"migrate:1:0:0:{marker}"})
    with pytest.raises(ValueError, match="expected <point>:<epoch>:<step>:<rank>:<marker path>"):
        FaultSwitch.from_env(0, env={FAULT_ENV: "step:1:0"})

    # Several faults, each once at its own point; the other rank's are left out.
    both = {FAULT_ENV: f"eval:3:0:1:{tmp_path / 'e'};step:3:0:0:{tmp_path / 's'};"
                       f"stall:2:1:1:{tmp_path / 't'}"}
    switch = FaultSwitch.from_env(1, env=both)
    assert not switch.due("step", 3, 0)  # rank 0's
    assert switch.due("stall", 2, 1) and not (tmp_path / "e").exists()
    assert switch.due("eval", 3) and not switch.due("eval", 3)
    assert FaultSwitch.from_env(0, env=both).due("step", 3, 0)


@pytest.mark.unit
def test_faults_reach_the_engine_only_through_the_hooks_they_install(tmp_path):
    base = EngineHooks(on_step=print)
    assert fault_hooks(None, base) is base  # no fault: the engine gets no fault callback
    switch = FaultSwitch.from_env(0, env={FAULT_ENV: f"eval:2:0:0:{tmp_path / 'e'}"})
    hooks = fault_hooks(switch, base)
    assert hooks.on_step is print and hooks.on_step_report is None
    # The eval point drops this rank's correct answers once, in its epoch only.
    assert hooks.on_eval(1, 7) == 7 and hooks.on_eval(2, 7) == 0 and hooks.on_eval(2, 7) == 7
    # The other points are installed too and do nothing when their fault is not due.
    hooks.on_transition(2)
    hooks.in_migration(2)
    shard = tmp_path / "shard"
    shard.write_bytes(b"1234")
    hooks.on_shard(shard, 2)
    assert shard.read_bytes() == b"1234"


def _run_with_fault(tmp_path: Path, name: str, spec: str, **extra):
    marker = tmp_path / "fired"
    result = fit(tiny_config(tmp_path, name=name, **extra),
                 worker_env={FAULT_ENV: f"{spec}:{marker}"})
    assert marker.exists(), "the fault was never injected"
    return result


def _checkpoints(tmp_path: Path, name: str) -> list[Path]:
    return [p for p in (tmp_path / name / "ray").glob("*/checkpoint_*") if p.is_dir()]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_rank_killed_during_migration_recovers_from_the_checkpoint_before_it(
        ray_cluster, tmp_path, reference_params):
    # Rank 1 dies in the transition that opens epoch 2 (3 of 4 blocks frozen, K 1, R 2: the
    # layers move to it), after its sends and before its receives.
    result = _run_with_fault(tmp_path, "fault-migration", "migration:2:0:1")
    assert result.restarts == 1
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert result.timeline[2].num_frozen == 3
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_rank_killed_while_writing_its_checkpoint_never_leaves_a_half_written_one(
        ray_cluster, tmp_path, reference_params):
    # Rank 1 dies with half of its shard after epoch 1 written: that checkpoint never reaches
    # storage, and the restart goes on from the one after epoch 0.
    result = _run_with_fault(tmp_path, "fault-checkpoint", "checkpoint:1:0:1")
    assert result.restarts == 1
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert all(damage(p) is None for p in _checkpoints(tmp_path, "fault-checkpoint"))
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(400)
@pytest.mark.parametrize("checkpoint_every", [1, 2])
def test_a_restart_between_a_freeze_and_the_guards_verdict_still_rolls_the_freeze_back(
        ray_cluster, tmp_path, checkpoint_every):
    # Evaluations after epochs 1 and 3 only. Block 2 freezes as epoch 2 opens (n 2 -> 3), and
    # rank 0 dies in the middle of epoch 3, before any verdict on that freeze. The group
    # restarts from the checkpoint after epoch 2 (every epoch checkpoints: the snapshot of
    # epoch 2 comes back from the workers' shards) or after epoch 1 (every 2 epochs: the
    # checkpoint is the snapshot of epoch 2, which the resume opens). Epoch 3's evaluation
    # loses rank 1's share (the `eval` fault): the guard orders a rollback to epoch 2's start.
    # The run ends where a reference run capped at 2 frozen blocks ends.
    freeze = {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1,
              "rollback": True}
    killed, dropped = tmp_path / "killed", tmp_path / "dropped"
    env = {FAULT_ENV: f"step:3:4:0:{killed};eval:3:0:1:{dropped}"}
    extra = {"freeze": freeze, "eval_every": 2, "epochs": 4,
             "checkpoint_every": checkpoint_every}
    name = f"fault-rollback-restart-{checkpoint_every}"
    result = fit(tiny_config(tmp_path, name=name, **extra), worker_env=env)
    assert killed.exists() and dropped.exists(), "a fault was never injected"
    assert result.restarts == 1
    assert [(r["epoch"], r["rollback_to"], r["num_frozen"], r["undone"])
            for r in result.rollbacks] == [(3, 2, 2, 3)]
    assert [(r.epoch, r.num_frozen) for r in result.timeline] == [(0, 0), (1, 2), (2, 2),
                                                                  (3, 2)]
    capped = tiny_config(tmp_path / "ref", engine="reference",
                         **{**extra, "freeze": {**freeze, "max_frozen": 2, "rollback": False}})
    trainer = build_reference(run_settings(capped).reference)
    trainer.fit()
    reference = {name: m.state_dict() for name, m in iter_layers(trainer.adapter)}
    assert max_difference(result.checkpoint, reference) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_controller_killed_mid_run_is_restarted_and_rebuilt_from_the_checkpoint(
        ray_cluster, tmp_path, reference_params):
    # Rank 0 kills the controller actor before step 3 of epoch 1; Ray restarts it empty, it
    # restores its timeline, decisions, freeze state and plans from the checkpoint after epoch
    # 0 when the workers find it again, and they go on: no worker-group restart.
    result = _run_with_fault(tmp_path, "fault-controller", "controller:1:3:0")
    assert result.restarts == 0
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert [r.num_frozen for r in result.timeline] == [0, 2, 3]
    assert len(result.decisions) >= 2
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_after_a_controller_restart_the_workers_find_its_new_cache_owners(ray_cluster, tmp_path):
    # The cache on and 2 blocks frozen from epoch 1 to the end. Rank 0 kills the controller
    # before step 3 of epoch 1: its cache owner dies with it, and the restarted controller
    # starts a new, empty one under the same name. The rows epoch 1 wrote are lost, so epoch 2
    # misses everywhere; the workers meet the dead owner, ask the controller again and write
    # epoch 2's rows to the new one, which serves every read of epoch 3.
    extra = {"cache": {"mode": "on", "block_size": 16}, "epochs": 4,
             "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 2,
                        "warmup_epochs": 1}}
    result = _run_with_fault(tmp_path, "fault-controller-cache", "controller:1:3:0", **extra)
    assert result.restarts == 0
    assert [r.num_frozen for r in result.timeline] == [0, 2, 2, 2]
    assert [r.cache_hit_rate for r in result.timeline] == [0.0, 0.0, 0.0, 1.0]
    # And the run ends where the reference trainer's run of the same config does.
    ref = tiny_config(tmp_path / "ref", engine="reference", **extra)
    trainer = build_reference(run_settings(ref).reference)
    trainer.fit()
    reference = {name: m.state_dict() for name, m in iter_layers(trainer.adapter)}
    assert max_difference(result.checkpoint, reference) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_controller_killed_after_the_workers_last_call_still_gives_the_whole_summary(
        ray_cluster, tmp_path, reference_params):
    # Rank 0 kills the controller once training is over: Ray restarts it empty and no worker
    # call is left to restore it. The driver's final collection reads the run's last
    # checkpoint instead, so the summary and the timeline are whole.
    result = _run_with_fault(tmp_path, "fault-controller-end", "controller:3:0:0")
    assert result.restarts == 0
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert [r.num_frozen for r in result.timeline] == [0, 2, 3]
    assert len(result.decisions) >= 2 and result.metric_name == "accuracy"
    summary = json.loads((tmp_path / "fault-controller-end" / "summary.json").read_text())
    assert [r["epoch"] for r in summary["timeline"]] == [0, 1, 2]
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_controller_lost_before_any_checkpoint_falls_back_to_a_group_restart(
        ray_cluster, tmp_path, reference_params):
    # With a checkpoint every 2 epochs none exists in epoch 1: the restarted controller has
    # nothing to restore, the workers' calls fail, and Ray Train restarts the group from the
    # start, which sets the controller up again.
    result = _run_with_fault(tmp_path, "fault-controller-early", "controller:1:3:0",
                             checkpoint_every=2)
    assert result.restarts == 0  # counted are restarts from a checkpoint; this one began anew
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_peer_that_stops_answering_inside_a_collective_fails_within_the_timeout_then_recovers(
        ray_cluster, tmp_path, reference_params):
    # Rank 1 stops before step 3 of epoch 1 while rank 0 waits for it inside a collective: the
    # wait ends after pipeline.collective_timeout_s, Ray Train ends the group (the hung rank
    # too) and restarts it from the checkpoint after epoch 0.
    result = _run_with_fault(tmp_path, "fault-hang", "hang:1:3:1",
                             pipeline={"num_workers": 2, "schedule": "1f1b", "policy": "paper",
                                       "collective_timeout_s": 10})
    assert result.restarts == 1
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert max_difference(result.checkpoint, reference_params) <= 1e-4


def _record(epoch: int, num_layers: int = 4):
    from pt_ray.reporting.summary import EpochRecord

    return EpochRecord(epoch=epoch, num_frozen=0, num_layers=num_layers, pipeline_length=1,
                       num_replicas=1, num_microbatches=1, throughput_samples_per_s=1.0,
                       epoch_time_s=1.0, transition_time_s=0.0, cache_hit_rate=0.0,
                       train_loss=1.0 / (epoch + 1), eval_metric=0.5, eval_time_s=0.0)


def _controller_after_epoch_0(tmp_path, name: str):
    """A controller set up for 4 blocks on 1 rank, epoch 0 recorded, and the checkpoint a
    worker writes after it (taken at decision 1's start) in the run's storage folder."""
    from pt_ray.core.plan import CostTable
    from pt_ray.runtime.checkpoint import write_meta
    from pt_ray.service.controller import ControllerActor, RayController, controller_name

    cfg = tiny_config(tmp_path, pipeline={"num_workers": 1, "policy": "paper"})
    name = controller_name(f"{name}-{tmp_path.name}")
    actor = ControllerActor.options(name=name, max_restarts=1).remote(
        cfg.model_dump(mode="json"), str(tmp_path / "ray"))
    handle = RayController(name, timeout_s=60)
    handle.setup(4, 1, 8, "accuracy", "local-cpu")
    handle.submit_costs(0, CostTable.from_param_counts(1.0, [1.0] * 4, 1.0))
    handle.plan_for(0)
    handle.submit_norms(0, 0, {b: 1.0 for b in range(4)}, _record(0))
    handle.plan_for(1)
    write_meta(tmp_path / "ray" / "checkpoint_2026-12-01_00-00-00.000000",
               {"epoch": 0, "next_decision": 1, "num_shards": 0,
                "controller": handle.state_dict()})
    return actor, handle


def _kill_and_wait_until_empty(actor) -> None:
    """Kill the controller and wait until Ray has restarted it, empty (``ray.kill`` returns
    before the actor dies, so the old actor may answer a moment longer)."""
    import time as _time

    import ray

    ray.kill(actor, no_restart=False)
    deadline = _time.monotonic() + 60
    while True:
        try:
            if ray.get(actor.timeline.remote(), timeout=5) == []:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert _time.monotonic() < deadline, "the controller did not come back empty"
        _time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_calls_that_reach_a_restarted_empty_controller_restore_it_from_the_checkpoint(
        ray_cluster, tmp_path):
    # The race a worker can lose: Ray restarts a killed controller before the worker's next
    # call, so the epoch's record and norms reach an actor that holds no state yet. They must
    # read as a lost controller (restore, then send again), never as an error of the run.
    import ray

    actor, handle = _controller_after_epoch_0(tmp_path, "restart")
    _kill_and_wait_until_empty(actor)
    handle.submit_norms(1, 0, {b: 0.5 for b in range(4)}, _record(1))
    assert handle.plan_for(2) is not None
    timeline = ray.get(actor.timeline.remote())
    assert [r.epoch for r in timeline] == [0, 1]
    assert timeline[1].train_loss == 0.5
    ray.kill(actor)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_restarted_controller_asked_only_for_the_summary_restores_itself_from_the_checkpoint(
        ray_cluster, tmp_path):
    # The driver's way back is the workers' one: a controller restarted after the workers'
    # last call restores itself from the checkpoint when asked for the summary, with what it
    # was set up with and its start-up figures. A checkpoint that lacks them is named in a
    # one-line error from the driver's collection.
    import ray

    from pt_ray.runtime.checkpoint import write_meta
    from pt_ray.service.trainer import _final_summary

    actor, handle = _controller_after_epoch_0(tmp_path / "a", "summary")
    figures = {"entered_at": 1.0, "dataset_s": 0.25, "model_s": 0.5, "setup_s": 0.125}
    handle.startup(figures)
    meta = {"epoch": 0, "next_decision": 1, "num_shards": 0,
            "controller": handle.checkpoint_state(1)}
    folder = tmp_path / "a" / "ray" / "checkpoint_2026-12-01_00-00-00.000000"
    write_meta(folder, meta)
    _kill_and_wait_until_empty(actor)
    summary = _final_summary(actor)
    assert [r.epoch for r in summary["timeline"]] == [0]
    assert summary["timeline"][0].train_loss == 1.0
    assert summary["startup"] == figures and summary["metric_name"] == "accuracy"
    assert summary["restarts"] == 0 and summary["decisions"] == meta["controller"]["decisions"]
    assert handle.plan_for(1) == ray.get(actor.plan_for.remote(1))  # a whole state again
    ray.kill(actor)

    actor, handle = _controller_after_epoch_0(tmp_path / "b", "summary-old")
    del meta["controller"]["actor"]  # a checkpoint without what the actor was set up with
    write_meta(tmp_path / "b" / "ray" / "checkpoint_2026-12-01_00-00-00.000000", meta)
    _kill_and_wait_until_empty(actor)
    with pytest.raises(RuntimeError, match="could not restore .* does not hold what the "
                                           "controller was set up with"):
        _final_summary(actor)
    ray.kill(actor)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_checkpoints_controller_state_asked_ahead_survives_a_lost_controller(
        ray_cluster, tmp_path):
    # Rank 0 asks for the state a checkpoint saves before writing its shard, and collects it
    # after: the same state as plan_for and state_dict give, and when the controller was lost
    # in between, the state restored from the checkpoint with the epoch's record and norms
    # sent again.
    import ray

    actor, handle = _controller_after_epoch_0(tmp_path, "ahead")
    handle.send_checkpoint_state(1)
    assert handle.checkpoint_state(1) == handle.state_dict()
    handle.submit_norms(1, 0, {b: 0.5 for b in range(4)}, _record(1))
    _kill_and_wait_until_empty(actor)
    handle.send_checkpoint_state(2)
    state = handle.checkpoint_state(2)
    assert state == handle.state_dict()
    timeline = ray.get(actor.timeline.remote())
    assert [r.epoch for r in timeline] == [0, 1] and timeline[1].train_loss == 0.5
    assert handle.plan_for(2) is not None
    # Not asked ahead, or asked ahead for another decision: a plain round trip.
    assert handle.checkpoint_state(2) == state
    handle.send_checkpoint_state(1)
    assert handle.checkpoint_state(2) == state
    ray.kill(actor)
