"""The elastic worker: one rank's pipeline x data-parallel training loop with live re-planning.

Every rank runs the same loop in lockstep over the WORLD process group (from Ray Train, or a
plain ``init_process_group``). At each decision point it asks the controller for the plan in
force; when the plan's generation changes, it migrates state, rebuilds its process groups, its
stage and its schedule, and goes on at the same step as every other rank.

One step:

1. the global sampler gives the step's indices; replica ``r`` of ``R`` takes its contiguous
   slice (``B / R`` samples under ``fixed_global``); with ``optimizer.accumulation_steps`` A
   the step is cut into A consecutive chunks first, step 2 runs once per chunk on the replica's
   slice of it (``B / (A R)`` samples), and gradients sum in ``.grad`` across the passes;
2. stage 0 runs the frozen prefix (``no_grad``, eval mode), or with the activation cache on
   takes it from the cache for the whole replica batch before the schedule
   (:class:`pt_ray.runtime.prefix.CachedPrefix`), then its active blocks; the schedule
   (``gpipe`` or ``1f1b``, M micro-batches) carries states to the last stage, which runs the head
   and the loss; K = 1 runs without a pipeline;
3. gradients of trained parameters are averaged over the stage's data-parallel group (frozen ones
   never are): at K = 1 by DDP over that group, during the last pass's backward; with a
   pipeline, in buckets after the last pass; per-block gradient norms are recorded; the global
   norm is clipped across stages (fp16: unscaled, and a step with an inf/nan anywhere is skipped
   on every rank);
4. the optimizer (rebuilt at each plan over the layers trained here, their state carried)
   steps with the learning rate of the run's progress.

Decisions are counted: one opens every epoch and, when decisions come inside epochs, one more
follows every k steps. After each epoch every rank reports its record (the accuracy guard reads
the metric) with its last interval's norms and loss. With ``freeze.rollback`` each rank keeps,
at the start of each epoch while blocks may still freeze, a host copy of what it holds
(parameters, optimizer state, step counters, random state); when the guard orders a rollback (a
plan with ``rollback_to``), every rank restores that copy, enters the plan and trains that epoch
again.

Every collective and point-to-point call of pt-ray's own goes through
:class:`pt_ray.runtime.comm.Comm`, on the groups' device (CUDA for NCCL); DDP and the pipeline
schedules send the model's own tensors, already on the device. Losses and gradient norms stay
on the device until an epoch or a decision interval ends.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pt_ray.core.config import RunConfig
from pt_ray.control.state import cache_policy, decision_interval
from pt_ray.data.base import DatasetSplits, gather, set_epoch
from pt_ray.runtime.faults import FaultSwitch, kill_self, stall
from pt_ray.data.sampler import (
    CacheBlocks,
    accumulation_chunks,
    eval_shards,
    split_for_replica,
    training_sampler,
)
from pt_ray.models.base import ModelAdapter, frozen_layer_names, iter_layers
from pt_ray.core.plan import CostTable, Plan, is_trainable, replica_batch
from pt_ray.runtime.cache import ActivationStore
from pt_ray.runtime.checkpoint import deal_layers, load_layers, read_meta, write_shard
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.controller import Controller, LocalController
from pt_ray.runtime.memory import FIELDS, MemoryMeter, rank_memory
from pt_ray.runtime.migrate import LayerStates, collect_layer_state, migrate
from pt_ray.runtime.owned import is_held, materialise, release, to_device
from pt_ray.runtime.optim import (
    build_optimizer,
    layer_param_groups,
    lr_factor,
    merge_groups,
    set_lr,
)
from pt_ray.runtime.precision import LossScaler, resolve_precision
from pt_ray.runtime.prefix import CachedPrefix, epoch_counters, store_figures
from pt_ray.runtime.profile import profile_costs
from pt_ray.runtime.norms import GradNormMeter, merge_block_norms, norm_row
from pt_ray.runtime.stages import Shapes, StageModule, build_schedule, probe_shapes
from pt_ray.runtime.sync import BlockIndex, all_reduce_grads, clip_grad_norm
from pt_ray.runtime.topology import Topology, TopologyCache
from pt_ray.reporting.steplog import StepRecord, StepWindow
from pt_ray.reporting.summary import EpochRecord

__all__ = ["Controller", "ElasticWorker", "LocalController"]

logger = logging.getLogger(__name__)


class ElasticWorker:
    """One rank of a pt-ray run.

    Args:
        cfg: the run configuration.
        adapter: the model, built whole on the host from the same seed on every rank; from
            the first plan on the rank keeps only its stage's layers, on ``device``.
        splits: the datasets (every rank reads the samples it needs by index).
        controller: where costs and norms go and plans come from.
        device: this rank's device (default: CPU).
        costs: a fixed cost table (skips profiling; for tests and forced layouts).
        on_step: called as ``on_step(epoch, step)`` before every training step (progress
            reporting, fault injection in tests).
        on_step_report: with ``logging.every_steps`` N > 0, called on every rank with the
            :class:`~pt_ray.reporting.steplog.StepRecord` of every N-th step of the run; give
            it on every rank or on none (each report reduces the step's loss over WORLD).
        store: the activation cache's store (None: the frozen prefix is always recomputed,
            whatever the plans say).
        comm: the run's communication (default: built for ``device`` over WORLD).
        fault: the fault this rank injects in tests (:mod:`pt_ray.runtime.faults`): the engine
            reaches the ``migration``, ``checkpoint`` and ``eval`` points.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        adapter: ModelAdapter,
        splits: DatasetSplits,
        controller: Controller,
        device: torch.device | None = None,
        costs: CostTable | None = None,
        on_step: Callable[[int, int], None] | None = None,
        store: ActivationStore | None = None,
        comm: Comm | None = None,
        on_step_report: Callable[[StepRecord], None] | None = None,
        fault: FaultSwitch | None = None,
    ) -> None:
        self.cfg = cfg
        self.fault = fault
        self.on_step = on_step
        self.on_step_report = on_step_report
        every = cfg.logging.every_steps
        self.step_window = StepWindow(every) if on_step_report is not None and every else None
        self.adapter = adapter
        self.splits = splits
        self.controller = controller
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.comm = comm or Comm(self.device)
        # Every process group's bound on a collective or point-to-point wait (WORLD's is set
        # by whoever formed it: Ray Train's TorchConfig, from the same field).
        self.timeout = timedelta(seconds=cfg.pipeline.collective_timeout_s)
        self.topologies = TopologyCache(self.timeout, warm_up=lambda g: self.comm.barrier(group=g))
        self.precision = resolve_precision(cfg.precision, self.device)
        self.scaler = LossScaler() if self.precision.scaled else None
        self._shapes: Shapes | None = None
        self.modules = dict(iter_layers(adapter))
        self.fixed_costs = costs
        deterministic = splits.train.deterministic_transform
        self.sampler = training_sampler(cfg, len(splits.train))
        self.prefix: CachedPrefix | None = None
        if store is not None and cache_policy(cfg, deterministic).mode != "off":
            blocks = CacheBlocks(len(splits.train), cfg.cache.block_size, cfg.seed)
            self.prefix = CachedPrefix(adapter, store, blocks, self.device, costs,
                                       memo_bytes=cfg.cache.worker_memo_bytes,
                                       precision=self.precision)
        self.total_samples = cfg.epochs * self.sampler.steps_per_epoch * cfg.data.batch_size
        self.plan: Plan | None = None
        self.topo: Topology | None = None
        self.stage: StageModule | None = None
        self.schedule = None
        self._ddp: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.global_step = 0
        self.samples_seen = 0
        self.lr = cfg.optimizer.lr  # the last step's learning rate
        self._epoch = 0
        self.next_epoch = 0
        # Decisions are counted: one opens each epoch, one more every `interval` steps inside
        # it (decide every k steps), and the interval that an epoch's end closes feeds the
        # next epoch's first. A rollback's plan is the next decision like any other.
        self.decision = 0
        self.interval = decision_interval(cfg, self.sampler.steps_per_epoch)
        self.snapshots: dict[int, dict] = {}
        self.rolled_back = False
        self.norms = GradNormMeter()
        self._loss_weight = 1.0  # the current pass's share of the step (gradient accumulation)
        # The model stays on the host, where the adapter built it, until the first plan says
        # which layers this rank holds: only those reach the device (:mod:`.owned`).
        self.memory = MemoryMeter(self.modules, self.device)

    # -- plans ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Profile (or take the fixed costs), submit them, and enter decision 0's plan."""
        costs = self.fixed_costs
        if costs is None:
            # One pass's replica share (what a device holds at once with accumulation).
            n = max(1, self.cfg.data.batch_size // self.cfg.optimizer.accumulation_steps
                    // self.world)
            batch = gather(self.splits.train, list(range(min(n, len(self.splits.train)))))
            batch = _to(batch, self.device)
            # Each layer visits the device only while it is timed: the whole model never
            # needs to fit there.
            costs = profile_costs(self.adapter, batch, precision=self.precision)
            if self.prefix is not None:
                self.prefix.set_costs(costs)
        self.controller.submit_costs(self.rank, costs)
        self.apply_plan(self.controller.plan_for(0))

    def apply_plan(self, plan: Plan, restored: LayerStates | None = None) -> float:
        """Enter ``plan`` (migrating state when it replaces another); returns the wall time.

        Args:
            plan: the plan to enter.
            restored: optimizer state per layer when entering the first plan from a checkpoint
                (parameters already loaded).
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
                self._probe()
        else:
            midway = None
            if self.fault is not None:
                midway = partial(self.fault.at, "migration", self._epoch)
                self.fault.at("stall", self._epoch, action=stall)
            for name in plan.stage_layers(stage):
                if not is_held(self.modules[name]):  # it arrives by migration, into this storage
                    materialise(self.modules[name], self.device)
            states = migrate(self.comm, self.modules, self.optimizer, self.plan, plan, self.rank,
                             midway=midway)
            self._ddp = None  # built again on the next plan's data-parallel group
        self._hold(plan, stage)
        for name in frozen_layer_names(plan.num_frozen):
            for p in self.modules[name].parameters():
                p.requires_grad_(False)
                p.grad = None
        self.topo = self.topologies.get(plan)
        stage = self.topo.stage
        cached = plan.cache and self.prefix is not None and stage == 0 and plan.num_frozen > 0
        self.stage = StageModule(self.adapter, plan, stage, state_inputs=cached,
                                 precision=self.precision)
        trained = [n for n in plan.stage_layers(stage) if is_trainable(plan, n)]
        self.optimizer = build_optimizer(self.cfg.optimizer, merge_groups(layer_param_groups(
            [(n, self.modules[n]) for n in trained], self.cfg.optimizer.weight_decay)))
        for name in trained:
            for p, s in zip(self.modules[name].parameters(), states.get(name, ())):
                if s:
                    self.optimizer.state[p] = s
        self._block_index = None
        if self.cfg.freeze.policy != "none":
            # Per-block norms feed freeze decisions only: a run that never freezes skips them.
            first, end = plan.boundaries[stage], plan.boundaries[stage + 1]
            self._block_index = BlockIndex(
                [p for p in self.stage.parameters() if p.requires_grad],
                {b: list(self.adapter.blocks[b].parameters()) for b in range(first, end)},
                first, end - first, self.device)
        self.schedule = None
        if plan.pipeline_length == 1 and self.topo.dp_group is not None and trained:
            # One stage per replica: DDP itself reduces the gradients, in buckets launched from
            # gradient hooks during backward (what the peer runs). The replicas already hold
            # the same parameters, so nothing is broadcast.
            self._ddp = DistributedDataParallel(
                self.stage, process_group=self.topo.dp_group, init_sync=False,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                **_NO_BUFFER_SYNC)
        if plan.pipeline_length > 1:
            # The schedule runs one accumulation chunk at a time: its micro-batches are that
            # chunk's replica share / M.
            pass_batch = replica_batch(self.cfg.data.batch_size, plan.num_replicas,
                                       self.cfg.batch_policy, self.cfg.optimizer.accumulation_steps)
            microbatch = pass_batch // plan.num_microbatches
            self.schedule = build_schedule(self.stage, plan, stage, self.topo.pipeline_group,
                                           self.device, self._scaled_loss, self._probe(),
                                           microbatch)
        old, self.plan = self.plan, plan
        self._set_modes()
        elapsed = time.perf_counter() - t0
        if old is not None and self.rank == 0:
            logger.info("rank 0 entered %s in %.3f s", plan.describe(), elapsed)
        return elapsed

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

    def _probe(self) -> Shapes:
        """The shapes crossing stage boundaries (learnt once, from one training sample)."""
        if self._shapes is None:
            sample = _to(gather(self.splits.train, [0]), self.device)
            for module in (self.adapter.embed, self.adapter.blocks[0], self.adapter.head):
                to_device(module, self.device)
            self._shapes = probe_shapes(self.adapter, sample.inputs, self.precision)
        return self._shapes

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: the mean loss times the pass's share of the step
        (gradient accumulation) and, under fp16, the loss scale."""
        loss = self.adapter.loss(output, target)
        if self._loss_weight != 1.0:
            loss = loss * self._loss_weight
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _set_modes(self) -> None:
        self.adapter.model.train()
        for name in frozen_layer_names(self.plan.num_frozen):
            self.modules[name].eval()

    # -- training ------------------------------------------------------------------------------

    def _replicas_batch(self, plan: Plan | None = None) -> int:
        """Samples per step over all replicas (the global batch)."""
        b = self.cfg.data.batch_size
        plan = plan or self.plan
        return b if self.cfg.batch_policy == "fixed_global" else b * plan.num_replicas

    def train_step(self, indices: np.ndarray) -> torch.Tensor | float:
        """One optimizer step on the global batch ``indices``; returns this rank's share of the
        replica-mean loss (a 0-d tensor on the device on last stages, 0.0 elsewhere), not read
        back to the host.

        With ``optimizer.accumulation_steps`` A > 1 the step runs as A passes over consecutive
        chunks of ``indices``, cut as the reference trainer cuts them
        (:func:`pt_ray.data.sampler.accumulation_chunks`): each pass runs this replica's share
        of its chunk and leaves its gradients summed into ``.grad``; the data-parallel
        reduction, norms, clipping and the step then run once.
        """
        plan, topo, cfg = self.plan, self.topo, self.cfg
        r = plan.num_replicas
        per_replica = cfg.batch_policy == "per_replica"
        scale = r if per_replica and cfg.optimizer.scale_lr_with_replicas else 1
        progress = self.samples_seen / self.total_samples
        self.lr = cfg.optimizer.lr * scale * lr_factor(progress, cfg.optimizer)
        set_lr(self.optimizer, self.lr)
        self.optimizer.zero_grad(set_to_none=True)
        parts = accumulation_chunks(len(indices), cfg.optimizer.accumulation_steps)
        loss: torch.Tensor | float = 0.0
        for c, part in enumerate(parts):
            weight = 1.0 if len(parts) == 1 else (part.stop - part.start) / len(indices)
            loss = loss + self._pass(indices[part], weight, sync=c == len(parts) - 1)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        last = topo.is_last_stage
        params = [p for p in self.stage.parameters() if p.requires_grad]
        if self._ddp is None:  # DDP reduced them during backward
            all_reduce_grads(self.comm, params, topo.dp_group, r)
        # One pass over the gradients gives the global norm and the per-block ones.
        total, block_norms = clip_grad_norm(self.comm, params, cfg.optimizer.grad_clip,
                                            topo.pipeline_group, inv_scale=1.0 / scale,
                                            blocks=self._block_index)
        self.global_step += 1
        self.samples_seen += len(indices)
        if self.scaler is not None:
            # The norm summed over the pipeline after the replicas' reduction: an inf/nan on any
            # rank is seen by every rank, which all skip the step and back off alike.
            found_inf = not bool(torch.isfinite(total))
            self.scaler.update(found_inf)
            if found_inf:
                if self.rank == 0:
                    logger.info("step %d skipped: inf/nan gradient; loss scale %g -> %g",
                                self.global_step - 1, scale, self.scaler.scale)
                return loss / r if last else 0.0
            if block_norms is not None:
                block_norms = block_norms / scale
        if block_norms is not None:
            self.norms.add_vector(self._block_index.first, block_norms)
        else:
            self.norms.add({})
        share = loss / r if last else 0.0
        self.norms.add_loss(share)
        self.optimizer.step()
        return share

    def _pass(self, chunk: np.ndarray, weight: float, sync: bool) -> torch.Tensor | float:
        """Forward and backward of this replica's share of ``chunk`` (the whole step without
        accumulation), adding to ``.grad``; returns this rank's part of the chunk's replica
        loss times ``weight`` (as :meth:`train_step`).

        Args:
            chunk: the chunk's indices over all replicas.
            weight: the chunk's share of the step, which scales its loss (1 / A).
            sync: the step's last pass: only then does DDP reduce (earlier passes run under
                ``no_sync``, so the summed gradients are reduced once).
        """
        plan, topo = self.plan, self.topo
        mine = split_for_replica(chunk, topo.replica, plan.num_replicas)
        first, last = topo.is_first_stage, topo.is_last_stage
        batch = _to(gather(self.splits.train, mine.tolist()), self.device) if last else None
        args = ()
        if first and self.stage.state_inputs:
            args = self.prefix(plan.num_frozen, mine, self._loader(mine, batch))
        elif first:
            if batch is None:
                batch = _to(gather(self.splits.train, mine.tolist()), self.device)
            args = batch.inputs
        self._loss_weight = weight
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.schedule is None:
            quiet = self._ddp is not None and not sync
            with self._ddp.no_sync() if quiet else contextlib.nullcontext():
                value = self._scaled_loss((self._ddp or self.stage)(*args), batch.target)
                value.backward()
            return value.detach() / scale
        if first:
            self.schedule.step(*args)
            return 0.0
        if last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=batch.target, losses=losses)
            # Each micro-batch's loss comes divided by M (build_schedule): their sum is the mean.
            return torch.stack([loss.detach() for loss in losses]).sum() / scale
        self.schedule.step()
        return 0.0

    def _loader(self, mine: np.ndarray, batch):
        """``load(rows)``: model inputs of rows of the replica batch ``mine`` (from ``batch``
        when this rank loaded it anyway, else read now: a cache hit loads nothing)."""
        if batch is not None:
            return lambda rows: tuple(t[torch.from_numpy(rows).to(t.device)] for t in batch.inputs)
        return lambda rows: _to(gather(self.splits.train, mine[rows].tolist()), self.device).inputs

    def _submit_norms(self, interval: int, norms: dict[int, float],
                      record: EpochRecord | None = None) -> None:
        """Hand interval ``interval``'s norms (merged over the ranks, the same on each), after
        the epoch ``record`` that ends it if any, to the controller, and start the next
        interval's."""
        self.controller.submit_norms(interval, self.rank, norms, record)
        self.norms.reset()

    def _open_epoch(self) -> float:
        """Enter the plan of the decision that opens the epoch (its norms went with the
        previous epoch's record). With ``freeze.rollback``, while blocks may still freeze,
        the epoch's starting state is kept first: a freeze anywhere in the epoch that the
        guard finds harmful returns here."""
        if self.cfg.freeze.rollback and self._may_freeze():
            self.snapshots[self._epoch] = self._snapshot()
        return self.apply_plan(self.controller.plan_for(self.decision))

    def _may_freeze(self) -> bool:
        """Whether a later decision could still grow the frozen prefix (no guard verdict has
        stopped freezing, and the prefix is below its cap)."""
        if self.rolled_back or self.plan is None:  # a rollback stops freezing for good
            return not self.rolled_back
        cap = self.cfg.freeze.max_frozen
        return self.plan.num_frozen < (self.plan.num_layers - 1 if cap is None else cap)

    def _decision_point(self) -> float:
        """Inside an epoch, every ``interval`` steps: submit the interval's norms (merged over
        the ranks) and enter the next decision's plan."""
        rows = self.comm.gather_values(norm_row(self.norms.mean(), self.plan.num_layers))
        self._submit_norms(self.decision, merge_block_norms(rows))
        self.decision += 1
        return self.apply_plan(self.controller.plan_for(self.decision))

    # -- the accuracy guard's rollback -----------------------------------------------------------

    def _snapshot(self) -> dict:
        """What this rank holds under the current plan, as host copies, and the counters and
        random state that decide the rest of the run."""
        layers = {}
        for name in self.plan.stage_layers(self.topo.stage):
            module = self.modules[name]
            entry = {"params": {k: v.detach().cpu().clone()
                                for k, v in module.state_dict().items()}}
            if is_trainable(self.plan, name):
                entry["optim"] = [
                    {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                     for k, v in st.items()}
                    for st in collect_layer_state(self.optimizer, module)]
            layers[name] = entry
        return {
            "layers": layers,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "norms": self.norms.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": torch.get_rng_state(),
            "cuda_rng": (torch.cuda.get_rng_state(self.device)
                         if self.device.type == "cuda" else None),
        }

    def _roll_back(self, plan: Plan) -> None:
        """Return to the snapshot taken at the start of epoch ``plan.rollback_to`` and enter
        ``plan`` (the layout that trained the epoch before it, as a new generation)."""
        snap = self.snapshots.pop(plan.rollback_to)
        self.snapshots.clear()
        self.rolled_back = True
        self._ddp = None
        self.plan = None
        frozen = set(frozen_layer_names(plan.num_frozen))
        states: LayerStates = {}
        with torch.no_grad():
            for name, module in self.modules.items():
                if name not in frozen:
                    for p in module.parameters():
                        p.requires_grad_(True)
            for name, entry in snap["layers"].items():
                module = self.modules[name]
                materialise(module, self.device)  # given away since the snapshot, perhaps
                module.load_state_dict(entry["params"])
                if "optim" in entry:
                    states[name] = [
                        {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v
                         for k, v in st.items()}
                        for p, st in zip(module.parameters(), entry["optim"])]
        self.global_step = snap["global_step"]
        self.samples_seen = snap["samples_seen"]
        self.norms.reset()
        self.norms.sums.update(snap["norms"]["sums"])
        self.norms.steps = snap["norms"]["steps"]
        if self.scaler is not None:
            self.scaler.load_state_dict(snap["scaler"])
        torch.set_rng_state(snap["rng"])
        if snap["cuda_rng"] is not None:
            torch.cuda.set_rng_state(snap["cuda_rng"], self.device)
        if self.prefix is not None:
            # Entries deeper than the restored prefix were computed by the undone freeze.
            self.prefix.invalidate_above(plan.num_frozen)
            self.comm.barrier()
        self.apply_plan(plan, restored=states)
        if self.rank == 0:
            logger.warning("rolled back to the start of epoch %d: %s", plan.rollback_to,
                           plan.describe())

    def steps_in_epoch(self) -> int:
        """Optimizer steps in an epoch under the current plan (for progress reporting)."""
        return len(self.splits.train) // max(self._replicas_batch(), 1)

    def resume_decision(self) -> int:
        """After an epoch: the decision a resumed run starts from, the one that opens the next
        epoch (decided once every rank has submitted the epoch's norms)."""
        return self.decision

    def train_epoch(self, epoch: int) -> EpochRecord:
        """Train one epoch (entering the plans of its decision points) and evaluate."""
        cfg = self.cfg
        self._epoch = epoch
        transition = self._open_epoch()
        set_epoch(self.splits.train, epoch)
        order = self.sampler.epoch_order(epoch)
        offset, steps, since = 0, 0, 0  # since: steps since the last decision
        frozen_steps = 0
        loss_sum: torch.Tensor | float = 0.0
        self.memory.start_epoch()
        t0 = time.perf_counter()
        mark = t0  # where the next step's wall time starts, for the step reports
        while offset + self._replicas_batch() <= len(order):
            if self.on_step is not None:
                self.on_step(epoch, steps)
            if self.interval is not None and since == self.interval:
                transition += self._decision_point()
                since = 0
            size = self._replicas_batch()  # a decision may have changed R
            if offset + size > len(order):
                break
            # Saved activations are counted on the epoch's last step (under the plan the record
            # reports), once per plan.
            frozen_steps += self.plan.num_frozen
            last = offset + 2 * size > len(order)
            with self.memory.step(last and self.memory.due(self.plan.generation),
                                  self.plan.generation):
                loss = self.train_step(order[offset:offset + size])
            loss_sum += loss
            offset += size
            steps += 1
            since += 1
            if self.step_window is not None:
                mark = self._step_report(epoch, steps, loss, size, mark)
        if self.device.type == "cuda":  # the epoch's kernels, not only their launches
            torch.cuda.synchronize(self.device)
        rec, norms = self._epoch_record(epoch, time.perf_counter() - t0, transition, loss_sum,
                                        steps, offset)
        rec = replace(rec, mean_frozen=frozen_steps / max(steps, 1))
        self.next_epoch = epoch + 1
        # The epoch's last interval ends here; its norms (after the record, which the accuracy
        # guard reads) feed the decision that opens the next epoch.
        self._submit_norms(self.decision, norms, rec)
        self.decision += 1
        if cfg.freeze.rollback:
            self._after_guard(evaluated=rec.eval_metric == rec.eval_metric)
        return rec

    def _epoch_record(self, epoch: int, epoch_time: float, transition: float,
                      loss_sum: torch.Tensor | float, steps: int, samples: int
                      ) -> tuple[EpochRecord, dict[int, float]]:
        """After an epoch's steps: evaluate (when due) and build, from one gather over the
        ranks, the epoch's record and its last interval's block norms merged over the ranks,
        the same on every rank.

        Args:
            epoch: the epoch.
            epoch_time: this rank's training time, s.
            transition: this rank's time entering the epoch's plans, s.
            loss_sum: this rank's share of the summed step losses.
            steps: the epoch's steps.
            samples: the epoch's training samples (over every replica).
        """
        cfg = self.cfg
        memory = self.memory.figures(self.plan.stage_layers(self.topo.stage), self.optimizer,
                                     self.topo.stage)
        cache, held = [0.0] * 6, [0.0, 0.0]
        if self.prefix is not None:
            # After this reduction every rank's cache writes have landed.
            cache = self.comm.reduce_values(epoch_counters(self.prefix))
            held = store_figures(self.prefix, self.rank)
        evaluated = cfg.evaluates_after(epoch)
        correct, eval_time = self.count_correct() if evaluated else (0, 0.0)
        if evaluated and self.fault is not None and self.fault.due("eval", epoch):
            correct = 0
        # One gather carries every figure of the epoch end: each rank's loss share, correct
        # count, times, store figures and memory row, and its last interval's block norms.
        mine = [float(loss_sum), float(correct), epoch_time, transition, *held, *memory]
        norms = self.norms.mean()
        rows = self.comm.gather_values(mine + norm_row(norms, self.plan.num_layers))
        loss_total, correct_total, held_bytes, held_objects = (
            sum(r[i] for r in rows) for i in (0, 1, 4, 5))
        epoch_time = max(r[2] for r in rows)
        transition = max(r[3] for r in rows)
        metric = correct_total / max(len(self.splits.eval), 1) if evaluated else float("nan")
        rec = EpochRecord(
            epoch=epoch,
            num_frozen=self.plan.num_frozen,
            num_layers=self.plan.num_layers,
            pipeline_length=self.plan.pipeline_length,
            num_replicas=self.plan.num_replicas,
            num_microbatches=self.plan.num_microbatches,
            throughput_samples_per_s=samples / max(epoch_time, 1e-9),
            epoch_time_s=epoch_time,
            transition_time_s=transition,
            cache_hit_rate=float(cache[1] / cache[0]) if cache[0] else 0.0,
            train_loss=loss_total / max(steps, 1),
            eval_metric=metric,
            eval_time_s=eval_time,
            # Replicas run side by side: the wall time saved is the mean over them.
            cache_saved_s=float(cache[2] / cache[3]) if cache[3] else 0.0,
            cache_bytes=int(held_bytes),
            cache_objects=int(held_objects),
            cache_cost_ratio=float(cache[4] / cache[5]) if cache[5] else 0.0,
            memory=rank_memory([v for r in rows for v in r[6:6 + len(FIELDS)]], self.world),
        )
        return rec, merge_block_norms([r[len(mine):] for r in rows])

    def _step_report(self, epoch: int, epoch_step: int, loss: torch.Tensor | float,
                     samples: int, mark: float) -> float:
        """Count the step just taken in the throughput window and, every
        ``logging.every_steps`` steps, hand its record to ``on_step_report`` on every rank.

        Args:
            epoch: the step's epoch.
            epoch_step: steps of the epoch so far, this one included.
            loss: this rank's share of the step's loss (:meth:`train_step`).
            samples: the step's global batch.
            mark: when the step's wall time began (the previous step's end).

        Returns:
            The next step's ``mark``.
        """
        window = self.step_window
        if not window.due(self.global_step):
            now = time.perf_counter()
            window.add(samples, now - mark)
            return now
        # Only reporting steps read the loss back, which waits for the window's kernels: the
        # window's wall time is the device's.
        loss = float(loss)
        now = time.perf_counter()
        window.add(samples, now - mark)
        # Last stages hold their replica's mean loss / R, other ranks 0: the sum is the mean
        # over the global batch. Rank 0's window time comes along, so that every rank reports
        # the same record (and makes the same reporting calls).
        loss, seconds = self.comm.reduce_values(
            [loss, window.seconds if self.rank == 0 else 0.0])
        samples_per_s, window_s, window_steps = window.take(seconds)
        self.on_step_report(StepRecord(
            epoch=epoch, global_step=self.global_step, epoch_step=epoch_step,
            epoch_steps=self.steps_in_epoch(), train_loss=loss, samples_per_s=samples_per_s,
            lr=self.lr, num_frozen=self.plan.num_frozen, window_s=window_s,
            window_steps=window_steps))
        return now

    def _after_guard(self, evaluated: bool) -> None:
        """With ``freeze.rollback``: take the next decision now, and roll back if the guard
        ordered it (else an evaluated epoch clears the snapshots: its freezes passed)."""
        plan = self.controller.plan_for(self.decision)
        if plan.rollback_to is not None and plan.generation != self.plan.generation:
            self._roll_back(plan)
            self.next_epoch = plan.rollback_to
        elif evaluated:
            self.snapshots.clear()

    def fit(
        self, on_epoch: Callable[[EpochRecord], None] | None = None, first_epoch: int = 0
    ) -> list[EpochRecord]:
        """Start (unless restored), then train from ``first_epoch`` to the end; returns the
        timeline of the epochs trained here (identical on every rank; after a rollback the
        epochs trained again replace the undone ones)."""
        if self.plan is None:
            self.start()
        timeline: list[EpochRecord] = []
        epoch = first_epoch
        while epoch < self.cfg.epochs:
            rec = self.train_epoch(epoch)
            timeline = [r for r in timeline if r.epoch < epoch] + [rec]
            if on_epoch is not None:
                on_epoch(rec)
            epoch = self.next_epoch
        return timeline

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def count_correct(self) -> tuple[int, float]:
        """Score this rank's share of the eval set: the set is split across replicas and piped
        through each replica's stages. Returns the correct predictions counted here (on last
        stages; 0 elsewhere: the sum over every rank is the whole set's) and the seconds it
        took."""
        t0 = time.perf_counter()
        plan, topo = self.plan, self.topo
        n = len(self.splits.eval)
        size = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        self.adapter.model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        prev = topo.pipeline_ranks[topo.stage - 1] if not topo.is_first_stage else None
        nxt = topo.pipeline_ranks[topo.stage + 1] if not topo.is_last_stage else None
        for idx in eval_shards(n, size, topo.replica, plan.num_replicas):
            if topo.is_first_stage:
                inputs = _to(gather(self.splits.eval, idx.tolist()), self.device).inputs
                if self.stage.state_inputs:  # the cache holds training samples only
                    inputs = self.stage.run_prefix(*inputs)
                out = self.stage(*inputs)
            else:
                out = self.stage(*self.comm.recv(prev, self.device))
            if nxt is not None:
                self.comm.send(out, nxt)
            else:
                target = gather(self.splits.eval, idx.tolist()).target.to(self.device)
                correct += self.adapter.correct(out, target).sum()
        self._set_modes()
        return int(correct), time.perf_counter() - t0

    # -- state ---------------------------------------------------------------------------------

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

    def layer_state_dicts(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameters of :meth:`primary_layers`, detached copies on the CPU."""
        return {
            name: {k: v.detach().cpu().clone() for k, v in self.modules[name].state_dict().items()}
            for name in self.primary_layers()
        }

    def save_shard(self, directory) -> None:
        """Write this rank's part of a checkpoint: its primary layers' parameters and optimizer
        state, and the gradient norms gathered since the last decision."""
        layers: dict = {}
        mine = self.primary_layers()
        for name in mine:
            module = self.modules[name]
            entry = {"params": {k: v.detach().cpu() for k, v in module.state_dict().items()}}
            if is_trainable(self.plan, name):
                entry["optim"] = [
                    {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()}
                    for st in collect_layer_state(self.optimizer, module)
                ]
            layers[name] = entry
        if mine:
            layers["__norms__"] = self.norms.state_dict()
        path = write_shard(directory, self.rank, layers)
        if self.fault is not None and self.fault.due("checkpoint", self.next_epoch - 1):
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
            kill_self()  # half of the shard written

    def checkpoint_meta(self, epoch: int) -> dict:
        """Run-level state after ``epoch`` (rank 0 writes it beside the shards)."""
        return {
            "epoch": epoch,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "rolled_back": self.rolled_back,
            "num_workers": self.world,
            "num_shards": self.world,  # every rank writes one, with its manifest
            "precision": self.precision.name,
            **({"loss_scale": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def restore(self, directory, plan: Plan) -> int:
        """Load a checkpoint and enter ``plan`` (decided for the resumed run, possibly for a
        different number of workers). Returns the first epoch to train."""
        meta = read_meta(directory)
        self.decision = meta["next_decision"]
        self.rolled_back = bool(meta.get("rolled_back", False))
        self.global_step = meta["global_step"]
        self.samples_seen = meta["samples_seen"]
        if self.scaler is not None and "loss_scale" in meta:
            self.scaler.load_state_dict(meta["loss_scale"])
        replica, stage = plan.coords(self.rank)
        names = plan.stage_layers(stage)
        loaded, norms = load_layers(directory, names)
        states: LayerStates = {}
        with torch.no_grad():
            for name in names:
                module = self.modules[name]
                materialise(module, self.device)
                module.load_state_dict(loaded[name]["params"])
                if is_trainable(plan, name) and "optim" in loaded[name]:
                    states[name] = [
                        {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v
                         for k, v in st.items()}
                        for p, st in zip(module.parameters(), loaded[name]["optim"])
                    ]
        self.norms.reset()
        blocks = set(plan.stage_blocks(stage))
        self.norms.sums.update({b: v for b, v in norms["sums"].items() if b in blocks})
        self.norms.steps = norms["steps"]
        if self.prefix is not None:
            # Entries deeper than the checkpoint's prefix came from training this resume
            # replays, perhaps to a different decision; writes still in flight too. Every rank
            # drops them (idempotent on a shared store), then all write under the last lineage.
            self.prefix.invalidate_above(plan.num_frozen)
            self.comm.barrier()
            self.prefix.store.attach()
        self.apply_plan(plan, restored=states)
        self.next_epoch = meta["epoch"] + 1
        return self.next_epoch

    def close(self) -> None:
        """Destroy this rank's subgroups (the WORLD group stays with its owner)."""
        self._ddp = None
        self.topologies.close()
        self.topo = None


# Buffers are the same on every replica (built from one seed, never trained): DDP need not
# broadcast them before each forward. torch 2.14 renamed the switch.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    from pt_ray.data.base import Batch

    return Batch(batch.indices, tuple(t.to(device) for t in batch.inputs), batch.target.to(device))
