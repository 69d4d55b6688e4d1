"""A run stopped in the middle of a freeze transition (``KeyboardInterrupt`` in ``fit``, as
Ctrl-C or a stopped job gives the driver): no actor of the run stays alive, every checkpoint
in storage is whole, and ``fit(resume_from=...)`` continues it to where a run that was never
stopped ends."""

from __future__ import annotations

import _thread
import threading
import time
from pathlib import Path

import pytest

from pt_ray.api import fit
from pt_ray.runtime.checkpoint import damage
from pt_ray.runtime.faults import FAULT_ENV
from test_ray_engine import max_difference, reference_layers, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

RUN_ACTORS = ("pt-ray-controller:", "pt-ray-cache:")


def alive_actors_of(run_name: str) -> list[str]:
    """Live actors of the run (its controller and cache owners, by name) and any live Ray
    Train worker or controller (no other run is training in this test)."""
    import ray._private.state as state

    found = []
    for info in state.actors().values():
        if info["State"] != "ALIVE":
            continue
        name, cls = info.get("Name") or "", info["ActorClassName"]
        if (name.startswith(RUN_ACTORS) and run_name in name) or "RayTrainWorker" in cls \
                or "TrainController" in cls:
            found.append(f"{cls} {name}".strip())
    return found


def interrupt_when(marker: Path, stop: threading.Event, run_name: str, seen: list) -> None:
    """Raise KeyboardInterrupt in the main thread once ``marker`` appears (the stalled rank
    wrote it: the transition is in flight), noting in ``seen`` the run's live actors then."""
    while not stop.is_set():
        if marker.exists():
            time.sleep(1.0)
            seen.extend(alive_actors_of(run_name))
            _thread.interrupt_main()
            return
        time.sleep(0.1)


def test_a_run_stopped_mid_transition_leaves_nothing_running_and_resumes_to_the_end(
        ray_cluster, tmp_path_factory, tmp_path):
    name = "stopped-mid-transition"
    cfg = tiny_config(tmp_path, name=name, cache={"mode": "on", "block_size": 16})
    marker = tmp_path / "stalled"
    stop, before = threading.Event(), []
    watcher = threading.Thread(target=interrupt_when, args=(marker, stop, name, before),
                               daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        # Ray's wait inside Ray Train turns the interrupt into SystemExit(1), as on Ctrl-C.
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            # Rank 0 stalls at the start of the transition into epoch 2 (2 -> 3 blocks frozen).
            fit(cfg, worker_env={FAULT_ENV: f"stall:2:0:0:{marker}"})
    finally:
        stop.set()
    stopped_s = time.monotonic() - t0
    assert marker.exists()
    # The check below sees the run's actors while they live: controller, cache owner, workers.
    assert any(a.startswith("ControllerActor") for a in before), before
    assert sum("RayTrainWorker" in a for a in before) == 2, before

    deadline = time.monotonic() + 60
    while (left := alive_actors_of(name)) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not left, f"still alive after the stop: {left}"
    cleared_s = time.monotonic() - t0 - stopped_s
    run_dir = tmp_path / name
    checkpoints = [p for p in (run_dir / "ray").glob("*/checkpoint_*") if p.is_dir()]
    assert checkpoints and all(damage(p) is None for p in checkpoints)
    assert not (run_dir / "summary.json").exists()

    resumed = fit(resume_from=run_dir)
    assert [r.epoch for r in resumed.timeline] == [0, 1, 2]
    assert [r.num_frozen for r in resumed.timeline] == [0, 2, 3]
    reference = reference_layers(tmp_path_factory)
    assert max_difference(resumed.checkpoint, reference) <= 1e-4
    print(f"stopped {stopped_s:.1f} s after the start, mid-transition; nothing of the run "
          f"alive {cleared_s:.1f} s later")
