"""A node lost in the middle of an epoch, on a three-node ``ray.cluster_utils.Cluster`` (a head
without CPUs and two 1-CPU nodes, one training worker on each): Ray Train sees the worker on the
lost node die, waits ``pipeline.placement_timeout_s`` for room for both workers again, then
restarts the group on the one node left (``pipeline.min_workers=1``); the controller re-plans
for one worker from the checkpoint, and the run ends within 1e-4 of the reference trainer's
parameters (the same global sample order). The recovery it prints (the node's removal to the
next checkpoint in storage) is mostly that wait.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from pt_ray.api import fit
from pt_ray.runtime.faults import FAULT_ENV
from conftest import SESSION_RAY
from test_ray_engine import max_difference, reference_layers, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture
def three_nodes():
    """A head without CPUs and two 1-CPU worker nodes (the session cluster, if up, is shut
    down here and started again afterwards)."""
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_up:
            ray.init(**SESSION_RAY)


def node_of_pid(pid: int) -> str | None:
    """The node id of the live actor whose process is ``pid``."""
    import ray._private.state as state

    for info in state.actors().values():
        if info["State"] == "ALIVE" and info.get("Pid") == pid:
            return info["Address"]["NodeID"]
    return None


def test_a_node_lost_mid_epoch_goes_on_with_the_worker_left(three_nodes, tmp_path,
                                                            tmp_path_factory):
    cfg = tiny_config(tmp_path, name="node-lost", pipeline={
        "num_workers": 2, "min_workers": 1, "schedule": "1f1b", "policy": "paper",
        "collective_timeout_s": 10, "placement_timeout_s": 20})
    marker = tmp_path / "stalled"
    outcome: dict = {}

    def run() -> None:
        try:
            # Rank 1 holds still before step 3 of epoch 1: its node goes while it waits.
            outcome["result"] = fit(cfg, worker_env={FAULT_ENV: f"stall:1:3:1:{marker}"})
        except BaseException as err:  # reported by the assertion below
            outcome["error"] = err

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline and runner.is_alive(), outcome
        time.sleep(0.2)
    pid = int(marker.read_text().rsplit("pid ", 1)[1].rstrip(")\n"))
    node_id = node_of_pid(pid)
    lost = [n for n in three_nodes.list_all_nodes() if n.node_id == node_id]
    assert len(lost) == 1 and lost[0] is not three_nodes.head_node
    storage = tmp_path / "node-lost" / "ray"
    before = {p.name for p in storage.glob("*/checkpoint_*")}
    removed_at = time.monotonic()
    three_nodes.remove_node(lost[0])

    # Recovery: from the node's removal to the next checkpoint in storage (epoch 1 trained
    # again on the worker left).
    recovered_s = None
    while runner.is_alive() and recovered_s is None:
        if {p.name for p in storage.glob("*/checkpoint_*")} - before:
            recovered_s = time.monotonic() - removed_at
        time.sleep(0.2)
    runner.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.restarts == 1
    assert [r.epoch for r in result.timeline] == [0, 1, 2]
    assert [r.num_frozen for r in result.timeline] == [0, 2, 3]
    # Epoch 0 on two workers; epochs 1 and 2, trained after the loss, on the one left.
    assert result.timeline[0].pipeline_length * result.timeline[0].num_replicas == 2
    assert [r.pipeline_length * r.num_replicas for r in result.timeline[1:]] == [1, 1]
    assert max_difference(result.checkpoint, reference_layers(tmp_path_factory)) <= 1e-4
    print(f"node removed mid-epoch: next checkpoint {recovered_s:.1f} s later")
