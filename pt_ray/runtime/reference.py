"""The single-process reference trainer: the numerical oracle for the distributed engine.

One process, no Ray, no process groups. It trains any adapter with a freeze policy exactly as
the README describes, so that a pipeline x data-parallel run on the same data order must end
with the same parameters:

1. at each decision point (every epoch's start, and every k steps inside it when decisions come
   inside epochs) the policy sees the per-block gradient norms and the mean training loss
   gathered since the last decision and returns ``num_frozen``;
2. newly frozen layers get ``requires_grad=False``, run in eval mode under ``no_grad`` and leave
   the optimizer with their state, while every other layer's optimizer state is untouched;
3. each step takes the global sampler's indices, sets the learning rate from the run's progress
   in samples, runs forward/backward (the trainable blocks recomputed in the backward with
   ``pipeline.activation_checkpointing``, as the engine's stages), clips the global norm of
   the active gradients and steps;
4. after each epoch the whole eval set is scored, and the accuracy guard sees the score: after a
   harmful freeze it stops freezing and, with ``freeze.rollback``, returns to the state kept at
   the start of the epoch in which the prefix grew and trains on from there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pt_ray.data.sampler import GlobalSampler
from pt_ray.data.base import (
    Batch,
    DatasetSplits,
    SampleDataset,
    finish_batch,
    gather_stored,
    set_epoch,
)
from pt_ray.data.loader import iterate_batches
from pt_ray.data.registry import build_dataset
from pt_ray.data.sampler import accumulation_chunks, probe_indices, training_sampler
from pt_ray.control.state import decision_interval, policy_for
from pt_ray.core.plan import start_pipeline_length
from pt_ray.core.freeze import (
    PROBE_NOW,
    PROBE_REVERTED,
    FreezeGuard,
    FreezePolicy,
)
from pt_ray.models.base import (
    ModelAdapter,
    State,
    forward_layers,
    frozen_layer_names,
    iter_layers,
    layer_module,
    run_blocks,
)
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.settings import ReferenceSettings
from pt_ray.runtime.layerstate import capture_layers, load_layers_into
from pt_ray.runtime.norms import GradNormMeter, block_grad_norms
from pt_ray.runtime.precision import LossScaler, Precision, resolve_precision
from pt_ray.runtime.rollback import Rollback
from pt_ray.runtime.clipping import clip_grad_norm
from pt_ray.runtime.optim import (
    adopt_states,
    build_optimizer,
    layer_param_groups,
    lr_factor,
    remove_layers,
    set_lr,
)
from pt_ray.reporting.steplog import StepRecord, StepWindow
from pt_ray.reporting.summary import EpochRecord

__all__ = ["ReferenceProbe", "ReferenceSettings", "ReferenceTrainer", "build_reference", "evaluate"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    adapter: ModelAdapter,
    splits: DatasetSplits,
    batch_size: int,
    num_workers: int = 0,
    precision: Precision | None = None,
) -> float:
    """The eval metric over the whole eval set (every sample once), in eval mode (under
    ``precision``'s autocast when given).

    Every module's own mode is restored afterwards: ``model.train()`` would also switch a
    frozen prefix (kept in eval mode) back to training mode, turning its dropout on.
    """
    modules = {
        m: m.training
        for root in (adapter.model, adapter.embed, adapter.blocks, adapter.head)
        for m in root.modules()
    }
    for m in modules:
        m.training = False
    n = len(splits.eval)
    steps = [np.arange(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    correct = 0
    try:
        for batch in iterate_batches(splits.eval, steps, num_workers):
            with precision.autocast() if precision is not None else contextlib.nullcontext():
                out = forward_layers(adapter, batch.inputs)
            correct += int(adapter.correct(out, batch.target).sum())
    finally:
        for m, mode in modules.items():
            m.training = mode
    return correct / max(n, 1)


class ReferenceProbe:
    """The probe of ``freeze.policy=probe`` in one process, written apart from the engine's
    (:class:`pt_ray.runtime.probe.Probe`), which it checks: the tested blocks' parameters
    copied at an interval's start, and at its end the mean probe loss as they are and with the
    tested blocks put back. The state entering the tested blocks is computed once for both:
    once per test while the embedding trains, once per frozen count after (the frozen prefix
    never changes while tests go on; a rollback ends them).

    Args:
        adapter: the model.
        dataset: the training split, which holds the probe samples.
        indices: the probe samples (:func:`pt_ray.data.sampler.probe_indices`).
        batch_size: samples per forward.
        precision: the run's precision.
    """

    def __init__(self, adapter: ModelAdapter, dataset: SampleDataset, indices: np.ndarray,
                 batch_size: int, precision: Precision) -> None:
        self.adapter, self.dataset, self.indices = adapter, dataset, indices
        self.batch_size, self.precision = batch_size, precision
        self.kept: dict[str, list[torch.Tensor]] | None = None
        self.start_frozen = 0
        self.seconds = 0.0  # spent measuring since the last epoch's record
        self.starts: list[tuple[State, torch.Tensor]] = []  # (state, target) a probe batch
        self.starts_for = -1  # the frozen count of ``starts``

    def start(self, num_frozen: int, blocks: int) -> None:
        """Keep the ``blocks`` leading active blocks as they are now (none: no test)."""
        self.kept, self.start_frozen = None, num_frozen
        if blocks:
            self.kept = {f"block.{i}": [p.detach().clone() for p in self.adapter.blocks[i]
                                        .parameters()]
                         for i in range(num_frozen, num_frozen + blocks)}

    def measure(self, num_frozen: int) -> dict[int, float]:
        """The two probe losses (empty when the interval tests nothing, or a rollback has
        shrunk the frozen prefix since it began)."""
        if self.kept is None or num_frozen != self.start_frozen:
            return {}
        t0 = time.perf_counter()
        if num_frozen != self.starts_for or not num_frozen:
            self.starts, self.starts_for = [], num_frozen
        modules = dict(iter_layers(self.adapter))
        now = self._loss()
        current = {n: [p.detach().clone() for p in modules[n].parameters()] for n in self.kept}
        with torch.no_grad():
            for n, kept in self.kept.items():
                for p, k in zip(modules[n].parameters(), kept):
                    p.copy_(k)
            reverted = self._loss()
            for n, now_params in current.items():
                for p, k in zip(modules[n].parameters(), now_params):
                    p.copy_(k)
        self.kept = None
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        logger.info("probe: %d blocks tested on %d samples in %.3f s", len(current),
                    len(self.indices), seconds)
        return {PROBE_NOW: now, PROBE_REVERTED: reverted}

    def take_seconds(self) -> float:
        """Seconds spent measuring since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @torch.no_grad()
    def _loss(self) -> float:
        a, n = self.adapter, self.start_frozen
        modes = {m: m.training for m in a.model.modules()}
        a.model.eval()
        total = 0.0
        for i, s in enumerate(range(0, len(self.indices), self.batch_size)):
            if i == len(self.starts):
                idx = self.indices[s:s + self.batch_size].tolist()
                batch = finish_batch(self.dataset, gather_stored(self.dataset, idx))
                with self.precision.autocast():
                    self.starts.append((run_blocks(a.blocks[:n], a.embed(*batch.inputs)),
                                        batch.target))
            state, target = self.starts[i]
            with self.precision.autocast():
                out = a.head(*run_blocks(a.blocks[n:], state))
            total += float(a.loss(out, target)) * len(target)
        for m, mode in modes.items():
            m.training = mode
        return total / len(self.indices)


def build_reference(
    settings: ReferenceSettings,
    *,
    splits: DatasetSplits | None = None,
    adapter: ModelAdapter | None = None,
    policy: FreezePolicy | None = None,
    on_step_report: Callable[[StepRecord], None] | None = None,
) -> ReferenceTrainer:
    """The reference trainer of a run, its parts built from its settings
    (:func:`pt_ray.service.settings.run_settings` reads them from the config).

    Args:
        settings: what the trainer is told about the run.
        splits: datasets (default: built from ``settings.data``).
        adapter: the model (default: built from ``settings.model`` for ``splits``).
        policy: the freeze policy (default: from ``settings.decisions``, L from the model).
        on_step_report: see :class:`ReferenceTrainer`.
    """
    s = settings
    seed, freeze = s.seed, s.decisions.freeze
    splits = splits or build_dataset(s.data, seed=seed, tokenizer_dir=s.model.weights)
    adapter = adapter or build_model_for(s.model, seed, splits)
    # The run's order, as the engine's (the same with the cache on or off).
    sampler = training_sampler(freeze, s.batch_size, seed, len(splits.train))
    # With the pipeline pinned (pipeline.elastic=false) the Ray run freezes at most L - K0.
    layers = adapter.num_layers
    pinned = (None if s.pinned_length is None
              else start_pipeline_length(s.pinned_length, layers, s.num_workers))
    policy = policy or policy_for(s.decisions, layers, sampler.steps_per_epoch,
                                  pinned_length=pinned)
    return ReferenceTrainer(settings, splits=splits, adapter=adapter, policy=policy,
                            sampler=sampler,
                            probe_samples=probe_indices(freeze, seed, len(splits.train)),
                            on_step_report=on_step_report)


class ReferenceTrainer:
    """Train one model in one process with AutoFreeze (:func:`build_reference` builds one from
    a config).

    Args:
        settings: what the trainer is told about the run.
        splits: the datasets.
        adapter: the model.
        policy: the freeze policy.
        sampler: the run's sample order (the engine's).
        probe_samples: the probe's training samples (:func:`pt_ray.data.sampler.probe_indices`;
            empty unless the policy probes).
        on_step_report: with ``logging.every_steps`` N > 0, called with the
            :class:`~pt_ray.reporting.steplog.StepRecord` of every N-th step of the run.
    """

    def __init__(
        self,
        settings: ReferenceSettings,
        *,
        splits: DatasetSplits,
        adapter: ModelAdapter,
        policy: FreezePolicy,
        sampler: GlobalSampler,
        probe_samples: np.ndarray,
        on_step_report: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.settings = s = settings
        self.on_step_report = on_step_report
        every = s.every_steps
        self.step_window = StepWindow(every) if on_step_report is not None and every else None
        self.splits = splits
        self.adapter = adapter
        self.sampler = sampler
        self.policy = policy
        self.optimizer = build_optimizer(
            s.optimizer,
            layer_param_groups(iter_layers(self.adapter), s.optimizer.weight_decay),
        )
        self.num_frozen = 0
        self.global_step = 0
        self.lr = s.optimizer.lr  # the last step's learning rate
        self.norms = GradNormMeter()
        self.precision = resolve_precision(s.precision, torch.device("cpu"))
        self.scaler = LossScaler() if self.precision.scaled else None
        self.guard = FreezeGuard(s.guard_points, s.rollback)
        self.rollback = Rollback()
        self.rollbacks: list[dict] = []
        # Decisions are counted as the engine counts them: one opens each epoch, one more every
        # `interval` steps inside it (None: per epoch).
        self.decision = 0
        self.interval = decision_interval(s.decisions, sampler.steps_per_epoch)
        # The run's training samples: the learning-rate schedule's length.
        self.total_samples = s.epochs * sampler.steps_per_epoch * s.batch_size
        self.discarded: list[EpochRecord] = []
        self.probe = (ReferenceProbe(adapter, splits.train, probe_samples, s.eval_batch_size,
                                     self.precision) if len(probe_samples) else None)
        self._epoch = 0
        self._set_modes()

    # -- freezing ------------------------------------------------------------------------------

    def _set_modes(self) -> None:
        self.adapter.model.train()
        for name in frozen_layer_names(self.num_frozen):
            layer_module(self.adapter, name).eval()

    def freeze_to(self, num_frozen: int) -> None:
        """Grow the frozen prefix: no gradients, eval mode, out of the optimizer."""
        if num_frozen <= self.num_frozen:
            return
        new = [n for n in frozen_layer_names(num_frozen) if n not in
               frozen_layer_names(self.num_frozen)]
        for name in new:
            for p in layer_module(self.adapter, name).parameters():
                p.requires_grad_(False)
                p.grad = None
        remove_layers(self.optimizer, new)
        self.num_frozen = num_frozen
        self._set_modes()

    def decide(self, decision: int) -> float:
        """Run the freeze policy at a decision point; returns the transition's wall time."""
        t0, before = time.perf_counter(), self.num_frozen
        inputs = {**self.norms.mean(), **(self.probe.measure(before) if self.probe else {})}
        result = self.guard.hold(self.policy.decide(decision, before, inputs), before)
        self.norms.reset()
        if result.num_frozen != before:
            self.freeze_to(result.num_frozen)
        if self.probe is not None:  # the next interval tests what the policy asked
            self.probe.start(self.num_frozen, 0 if self.guard.stopped else result.probe)
            logger.info(
                "decision %d: frozen %d -> %d of %d blocks (%s)",
                decision, before, self.num_frozen, self.adapter.num_layers, result.reason,
            )
        return time.perf_counter() - t0

    # -- the accuracy guard's rollback -----------------------------------------------------------

    def _keep_snapshot(self, epoch: int) -> None:
        """Keep everything that decides the rest of the run as it is now (the start of
        ``epoch``)."""
        modules = dict(iter_layers(self.adapter))
        frozen = set(frozen_layer_names(self.num_frozen))
        self.rollback.keep(
            epoch,
            capture_layers(modules, modules, set(modules) - frozen, self.optimizer, copy=True),
            {"global_step": self.global_step, "num_frozen": self.num_frozen},
            self.norms.state_dict(),
            self.scaler.state_dict() if self.scaler is not None else None)

    def _roll_back(self, epoch: int) -> None:
        """Return to the snapshot of ``epoch``'s start: the blocks frozen since train again."""
        snap = self.rollback.undo(epoch)
        modules = dict(iter_layers(self.adapter))
        num_frozen = snap.counters["num_frozen"]
        frozen = frozen_layer_names(num_frozen)
        for name in set(frozen_layer_names(self.num_frozen)) - set(frozen):
            for p in modules[name].parameters():
                p.requires_grad_(True)
        trained = set(modules) - set(frozen)
        states = load_layers_into(modules, snap.layers, trained, torch.device("cpu"))
        self.num_frozen = num_frozen
        optimizer = self.settings.optimizer
        self.optimizer = build_optimizer(
            optimizer, layer_param_groups(iter_layers(self.adapter), optimizer.weight_decay))
        remove_layers(self.optimizer, frozen)
        adopt_states(self.optimizer, [pair for name, layer_states in states.items()
                                      for pair in zip(modules[name].parameters(), layer_states)])
        self.global_step = snap.counters["global_step"]
        if self.scaler is not None:
            self.scaler.load_state_dict(snap.scaler)
        self.norms.load_state_dict(snap.norms)
        self._set_modes()

    def after_epoch(self, rec: EpochRecord, timeline: list[EpochRecord]) -> int:
        """Show an epoch to the guard; returns the next epoch to train (earlier than
        ``rec.epoch + 1`` after a rollback, whose undone epochs move from ``timeline`` to
        :attr:`discarded`)."""
        verdict = self.guard.observe(rec.epoch, rec.num_frozen, rec.eval_metric)
        if verdict is None:
            if rec.eval_metric == rec.eval_metric:  # evaluated: no earlier freeze is suspect
                self.rollback.passed()
            return rec.epoch + 1
        logger.warning("accuracy guard: %s", verdict.describe())
        if not verdict.rollback:
            return rec.epoch + 1
        q = verdict.freeze_epoch
        self._roll_back(q)
        self.discarded += [r for r in timeline if r.epoch >= q]
        timeline[:] = [r for r in timeline if r.epoch < q]
        self.rollbacks.append({"epoch": rec.epoch, "rollback_to": q,
                               "num_frozen": self.num_frozen, "undone": rec.num_frozen,
                               "before": verdict.before, "after": verdict.after})
        return q

    # -- training ------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> float:
        """One optimizer step on a global batch; returns its mean loss.

        With ``optimizer.accumulation_steps`` A > 1 the batch runs as A consecutive chunks
        (:func:`pt_ray.data.sampler.accumulation_chunks`), one forward and backward each. Each
        chunk's mean loss is weighted by its share of the batch (1 / A), so the summed gradient is
        the whole batch's mean-loss gradient; norms, clipping and the step then run once.
        """
        s = self.settings
        self.lr = s.optimizer.lr * lr_factor(
            self.global_step * s.batch_size / self.total_samples, s.optimizer)
        set_lr(self.optimizer, self.lr)
        self.optimizer.zero_grad(set_to_none=True)
        parts = accumulation_chunks(len(batch), s.optimizer.accumulation_steps)
        loss: torch.Tensor | float = 0.0
        for part in parts:
            chunk = batch if len(parts) == 1 else Batch(
                batch.indices[part], tuple(t[part] for t in batch.inputs), batch.target[part])
            value = self._loss(chunk)
            if len(parts) > 1:
                value = value * (len(chunk) / len(batch))
            (value * self.scaler.scale if self.scaler is not None else value).backward()
            loss = loss + value.detach()
        return self._step(float(loss))

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The mean loss of ``batch`` (the frozen prefix without gradients)."""
        a, n, prec = self.adapter, self.num_frozen, self.precision
        with prec.autocast():
            if n > 0:
                with torch.no_grad():
                    state = a.embed(*batch.inputs)
                    for block in a.blocks[:n]:
                        state = block(*state)
                # The frozen prefix's output is an activation the engine sends or caches.
                state = prec.cast_state(state)
            else:
                state = a.embed(*batch.inputs)
            # As the engine's stages: the trainable blocks checkpointed when configured.
            state = run_blocks(a.blocks[n:], state, self.settings.activation_checkpointing)
            out = prec.logits(a.head(*state))
        return a.loss(out, batch.target)

    def _step(self, loss: float) -> float:
        """Per-block norms, clipping (unscaling under fp16) and the optimizer step on the
        gradients the step's backward passes left; returns ``loss``."""
        a, n = self.adapter, self.num_frozen
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            scale = self.scaler.scale
            scaled = block_grad_norms(a, range(n, a.num_layers))
            norm, _ = clip_grad_norm(None, params, self.settings.optimizer.grad_clip, None,
                                     inv_scale=1.0 / scale)
            found_inf = not bool(torch.isfinite(norm))
            self.scaler.update(found_inf)
            self.global_step += 1
            if found_inf:  # skipped: no step, no norms
                return loss
            self.norms.add({b: v / scale for b, v in scaled.items()})
            self.norms.add_loss(loss)
            self.optimizer.step()
            return loss
        self.norms.add(block_grad_norms(a, range(n, a.num_layers)))
        self.norms.add_loss(loss)
        clip = self.settings.optimizer.grad_clip
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        self.optimizer.step()
        self.global_step += 1
        return loss

    def train_epoch(self, epoch: int) -> EpochRecord:
        """Train one epoch (with its decision points) and evaluate."""
        s = self.settings
        transition = 0.0
        self._epoch = epoch
        g = self.guard
        if g.rollback and not g.stopped and self.num_frozen < self.policy.max_frozen:
            # A freeze anywhere in this epoch that the guard finds harmful returns here.
            self._keep_snapshot(epoch)
        transition += self.decide(self.decision)
        set_epoch(self.splits.train, epoch)
        steps = [self.sampler.step_indices(epoch, s) for s in range(self.sampler.steps_per_epoch)]
        losses = []
        frozen_steps = 0
        t0 = time.perf_counter()
        mark = t0  # where the next step's wall time starts, for the step reports
        for batch in iterate_batches(self.splits.train, steps, s.loader_workers):
            if self.interval is not None and losses and len(losses) % self.interval == 0:
                self.decision += 1
                transition += self.decide(self.decision)
            frozen_steps += self.num_frozen
            losses.append(self.train_step(batch))
            if self.step_window is not None:
                now = time.perf_counter()
                self.step_window.add(len(batch), now - mark)
                mark = now
                if self.step_window.due(self.global_step):
                    samples_per_s, window_s, window_steps = self.step_window.take()
                    self.on_step_report(StepRecord(
                        epoch=epoch, global_step=self.global_step, epoch_step=len(losses),
                        epoch_steps=len(steps), train_loss=losses[-1],
                        samples_per_s=samples_per_s, lr=self.lr, num_frozen=self.num_frozen,
                        window_s=window_s, window_steps=window_steps))
        train_time = time.perf_counter() - t0
        self.decision += 1  # the epoch's last interval feeds the decision opening the next
        t1 = time.perf_counter()
        metric = float("nan")
        if epoch in s.eval_epochs:
            metric = evaluate(self.adapter, self.splits, s.eval_batch_size, s.loader_workers,
                              self.precision)
        samples = len(steps) * s.batch_size
        return EpochRecord(
            epoch=epoch,
            num_frozen=self.num_frozen,
            num_layers=self.adapter.num_layers,
            pipeline_length=1,
            num_replicas=1,
            num_microbatches=1,
            throughput_samples_per_s=samples / max(train_time, 1e-9),
            epoch_time_s=train_time,
            transition_time_s=transition,
            cache_hit_rate=0.0,
            train_loss=float(np.mean(losses)) if losses else float("nan"),
            eval_metric=metric,
            eval_time_s=time.perf_counter() - t1,
            mean_frozen=frozen_steps / max(len(losses), 1),
            probe_time_s=self.probe.take_seconds() if self.probe is not None else 0.0,
        )

    def fit(self, on_epoch: Callable[[EpochRecord], None] | None = None) -> list[EpochRecord]:
        """Train for the run's epochs; returns the timeline (after a rollback, the epochs
        trained again replace the undone ones, which are kept in :attr:`discarded`)."""
        timeline: list[EpochRecord] = []
        epoch = 0
        while epoch < self.settings.epochs:
            rec = self.train_epoch(epoch)
            timeline.append(rec)
            if on_epoch is not None:
                on_epoch(rec)
            epoch = self.after_epoch(rec, timeline)
        return timeline
