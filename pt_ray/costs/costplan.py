"""AutoPipe by prediction: the planner that picks K, M and the cache by simulated throughput.

Pure module. It meets the :class:`pt_ray.core.plan.Planner` protocol, as the paper's rule does
(:class:`pt_ray.core.plan.PaperPlanner`, for ``pipeline.policy=paper``), and takes the same
:class:`pt_ray.core.plan.PlanSettings`. For a frozen-prefix length n it

1. lists the candidate pipeline lengths K: divisors of N, no larger than the current K (K only
   shrinks) nor than the active blocks (every stage trains at least one block);
2. for each K, partitions the active blocks exactly (stage 0 carrying the embedding while it
   trains, or the frozen prefix's per-micro-batch cost: its forward, or a cache read; the last
   stage the head);
3. for each K, each cache choice the run's policy leaves at n
   (:meth:`pt_ray.cache.policy.CachePolicy.choices`: off, on, or both to weigh), and each
   micro-batch count M (a divisor of the replica batch, at most
   ``max_microbatches_per_stage * K``), predicts the step
   with :func:`pt_ray.costs.costmodel.step_time` (cache in steady state: reads hit at level n;
   a read costs more when the cache outgrows a worker's memo:
   :func:`pt_ray.costs.costmodel.cache_read_factor`) and keeps the layouts whose every stage
   fits the memory budget;
4. returns the layout with the highest predicted throughput ``R * batch / step``, and notes why
   the cache is on or off in it (:meth:`CostModelPlanner.cache_reason`).

With gradient accumulation (A passes per step) the replica batch above is one pass's, and a step
is predicted as A passes of the schedule, then one all-reduce and one optimizer step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pt_ray.cache.policy import AUTO, CachePolicy
from pt_ray.costs.costmodel import (
    PT_RAY,
    CacheLayout,
    HardwareProfile,
    Runtime,
    StepBreakdown,
    cache_read_factor,
    step_time,
)
from pt_ray.core.memory import MemoryModel
from pt_ray.core.partition import Partition, partition
from pt_ray.core.plan import (
    CostTable,
    Plan,
    PlanSettings,
    TrialLayout,
    divisors,
    pinned_length,
    too_few_microbatches,
)

__all__ = ["CostModelPlanner", "cache_break_even", "close_first_layouts", "stage_partition"]

_FIT = 1 + 1e-9


class CostModelPlanner:
    """Chooses Plans by predicted throughput.

    Args:
        num_workers: N, devices in use.
        costs: per-layer costs in seconds (profiled, or
            :func:`pt_ray.costs.costmodel.analytic_costs`).
        hw: the cluster's profile (links, overheads, memory, cache bandwidth).
        settings: what every planner is told (``initial_pipeline_length`` None: the fastest
            predicted K that fits; ``memory_budget`` None: 90% of the device memory, or what
            the configured start needs with its leanest M if that is more, so it always fits;
            with ``elastic`` False, M and the cache are still chosen by prediction; with
            ``activation_checkpointing``, :meth:`stage_memory` counts what a checkpointed
            block keeps).
        cache: the run's cache policy (:class:`pt_ray.cache.policy.CachePolicy`): which cache
            choices each frozen depth leaves the prediction (default ``auto``: on where
            predicted faster).
        cache_layout: how the cache keeps its rows, for the cost of a read in the run's plain
            order (None: a read moves only the rows it uses).
        budget_from_start: the memory budget becomes the largest stage of the plan the run
            starts on (:meth:`start_on`; the paper's default), once the start is known; until
            then layouts are weighed against what a device holds.
        runtime: how the runtime runs the prefix and writes the cache.
        activation_memory_factor: bytes a block keeps for backward per byte of its output,
            for layers whose ``saved_bytes`` were not measured (analytic tables;
            :func:`pt_ray.core.shapes.saved_activation_factor`; about 25 for ViT-B/16).
        max_microbatches_per_stage: the M search stops at this many micro-batches per stage.
        optimizer_traffic: see :func:`pt_ray.costs.costmodel.step_time`.
        accumulate: whether the runtime accumulates gradients over M micro-batches at K = 1,
            M chosen by the planner (the engine does not: at K = 1 it runs each pass's replica
            batch at once, M = 1). Not ``accumulation_steps``, which the user fixes.
    """

    def __init__(
        self,
        num_workers: int,
        costs: CostTable,
        hw: HardwareProfile,
        settings: PlanSettings,
        *,
        cache: CachePolicy = AUTO,
        cache_layout: CacheLayout | None = None,
        budget_from_start: bool = False,
        runtime: Runtime = PT_RAY,
        activation_memory_factor: float = 24.0,
        max_microbatches_per_stage: int = 16,
        optimizer_traffic: float = 5.0,
        accumulate: bool = False,
    ) -> None:
        k0 = settings.initial_pipeline_length
        fits_layers = [d for d in divisors(num_workers) if d <= max(1, costs.num_layers)]
        if k0 is not None and k0 not in fits_layers:
            raise ValueError(
                f"pipeline_length={k0} must divide num_workers={num_workers} "
                f"and leave every stage a block; choose one of {fits_layers}"
            )
        self.num_workers = num_workers
        self.settings = settings
        self.costs = costs.with_recompute() if settings.activation_checkpointing else costs
        self.hw = hw
        self.options: dict[str, Any] = {
            "cache": cache, "cache_layout": cache_layout, "runtime": runtime,
            "activation_memory_factor": activation_memory_factor,
            "max_microbatches_per_stage": max_microbatches_per_stage,
            "optimizer_traffic": optimizer_traffic, "accumulate": accumulate}
        self.cache, self.cache_layout = cache, cache_layout
        self.runtime = runtime
        self.max_microbatches_per_stage = max_microbatches_per_stage
        self.optimizer_traffic = optimizer_traffic
        self.accumulate = accumulate
        self._cache_notes: dict[int, str] = {}
        self._predictions: dict[Plan, StepBreakdown] = {}
        self.memory_model = MemoryModel(optimizer_state_factor=settings.optimizer_state_factor,
                                        activation_factor=activation_memory_factor)
        self.memory_budget = (settings.memory_budget if settings.memory_budget is not None
                              else 0.9 * hw.device_memory_bytes)
        self.device_budget = self.memory_budget  # what any start must fit
        self.budget_from_start = budget_from_start
        if k0 is None:
            self.initial_pipeline_length = self._choose(0, num_workers).pipeline_length
            return
        self.initial_pipeline_length = k0
        if settings.memory_budget is None:
            # The configured start must fit: with its leanest M at least.
            part = self._partition(0, k0, False)
            ms = self._microbatch_candidates(k0, num_workers // k0)
            if not ms:
                raise self._no_microbatches(k0)
            self.memory_budget = max(self.memory_budget, min(
                max(self.stage_memory(self._layout(0, k0, m, False, part))) for m in ms))

    # -- predictions ---------------------------------------------------------------------------

    def replica_batch(self, num_replicas: int) -> int:
        """Samples one replica processes per pass (:func:`pt_ray.core.plan.replica_batch`)."""
        return self.settings.replica_batch(num_replicas)

    def _partition(self, num_frozen: int, k: int, cache: bool) -> Partition:
        return stage_partition(self.costs, num_frozen, k, cache, self.hw, self.runtime,
                               read_factor=self._read_factor(num_frozen, self.num_workers // k))

    def _read_factor(self, num_frozen: int, num_replicas: int) -> float:
        """Bytes a cache read moves per byte used, for a replica of ``num_replicas``."""
        if num_frozen == 0:
            return 1.0
        return cache_read_factor(self.costs, num_frozen, self.replica_batch(num_replicas),
                                 self.cache_layout)

    def stage_memory(self, plan: Plan) -> list[float]:
        """Predicted peak bytes per stage: active parameters with their gradient and optimizer
        state, the frozen prefix's weights on stage 0, and the activations kept for backward
        (GPipe keeps all M micro-batches; 1F1B at most ``K - stage``).

        What a layer keeps for backward is its profiled ``saved_bytes`` per sample when the
        table has them (:func:`pt_ray.runtime.profile.profile_costs` measures them), else
        ``activation_memory_factor`` outputs' worth (the head: one).

        With ``plan.activation_checkpointing`` a trainable block keeps only its input per
        micro-batch in flight (one output's worth), and the backward holds one block's
        activations of one micro-batch at a time while it recomputes them."""
        k, m = plan.pipeline_length, plan.num_microbatches
        per_mb = self.replica_batch(plan.num_replicas) / m
        # GPipe keeps all M micro-batches in flight; 1F1B at most K - s on stage s.
        held = [m if plan.schedule == "gpipe" else min(m, k - s) for s in range(k)]
        return self.memory_model.stage_bytes(
            self.costs, plan.boundaries, plan.num_frozen, [h * per_mb for h in held],
            per_microbatch=per_mb, checkpointing=plan.activation_checkpointing)

    def predict(self, plan: Plan) -> StepBreakdown:
        """The predicted step of ``plan`` in steady state (cache reads hit at its level)."""
        key = replace(plan, generation=0)
        if key not in self._predictions:
            self._predictions[key] = step_time(
                plan, self.costs, self.hw, self.replica_batch(plan.num_replicas),
                runtime=self.runtime, optimizer_traffic=self.optimizer_traffic,
                passes=self.settings.accumulation_steps, cache_layout=self.cache_layout)
        return self._predictions[key]

    def _microbatch_candidates(self, k: int, num_replicas: int) -> list[int]:
        if k == 1:
            # Without a pipeline the engine runs the replica batch at once; with accumulation
            # (1F1B order at K = 1) each micro-batch's activations are freed before the next.
            if self.accumulate and self.settings.schedule == "1f1b":
                return divisors(self.replica_batch(num_replicas))
            return [1]
        if self.settings.num_microbatches is not None:
            return [self.settings.num_microbatches]
        b = self.replica_batch(num_replicas)
        # 1F1B needs a micro-batch per stage in flight (torch rejects M < K).
        least = k if self.settings.schedule == "1f1b" else 1
        return [d for d in divisors(b) if least <= d <= self.max_microbatches_per_stage * k]

    def _layout(self, num_frozen: int, k: int, m: int, cache: bool, part: Partition) -> Plan:
        return Plan(
            generation=0,
            num_layers=self.costs.num_layers,
            num_frozen=num_frozen,
            pipeline_length=k,
            num_replicas=self.num_workers // k,
            boundaries=tuple(num_frozen + b for b in part.boundaries),
            num_microbatches=m,
            schedule=self.settings.schedule,
            cache=cache,
            stage_loads=part.loads,
            activation_checkpointing=self.settings.activation_checkpointing,
        )

    def _best(self, num_frozen: int, k: int, cache: bool, check_memory: bool = True,
              budget: float | None = None) -> Plan | None:
        """The fastest M for (n, K, cache) among those that fit ``budget`` (default: the
        memory budget); None if none fits."""
        part = self._partition(num_frozen, k, cache)
        budget = self.memory_budget if budget is None else budget
        best, best_rate = None, -1.0
        for m in self._microbatch_candidates(k, self.num_workers // k):
            plan = self._layout(num_frozen, k, m, cache, part)
            if check_memory and max(self.stage_memory(plan)) > budget * _FIT:
                continue
            rate = self.predict(plan).throughput
            if rate > best_rate * _FIT:
                best, best_rate = plan, rate
        return best

    def _choose(self, num_frozen: int, current: int) -> Plan:
        active = self.costs.num_layers - num_frozen
        ks = [d for d in divisors(self.num_workers) if d <= min(current, max(active, 1))]
        if not self.settings.elastic:
            ks = [pinned_length(current, active, num_frozen)]
        caches = self.cache.choices(num_frozen)
        best, best_rate = None, -1.0
        fastest: dict[bool, tuple[Plan, float]] = {}  # per cache choice, its fastest layout
        for k in ks:
            for cache in caches:
                plan = self._best(num_frozen, k, cache)
                if plan is None:
                    continue
                rate = self.predict(plan).throughput
                if cache not in fastest or rate > fastest[cache][1] * _FIT:
                    fastest[cache] = (plan, rate)
                if rate > best_rate * _FIT:
                    best, best_rate = plan, rate
        if best is None:  # nothing fits: keep the longest pipeline, as the paper's rule does
            best = self._best(num_frozen, ks[-1], caches[-1], check_memory=False)
        if best is None:
            raise self._no_microbatches(ks[-1])
        self._cache_notes[num_frozen] = cache_note(self, num_frozen, fastest)
        return best

    def cache_reason(self, plan: Plan) -> str:
        """Why ``plan`` reads the cache or not, in one line with the predicted numbers."""
        if plan.num_frozen not in self._cache_notes:  # a plan restored from a checkpoint
            self._choose(plan.num_frozen, plan.pipeline_length)
        why = self._cache_notes[plan.num_frozen]
        return f"cache {'on' if plan.cache else 'off'} at {plan.num_frozen} frozen blocks: {why}"

    def _no_microbatches(self, k: int) -> ValueError:
        return too_few_microbatches(self.replica_batch(self.num_workers // k), k,
                                    self.settings.accumulation_steps)

    # -- the Planner interface -----------------------------------------------------------------

    def microbatches_for(self, k: int, num_replicas: int, num_frozen: int = 0,
                         cache: bool = False) -> int:
        """The predicted-fastest M for K stages (forced M when configured)."""
        plan = self._best(num_frozen, k, cache) or self._best(num_frozen, k, cache, False)
        assert plan is not None, f"no layout of K = {k} is known to the planner"
        return plan.num_microbatches

    def pipeline_length_for(self, num_frozen: int, current: int) -> int:
        """The predicted-fastest K that fits, at most ``current``."""
        return self._choose(num_frozen, current).pipeline_length

    def start_on(self, plan: Plan) -> None:
        """The run starts on ``plan``: with ``budget_from_start``, a stage may hold from now on
        what ``plan``'s largest stage holds."""
        if self.budget_from_start:
            self.memory_budget = max(self.stage_memory(plan))

    def trial_plans(self, margin: float) -> tuple[TrialLayout, ...]:
        """The close first layouts worth timing (:func:`close_first_layouts`)."""
        return close_first_layouts(self, margin)

    def initial_plan(self) -> Plan:
        """Generation 0: nothing frozen, the initial pipeline length, the fastest M."""
        k = self.initial_pipeline_length
        plan = self._best(0, k, False) or self._best(0, k, False, check_memory=False)
        if plan is None:
            raise self._no_microbatches(k)
        return plan

    def next_plan(self, prev: Plan, num_frozen: int) -> Plan:
        """The plan after the frozen prefix grows to ``num_frozen`` (``prev`` itself when
        nothing changes)."""
        if num_frozen < prev.num_frozen:
            raise ValueError(
                f"num_frozen may only grow: {prev.num_frozen} -> {num_frozen} requested")
        if num_frozen == prev.num_frozen:
            return prev
        return replace(self._choose(num_frozen, prev.pipeline_length),
                       generation=prev.generation + 1)

    def replan(self, prev: Plan, num_workers: int) -> Plan:
        """A plan for a different device count (a restart with a new N), keeping
        ``num_frozen``; K may grow again, up to the new N."""
        settings = replace(self.settings, initial_pipeline_length=None,
                           memory_budget=self.memory_budget)
        planner = CostModelPlanner(num_workers, self.costs, self.hw, settings, **self.options)
        # A new N re-plans K from scratch even when not elastic: the old K may not divide it.
        plan = planner._choose(prev.num_frozen, num_workers)
        self._cache_notes[prev.num_frozen] = planner._cache_notes[prev.num_frozen]
        return replace(plan, generation=prev.generation + 1)


def stage_partition(costs: CostTable, num_frozen: int, k: int, cache: bool, hw: HardwareProfile,
                    runtime: Runtime = PT_RAY, read_factor: float = 1.0) -> Partition:
    """The exact partition of the active blocks over K stages as the cost planner weighs them:
    stage 0 also carries the embedding while it trains, or the frozen prefix's cost per
    micro-batch (its forward, or a cache read); the last stage carries the head.

    Args:
        costs: per-layer costs of one micro-batch.
        num_frozen: n, the frozen prefix.
        k: K, the pipeline length.
        cache: stage 0 reads the prefix's output from the cache.
        hw: the cluster's profile (the cache's read rate).
        runtime: how the runtime runs the prefix (``serial``: before the schedule, weighing
            nothing on stage 0).
        read_factor: bytes a cache read moves per byte used
            (:func:`pt_ray.costs.costmodel.cache_read_factor`).
    """
    c = costs
    active = [b.forward_s + b.backward_s for b in c.blocks[num_frozen:]]
    if num_frozen == 0:
        first = c.embed.forward_s + c.embed.backward_s
    elif runtime.prefix == "serial":
        first = 0.0  # the prefix runs before the schedule, not inside stage 0's turns
    elif cache:
        first = (c.blocks[num_frozen - 1].activation_bytes * c.samples * read_factor
                 / runtime.cache_rate(hw))
    else:
        first = c.embed.forward_s + sum(b.forward_s for b in c.blocks[:num_frozen])
    return partition(active, k, first_extra=first,
                     last_extra=c.head.forward_s + c.head.backward_s)


def cache_break_even(
    costs: CostTable, hw: HardwareProfile, runtime: Runtime = PT_RAY,
    layout: CacheLayout | None = None, samples: float = 1.0,
) -> int | None:
    """The fewest frozen blocks at which reading one sample's cached prefix output is faster
    than recomputing it (embedding + the frozen blocks' forward); None if it never is.

    The cache policy's rule planners turn the cache on from here under ``cache.mode=auto``
    (:meth:`pt_ray.cache.policy.CachePolicy.for_rules`).

    Args:
        costs: per-layer costs.
        hw: the cluster's profile (the cache's read rate).
        runtime: how the runtime reads the cache.
        layout: the cache's layout: a read is amplified when it outgrows a worker's memo
            (:func:`pt_ray.costs.costmodel.cache_read_factor`); None: not.
        samples: rows one read takes (a replica's pass), for that amplification.
    """
    per = 1.0 / costs.samples
    forward = costs.embed.forward_s * per
    for n, block in enumerate(costs.blocks, start=1):
        forward += block.forward_s * per
        read = block.activation_bytes * cache_read_factor(costs, n, samples, layout)
        if read / runtime.cache_rate(hw) < forward:
            return n
    return None


def close_first_layouts(planner: CostModelPlanner, margin: float) -> tuple[TrialLayout, ...]:
    """The first layouts worth timing: with the start chosen by prediction
    (``initial_pipeline_length`` None), the fastest layout of each pipeline length whose
    predicted throughput is within ``margin`` (a fraction) of the fastest one's, fastest first,
    numbered as generations ``0, 1, ...``. Empty when one layout stands alone (or the start is
    configured): there is nothing to time.

    The cost model is right about trends (a longer pipeline pays a bubble; more replicas pay a
    reduce) and off by tens of percent on absolute step times where other processes share the
    host, so a choice between close predictions is left to a measurement.
    """
    if planner.settings.initial_pipeline_length is not None or margin <= 0:
        return ()
    best = [p for k in divisors(planner.num_workers) if k <= max(1, planner.costs.num_layers)
            if (p := planner._best(0, k, False, budget=planner.device_budget)) is not None]
    rates = {p: planner.predict(p).throughput for p in best}
    top = max(rates.values(), default=0.0)
    close = sorted((p for p in best if rates[p] * (1 + margin) >= top), key=lambda p: -rates[p])
    if len(close) < 2:
        return ()
    return tuple(TrialLayout(replace(p, generation=g), rates[p], planner.predict(p).optimizer_s)
                 for g, p in enumerate(close))


def cache_note(planner: CostModelPlanner, num_frozen: int,
               fastest: dict[bool, tuple[Plan, float]]) -> str:
    """Why ``planner``'s plans with ``num_frozen`` frozen blocks read the cache or not, with the
    numbers (``fastest``: per cache choice, its fastest layout and predicted rate)."""
    if (fixed := planner.cache.why(num_frozen)) is not None:
        return fixed
    if not fastest:
        return "no layout fits the memory budget (the longest pipeline is kept)"
    if True not in fastest:
        return "no layout with the cache fits the memory budget"
    on, off = fastest[True], fastest.get(False)
    note = f"predicted {on[1]:.0f} samples/s with the cache"
    if off is not None:
        note += f", {off[1]:.0f} without"
    layout = planner.cache_layout
    if layout is None:
        return note
    row = planner.costs.blocks[num_frozen - 1].activation_bytes
    size, memo = layout.cache_bytes(row), layout.memo_bytes
    if layout.fits(row):
        limit = "" if memo is None else f" ({memo / 2**20:.0f} MiB)"
        return (f"{note}; the whole cache ({size / 2**20:.1f} MiB) fits a worker's memo"
                f"{limit}, read once per epoch")
    rows = planner.replica_batch(on[0].num_replicas)
    return (f"{note}; the cache ({size / 2**20:.1f} MiB) outgrows a worker's memo "
            f"({(memo or 0) / 2**20:.0f} MiB, cache.worker_memo_bytes), so a pass of {rows} "
            f"rows reads about {layout.blocks_touched(rows):.0f} of {layout.num_blocks} "
            f"blocks whole: {planner._read_factor(num_frozen, on[0].num_replicas):.1f}x the "
            f"bytes it uses")
