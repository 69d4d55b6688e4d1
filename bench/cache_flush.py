"""What a cache owner's end-of-epoch store costs the ranks: the owner's ``flush`` of blocks an
epoch left incomplete (a freeze landing late in an epoch leaves every block so), timed from a
worker's handle until the figures it asks next come back (the engine asks them after its
evaluation; before, every rank waited for them).

For each block count, a new ``CacheActor`` on an embedded cluster receives half the rows of
every block (32 of 64 samples, ``[17, 16]`` float32 each, in the worker's 4 MiB batches), then
the worker drains, flushes and asks for the stats. Prints one line per count and writes
``cache_flush.json`` into ``--out``. 468 blocks are ``fashion-transfer``'s 30,000 images;
1,562 a 100,000-sample set.

    python bench/cache_flush.py [--blocks 468,1562,4096] [--repeats 3] [--out bench/out/flush]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from pt_ray.cache.owners import CacheActor, RayStore  # noqa: E402


def flush_seconds(blocks: int, name: str) -> tuple[float, int]:
    """Seconds from the flush to the stats' answer, and the blocks stored."""
    actor = CacheActor.options(name=name).remote(0.8)
    try:
        store = RayStore(name, batch_bytes=4 * 2**20)
        rows = [np.ones((32, 17, 16), np.float32)]
        for b in range(blocks):
            store.write(b, 64, 4, np.arange(b * 64, b * 64 + 32), rows, ["float32"])
            if b % 256 == 255:  # no batch dropped for a full backlog: every block is stored
                store.drain()
        store.drain()
        t0 = time.perf_counter()
        store.flush()
        stored = store.stats().objects
        seconds = time.perf_counter() - t0
        if stored != blocks:
            raise RuntimeError(f"{stored} of {blocks} blocks stored: the figures would not "
                               f"time the flush of every block")
        return seconds, stored
    finally:
        ray.kill(actor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="468,1562,4096", help="block counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/flush"))
    args = ap.parse_args()
    counts = [int(c) for c in args.blocks.split(",")]
    ray.init(address="local", num_cpus=2, object_store_memory=1024 * 2**20,
             include_dashboard=False, logging_level="ERROR")
    results = []
    try:
        for blocks in counts:
            runs = [flush_seconds(blocks, f"pt-ray-flush-{blocks}-{i}")
                    for i in range(args.repeats)]
            median = statistics.median(s for s, _ in runs)
            print(f"{blocks} incomplete blocks: flush and figures {median:.3f} s (median of "
                  f"{args.repeats}; {runs[0][1]} blocks stored)", flush=True)
            results.append({"blocks": blocks, "seconds": [s for s, _ in runs],
                            "median_s": median, "stored": runs[0][1]})
    finally:
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_flush.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out / 'cache_flush.json'}")


if __name__ == "__main__":
    main()
