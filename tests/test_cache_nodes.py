"""The activation cache on a two-node cluster on one machine (``ray.cluster_utils.Cluster``, each
node with its own object store): one owner per node, reads that stay on the node after the
first epoch at a depth, killed owners and a lost node that turn into remote reads and then
misses (never a wrong row), figures that count each row once however many nodes copy it, and a
tiny job with the cache on that still ends where the reference does."""

from __future__ import annotations

import sys
import time
import types
import uuid

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch import nn

from pt_ray.data.sampler import CacheBlocks, GlobalSampler
from pt_ray.models.base import iter_layers, layer_names
from pt_ray.runtime.checkpoint import load_layers
from pt_ray.cache.prefix import CachedPrefix
from pt_ray.runtime.reference import build_reference
from pt_ray.cache.owners import RayStore, cache_name, create_owners, owners_report
from pt_ray.service.trainer import run_on_ray
from pt_ray.service.settings import run_settings
from conftest import SESSION_RAY
from test_cache_ray import wait_until_dead
from test_ray_engine import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STORE_BYTES = 80 * 2**20


@pytest.fixture(scope="module")
def local_cluster():
    """A head without CPUs (no worker or owner lands there) and two 1-CPU nodes with their own
    80 MiB object stores. A session cluster already connected (conftest's ``ray_cluster``) is
    shut down here and started again afterwards. A test that removes a node adds it first."""
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE_BYTES, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_up:  # as conftest's ray_cluster started it
            ray.init(**SESSION_RAY)


@pytest.fixture(scope="module")
def two_nodes(local_cluster):
    """The ids of ``local_cluster``'s two worker nodes."""
    nodes = sorted(n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
    assert len(nodes) == 2
    return nodes


class _Embed(nn.Module):
    """Sample ``i`` -> a ``[2, 8]`` state filled with ``10 i``."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        return ((ids.float() * 10).view(-1, 1, 1).expand(-1, 2, 8).contiguous(),)


class _Block(nn.Module):
    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden + 1,)


@ray.remote(num_cpus=0)
class Replica:
    """Stage 0 of one replica, on its node, with a stand-in model whose rows can be checked."""

    def __init__(self, owners: dict[str, str], blocks: CacheBlocks) -> None:
        torch.set_num_threads(1)
        model = types.SimpleNamespace(embed=_Embed(), blocks=[_Block(), _Block()])
        self.store = RayStore(owners, timeout_s=10)
        self.prefix = CachedPrefix(model, self.store, blocks, torch.device("cpu"))
        # The calls the store makes to each other node's owner by name ("own": the one it
        # writes to), each of which may wait up to timeout_s.
        self.asked: dict[str, int] = {}
        call = self.store._call

        def counted(method, *args, actor=None, **kwargs):
            name = next((n for n, a in self.store.peers.items() if a is actor), "own")
            self.asked[name] = self.asked.get(name, 0) + 1
            return call(method, *args, actor=actor, **kwargs)

        self.store._call = counted

    def epoch(self, steps: list[np.ndarray], level: int) -> dict:
        local, remote = self.store.local_reads, self.store.remote_reads
        asked = dict(self.asked)
        for ids in steps:
            ids = ids.copy()
            (state,) = self.prefix(level, ids, lambda r, ids=ids: (torch.from_numpy(ids[r]),))
            if not torch.equal(state[:, 0, 0], torch.from_numpy(ids).float() * 10 + level):
                raise AssertionError("a cached row differs from its value")
        self.store.drain()
        c = self.prefix.reset()
        return {"rows": c.rows, "hits": c.hits, "advanced": c.advanced, "misses": c.misses,
                "local": self.store.local_reads - local,
                "remote": self.store.remote_reads - remote,
                "asked": {n: k - asked.get(n, 0) for n, k in self.asked.items()}}

    def flush(self) -> None:
        self.store.flush()


def run_epoch(replicas, blocks, epoch, level, batch=32):
    """One epoch of both replicas (each its half of every step), then the end-of-epoch
    flush once both have drained, as the engine orders it."""
    order = GlobalSampler(blocks.num_samples, batch, 0).epoch_order(epoch)  # the run's order
    steps = [order[s:s + batch] for s in range(0, len(order) - batch + 1, batch)]
    per = ray.get([rep.epoch.remote([np.array_split(s, 2)[r] for s in steps], level)
                   for r, rep in enumerate(replicas)])
    ray.get([rep.flush.remote() for rep in replicas])
    return per


def start(nodes, num_samples=256, block_size=16):
    run_id = f"test-nodes-{uuid.uuid4().hex[:6]}"
    owners = create_owners(run_id, 0.5)
    assert sorted(owners) == nodes
    names = {node: cache_name(run_id, node) for node in owners}
    blocks = CacheBlocks(num_samples, block_size, 0)
    replicas = [Replica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(names, blocks) for node in nodes]
    return owners, replicas, blocks


def test_owners_are_per_node_and_reads_stay_local_after_the_first_epoch_at_a_depth(two_nodes):
    owners, replicas, blocks = start(two_nodes)
    locations = ray.get([a.__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()) for a in owners.values()])
    assert locations == list(owners)  # each owner pinned to its node
    cold = run_epoch(replicas, blocks, 0, 1)
    assert [p["misses"] for p in cold] == [128, 128]
    # Epoch 1, depth 1: every row a hit, every object read on its own node.
    warm = run_epoch(replicas, blocks, 1, 1)
    assert [(p["hits"], p["remote"]) for p in warm] == [(128, 0), (128, 0)]
    assert all(p["local"] > 0 for p in warm)
    # A deeper depth: rows advanced from depth 1 (local), then hits at depth 2, all local.
    deeper = run_epoch(replicas, blocks, 2, 2)
    assert [(p["advanced"], p["remote"]) for p in deeper] == [(128, 0), (128, 0)]
    again = run_epoch(replicas, blocks, 3, 2)
    assert [(p["hits"], p["remote"]) for p in again] == [(128, 0), (128, 0)]

    report = owners_report(owners)
    assert sorted(report["nodes"]) == two_nodes
    for figures in report["nodes"].values():
        # Each node holds every block at depth 2 (one object each), none refused.
        assert figures["objects"] == blocks.num_blocks and figures["bytes"] > 0
        assert figures["remote_reads"] == 0 and figures["local_reads"] > 0
        assert figures["refused_rows"] == 0
        assert figures["budget_bytes"] == int(0.5 * STORE_BYTES)
    # The run's figures count each row once; the copies are counted apart.
    assert report["objects"] == blocks.num_blocks
    assert report["stored_objects"] == 2 * blocks.num_blocks
    assert report["stored_bytes"] == 2 * report["bytes"] > 0
    for actor in [*owners.values(), *replicas]:
        ray.kill(actor)


def test_killed_owners_turn_into_remote_reads_then_misses_with_correct_rows(two_nodes):
    owners, replicas, blocks = start(two_nodes)
    run_epoch(replicas, blocks, 0, 1)
    # Node 1's owner dies with its objects: its replica reads node 0's copy (remote).
    ray.kill(owners[two_nodes[1]])
    wait_until_dead(owners[two_nodes[1]])
    after = run_epoch(replicas, blocks, 1, 1)
    assert after[0]["hits"] == 128 and after[0]["remote"] == 0
    assert after[1]["hits"] == 128 and after[1]["remote"] > 0
    # Both owners gone: every row is recomputed (and checked inside the replicas).
    ray.kill(owners[two_nodes[0]])
    wait_until_dead(owners[two_nodes[0]])
    fresh = run_epoch(replicas, blocks, 2, 2)
    assert [p["misses"] for p in fresh] == [128, 128]
    for actor in replicas:
        ray.kill(actor)


def test_tiny_job_on_two_nodes_reads_locally_and_ends_on_the_reference(two_nodes, tmp_path):
    def job(**extra):
        return tiny_config(tmp_path, **{
            "name": "ray-cache-nodes", "cache": {"mode": "on", "block_size": 16},
            "epochs": 4, **extra})

    run = run_on_ray(job(), tmp_path / "run")
    layout = [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in run.timeline]
    assert layout[0] == (0, 2, 1) and layout[2:] == [(3, 1, 2)] * 2
    assert [r.cache_hit_rate for r in run.timeline] == [0.0, 0.0, 1.0, 1.0]
    nodes = run.cache["nodes"]
    assert sorted(nodes) == two_nodes
    # Both replicas' nodes end holding every block at depth 3; the run's figures count it once.
    assert all(n["objects"] == 128 // 16 and n["refused_rows"] == 0 for n in nodes.values())
    assert run.cache["objects"] == run.timeline[-1].cache_objects == 128 // 16
    assert run.cache["stored_objects"] == 2 * 128 // 16
    assert run.cache["stored_bytes"] == 2 * run.cache["bytes"] == 2 * run.timeline[-1].cache_bytes

    reference = build_reference(run_settings(job(engine="reference")).reference)
    reference.fit()
    layers, _ = load_layers(run.checkpoint, layer_names(4))
    worst = max(float((layers[name]["params"][k] - v).abs().max())
                for name, m in iter_layers(reference.adapter) for k, v in m.state_dict().items())
    assert worst <= 1e-4


def _wait_for_node_death(node: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the removed node still shows alive"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_a_lost_node_turns_its_rows_into_misses_or_reads_of_a_surviving_copy(
        local_cluster, two_nodes):
    a, b = two_nodes
    lost = local_cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
    local_cluster.wait_for_nodes()
    x = lost.node_id
    run_id = f"test-lost-{uuid.uuid4().hex[:6]}"
    owners = create_owners(run_id, 0.5)
    assert sorted(owners) == sorted([a, b, x])
    names = {node: cache_name(run_id, node) for node in owners}
    blocks = CacheBlocks(256, 16, 0)
    on = lambda node: Replica.options(  # noqa: E731
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    # The replica on the node to be lost computes every row; node b's owner copies the even
    # blocks (as b's worker would at an epoch's end), node a's holds nothing.
    rx, ra = on(x).remote(names, blocks), on(a).remote(names, blocks)
    # Node a's replica must have built its store (found x's owner alive) before x goes: actor
    # creation is asynchronous and, on a loaded host, can outlast the rest of the setup.
    ray.get([rx.__ray_ready__.remote(), ra.__ray_ready__.remote()])
    order = GlobalSampler(blocks.num_samples, 32, 0).epoch_order(0)
    steps = [order[s:s + 32] for s in range(0, len(order), 32)]
    assert ray.get(rx.epoch.remote(steps, 1))["misses"] == 256
    ray.get(rx.flush.remote())
    held = ray.get(owners[x].holdings.remote())
    copied = [e for e in held if e[0] % 2 == 0]
    assert len(held) == blocks.num_blocks and ray.get(owners[b].adopt.remote(copied)) > 0
    kept = sum(len(e[3]) for e in copied)

    local_cluster.remove_node(lost)  # its owner, its replica and its objects go with it
    _wait_for_node_death(x)
    # Node a's replica still holds a handle to the lost owner: the copied rows are read from
    # b (remote), the rest recomputed; every row is checked inside the replica.
    after = ray.get(ra.epoch.remote(steps, 1))
    assert (after["hits"], after["misses"], after["local"]) == (kept, 256 - kept, 0)
    # The lost owner cost one call (the epoch's lookup, bounded by the store's timeout), not
    # one per step or per row.
    assert after["remote"] > 0 and after["asked"][names[x]] == 1

    # A worker started after its node's owner died (a restart): b's owner stands in for it,
    # reads and writes; the lost node's owner is left out, never a crash.
    ray.kill(owners[a])
    wait_until_dead(owners[a])
    fresh = on(a).remote(names, blocks)
    first = ray.get(fresh.epoch.remote(steps, 1))
    assert (first["hits"], first["misses"], first["local"]) == (kept, 256 - kept, 0)
    ray.get(fresh.flush.remote())
    second = ray.get(fresh.epoch.remote(steps, 1))
    assert (second["hits"], second["local"]) == (256, 0) and second["remote"] > 0
    report = owners_report({node: owners[node] for node in (a, b)}, timeout_s=10)
    assert report["nodes"][a] == {} and report["nodes"][b]["objects"] == blocks.num_blocks
    for actor in [owners[b], ra, fresh]:
        ray.kill(actor)
