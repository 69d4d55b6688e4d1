"""What a worker pays for its dataset at start-up: reading (and tokenising) the files itself,
against reading the splits the driver shipped through Ray's object store.

Side by side on one local Ray cluster, ``--repeats`` times each, alternated: a Ray task with one
CPU (as a worker has) runs ``build_dataset`` from the workload's files, and another one
``ray.get``\\ s the splits the driver built and put (``pt_ray.service.shipped.ship_splits``, as
``fit`` does). Prints the median seconds of each and their ratio; writes
``<out>/shipped_data.json``. ``--workload`` takes a fine-tuning workload of
``bench/accuracy_matrix.py`` (``wordnet-senses`` by default: 10,000 WordNet glosses tokenised
by MiniLM's tokenizer; it needs the Debian package wordnet-base) or ``default``. Usage:

    python bench/shipped_data.py [--workload wordnet-senses] [--repeats 3] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_matrix import WORKLOADS, prepare_workload  # noqa: E402


def _overrides(workload: str, out: Path) -> list[str]:
    made = prepare_workload(WORKLOADS[workload], out)
    if made is None:
        raise SystemExit(f"{workload} cannot run here (see the line above)")
    return list(made.overrides)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="wordnet-senses", choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from pt_ray.api import resolve_config
    from pt_ray.cache.owners import store_capacities
    from pt_ray.data.registry import build_dataset
    from pt_ray.service.shipped import ship_splits

    args.out.mkdir(parents=True, exist_ok=True)
    cfg = resolve_config(None, _overrides(args.workload, args.out))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        t = time.perf_counter()
        splits = build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
        driver_s = time.perf_counter() - t
        ref, size = ship_splits(splits, store_capacities())
        if ref is None:
            raise SystemExit("the splits did not ship (see the line above)")

        @ray.remote(num_cpus=1)
        def from_files() -> float:
            import torch

            torch.set_num_threads(1)
            t = time.perf_counter()
            build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
            return time.perf_counter() - t

        @ray.remote(num_cpus=1)
        def from_store(shipped: list[Any]) -> float:
            t = time.perf_counter()
            ray.get(shipped[0])
            return time.perf_counter() - t

        ray.get(from_store.remote([ref]))  # the task's process and imports, outside the clock
        ray.get(from_files.remote())
        files, store = [], []
        for _ in range(args.repeats):
            files.append(ray.get(from_files.remote()))
            store.append(ray.get(from_store.remote([ref])))
    finally:
        ray.shutdown()
    doc = {"workload": args.workload, "repeats": args.repeats, "driver_build_s": driver_s,
           "shipped_mib": size / 2**20, "train": len(splits.train), "eval": len(splits.eval),
           "worker_from_files_s": files, "worker_from_store_s": store,
           "ratio": statistics.median(files) / statistics.median(store),
           "load": os.getloadavg()}
    (args.out / "shipped_data.json").write_text(json.dumps(doc, indent=1))
    print(f"{args.workload}: {len(splits.train):,} train + {len(splits.eval):,} eval samples, "
          f"{size / 2**20:.1f} MiB shipped; a worker reads its files in "
          f"{statistics.median(files):.2f} s, the shipped splits in "
          f"{statistics.median(store):.3f} s ({doc['ratio']:.0f}x; medians of {args.repeats})")
    return doc


if __name__ == "__main__":
    main()
