"""The activation cache in Ray's object store: shared across processes, owned by the cache actor,
and every failure a miss; a tiny job with the cache on ends where the reference does."""

from __future__ import annotations

import sys
import time
import types
import uuid

import numpy as np
import pytest
import ray
import torch

from pt_ray.cache.size import resolve_cache_sizes
from pt_ray.core.config import build_config
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import CacheBlocks
from pt_ray.models.base import iter_layers, layer_names
from pt_ray.runtime.checkpoint import load_layers
from pt_ray.cache.prefix import CachedPrefix
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.reference import build_reference
from pt_ray.cache.owners import CacheActor, RayStore, store_capacities
from pt_ray.service.trainer import run_on_ray
from pt_ray.service.settings import run_settings
from conftest import SESSION_RAY
from test_ray_engine import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# The actors below are defined here; Ray's workers cannot import a test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def new_cache(**kw):
    name = f"test-cache-{uuid.uuid4().hex[:8]}"
    actor = CacheActor.options(name=name).remote(kw.pop("budget_fraction", 0.5), **kw)
    return name, actor


def rows(ids, level):
    ids = np.asarray(ids, dtype=np.int64)
    return ids, [np.stack([np.arange(4, dtype=np.float32) + 10 * i + level for i in ids])]


@ray.remote(num_cpus=0)
class Writer:
    """A stand-in for a stage-0 worker in its own process."""

    def write(self, name, block, size, level, ids):
        store = RayStore(name)
        ids, arrays = rows(ids, level)
        store.write(block, size, level, ids, arrays, ["float32"])
        return store.stats().objects  # a call after the write: the write has landed


def test_rows_written_by_one_process_are_read_by_another_after_it_died(ray_cluster):
    name, actor = new_cache()
    writer = Writer.remote()
    assert ray.get(writer.write.remote(name, 3, 4, 2, [8, 1, 5, 2])) == 1
    ray.kill(writer)  # the writer is gone; the cache actor owns the object
    store = RayStore(name)
    (seg,) = store.read([3], 2)
    assert (seg.block, seg.level, seg.ids.tolist()) == (3, 2, [1, 2, 5, 8])
    np.testing.assert_array_equal(seg.arrays[0], rows([1, 2, 5, 8], 2)[1][0])
    assert not seg.arrays[0].flags.writeable  # a zero-copy view of the object store
    assert store.read([3], 1) == [] and store.read([4], 2) == []
    ray.kill(actor)


def test_reads_see_the_index_of_their_epoch_and_writes_go_in_batches(ray_cluster):
    name, actor = new_cache()
    store = RayStore(name, batch_bytes=10**6)
    store.write(0, 2, 1, *rows([0, 1], 1), ["float32"])
    assert ray.get(actor.stats.remote()).objects == 0      # still waiting in the batch
    store.drain()                                          # sent, landed; a new epoch
    assert [s.block for s in store.read([0, 1], 1)] == [0]
    store.write(1, 2, 1, *rows([2, 3], 1), ["float32"])
    assert store.stats().objects == 2                      # landed, but this epoch's
    assert [s.block for s in store.read([0, 1], 1)] == [0]   # snapshot does not show it
    store.drain()
    assert [s.block for s in store.read([0, 1], 1)] == [0, 1]
    ray.kill(actor)


def test_budget_refuses_rows_which_then_read_as_misses(ray_cluster):
    name, actor = new_cache(budget_bytes=100)
    store = RayStore(name)
    store.write(0, 2, 1, *rows([0, 1], 1), ["float32"])   # 48 bytes: admitted
    store.write(1, 2, 1, *rows([2, 3], 1), ["float32"])   # would pass 100: refused
    stats = store.stats()
    assert (stats.objects, stats.refused_rows, stats.budget_bytes) == (1, 2, 100)
    assert [s.block for s in store.read([0, 1], 1)] == [0]
    ray.kill(actor)


def test_an_epochs_end_stores_its_incomplete_blocks_in_one_object(ray_cluster):
    name, actor = new_cache()
    store = RayStore(name, batch_bytes=10**6)
    for block in range(6):  # every block lacks half its rows (a freeze landed mid-epoch)
        store.write(block, 4, 2, *rows([4 * block, 4 * block + 1], 2), ["float32"])
    store.drain()
    store.flush()
    entries = ray.get(actor.lookup.remote(None, 2))
    assert len({ref for _, _, (ref, _) in entries}) == 1  # one put, not six
    assert sorted(index for _, _, (_, index) in entries) == list(range(6))
    segments = store.read(range(6), 2)
    assert [s.block for s in segments] == list(range(6))
    for seg in segments:
        assert seg.ids.tolist() == [4 * seg.block, 4 * seg.block + 1]
        np.testing.assert_array_equal(seg.arrays[0], rows(seg.ids, 2)[1][0])
    # The next epoch completes block 1 from the pack's rows plus new ones: a block of its own.
    store.write(1, 4, 2, *rows([6, 7], 2), ["float32"])
    store.drain()
    (seg,) = store.read([1], 2)
    assert seg.ids.tolist() == [4, 5, 6, 7]
    np.testing.assert_array_equal(seg.arrays[0], rows([4, 5, 6, 7], 2)[1][0])
    assert store.stats().objects == 6
    ray.kill(actor)


class Names:
    """A store's way to the owners' names: ``{}`` until :meth:`up`, as a controller answers
    before its owners answer; records how it was asked."""

    def __init__(self):
        self.names: dict[str, str] = {}
        self.asked: list[bool] = []

    def __call__(self, wait):
        self.asked.append(wait)
        return self.names

    def up(self, name):
        self.names = {ray.get_runtime_context().get_node_id(): name}


def test_writes_made_while_the_owners_start_are_held_then_land_and_steps_never_wait(ray_cluster):
    names = Names()
    store = RayStore(names, batch_bytes=1, max_inflight=3, ask_every_s=3600)
    store.drain()
    store.flush()
    assert store.stats().objects == 0
    assert names.asked == []  # an epoch's end asks nothing before the cache is used
    store.write(0, 2, 1, *rows([0, 1], 1), ["float32"])   # held in this node's store
    assert store.read([0], 1) == []                       # a miss, not a wait
    store.write(1, 2, 1, *rows([2, 3], 1), ["float32"])
    store.write(2, 2, 1, *rows([4, 5], 1), ["float32"])
    store.write(3, 2, 1, *rows([6, 7], 1), ["float32"])   # past max_inflight: dropped
    # Within a step the store asked once, without waiting (then not again for ask_every_s).
    assert names.asked == [False]
    name, actor = new_cache()
    names.up(name)
    store.drain()  # the epoch's end asks, waiting: the held rows land
    assert names.asked == [False, True]
    assert [s.block for s in store.read(range(4), 1)] == [0, 1, 2]
    stats = store.stats()
    assert (stats.objects, stats.refused_rows) == (3, 2)  # block 3's two rows never sent
    ray.kill(actor)


def test_the_owners_start_with_the_controller_answer_once_up_and_die_with_it(
        ray_cluster, tmp_path):
    from pt_ray.cache.owners import cache_name, cache_nodes
    from pt_ray.service.controller import ControllerActor, RayController, controller_name

    cfg = job(tmp_path, pipeline={"num_workers": 1, "policy": "paper"})
    def owner_names(run: str) -> list[str]:
        return [cache_name(run, node) for node in cache_nodes()]

    def started(names: list[str]) -> list[str]:
        found = []
        for name in names:
            try:
                ray.get_actor(name)
                found.append(name)
            except ValueError:
                pass
        return found

    # A config that rules the cache out (no cache run id) starts no owner.
    off = f"no-owners-{uuid.uuid4().hex[:8]}"
    idle = ControllerActor.options(name=controller_name(off)).remote(
        cfg.model_dump(mode="json"), None, None)
    assert RayController(controller_name(off), timeout_s=60).cache_owners(True) == {}
    assert started(owner_names(off)) == []
    ray.kill(idle)

    # Otherwise the owners start with the controller, before any worker sets it up or any
    # plan reads the cache, and are named once each answers.
    run = f"owners-{uuid.uuid4().hex[:8]}"
    actor = ControllerActor.options(name=controller_name(run)).remote(
        cfg.model_dump(mode="json"), None, run)
    handle = RayController(controller_name(run), timeout_s=60)
    deadline = time.monotonic() + 60
    while started(owner_names(run)) != owner_names(run):
        assert time.monotonic() < deadline, "the controller did not start its cache owners"
        time.sleep(0.2)
    named = handle.cache_owners(True)  # waits until every owner answers
    assert sorted(named.values()) == sorted(owner_names(run))
    assert ray.get([ray.get_actor(n).lineage.remote() for n in owner_names(run)]) == [0] * len(
        owner_names(run))
    # The driver kills the controller at the end; its owners go with it.
    ray.kill(actor)
    deadline = time.monotonic() + 60
    while started(owner_names(run)):
        assert time.monotonic() < deadline, "the cache owners outlived their controller"
        time.sleep(0.2)


@ray.remote(num_cpus=0)
class Owner:
    def make(self):
        # Large enough (1 MiB) to live in the object store rather than inline in the reply.
        return [ray.put((np.arange(2), (np.zeros((2, 2**17), np.float32),), ("float32",)))]



@ray.remote(num_cpus=0)
def readable(refs):
    try:
        ray.get(refs[0], timeout=5)
        return True
    except ray.exceptions.RayError:
        return False


def kill_owner(owner, ref):
    """Kill ``owner`` and wait until its object reads as lost (probing from tasks: a read in
    this process before the death is known would keep the object here)."""
    ray.kill(owner)
    for _ in range(150):
        if not ray.get(readable.remote([ref])):
            return
        time.sleep(0.2)
    raise AssertionError("the object outlived its owner")


def test_lost_objects_and_a_dead_cache_read_as_misses(ray_cluster):
    name, actor = new_cache()
    store = RayStore(name, timeout_s=5)
    store.write(0, 2, 1, *rows([0, 1], 1), ["float32"])
    store.stats()
    # An object whose owner died (lookup hands out its ref): dropped, the live one still read.
    owner = Owner.remote()
    (lost,) = ray.get(owner.make.remote())
    kill_owner(owner, lost)
    live = ray.get(actor.lookup.remote([0], 1))
    forgotten = []
    store.actor = types.SimpleNamespace(
        lookup=types.SimpleNamespace(remote=lambda b, lv: ray.put(live + [(5, 1, (lost, None))])),
        forget=types.SimpleNamespace(remote=forgotten.extend),
    )
    assert [s.block for s in store.read([0, 5], 1)] == [0]
    assert forgotten == [(5, 1)]
    # The cache actor itself dies (its objects with it): reads miss, writes are dropped.
    store.actor = actor
    ray.kill(actor)
    wait_until_dead(actor)  # ray.kill is asynchronous: a read could still reach it
    store.drain()  # a new epoch: the snapshot of the old index goes
    assert store.read([0], 1) == []
    store.write(1, 2, 1, *rows([2, 3], 1), ["float32"])
    store.flush()
    assert store.stats().objects == 0


def wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.1)
    raise AssertionError("the killed cache actor still answers")


def test_cached_prefix_over_a_dead_cache_still_gives_the_prefix(ray_cluster):
    cfg = build_config({
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 3, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 32, "image_size": 8},
    })
    splits = build_dataset(cfg.data, seed=0)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    adapter.model.eval()
    name, actor = new_cache()
    prefix = CachedPrefix(adapter, RayStore(name, timeout_s=5), CacheBlocks(32, 8, 0),
                          torch.device("cpu"))
    idx = np.arange(16)
    load = lambda r: splits.train.batch(idx[r].tolist()).inputs  # noqa: E731
    first = prefix(2, idx, load)
    prefix.store.drain()  # the end of an epoch, as the engine does it: writes land, then
    prefix.store.flush()  # incomplete blocks are stored
    again = prefix(2, idx, load)
    assert prefix.counters.hits == 16 and torch.equal(first[0], again[0])
    ray.kill(actor)
    wait_until_dead(actor)  # ray.kill is asynchronous: a lookup could still reach it
    # Blocks this process already read stay served from its memo; a fresh one (a restarted
    # worker), in a new epoch, finds nothing and recomputes everything.
    assert torch.equal(first[0], prefix(2, idx, load)[0])
    prefix.store.drain()
    fresh = CachedPrefix(adapter, prefix.store, CacheBlocks(32, 8, 0), torch.device("cpu"))
    after = fresh(2, idx, load)
    assert fresh.counters.misses == 16 and torch.equal(first[0], after[0])


def job(tmp_path, **extra):
    """The engine's Ray test job (tests/test_ray_engine.py) with the cache on, 4 epochs."""
    return tiny_config(tmp_path, **{
        "name": "ray-cache",
        "cache": {"mode": "on", "block_size": 16, "spill_directory": str(tmp_path / "spill")},
        "epochs": 4,
        **extra,
    })


def test_the_memo_is_sized_from_the_stores_the_cluster_reports(ray_cluster):
    # The session cluster's one node: its 256 MiB store, of which the owner's budget is half.
    store = SESSION_RAY["object_store_memory"]
    assert store_capacities() == [store]
    cfg = build_config({"cache": {"budget_fraction": 1.0}})
    assert resolve_cache_sizes(cfg.cache, store_capacities()).worker_memo_bytes == store
    name, actor = new_cache(budget_fraction=1.0)
    assert ray.get(actor.stats.remote()).budget_bytes == store  # the same rule, node side
    ray.kill(actor)


def test_tiny_job_with_the_cache_hits_after_the_freeze_and_ends_on_the_reference(
        ray_cluster, tmp_path):
    cfg = job(tmp_path)
    run = run_on_ray(cfg, tmp_path / "run")
    # The driver sized the memo once and shipped it in the config (half the session's 256 MiB
    # store is under the 256 MiB floor).
    assert cfg.cache.worker_memo_bytes == "auto"
    assert run.config["cache"]["worker_memo_bytes"] == 256 * 2**20
    layout = [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in run.timeline]
    # K may already be 1 at 2 frozen blocks (see test_ray_engine's replan test).
    assert layout[0] == (0, 2, 1) and layout[2:] == [(3, 1, 2)] * 2
    assert layout[1] in ((2, 2, 1), (2, 1, 2))
    rates = [r.cache_hit_rate for r in run.timeline]
    # Epoch 1 fills depth 2, epoch 2 advances it to depth 3 (two replicas, each reading rows
    # of blocks the other also reads), epoch 3 reads depth 3.
    assert rates == [0.0, 0.0, 1.0, 1.0]
    assert run.timeline[3].cache_objects <= 128 // 16 and run.timeline[3].cache_bytes > 0
    assert run.cache["objects"] == 8 and run.cache["refused_rows"] == 0
    assert "spilled_bytes" in run.cache["object_store"]

    reference = build_reference(run_settings(job(tmp_path, engine="reference")).reference)
    reference.fit()
    layers, _ = load_layers(run.checkpoint, layer_names(4))
    worst = max(float((layers[name]["params"][k] - v).abs().max())
                for name, m in iter_layers(reference.adapter) for k, v in m.state_dict().items())
    assert worst <= 1e-4
