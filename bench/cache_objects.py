"""Object count and bytes of the activation cache for a synthetic run over many samples.

Drives the real cache path (``CachedPrefix`` on each replica's stage 0, ``RayStore`` handles,
one ``CacheActor`` owning the objects, the run's plain order from ``GlobalSampler``, so a step's
rows fall in up to ``batch`` of the ``CacheBlocks`` objects) with a stand-in model: the
"embedding" turns a sample index ``i`` into a ``[tokens, width]`` state filled with ``10 i``
and each "frozen block" adds 1, so every row read back can be checked.
Each replica is a Ray actor (its own process) and takes its share of each global batch.
Three epochs:

  1. depth 1, cold: every row is computed and written (misses);
  2. depth 2: every row is read at depth 1 (written by either replica), advanced through one
     block and written at depth 2, which releases depth 1 block by block;
  3. depth 2: every row is a hit.

Reports stored blocks ("objects" in the JSON: one entry per block and depth; the blocks one
write or one epoch's end stores share a Ray object) and bytes after each epoch (one entry per
sample would be ``--samples``; the cache keeps at most ``samples / block_size``), hit rates
and timings; writes
``<out>/cache_objects.json``. With ``--nodes N`` the run is on a cluster of N nodes on this
machine (``ray.cluster_utils.Cluster``, each node with its own ``--store-mib`` object store and
one owner), replica r pinned to node ``r % N``, and each epoch also reports per node: bytes,
objects, local and remote reads (objects) and refused rows. The epoch's objects and bytes are
the cache's distinct contents (each row once); ``stored_bytes`` and ``stored_objects`` add up
every node's copy. Usage:

    python bench/cache_objects.py [--samples 100000] [--block-size 64] [--batch 256]
                                  [--replicas 2] [--tokens 5] [--width 64] [--nodes 1]
                                  [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import types
import uuid
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from pt_ray.data.sampler import CacheBlocks, GlobalSampler
from pt_ray.cache.prefix import CachedPrefix
from pt_ray.cache.owners import (
    CacheActor,
    RayStore,
    cache_name,
    create_owners,
    object_store_report,
    owners_report,
)


class _Embed(nn.Module):
    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.shape = (tokens, width)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        return ((ids.float() * 10).view(-1, 1, 1).expand(-1, *self.shape).contiguous(),)


class _Block(nn.Module):
    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden + 1,)


@ray.remote(num_cpus=0)
class Replica:
    """Stage 0 of one replica."""

    def __init__(self, name: str | dict[str, str], blocks: CacheBlocks, tokens: int,
                 width: int) -> None:
        torch.set_num_threads(1)
        model = types.SimpleNamespace(embed=_Embed(tokens, width), blocks=[_Block(), _Block()])
        self.store = RayStore(name, timeout_s=60)
        self.prefix = CachedPrefix(model, self.store, blocks, torch.device("cpu"))

    def epoch(self, steps: list[np.ndarray], level: int) -> dict:
        t0 = time.perf_counter()
        for ids in steps:
            ids = ids.copy()  # arguments arrive as read-only views of the object store
            (state,) = self.prefix(level, ids, lambda rows, ids=ids: (torch.from_numpy(ids[rows]),))
            want = torch.from_numpy(ids).float() * 10 + level
            assert torch.equal(state[:, 0, 0], want), "a cached row differs from its value"
        self.store.drain()  # as the engine does at an epoch's end: every write lands
        c = self.prefix.reset()
        return {"rows": c.rows, "hits": c.hits, "advanced": c.advanced, "misses": c.misses,
                "io_s": c.io_s, "epoch_s": time.perf_counter() - t0}

    def flush(self) -> None:
        self.store.flush()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256, help="global batch per step")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=5, help="state rows per sample")
    ap.add_argument("--width", type=int, default=64, help="hidden size")
    ap.add_argument("--store-mib", type=int, default=1024,
                    help="object store of the cluster (of each node with --nodes)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes of a local multi-node cluster")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = None
    if args.nodes > 1:
        from ray.cluster_utils import Cluster
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": args.store_mib * 2**20,
            "include_dashboard": False})
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1, object_store_memory=args.store_mib * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.WARNING)
    else:
        ray.init(address="local", num_cpus=max(2, args.replicas), include_dashboard=False,
                 object_store_memory=args.store_mib * 2**20, logging_level=logging.WARNING)
    try:
        name = f"bench-cache-{uuid.uuid4().hex[:6]}"
        blocks = CacheBlocks(args.samples, args.block_size, seed=0)
        if cluster is None:
            owners = {"": CacheActor.options(name=name).remote(0.8)}
            replicas = [Replica.remote(name, blocks, args.tokens, args.width)
                        for _ in range(args.replicas)]
        else:
            owners = create_owners(name, 0.8)
            names = {node: cache_name(name, node) for node in owners}
            nodes = sorted(owners)
            replicas = [Replica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nodes[r % len(nodes)], soft=False)).remote(names, blocks, args.tokens, args.width)
                for r in range(args.replicas)]
        epochs = []
        sampler = GlobalSampler(args.samples, args.batch, seed=0)
        for epoch, level in enumerate((1, 2, 2)):
            steps = [sampler.step_indices(epoch, s) for s in range(sampler.steps_per_epoch)]
            shares = [[np.array_split(s, args.replicas)[r] for s in steps]
                      for r in range(args.replicas)]
            t0 = time.perf_counter()
            per = ray.get([rep.epoch.remote(shares[r], level) for r, rep in enumerate(replicas)])
            # As in training, incomplete blocks are stored once every replica ended the epoch
            # (on several nodes, each node's owner then copies in what the others hold).
            ray.get([rep.flush.remote() for rep in replicas])
            ray.get([owner.flush.remote() for owner in owners.values()])
            wall = time.perf_counter() - t0
            report = owners_report(owners)
            stats = types.SimpleNamespace(**{k: v for k, v in report.items() if k != "nodes"})
            total = {k: sum(p[k] for p in per) for k in ("rows", "hits", "advanced", "misses")}
            epochs.append({
                "epoch": epoch, "depth": level, **total,
                "hit_rate": total["hits"] / max(total["rows"], 1),
                "objects": stats.objects, "bytes": stats.bytes,
                "stored_objects": stats.stored_objects, "stored_bytes": stats.stored_bytes,
                "pending_bytes": stats.pending_bytes, "refused_rows": stats.refused_rows,
                "released_objects": stats.released_objects, "wall_s": wall,
                "read_s_per_replica": max(p["io_s"] for p in per),
                "nodes": report["nodes"] if cluster is not None else {},
            })
            e = epochs[-1]
            print(f"epoch {epoch} depth {level}: {e['objects']} blocks, "
                  f"{e['bytes'] / 2**20:.1f} MiB (stored {e['stored_bytes'] / 2**20:.1f} MiB "
                  f"in {e['stored_objects']} blocks), hits {e['hit_rate']:.0%} "
                  f"(advanced {e['advanced']}, misses {e['misses']}), "
                  f"{e['refused_rows']} refused, {wall:.1f} s")
            before = epochs[-2]["nodes"] if len(epochs) > 1 else {}
            for node, n in sorted(e["nodes"].items()):
                was = before.get(node, {})
                print(f"  node {node[:8]}: {n.get('bytes', 0) / 2**20:.1f} MiB, "
                      f"{n.get('objects', 0)} blocks, reads this epoch "
                      f"{n.get('local_reads', 0) - was.get('local_reads', 0)} local / "
                      f"{n.get('remote_reads', 0) - was.get('remote_reads', 0)} remote, "
                      f"{n.get('refused_rows', 0)} rows refused, "
                      f"{n.get('spilled_bytes', 0) / 2**20:.1f} MiB spilled")
        result = {
            "samples": args.samples, "block_size": args.block_size, "batch": args.batch,
            "replicas": args.replicas, "row_bytes": args.tokens * args.width * 4,
            "num_blocks": blocks.num_blocks, "max_objects_allowed": args.samples / 64,
            # Per store: each node's owner holds at most one object per block.
            "max_objects": max(max((n.get("objects", 0) for n in e["nodes"].values()),
                                   default=e["objects"]) for e in epochs),
            "epochs": epochs, "object_store": object_store_report(),
        }
        assert result["max_objects"] <= args.samples / args.block_size
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cache_objects.json").write_text(json.dumps(result, indent=2))
        print(f"{args.samples} samples: at most {result['max_objects']} blocks "
              f"(limit {args.samples / 64:.0f}); wrote {args.out / 'cache_objects.json'}")
        return result
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
