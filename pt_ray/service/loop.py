"""The training function the driver hands to Ray Train, torch-free on the driver.

The worker loop (:mod:`pt_ray.service.worker`) imports torch and ``torch._dynamo`` (over a
second of CPU). The driver only passes the function on, so it holds this stand-in instead: it
pickles as a call that imports the worker module, which a Ray Train worker makes while it
deserialises the function (before the function starts in a thread of its own), so the heavy
import happens where it did before, on the worker, and never on the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["WORKER_LOOP", "WorkerLoop"]


def _worker_loop() -> Callable[[dict[str, Any]], None]:
    """The real per-worker function (run where the stand-in is unpickled)."""
    from pt_ray.service.worker import train_loop_per_worker

    return train_loop_per_worker


class WorkerLoop:
    """Stands for :func:`pt_ray.service.worker.train_loop_per_worker` on the driver: called,
    it runs it; pickled, it becomes it."""

    def __call__(self, config: dict[str, Any]) -> None:
        _worker_loop()(config)

    def __reduce__(self) -> tuple[Callable[[], Callable[[dict[str, Any]], None]], tuple[()]]:
        return _worker_loop, ()


WORKER_LOOP = WorkerLoop()
