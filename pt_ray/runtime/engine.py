"""The elastic worker: one rank's pipeline x data-parallel training loop with live re-planning.

Every rank runs the same loop in lockstep over the WORLD process group (from Ray Train, or a
plain ``init_process_group``). At each decision point it asks the controller for the plan in
force; when the plan's generation changes, it migrates state, rebuilds its process groups, its
stage and its runner (:class:`pt_ray.runtime.layout.Layout`), and goes on at the same step as
every other rank. Each step is :class:`pt_ray.runtime.step.Stepper`'s.

Decisions are counted: one opens every epoch and, when decisions come inside epochs, one more
follows every k steps. After each epoch every rank reports its record (the accuracy guard reads
the metric) with its last interval's norms and loss (:mod:`pt_ray.runtime.records`). With
``freeze.rollback`` each rank keeps, at the start of each epoch while blocks may still freeze,
a host copy of what it holds (:class:`pt_ray.runtime.rollback.Rollback`); when the guard orders
a rollback (a plan with ``rollback_to``), every rank restores that copy, enters the plan and
trains that epoch again. Snapshots still waiting for a verdict travel in checkpoints.

Every collective and point-to-point call of pt-ray's own goes through
:class:`pt_ray.runtime.comm.Comm`, on the groups' device (CUDA for NCCL); DDP and the pipeline
schedules send the model's own tensors, already on the device. Losses and gradient norms stay
on the device until an epoch or a decision interval ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from pt_ray.control.state import decision_interval
from pt_ray.core.plan import CostTable, Plan
from pt_ray.data.base import DatasetSplits, set_epoch
from pt_ray.data.sampler import probe_indices, training_sampler
from pt_ray.models.base import ModelAdapter
from pt_ray.reporting.steplog import StepRecord
from pt_ray.reporting.summary import EpochRecord
from pt_ray.cache.store import ActivationStore
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.controller import Controller, LocalController
from pt_ray.runtime.layout import Layout
from pt_ray.runtime.memory import MemoryMeter
from pt_ray.runtime.migrate import LayerStates
from pt_ray.runtime.norms import GradNormMeter, merge_block_norms, norm_row
from pt_ray.runtime.precision import LossScaler, resolve_precision
from pt_ray.runtime.probe import probe_for
from pt_ray.cache.prefix import cached_prefix_for, epoch_counters, flush_rows, store_figures
from pt_ray.runtime.profile import profile_share
from pt_ray.runtime.records import (
    CacheFigures,
    EpochFigures,
    EvalPrefix,
    StepReports,
    count_correct,
    epoch_record,
)
from pt_ray.runtime.rankstate import RankState
from pt_ray.runtime.settings import EngineSettings
from pt_ray.runtime.step import StepLoss, Stepper

__all__ = ["Controller", "ElasticWorker", "EngineHooks", "LocalController"]

TRIAL_STEPS = 3
"""Steps rehearsed per first layout the controller asks to time, after one warm-up."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineHooks:
    """Where a rank's engine calls out.

    Tests install the last four to inject faults at the engine's worst moments
    (:func:`pt_ray.runtime.faults.fault_hooks`); a plain run leaves them out.

    Attributes:
        on_step: called as ``on_step(epoch, step)`` before every training step (progress
            reporting, fault injection in tests).
        on_step_report: with ``logging.every_steps`` N > 0, called on every rank with the
            :class:`~pt_ray.reporting.steplog.StepRecord` of every N-th step of the run; give
            it on every rank or on none (each report reduces the step's loss over WORLD).
        on_transition: called as ``on_transition(epoch)`` when a plan is about to replace the
            one in force, before any layer moves.
        in_migration: called as ``in_migration(epoch)`` inside such a migration, after this
            rank's sends and before it receives.
        on_shard: called as ``on_shard(path, epoch)`` once this rank's checkpoint shard after
            ``epoch`` is written.
        on_eval: called as ``on_eval(epoch, correct)`` with the correct predictions this rank
            counted in epoch ``epoch``'s evaluation; returns the count the record takes.
    """

    on_step: Callable[[int, int], None] | None = None
    on_step_report: Callable[[StepRecord], None] | None = None
    on_transition: Callable[[int], None] | None = None
    in_migration: Callable[[int], None] | None = None
    on_shard: Callable[[Path, int], None] | None = None
    on_eval: Callable[[int, int], int] | None = None


class ElasticWorker:
    """One rank of a pt-ray run.

    Args:
        settings: what the rank is told about the run
            (:func:`pt_ray.service.settings.run_settings` reads them from the config).
        adapter: the model, built whole on the host from the same seed on every rank; from
            the first plan on the rank keeps only its stage's layers, on ``device``.
        splits: the datasets (every rank reads the samples it needs by index).
        controller: where costs and norms go and plans come from.
        device: this rank's device (default: CPU).
        costs: a fixed cost table (skips profiling; for tests and forced layouts).
        store: the activation cache's store (None: the frozen prefix is always recomputed,
            whatever the plans say).
        comm: the run's communication (default: built for ``device`` over WORLD).
        hooks: where the engine calls out (progress, step reports, faults in tests).

    The parts are built in dependency order: the step's loss, the cached prefix, the layout
    (whose pipeline schedule takes the loss), the steps over that layout and prefix, and the
    saved state over the layout and steps. Each keeps its own settings
    (:mod:`pt_ray.runtime.settings`), never the whole config.
    """

    def __init__(self, settings: EngineSettings, *, adapter: ModelAdapter, splits: DatasetSplits,
                 controller: Controller, device: torch.device | None = None,
                 costs: CostTable | None = None, store: ActivationStore | None = None,
                 comm: Comm | None = None, hooks: EngineHooks | None = None) -> None:
        self.hooks = hooks or EngineHooks()
        self.adapter = adapter
        self.splits = splits
        self.controller = controller
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.comm = comm or Comm(self.device)
        self.precision = resolve_precision(settings.precision, self.device)
        self.scaler = LossScaler() if self.precision.scaled else None
        self.fixed_costs = costs
        freeze = settings.decisions.freeze
        self.sampler = training_sampler(freeze, settings.batch_size, settings.seed,
                                        len(splits.train))
        self.settings = settings
        steps = self.sampler.steps_per_epoch
        self.norms = GradNormMeter()
        loss = StepLoss(adapter, self.scaler)
        deterministic = splits.train.deterministic_transform
        self.prefix = cached_prefix_for(settings.cache, freeze, settings.seed, adapter, store,
                                        len(splits.train), deterministic, self.device, costs,
                                        self.precision)
        self.layout = Layout(settings.layout, adapter, splits, self.comm, self.device,
                             self.precision, loss, cache=self.prefix is not None)
        self.stepper = Stepper(settings.step_settings(steps), self.layout, self.prefix, loss,
                               splits, self.comm, self.norms)
        self.modules = self.layout.modules
        every = settings.every_steps
        on_report = self.hooks.on_step_report
        self.step_reports = (StepReports(every, on_report, self.comm, self.rank)
                             if on_report is not None and every else None)
        self._epoch = 0
        self.next_epoch = 0
        # Decisions are counted: one opens each epoch, one more every `interval` steps inside
        # it (decide every k steps), and the interval that an epoch's end closes feeds the
        # next epoch's first. A rollback's plan is the next decision like any other.
        self.decision = 0
        self.interval = decision_interval(settings.decisions, steps)
        self.state = RankState(settings.rank, self.layout, self.stepper, self.norms, self.scaler,
                               self.hooks.on_shard)
        # The model stays on the host, where the adapter built it, until the first plan says
        # which layers this rank holds: only those reach the device (:mod:`.owned`).
        self.memory = MemoryMeter(self.modules, self.device)
        self.probe = probe_for(probe_indices(freeze, settings.seed, len(splits.train)), splits,
                               settings.eval_batch_size, self.comm)
        self.eval_prefix = EvalPrefix(settings.cache, self.device)

    # The layout in force, as the rest of the engine (and tests) read it.
    plan = property(lambda self: self.layout.plan)
    topo = property(lambda self: self.layout.topo)
    optimizer = property(lambda self: self.layout.optimizer)

    # -- plans ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Profile (or take the fixed costs), submit them, and enter decision 0's plan."""
        costs = self.fixed_costs
        if costs is None:
            # One pass's replica share: what a device holds at once with accumulation.
            share = (self.settings.batch_size // self.settings.layout.optimizer.accumulation_steps
                     // self.world)
            costs = profile_share(self.adapter, self.splits.train, share, self.device,
                                  self.precision)
            if self.prefix is not None:
                self.prefix.set_costs(costs)
        self.controller.submit_costs(self.rank, costs)
        trials = self.controller.trial_plans()
        if trials:  # close first layouts: time each (the slowest rank's figure counts)
            seconds = []
            for plan in trials:
                self.apply_plan(plan)
                batches = self.sampler.epoch_batches(0, self._replicas_batch())
                seconds.append(self.stepper.rehearse(batches[:TRIAL_STEPS + 1]))
            self.controller.submit_trial(self.rank, self.comm.reduce_values(seconds, op="max"))
        self.apply_plan(self.controller.plan_for(0))

    def apply_plan(self, plan: Plan, restored: LayerStates | None = None) -> float:
        """Enter ``plan`` (migrating state when it replaces another); returns the wall time.

        Args:
            plan: the plan to enter.
            restored: optimizer state per layer when entering the first plan from a checkpoint
                (parameters already loaded).
        """
        midway, hooks = None, self.hooks
        if self.plan is not None and plan.generation != self.plan.generation:
            if hooks.in_migration is not None:
                midway = partial(hooks.in_migration, self._epoch)
            if hooks.on_transition is not None:
                hooks.on_transition(self._epoch)
        elapsed = self.layout.enter(plan, restored, midway)
        if self.probe is not None:  # the plan's interval starts: keep what it tests
            self.probe.start(self.layout, plan)
        return elapsed

    def _open_epoch(self) -> float:
        """Enter the plan of the decision that opens the epoch (its norms went with the
        previous epoch's record). With ``freeze.rollback``, while blocks may still freeze,
        the epoch's starting state is kept first: a freeze anywhere in the epoch that the
        guard finds harmful returns here."""
        if (self.settings.rollback and self.state.may_freeze()
                and self._epoch not in self.state.rollback.snapshots):  # kept at a resume
            self.state.keep_snapshot(self._epoch)
        return self.apply_plan(self.controller.plan_for(self.decision))

    def _submit_norms(self, interval: int, norms: dict[int, float],
                      record: EpochRecord | None = None) -> None:
        """Hand interval ``interval``'s merged norms (and the epoch ``record`` that ends it)
        to the controller (with the interval's probe losses), and start the next interval's."""
        if self.probe is not None:
            norms = {**norms, **self.probe.measure(self.layout)}
        self.controller.submit_norms(interval, self.rank, norms, record)
        self.norms.reset()

    def _decision_point(self) -> float:
        """Inside an epoch, every ``interval`` steps: submit the interval's norms (merged over
        the ranks) and enter the next decision's plan."""
        rows = self.comm.gather_values(norm_row(self.norms.mean(), self.plan.num_layers))
        self._submit_norms(self.decision, merge_block_norms(rows))
        self.decision += 1
        return self.apply_plan(self.controller.plan_for(self.decision))

    # -- training ------------------------------------------------------------------------------

    def _replicas_batch(self) -> int:
        """Samples per step over all replicas (the global batch)."""
        return self.settings.replicas_batch(self.plan.num_replicas)

    def steps_in_epoch(self) -> int:
        """Optimizer steps in an epoch under the current plan (for progress reporting)."""
        return self.sampler.num_samples // max(self._replicas_batch(), 1)

    def train_epoch(self, epoch: int) -> EpochRecord:
        """Train one epoch (entering the plans of its decision points) and evaluate."""
        self._epoch = epoch
        transition = self._open_epoch()
        set_epoch(self.splits.train, epoch)
        order = self.sampler.epoch_order(epoch)
        self.stepper.prefetch(self.sampler.epoch_batches(epoch, self._replicas_batch()))
        if self.prefix is not None:  # no later epoch reads what the last one would cache
            self.prefix.keeps_rows = epoch + 1 < self.settings.epochs
        offset, steps, since = 0, 0, 0  # since: steps since the last decision
        frozen_steps, loss_sum = 0, 0.0
        self.memory.start_epoch()
        t0 = mark = time.perf_counter()  # mark: where the next step's wall time starts
        while offset + self._replicas_batch() <= len(order):
            if self.hooks.on_step is not None:
                self.hooks.on_step(epoch, steps)
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
                loss = self.stepper.step(order[offset:offset + size])
            loss_sum += loss
            offset, steps, since = offset + size, steps + 1, since + 1
            if self.step_reports is not None:
                mark = self.step_reports.after_step(
                    mark, size, loss, epoch=epoch, global_step=self.stepper.global_step,
                    epoch_step=steps, epoch_steps=self.steps_in_epoch(), lr=self.stepper.lr,
                    num_frozen=self.plan.num_frozen)
        final = epoch + 1 == self.settings.epochs  # else the next epoch's reads start loading
        self.stepper.end_epoch(None if final else self.sampler.epoch_batches(
            epoch + 1, self._replicas_batch()))
        if self.device.type == "cuda":  # the epoch's kernels, not only their launches
            torch.cuda.synchronize(self.device)
        rec, norms = self._epoch_record(epoch, time.perf_counter() - t0, transition, loss_sum,
                                        steps, offset)
        rec = replace(rec, mean_frozen=frozen_steps / max(steps, 1), probe_time_s=0.0 if
                      self.probe is None else self.probe.take_seconds())
        self.next_epoch = epoch + 1
        # The epoch's last interval ends here; its norms (after the record, which the accuracy
        # guard reads) feed the decision that opens the next epoch.
        self._submit_norms(self.decision, norms, rec)
        self.decision += 1
        if self.settings.rollback:
            self._after_guard(evaluated=rec.eval_metric == rec.eval_metric)
        return rec

    def _epoch_record(self, epoch: int, epoch_time: float, transition: float,
                      loss_sum: torch.Tensor | float, steps: int, samples: int
                      ) -> tuple[EpochRecord, dict[int, float]]:
        """After an epoch's steps: evaluate (when due) and build the epoch's record and its
        last interval's block norms merged over the ranks (:func:`records.epoch_record`)."""
        layout = self.layout
        memory = self.memory.figures(self.plan.stage_layers(self.topo.stage), self.optimizer,
                                     self.topo.stage)
        cache = CacheFigures()
        if self.prefix is not None:  # the sum waits for every rank's writes; the owner then
            cache = CacheFigures.summed(self.comm, epoch_counters(self.prefix))
            flush_rows(self.prefix)  # stores the incomplete blocks while the ranks evaluate
        evaluated = epoch in self.settings.eval_epochs
        correct, eval_time = 0, 0.0
        if evaluated:
            correct, eval_time = count_correct(self.layout, self.splits,
                                               self.settings.eval_batch_size, self.comm,
                                               self.eval_prefix.for_plan(self.layout))
            if self.hooks.on_eval is not None:
                correct = self.hooks.on_eval(epoch, correct)
        mine = EpochFigures(float(loss_sum), correct, epoch_time, transition,
                            *store_figures(self.prefix, self.rank), memory=tuple(memory))
        return epoch_record(self.comm, layout, epoch, mine, self.norms.mean(), cache,
                            (evaluated, len(self.splits.eval), eval_time), steps, samples)

    def fit(self, on_epoch: Callable[[EpochRecord], None] | None = None,
            first_epoch: int = 0) -> list[EpochRecord]:
        """Start (unless restored), then train from ``first_epoch`` to the end; returns the
        timeline of the epochs trained here (identical on every rank; after a rollback the
        epochs trained again replace the undone ones)."""
        if self.plan is None:
            self.start()
        timeline: list[EpochRecord] = []
        epoch = first_epoch
        while epoch < self.settings.epochs:
            rec = self.train_epoch(epoch)
            timeline = [r for r in timeline if r.epoch < epoch] + [rec]
            if on_epoch is not None:
                on_epoch(rec)
            epoch = self.next_epoch
        return timeline

    # -- the accuracy guard's rollback -----------------------------------------------------------

    def _after_guard(self, evaluated: bool) -> None:
        """With ``freeze.rollback``: take the next decision now, and roll back if the guard
        ordered it (else an evaluated epoch clears the snapshots: its freezes passed)."""
        plan = self.controller.plan_for(self.decision)
        if plan.rollback_to is not None and plan.generation != self.plan.generation:
            self._roll_back(plan)
            self.next_epoch = plan.rollback_to
        elif evaluated:
            self.state.rollback.passed()

    def _roll_back(self, plan: Plan) -> None:
        """Return to the snapshot taken at the start of epoch ``plan.rollback_to`` and enter
        ``plan`` (the layout that trained the epoch before it, as a new generation)."""
        states = self.state.roll_back(plan)
        self.eval_prefix.clear()
        if self.prefix is not None:
            # Entries deeper than the restored prefix were computed by the undone freeze.
            self.prefix.invalidate_above(plan.num_frozen)
            self.comm.barrier()
        self.apply_plan(plan, restored=states)
        if self.rank == 0:
            logger.warning("rolled back to the start of epoch %d: %s", plan.rollback_to,
                           plan.describe())

    # -- checkpoints ---------------------------------------------------------------------------

    def restore(self, directory, plan: Plan) -> int:
        """Load a checkpoint and enter ``plan`` (decided for the resumed run, possibly for a
        different number of workers). Returns the first epoch to train."""
        meta, states = self.state.load(directory, plan)
        self.eval_prefix.clear()
        self.decision = meta["next_decision"]
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
        """End the background reads and destroy this rank's subgroups (the WORLD group stays
        with its owner)."""
        self.stepper.close_prefetch()
        self.layout.close()
