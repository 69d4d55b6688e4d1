"""The probe of ``freeze.policy=probe`` on the ranks: the tested blocks kept as they were at an
interval's start, and the probe loss two ways at its end.

Torch runtime layer. The policy (:class:`pt_ray.core.freeze.ProbeFreeze`) names the leading
active blocks to test in the plan of each decision (``Plan.probe_blocks``). When a rank enters
such a plan it copies the parameters of the tested blocks it holds; at the interval's end it
pipes the probe split (training samples the sampler never draws:
:func:`pt_ray.data.sampler.probe_indices`) through the replicas twice, in eval mode: as the
parameters are, and with the tested blocks put back as they were, then puts them back as they
are. Each replica scores its share; one all-reduce gives every rank the same mean losses, which
travel to the controller with the interval's norms.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from pt_ray.core.freeze import PROBE_NOW, PROBE_REVERTED
from pt_ray.core.plan import Plan
from pt_ray.data.base import DatasetSplits, SampleDataset
from pt_ray.data.sampler import split_for_replica
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.layout import Layout
from pt_ray.runtime.records import PrefixStarts, pipe_score

__all__ = ["Probe", "probe_for"]

logger = logging.getLogger(__name__)


def probe_for(held_out: np.ndarray, splits: DatasetSplits, batch_size: int,
              comm: Comm) -> Probe | None:
    """The run's probe over the training samples ``held_out``
    (:func:`pt_ray.data.sampler.probe_indices`; none unless ``freeze.policy=probe``: then
    None), scoring ``batch_size``-sample (eval-sized) batches."""
    if not len(held_out):
        return None
    return Probe(splits.train, held_out, batch_size, comm)


class Probe:
    """One rank's part of the probe.

    Args:
        dataset: the training split (the probe samples are in it).
        indices: the probe samples' indices.
        batch_size: the most samples a replica scores at once.
        comm: the run's communication.
    """

    def __init__(self, dataset: SampleDataset, indices: np.ndarray, batch_size: int,
                 comm: Comm) -> None:
        self.dataset = dataset
        self.indices = indices
        self.batch_size = batch_size
        self.comm = comm
        self.kept: dict[str, list[torch.Tensor]] | None = None
        self.seconds = 0.0  # spent measuring since the last read (:meth:`take_seconds`)
        # Stage 0: each probe batch's state after the prefix, for the frozen count and replica
        # of ``starts_for``: a test's two passes share it, and while blocks are frozen (the
        # prefix then never changes: a rollback ends the tests) so do later tests.
        self.starts = PrefixStarts()
        self.starts_for: tuple[int, int, int] | None = None

    def start(self, layout: Layout, plan: Plan) -> None:
        """Enter ``plan``'s interval: keep the tested blocks this rank holds as they are now
        (none when the plan tests nothing; every rank still measures)."""
        self.kept = None
        if not plan.probe_blocks or not len(self.indices):
            return
        first, held = plan.num_frozen, set(plan.stage_layers(layout.topo.stage))
        tested = {f"block.{i}" for i in range(first, first + plan.probe_blocks)}
        self.kept = {n: [p.detach().clone() for p in layout.modules[n].parameters()]
                     for n in tested & held}

    def measure(self, layout: Layout) -> dict[int, float]:
        """The probe losses at the interval's end (:data:`~pt_ray.core.freeze.PROBE_NOW` and
        ``PROBE_REVERTED``), the same on every rank; empty when the interval tests nothing."""
        if self.kept is None:
            return {}
        t0 = time.perf_counter()
        plan = layout.plan
        key = (plan.num_frozen, layout.topo.replica, plan.num_replicas)
        if key != self.starts_for or not plan.num_frozen:  # the embedding still trains
            self.starts, self.starts_for = PrefixStarts(), key
        now = self._loss(layout)
        with self._put_back(layout):
            reverted = self._loss(layout)
        self.kept = None
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        if layout.topo.rank == 0:
            logger.info("probe: %d blocks tested on %d samples in %.3f s",
                        layout.plan.probe_blocks, len(self.indices), seconds)
        return {PROBE_NOW: now, PROBE_REVERTED: reverted}

    def take_seconds(self) -> float:
        """Seconds spent measuring since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _loss(self, layout: Layout) -> float:
        """The mean loss over the probe, every replica scoring its share."""
        mine = split_for_replica(self.indices, layout.topo.replica, layout.plan.num_replicas)
        batches = [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
        total = pipe_score(layout, self.dataset, batches, self.comm,
                           lambda out, target: layout.adapter.loss(out, target) * len(target),
                           self.starts)
        # Replicas' last stages hold their shares: the sum over WORLD is the probe's.
        return float(self.comm.all_reduce(total.reshape(1))[0]) / len(self.indices)

    @contextlib.contextmanager
    def _put_back(self, layout: Layout) -> Iterator[None]:
        """The kept parameters in place, then the current ones again."""
        held = list(self.kept)
        now = {n: [p.detach().clone() for p in layout.modules[n].parameters()] for n in held}
        with torch.no_grad():
            for n in held:
                for p, k in zip(layout.modules[n].parameters(), self.kept[n]):
                    p.copy_(k)
            try:
                yield
            finally:
                for n in held:
                    for p, k in zip(layout.modules[n].parameters(), now[n]):
                        p.copy_(k)
