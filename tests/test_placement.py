"""A cluster that cannot place the run's workers says so: at once when it never can (no
autoscaler), after ``pipeline.placement_timeout_s`` when other jobs hold the room, in one line
naming the shortfall and the fields to change."""

from __future__ import annotations

import logging
import os
import functools
import re
import time

import pytest

from pt_ray.core.config import ConfigError, build_config
from pt_ray.core.placement import (
    ClusterView,
    Demand,
    PlacementError,
    check_placement,
    demand_for,
    has_autoscaler,
    timeout_message,
    workers_fitting,
)

pytestmark = pytest.mark.timeout(120)

ANONYMOUS = "node_" + "ab" * 28  # how Ray names a node no node provider launched


def view(*nodes: dict, free: tuple[dict, ...] | None = None, **extra) -> ClusterView:
    return ClusterView(nodes_total=nodes, nodes_free=nodes if free is None else free, **extra)


# -- the decision (no cluster) -------------------------------------------------------------------


@pytest.mark.unit
def test_demand_counts_min_workers_and_a_gpu_per_worker():
    p = build_config({"pipeline": {"num_workers": 4}}).pipeline
    assert str(demand_for(p, use_gpu=False)) == "4 x {CPU: 1}"
    elastic = build_config({"pipeline": {"num_workers": 4, "min_workers": 2,
                                         "cpus_per_worker": 0.5}}).pipeline
    demand = demand_for(elastic, use_gpu=True)
    assert (str(demand), demand.elastic) == ("2 x {CPU: 0.5, GPU: 1}", True)
    assert p.placement_timeout_s == 60.0


@pytest.mark.unit
def test_placement_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="pipeline.placement_timeout_s"):
        build_config({"pipeline": {"placement_timeout_s": 0}})


@pytest.mark.unit
def test_too_small_without_autoscaler_fails_at_once_naming_the_fields():
    check = check_placement(Demand(4, {"CPU": 1.0}), view({"CPU": 2.0}))

    assert check.verdict == "never"
    assert check.message == (
        "4 x {CPU: 1} requested, the cluster has 2 CPUs and no autoscaler; choose "
        "pipeline.num_workers <= 2 (or pipeline.min_workers <= 2 to start with fewer), "
        "pipeline.cpus_per_worker <= 0.5, or add nodes")


@pytest.mark.unit
def test_each_worker_must_fit_within_one_node():
    nodes = ({"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0})
    assert workers_fitting(nodes, {"CPU": 3.0}) == 0
    check = check_placement(Demand(2, {"CPU": 3.0}), view(*nodes))

    assert check.verdict == "never"
    assert check.message == (
        "2 x {CPU: 3} requested, the cluster has 6 CPUs on 3 nodes and no autoscaler, but a "
        "worker must fit within one node and none does (the largest node has 2 CPUs); choose "
        "pipeline.cpus_per_worker <= 2, or add nodes")
    two = check_placement(Demand(3, {"CPU": 3.0}), view({"CPU": 4.0}, {"CPU": 4.0}, {"CPU": 2.0}))
    assert ", but a worker must fit within one node and only 2 do (the largest node has 4 " \
           "CPUs); choose pipeline.num_workers <= 2" in two.message


@pytest.mark.unit
def test_gpu_and_elastic_runs_get_their_own_fixes():
    gpu = check_placement(Demand(2, {"CPU": 1.0, "GPU": 1.0}), view({"CPU": 1.0, "GPU": 2.0}))
    assert gpu.message == (
        "2 x {CPU: 1, GPU: 1} requested, the cluster has 1 CPU and 2 GPUs and no autoscaler; "
        "choose pipeline.num_workers <= 1 (or pipeline.min_workers <= 1 to start with fewer), "
        "pipeline.cpus_per_worker <= 0.5, pipeline.use_gpu=false to train on CPUs, or add nodes")

    elastic = check_placement(Demand(3, {"CPU": 1.0}, elastic=True), view({"CPU": 2.0}))
    assert "choose pipeline.min_workers <= 2, pipeline.cpus_per_worker <= 0.66," in (
        elastic.message)


@pytest.mark.unit
def test_busy_cluster_waits_and_then_fails_with_what_is_free():
    busy = view({"CPU": 4.0}, free=({"CPU": 1.0},))
    demand = Demand(2, {"CPU": 1.0})

    check = check_placement(demand, busy)
    assert check == check_placement(demand, busy)  # plain data
    assert check.verdict == "wait"
    assert check.message == ("waiting for 2 x {CPU: 1}: the cluster has 1 of its 4 CPUs free "
                             "(other jobs hold the rest)")
    assert timeout_message(demand, busy, 3.2, 3) == (
        "2 x {CPU: 1} requested, the cluster has 1 of its 4 CPUs free after waiting 3 s "
        "(pipeline.placement_timeout_s=3): other jobs hold the rest; choose "
        "pipeline.num_workers <= 1 (or pipeline.min_workers <= 1 to start with fewer), "
        "pipeline.cpus_per_worker <= 0.5, or raise pipeline.placement_timeout_s, or retry when "
        "they finish")
    assert check_placement(demand, view({"CPU": 4.0})).verdict == "fits"


@pytest.mark.unit
def test_with_an_autoscaler_a_small_cluster_waits_up_to_its_limits():
    demand = Demand(4, {"CPU": 1.0})
    check = check_placement(demand, view({"CPU": 2.0}, autoscaler=True))
    assert (check.verdict, check.message) == (
        "wait", "waiting for 4 x {CPU: 1}: the cluster has 2 of its 2 CPUs free; the autoscaler "
                "may add nodes")

    capped = check_placement(demand, view({"CPU": 2.0}, autoscaler=True,
                                          max_total={"CPU": 3.0}))
    assert (capped.verdict, capped.message) == (
        "never", "4 x {CPU: 1} requested, the autoscaler lets the cluster grow to at most "
                 "3 CPUs; choose pipeline.num_workers <= 3 (or pipeline.min_workers <= 3 to "
                 "start with fewer), pipeline.cpus_per_worker <= 0.75, or raise the autoscaler "
                 "limits")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("groups", "types", "pending", "expected"),
    [
        ([], [], 0, False),                       # a local cluster, `ray start` by hand
        ([(2, 2)], [ANONYMOUS], 0, False),        # fixed node groups
        ([(0, 4)], [], 0, True),                  # a group that can grow
        ([(1, -1)], [], 0, True),                 # without an upper bound
        ([], [ANONYMOUS, ""], 0, False),
        ([], [ANONYMOUS, "ray.worker.gpu"], 0, True),  # launched by a node provider
        ([], [ANONYMOUS], 2, True),               # nodes being launched
    ],
)
def test_autoscaler_detection(groups, types, pending, expected):
    assert has_autoscaler(groups, types, pending) is expected


# -- on a local cluster --------------------------------------------------------------------------


@pytest.mark.unit
def test_the_preemption_watcher_runs_only_where_a_node_can_be_drained(monkeypatch):
    from pt_ray.service.trainer import _train_env, watches_preemption

    one = {"CPU": 2.0}
    assert not watches_preemption(view(one))
    assert watches_preemption(view(one, one))  # another node may be drained
    assert watches_preemption(view(one, autoscaler=True))  # it drains the nodes it removes
    assert watches_preemption(ClusterView((), ()))  # the cluster could not be read

    start, watcher = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    monkeypatch.delenv(start, raising=False)
    monkeypatch.delenv(watcher, raising=False)
    with _train_env(30, watch_preemption=False):
        assert (os.environ[start], os.environ[watcher]) == ("30", "0")
    assert start not in os.environ and watcher not in os.environ  # set for the run only
    with _train_env(30, watch_preemption=True):
        assert watcher not in os.environ  # Ray Train's default: on
    # What the user set is theirs.
    monkeypatch.setenv(watcher, "1")
    monkeypatch.setenv(start, "600")
    with _train_env(30, watch_preemption=False):
        assert (os.environ[start], os.environ[watcher]) == ("600", "1")
    assert (os.environ[start], os.environ[watcher]) == ("600", "1")


def tiny(tmp_path, **pipeline) -> dict:
    return {
        "name": "placement",
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 32, "image_size": 8,
                 "batch_size": 8},
        "pipeline": pipeline,
        "epochs": 1,
        "output_dir": str(tmp_path / "runs"),
    }


@pytest.fixture
def no_worker_may_start(monkeypatch):
    """Past the check, ``_run`` starts the actors and Ray Train's workers: fail instead."""
    from pt_ray.service import trainer

    def started(*args, **kwargs):
        raise AssertionError("the run got past the placement check")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer, "_run", started)


def cpus(settle_s: float = 10.0) -> tuple[float, float]:
    """The cluster's CPUs and its free ones, once those freed by earlier tests are back
    (a removed placement group returns its CPUs a moment later)."""
    import ray

    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + settle_s
    while (free := ray.available_resources().get("CPU", 0.0)) < total:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return total, free


def hold_cpus(amount: float):
    """A placement group that holds ``amount`` CPUs, as another job would."""
    from ray.util.placement_group import placement_group

    held = placement_group([{"CPU": amount}])
    assert held.wait(30)
    return held


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class Probes:
    """The probe placement groups :func:`pt_ray.service.placement.wait_for_room` made: the
    seconds each of their waits asked Ray for, and Ray's answers.

    :meth:`clock` reads the seconds asked so far: given to ``wait_for_room`` as its clock, the
    time it counts is the time it asked Ray to wait, whatever this host's speed.
    """

    def __init__(self) -> None:
        self.made = 0
        self.waits: list[float] = []
        self.answers: list[bool] = []
        self.before_wait = lambda: None  # runs as each wait begins

    def clock(self) -> float:
        return float(sum(self.waits))


@pytest.fixture
def probes(monkeypatch) -> Probes:
    from pt_ray.service import placement

    seen, make = Probes(), placement.placement_group

    def recorded(*args, **kwargs):
        group = make(*args, **kwargs)
        wait = group.wait

        def recorded_wait(timeout_seconds):
            seen.waits.append(timeout_seconds)
            seen.before_wait()
            seen.answers.append(wait(timeout_seconds))
            return seen.answers[-1]

        group.wait = recorded_wait
        seen.made += 1
        return group

    monkeypatch.setattr(placement, "placement_group", recorded)
    return seen


@pytest.fixture
def placement_lines():
    handler = Lines()
    log = logging.getLogger("pt_ray.service.placement")
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


@pytest.mark.ray
def test_a_cluster_too_small_fails_at_once_before_any_worker(ray_cluster, tmp_path,
                                                             no_worker_may_start, probes,
                                                             placement_lines):
    from pt_ray.api import fit
    from pt_ray.service.placement import read_cluster

    total, _ = cpus()
    local = read_cluster()
    assert local.autoscaler is False and local.total("CPU") == total

    with pytest.raises(PlacementError) as err:
        # 2 CPUs a worker, twice what the cluster has; it must not wait out the 30 s.
        fit(tiny(tmp_path, num_workers=int(total), cpus_per_worker=2, placement_timeout_s=30))

    # Decided from the cluster's figures alone: no probe placed, no wait begun or announced.
    assert (probes.made, probes.waits, placement_lines) == (0, [], [])
    message = str(err.value)
    assert message.startswith(f"{int(total)} x {{CPU: 2}} requested, the cluster has "
                              f"{total:g} CPUs and no autoscaler; ")
    for name in ("pipeline.num_workers", "pipeline.min_workers", "pipeline.cpus_per_worker"):
        assert name in message
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.ray
def test_a_busy_cluster_fails_after_the_timeout(ray_cluster, tmp_path, no_worker_may_start,
                                               placement_lines, probes, monkeypatch):
    from ray.util.placement_group import remove_placement_group

    from pt_ray.api import fit
    from pt_ray.service import placement, trainer

    monkeypatch.setattr(trainer, "wait_for_room",
                        functools.partial(placement.wait_for_room, clock=probes.clock))
    total, free = cpus()
    held = hold_cpus(free - 1)  # one CPU left free: two workers of one CPU wait
    try:
        with pytest.raises(PlacementError) as err:
            fit(tiny(tmp_path, num_workers=2, placement_timeout_s=3))
    finally:
        remove_placement_group(held)

    # One probe, whose one wait (of the whole timeout) Ray answered "not placed"; then the run
    # failed without waiting again.
    assert (probes.made, probes.waits, probes.answers) == (1, [3], [False])
    assert str(err.value).startswith(
        f"2 x {{CPU: 1}} requested, the cluster has 1 of its {total:g} CPUs free after waiting "
        "3 s (pipeline.placement_timeout_s=3): other jobs hold the rest; choose "
        "pipeline.num_workers <= 1")
    assert placement_lines[0].startswith(
        f"waiting for 2 x {{CPU: 1}}: the cluster has 1 of its {total:g} CPUs free (other "
        "jobs hold the rest); failing in 3 s")
    assert not (tmp_path / "runs").exists()


@pytest.mark.ray
def test_the_wait_ends_when_the_room_frees(ray_cluster, placement_lines, probes):
    from ray.util.placement_group import remove_placement_group

    from pt_ray.service.placement import wait_for_room

    _, free = cpus()
    held = hold_cpus(free)
    released: list[int] = []

    def release_once():  # as the first wait begins: the room frees while the run waits
        if not released:
            remove_placement_group(held)
            released.append(len(probes.waits))

    probes.before_wait = release_once
    try:
        # The timeout counts the seconds asked of Ray (probes.clock): 60 waits of 1 s.
        view = wait_for_room(Demand(2, {"CPU": 1.0}), timeout_s=60, report_every_s=1,
                             clock=probes.clock)
    finally:
        if not released:
            remove_placement_group(held)

    # It waited (the room freed during its first wait), then returned instead of failing at
    # the timeout: placed, or seen to fit at the next read.
    assert released == [1] and probes.made == 1 and set(probes.waits) == {1}
    assert len(probes.waits) < 60 and probes.answers[:-1] == [False] * (len(probes.answers) - 1)
    assert view.autoscaler is False
    # Waiting lines, then (when the probe, not a re-read, saw the room first) one line saying
    # the room came: which of the two ends the wait depends on the machine's timing.
    waiting = placement_lines
    if placement_lines and placement_lines[-1].startswith("room for "):
        assert placement_lines[-1].startswith("room for 2 x {CPU: 1} after ")
        waiting = placement_lines[:-1]
    assert waiting and all(line.startswith("waiting for 2 x {CPU: 1}: ") for line in waiting)
    assert cpus()[1] == free  # the probe's placement group is gone


@pytest.mark.ray
def test_ray_trains_own_wait_is_bounded_by_the_timeout(ray_cluster, tmp_path, monkeypatch):
    """The check passed, then another job took the room (a race lost): Ray Train's own wait for
    its workers gives up after ``placement_timeout_s`` (one try with ``max_failures=0``) and
    ends in the same kind of line."""
    from ray.train import TrainingFailedError
    from ray.util.placement_group import remove_placement_group

    from pt_ray.api import fit
    from pt_ray.service import trainer

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    monkeypatch.setattr(trainer, "wait_for_room", lambda *args: ClusterView((), ()))
    total, free = cpus()
    held = hold_cpus(free - 1)
    try:
        with pytest.raises(PlacementError) as err:
            fit(tiny(tmp_path, num_workers=2, placement_timeout_s=3, max_failures=0))
    finally:
        remove_placement_group(held)

    # Ray Train's own wait gave up at pipeline.placement_timeout_s, not at its default 30 s.
    failed = err.value.__cause__.controller_failure
    assert "startup timed out after 3.0 seconds waiting for 2 workers" in str(failed)
    assert str(err.value).startswith(
        f"Ray Train could not place the workers: 2 x {{CPU: 1}} requested, the cluster has 1 "
        f"of its {total:g} CPUs free after waiting ")
    assert "(pipeline.placement_timeout_s=3)" in str(err.value)
    assert isinstance(err.value.__cause__, TrainingFailedError)
    assert "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S" not in os.environ  # set for the run only
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ


@pytest.mark.ray
def test_cli_prints_one_line_and_exits_2(ray_cluster, tmp_path, capsys, no_worker_may_start):
    from pt_ray.cli import main

    total, _ = cpus()
    out = tmp_path / "out"
    code = main(["train", "--set", "model.depth=2", "--set", "model.width=32",
                 "--set", "model.num_heads=2", "--set", f"pipeline.num_workers={int(total)}",
                 "--set", "pipeline.cpus_per_worker=2", "--set", "epochs=1",
                 "--output", str(out)])
    # Ray forwards its own actors' output (an earlier run's) to this stderr too: leave it out.
    err = [line for line in capsys.readouterr().err.splitlines()
           if not re.match(r"(\x1b\[\d+m)?\(\w+ pid=\d+", line)]

    assert code == 2
    assert len(err) == 1 and err[0].startswith(
        f"pt-ray: error: {int(total)} x {{CPU: 2}} requested, the cluster has {total:g} CPUs "
        "and no autoscaler; choose pipeline.num_workers"), err
    assert not out.exists()
