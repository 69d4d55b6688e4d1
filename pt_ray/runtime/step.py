"""One optimizer step of one rank on the layout in force.

1. the global sampler's indices for the step; replica ``r`` of ``R`` takes its contiguous
   slice (``B / R`` samples under ``fixed_global``); with ``optimizer.accumulation_steps`` A
   the step is cut into A consecutive chunks first, step 2 runs once per chunk on the replica's
   slice of it (``B / (A R)`` samples), and gradients sum in ``.grad`` across the passes;
2. stage 0 runs the frozen prefix (``no_grad``, eval mode), or with the activation cache on
   takes it from the cache for the whole replica batch before the schedule
   (:class:`pt_ray.cache.prefix.CachedPrefix`), then its active blocks; the schedule
   (``gpipe`` or ``1f1b``, M micro-batches) carries states to the last stage, which runs the head
   and the loss; K = 1 runs without a pipeline;
3. gradients of trained parameters are averaged over the stage's data-parallel group by DDP,
   during backward (frozen ones never are): at K = 1 in the last pass's backward; with a
   pipeline, with each pass's last micro-batch; per-block gradient norms are recorded; the global
   norm is clipped across stages (fp16: unscaled, and a step with an inf/nan anywhere is skipped
   on every rank);
4. the optimizer steps with the learning rate of the run's progress.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time

import numpy as np
import torch

from pt_ray.data.base import (
    Batch,
    DatasetSplits,
    StoredSamples,
    finish_batch,
    gather_stored,
    gather_targets,
    set_epoch,
)
from pt_ray.data.loader import iterate_batches
from pt_ray.data.sampler import accumulation_chunks, split_for_replica
from pt_ray.models.base import ModelAdapter
from pt_ray.runtime.clipping import clip_grad_norm
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.layout import Layout, to_device_batch
from pt_ray.runtime.norms import GradNormMeter
from pt_ray.runtime.optim import lr_factor, set_lr
from pt_ray.runtime.precision import LossScaler
from pt_ray.cache.prefix import CachedPrefix
from pt_ray.runtime.settings import StepSettings

__all__ = ["StepLoss", "Stepper"]

logger = logging.getLogger(__name__)


class StepLoss:
    """The loss the backward starts from: the model's mean loss times the pass's share of the
    step (:attr:`weight`, under gradient accumulation) and, under fp16, the loss scale. Built
    before the layout, whose pipeline schedule's last stage starts its backward from it.

    Args:
        adapter: the model (its loss).
        scaler: the fp16 loss scaler, or None.
    """

    def __init__(self, adapter: ModelAdapter, scaler: LossScaler | None) -> None:
        self.adapter = adapter
        self.scaler = scaler
        self.weight = 1.0  # the current pass's share of the step

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.adapter.loss(output, target)
        if self.weight != 1.0:
            loss = loss * self.weight
        return loss * self.scaler.scale if self.scaler is not None else loss


class Stepper:
    """Runs the steps of one rank and counts them.

    Args:
        settings: what the steps are told about the run.
        layout: the rank's layout (what it holds and runs; built with ``loss``).
        prefix: the activation cache's frozen prefix on stage 0 (None: no cache in this run).
        loss: the step's loss (the one ``layout`` was built with).
        splits: the datasets (read by index).
        comm: the run's communication.
        norms: where each step's per-block gradient norms and loss share go.
    """

    def __init__(self, settings: StepSettings, layout: Layout, prefix: CachedPrefix | None,
                 loss: StepLoss, splits: DatasetSplits, comm: Comm,
                 norms: GradNormMeter) -> None:
        self.settings = settings
        self.layout = layout
        self.prefix = prefix
        self.loss = loss
        self.splits = splits
        self.comm = comm
        self.norms = norms
        self.scaler = loss.scaler
        self._ahead = None  # the epoch's reads, loaded in background workers, in order
        self._ahead_reads: list[np.ndarray] | None = None  # what they load
        self.prefetched = 0  # reads served by them (for tests and logs)
        self.kept_ahead = 0  # epochs whose reads were already loading when they opened
        self.global_step = 0
        self.samples_seen = 0
        self.lr = settings.optimizer.lr  # the last step's learning rate

    def step(self, indices: np.ndarray) -> torch.Tensor | float:
        """One optimizer step on the global batch ``indices``; returns this rank's share of the
        replica-mean loss (a 0-d tensor on the device on last stages, 0.0 elsewhere), not read
        back to the host.

        With ``optimizer.accumulation_steps`` A > 1 the step runs as A passes over consecutive
        chunks of ``indices``, cut as the reference trainer cuts them
        (:func:`pt_ray.data.sampler.accumulation_chunks`): each pass runs this replica's share
        of its chunk and leaves its gradients summed into ``.grad``; the data-parallel
        reduction, norms, clipping and the step then run once.
        """
        layout, s = self.layout, self.settings
        r = layout.plan.num_replicas
        per_replica = s.batch_policy == "per_replica"
        scale = r if per_replica and s.optimizer.scale_lr_with_replicas else 1
        progress = self.samples_seen / s.total_samples
        self.lr = s.optimizer.lr * scale * lr_factor(progress, s.optimizer)
        set_lr(layout.optimizer, self.lr)
        layout.optimizer.zero_grad(set_to_none=True)
        loss = self._passes(indices)
        self.global_step += 1
        self.samples_seen += len(indices)
        share = loss / r if layout.topo.is_last_stage else 0.0
        if self._reduce_and_clip():
            self.norms.add_loss(share)
            layout.optimizer.step()
        return share

    def _passes(self, indices: np.ndarray) -> torch.Tensor | float:
        """The step's passes (one per accumulation chunk), gradients summed in ``.grad`` and
        reduced by the last; returns this rank's part of the replica loss (as :meth:`_pass`)."""
        parts = accumulation_chunks(len(indices), self.settings.optimizer.accumulation_steps)
        loss: torch.Tensor | float = 0.0
        for c, part in enumerate(parts):
            weight = 1.0 if len(parts) == 1 else (part.stop - part.start) / len(indices)
            loss = loss + self._pass(indices[part], weight, sync=c == len(parts) - 1)
        self.loss.weight = 1.0
        return loss

    def rehearse(self, batches: list[np.ndarray]) -> float:
        """Median seconds this rank takes for the passes and the data-parallel reduce of a step,
        over the global batches ``batches`` after the first (a warm-up), under the layout in
        force. What a step changes stays as it was: gradients are dropped, nothing is updated
        or counted (no optimizer step, learning rate, norms or step counter), and the RNG is
        put back, so the run draws the dropout masks it would have drawn. The engine times close
        first layouts with it."""
        device = self.layout.device
        cuda = device.type == "cuda"
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
        set_epoch(self.splits.train, 0)
        times = []
        for indices in batches:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            self._passes(indices)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            self.layout.optimizer.zero_grad(set_to_none=True)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        return statistics.median(times[1:] or times)

    def _reduce_and_clip(self) -> bool:
        """Record the per-block norms of the gradients (DDP averaged them over the replicas
        during backward) and clip the global norm; False when fp16 found an inf/nan (the step
        is skipped on every rank)."""
        layout = self.layout
        scale = self.scaler.scale if self.scaler is not None else 1.0
        params = [p for p in layout.stage.parameters() if p.requires_grad]
        # One pass over the gradients gives the global norm and the per-block ones.
        total, block_norms = clip_grad_norm(self.comm, params, self.settings.optimizer.grad_clip,
                                            layout.topo.pipeline_group, inv_scale=1.0 / scale,
                                            blocks=layout.param_blocks)
        if self.scaler is not None:
            # The norm summed over the pipeline after the replicas' reduction: an inf/nan on any
            # rank is seen by every rank, which all skip the step and back off alike.
            found_inf = not bool(torch.isfinite(total))
            self.scaler.update(found_inf)
            if found_inf:
                if layout.rank == 0:
                    logger.info("step %d skipped: inf/nan gradient; loss scale %g -> %g",
                                self.global_step - 1, scale, self.scaler.scale)
                return False
            if block_norms is not None:
                block_norms = block_norms / scale
        if block_norms is not None:
            self.norms.add_vector(layout.param_blocks.first, block_norms)
        else:
            self.norms.add({})
        return True

    def _pass(self, chunk: np.ndarray, weight: float, sync: bool) -> torch.Tensor | float:
        """Forward and backward of this replica's share of ``chunk`` (the whole step without
        accumulation), adding to ``.grad``; returns this rank's part of the chunk's replica
        loss times ``weight`` (as :meth:`step`).

        Args:
            chunk: the chunk's indices over all replicas.
            weight: the chunk's share of the step, which scales its loss (1 / A).
            sync: the step's last pass: only then does DDP reduce (earlier passes run under
                ``no_sync``, so the summed gradients are reduced once).
        """
        layout = self.layout
        plan, topo = layout.plan, layout.topo
        mine = split_for_replica(chunk, topo.replica, plan.num_replicas)
        first, last = topo.is_first_stage, topo.is_last_stage
        args, target = (), None
        if first and layout.stage.state_inputs:
            args = self.prefix(plan.num_frozen, mine, lambda rows: self._read(mine[rows]).inputs)
        elif first:
            batch = self._read(mine)
            args, target = batch.inputs, batch.target
        if last and target is None:  # the last stage needs the labels only
            target = gather_targets(self.splits.train, mine.tolist()).to(layout.device)
        self.loss.weight = weight
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if layout.schedule is None:
            quiet = layout.ddp is not None and not sync
            with layout.ddp.no_sync() if quiet else contextlib.nullcontext():
                value = self.loss((layout.ddp or layout.stage)(*args), target)
                value.backward()
            return value.detach() / scale
        if first:
            layout.schedule.step(*args)
            return 0.0
        if last:
            losses: list[torch.Tensor] = []
            layout.schedule.step(target=target, losses=losses)
            # Each micro-batch's loss comes divided by M (build_schedule): their sum is the mean.
            return torch.stack([loss.detach() for loss in losses]).sum() / scale
        layout.schedule.step()
        return 0.0

    def prefetch(self, steps: list[np.ndarray]) -> None:
        """Load the input reads of an epoch's steps ahead, in ``data.num_workers`` background
        processes (stored form, pinned on CUDA), under the plan in force: what :meth:`_pass`
        reads, in the order it reads it. Only a first stage that runs the embedding reads
        inputs; later stages read labels. The processes start now, so a call at the end of an
        epoch for the next one hides their start and first batches behind the evaluation; a
        later call for the same reads keeps them. A read that differs (the plan changed) ends
        them."""
        reads = self._reads(steps)
        if reads is not None and self._ahead_reads is not None and len(reads) == len(
                self._ahead_reads) and all(map(np.array_equal, reads, self._ahead_reads)):
            self.kept_ahead += 1
            return  # already loading exactly these (started at the end of the last epoch)
        self.close_prefetch()
        if reads is None:
            return
        self._ahead = iterate_batches(self.splits.train, reads, self.settings.loader_workers,
                                      stored=True, pin_memory=self.layout.device.type == "cuda")
        self._ahead_reads = reads

    def end_epoch(self, next_steps: list[np.ndarray] | None) -> None:
        """After an epoch's last step: start loading the next epoch's reads under this plan
        (``next_steps``; None: the run ends), so they load during the evaluation, where a read
        does not depend on the epoch (stored reads, or no augmentation); else stop."""
        train = self.splits.train
        if next_steps is not None and (train.deterministic_transform
                                       or isinstance(train, StoredSamples)):
            self.prefetch(next_steps)
        else:
            self.close_prefetch()

    def _reads(self, steps: list[np.ndarray]) -> list[np.ndarray] | None:
        """This rank's input reads of ``steps`` under the plan in force, in order (None: it
        reads no inputs, or loads in the training process)."""
        layout = self.layout
        topo, plan = layout.topo, layout.plan
        if (self.settings.loader_workers == 0 or not topo.is_first_stage
                or layout.stage.state_inputs):
            return None
        passes = self.settings.optimizer.accumulation_steps
        return [split_for_replica(idx[part], topo.replica, plan.num_replicas)
                for idx in steps for part in accumulation_chunks(len(idx), passes)]

    def close_prefetch(self) -> None:
        """Stop the background reads (their workers end)."""
        self._ahead = None
        self._ahead_reads = None

    def _read(self, indices: np.ndarray) -> Batch:
        """The training samples ``indices`` as model inputs on this rank's device: read in
        their stored form (from the background reads when they hold them next, else now),
        copied, then transformed on the device (:func:`pt_ray.data.base.finish_batch`)."""
        stored = None
        if self._ahead is not None:
            stored = next(self._ahead, None)
            if stored is not None and np.array_equal(stored.indices.numpy(), indices):
                self.prefetched += 1
            else:
                stored = None
                self.close_prefetch()
        if stored is None:
            stored = gather_stored(self.splits.train, indices.tolist())
        return finish_batch(self.splits.train, to_device_batch(stored, self.layout.device))
