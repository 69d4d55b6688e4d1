"""One rank's layout under a plan: the layers it holds, its process groups, its stage, its
optimizer, and what runs the stage (DDP at K = 1, a pipeline schedule otherwise).

:meth:`Layout.enter` moves a rank from one plan to the next: layers the new plan gives this
rank's stage arrive by migration (with their optimizer state), layers it gives away release
their storage, newly frozen layers stop taking gradients, and the process groups (cached per
layout), the stage, the optimizer and the runner are built for the new plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pt_ray.core.plan import Plan, is_trainable, replica_batch
from pt_ray.data.base import DatasetSplits, gather
from pt_ray.models.base import ModelAdapter, frozen_layer_names, iter_layers
from pt_ray.runtime.checkpoint import deal_layers
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.compiled import compile_blocks
from pt_ray.runtime.migrate import LayerStates, migrate
from pt_ray.runtime.optim import (
    adopt_states,
    build_optimizer,
    layer_param_groups,
    merge_groups,
)
from pt_ray.runtime.owned import is_held, materialise, release, to_device
from pt_ray.runtime.precision import Precision
from pt_ray.runtime.settings import LayoutSettings
from pt_ray.runtime.stages import Shapes, StageModule, build_schedule, probe_shapes
from pt_ray.runtime.clipping import ParamBlocks
from pt_ray.runtime.topology import Topology, TopologyCache

__all__ = ["Layout", "to_device_batch"]

logger = logging.getLogger(__name__)


class Layout:
    """What one rank holds and runs under the plan in force.

    Args:
        settings: what the layout is told about the run.
        adapter: the model, built whole on the host; from the first plan on only this rank's
            stage's layers keep storage, on ``device``.
        splits: the datasets (one training sample teaches the shapes between stages).
        comm: the run's communication.
        device: this rank's device.
        precision: the run's precision.
        loss: the loss a pipeline's last stage starts its backward from.
        cache: whether the activation cache serves the frozen prefix (stage 0 then takes its
            states from the cache, under plans that cache).
    """

    def __init__(self, settings: LayoutSettings, adapter: ModelAdapter, splits: DatasetSplits,
                 comm: Comm, device: torch.device, precision: Precision,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 cache: bool = False) -> None:
        self.settings = settings
        self.adapter = adapter
        self.splits = splits
        self.comm = comm
        self.device = device
        self.precision = precision
        self.loss = loss
        self.cache = cache
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.modules = dict(iter_layers(adapter))
        self.compiled = compile_blocks(adapter, settings.compile, device, self.rank == 0)
        # Every process group's bound on a collective or point-to-point wait (WORLD's is set
        # by whoever formed it: Ray Train's TorchConfig, from the same field).
        timeout = timedelta(seconds=settings.collective_timeout_s)
        self.topologies = TopologyCache(timeout, warm_up=lambda g: comm.barrier(group=g))
        self._shapes: Shapes | None = None
        self.plan: Plan | None = None
        self.topo: Topology | None = None
        self.stage: StageModule | None = None
        self.schedule = None
        self.ddp: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.param_blocks: ParamBlocks | None = None

    def enter(self, plan: Plan, restored: LayerStates | None = None,
              midway: Callable[[], None] | None = None) -> float:
        """Enter ``plan`` (migrating state when it replaces another); returns the wall time.

        Args:
            plan: the plan to enter (nothing happens when its generation is in force).
            restored: optimizer state per layer when entering a first plan from a checkpoint
                or a snapshot (parameters already loaded).
            midway: called inside the migration, after this rank's sends (fault tests).
        """
        if self.plan is not None and plan.generation == self.plan.generation:
            return 0.0
        t0 = time.perf_counter()
        stage = plan.coords(self.rank)[1]
        if self.plan is None:
            states = restored or {}
            if self.world > 1:
                # The shapes between stages are learnt while embed, block 0 and the head are
                # still here (every later plan reuses them).
                self.probe()
        else:
            for name in plan.stage_layers(stage):
                if not is_held(self.modules[name]):  # it arrives by migration, into this storage
                    materialise(self.modules[name], self.device)
            states = migrate(self.comm, self.modules, self.optimizer, self.plan, plan, self.rank,
                             midway=midway)
            self.ddp = None  # built again on the next plan's data-parallel group
        self._hold(plan, stage)
        for name in frozen_layer_names(plan.num_frozen):
            for p in self.modules[name].parameters():
                p.requires_grad_(False)
                p.grad = None
        self.topo = self.topologies.get(plan)
        cached = self.cache and plan.cache and self.topo.stage == 0 and plan.num_frozen > 0
        self.stage = StageModule(self.adapter, plan, self.topo.stage, state_inputs=cached,
                                 precision=self.precision)
        trained = self.trained(plan.stage_layers(stage), plan)
        self._build_optimizer(trained, states)
        self._build_runner(plan, bool(trained))
        old, self.plan = self.plan, plan
        self.set_modes()
        elapsed = time.perf_counter() - t0
        if old is not None and self.rank == 0:
            logger.info("rank 0 entered %s in %.3f s", plan.describe(), elapsed)
        return elapsed

    def forget(self) -> None:
        """Leave the plan in force without migrating (a rollback enters the next one as a first
        plan, from its snapshot)."""
        self.ddp = None
        self.plan = None

    def _build_optimizer(self, trained: list[str], states: LayerStates) -> None:
        """The optimizer over the layers trained here, their state carried."""
        optimizer = self.settings.optimizer
        self.optimizer = build_optimizer(optimizer, merge_groups(layer_param_groups(
            [(n, self.modules[n]) for n in trained], optimizer.weight_decay)))
        adopt_states(self.optimizer, [pair for name in trained for pair in zip(
            self.modules[name].parameters(), states.get(name, ()))])

    def _build_runner(self, plan: Plan, trains: bool) -> None:
        """Per-block norm bookkeeping, and DDP (K = 1) or the pipeline schedule (K > 1)."""
        stage = self.topo.stage
        self.param_blocks = None
        if self.settings.block_norms:
            # Per-block norms feed freeze decisions only: a run that never freezes skips them.
            first, end = plan.boundaries[stage], plan.boundaries[stage + 1]
            self.param_blocks = ParamBlocks(
                [p for p in self.stage.parameters() if p.requires_grad],
                {b: list(self.adapter.blocks[b].parameters()) for b in range(first, end)},
                first, end - first, self.device)
        self.schedule = None
        if self.topo.dp_group is not None and trains:
            # DDP reduces the stage's gradients over its data-parallel group, in buckets
            # launched from gradient hooks during backward (what the peer runs). At K > 1 the
            # pipeline schedule drives it: earlier micro-batches run under no_sync, the last
            # one reduces. The replicas already hold the same parameters: nothing is broadcast.
            self.ddp = DistributedDataParallel(
                self.stage, process_group=self.topo.dp_group, init_sync=False,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                **_NO_BUFFER_SYNC)
        if plan.pipeline_length > 1:
            # The schedule runs one accumulation chunk at a time: its micro-batches are that
            # chunk's replica share / M.
            s = self.settings
            pass_batch = replica_batch(s.batch_size, plan.num_replicas, s.batch_policy,
                                       s.optimizer.accumulation_steps)
            self.schedule = build_schedule(self.stage, plan, stage, self.topo.pipeline_group,
                                           self.device, self.loss, self.probe(),
                                           pass_batch // plan.num_microbatches, runner=self.ddp)

    def _hold(self, plan: Plan, stage: int) -> None:
        """Keep in storage, on the device, exactly the layers ``plan`` gives ``stage``: the
        others are released (their storage freed; the optimizer built next leaves them out).

        Raises:
            RuntimeError: a layer of the stage has no storage here (nothing brought it).
        """
        owned = set(plan.stage_layers(stage))
        for name, module in self.modules.items():
            if name not in owned:
                release(module)
            elif not is_held(module):
                raise RuntimeError(f"rank {self.rank} holds no storage for {name}, which "
                                   f"{plan.describe()} gives its stage {stage}")
        # Owned layers and what no layer owns (e.g. non-persistent buffers) go to the device.
        to_device(self.adapter.model, self.device)

    def probe(self) -> Shapes:
        """The shapes crossing stage boundaries (learnt once, from one training sample)."""
        if self._shapes is None:
            sample = to_device_batch(gather(self.splits.train, [0]), self.device)
            for module in (self.adapter.embed, self.adapter.blocks[0], self.adapter.head):
                to_device(module, self.device)
            self._shapes = probe_shapes(self.adapter, sample.inputs, self.precision)
        return self._shapes

    def set_modes(self) -> None:
        """Training mode, except the frozen prefix (eval mode: no dropout)."""
        self.adapter.model.train()
        for name in frozen_layer_names(self.plan.num_frozen):
            self.modules[name].eval()

    def trained(self, names, plan: Plan | None = None) -> list[str]:
        """Those of ``names`` that train under ``plan`` (default: the plan in force)."""
        plan = plan or self.plan
        return [n for n in names if is_trainable(plan, n)]

    def primary_layers(self) -> list[str]:
        """The layers this rank writes into checkpoints: every replica holds its stage's
        layers alike, so they are dealt out among the stage's R replicas by bytes
        (:func:`pt_ray.runtime.checkpoint.deal_layers`; a trained layer weighs its parameters
        three times, with AdamW's two moments) and each writes its share."""
        replica, stage = self.plan.coords(self.rank)
        weights = {n: sum(p.numel() * p.element_size() for p in self.modules[n].parameters())
                   * (3 if is_trainable(self.plan, n) else 1)
                   for n in self.plan.stage_layers(stage)}
        return deal_layers(weights, self.plan.num_replicas)[replica]

    def close(self) -> None:
        """Destroy this rank's subgroups (the WORLD group stays with its owner)."""
        self.ddp = None
        self.topologies.close()
        self.topo = None


# Buffers are the same on every replica (built from one seed, never trained): DDP need not
# broadcast them before each forward.
_NO_BUFFER_SYNC = {"forward_sync_buffers": False}


def to_device_batch(batch, device: torch.device):
    """``batch`` with its tensors on ``device`` (as it is on the CPU)."""
    if device.type == "cpu":
        return batch
    from pt_ray.data.base import Batch

    # Asynchronous when the batch is pinned (a background loader's, on CUDA).
    return Batch(batch.indices, tuple(t.to(device, non_blocking=True) for t in batch.inputs),
                 batch.target.to(device, non_blocking=True))
