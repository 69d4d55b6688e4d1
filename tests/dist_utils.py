"""Run a function on N forked gloo processes (file:// rendezvous, one thread each, a timeout)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _child(fn, rank, world, path, queue, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{path}", rank=rank, world_size=world,
            timeout=timedelta(seconds=120),
        )
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle bytes: tensors in the queue would otherwise travel as shared-memory handles
        # that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240,
              daemon: bool = True) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked processes; returns results by rank.
    ``daemon=False`` lets a rank start processes of its own (a DataLoader's workers); the
    ranks are ended here either way.

    Raises:
        RuntimeError: a rank raised (its traceback is included) or did not finish in time.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(fn, r, world, path, queue, args), daemon=daemon)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            for _ in range(world):
                rank, status, value = queue.get(timeout=timeout)
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


def written_layers(worker: Any) -> dict[str, dict[str, Any]]:
    """The parameters of the layers an engine's rank writes into checkpoints, as its
    checkpoint shard captures them (``Layout.primary_layers``), detached copies on the CPU."""
    from pt_ray.runtime.layerstate import capture_layers

    layout = worker.layout
    entries = capture_layers(layout.modules, layout.primary_layers(), (), None, copy=True)
    return {name: entry["params"] for name, entry in entries.items()}
