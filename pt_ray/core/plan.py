"""AutoPipe + AutoDP planning: from N devices, ``num_frozen`` and per-layer costs to a ``Plan``.

Pure module. The planner decides; the runtime executes. Given the frozen-prefix length it

1. lists the candidate pipeline lengths K: divisors of N, no larger than the current K (K only
   shrinks) nor than the number of active blocks;
2. partitions the active blocks over each candidate K with the exact min-max partitioner, stage 0
   also carrying the embedding and the frozen prefix's forward, the last stage the head;
3. keeps the candidates whose largest stage fits the memory budget (default: the largest stage
   of the initial plan, as the paper does) and, by the paper's rule, takes the shortest pipeline
   among them (the paper halves K while the halved pipeline still fits);
4. sets R = N / K and the micro-batch count M for that K.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from pt_ray.core.memory import MemoryModel
from pt_ray.core.partition import Partition, partition

__all__ = [
    "CacheRule",
    "CostTable",
    "LayerCost",
    "PaperPlanner",
    "Plan",
    "PlanSettings",
    "Planner",
    "Transfer",
    "device_batch",
    "divisors",
    "feed_line",
    "pinned_length",
    "replica_batch",
    "start_pipeline_length",
    "holders",
    "is_trainable",
    "stage_of",
    "too_few_microbatches",
    "transfers",
]


@dataclass(frozen=True)
class LayerCost:
    """Measured (or estimated) cost of one layer for one micro-batch of ``CostTable.samples``.

    Attributes:
        forward_s: forward time in seconds.
        backward_s: backward time in seconds (input and weight gradients).
        activation_bytes: bytes of the layer's output, per sample.
        param_bytes: bytes of the layer's parameters.
        saved_bytes: bytes the layer's forward keeps for its backward, per sample, measured
            when it was profiled; None: unknown (estimates multiply ``activation_bytes`` by a
            factor instead, see :meth:`kept_bytes`).
        forward_fixed_s: the part of ``forward_s`` a micro-batch costs whatever its size
            (kernel launches, small matrices that leave the device idle), from a second
            profile at a smaller micro-batch; 0: time in proportion to the samples.
        backward_fixed_s: the same for ``backward_s`` (a dense embedding gradient is written
            whole for one sample as for a thousand).
    """

    forward_s: float
    backward_s: float
    activation_bytes: float
    param_bytes: float
    saved_bytes: float | None = None
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0

    def forward_at(self, scale: float) -> float:
        """Forward seconds of a micro-batch of ``scale`` times the profiled samples: the fixed
        part once, the rest in proportion."""
        return self.forward_fixed_s + (self.forward_s - self.forward_fixed_s) * scale

    def backward_at(self, scale: float) -> float:
        """Backward seconds of a micro-batch of ``scale`` times the profiled samples."""
        return self.backward_fixed_s + (self.backward_s - self.backward_fixed_s) * scale

    def kept_bytes(self, factor: float) -> float:
        """Bytes kept for backward per sample: the measured ``saved_bytes``, else
        ``factor`` outputs' worth."""
        return self.saved_bytes if self.saved_bytes is not None else self.activation_bytes * factor


@dataclass(frozen=True)
class CostTable:
    """Per-layer costs of a model: embed, each block, head.

    Attributes:
        embed: the embedding (patch/token embedding, position embedding).
        blocks: the L transformer blocks, in order.
        head: final norm, pooling, classifier and the loss.
        samples: micro-batch size the times were measured at.
        recompute: each block's ``backward_s`` includes one more forward (activation
            checkpointing: :meth:`with_recompute`).
    """

    embed: LayerCost
    blocks: tuple[LayerCost, ...]
    head: LayerCost
    samples: int = 1
    recompute: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def with_recompute(self) -> CostTable:
        """The table under activation checkpointing: a block's backward also runs its forward
        again (only trainable blocks ever use ``backward_s``; the embedding and the head are
        not checkpointed). Applying it twice changes nothing."""
        if self.recompute:
            return self
        blocks = tuple(replace(b, backward_s=b.backward_s + b.forward_s,
                               backward_fixed_s=b.backward_fixed_s + b.forward_fixed_s)
                       for b in self.blocks)
        return replace(self, blocks=blocks, recompute=True)

    @classmethod
    def from_param_counts(
        cls, embed: float, blocks: Sequence[float], head: float, backward_ratio: float = 2.0
    ) -> CostTable:
        """A fallback table from parameter counts: time proportional to parameters.

        Args:
            embed: embedding parameters; blocks: per-block parameters; head: head parameters.
            backward_ratio: backward time as a multiple of forward time.
        """

        def cost(p: float) -> LayerCost:
            return LayerCost(p, backward_ratio * p, 0.0, p)

        return cls(cost(embed), tuple(cost(b) for b in blocks), cost(head))


@dataclass(frozen=True)
class Plan:
    """One layout of the run. Every rank holds the same Plan and switches at the same step.

    Ranks are laid out pipeline-major: replica ``r`` uses the contiguous ranks
    ``r*K .. r*K + K - 1``, one per stage, so a pipeline stays on neighbouring devices.

    Attributes:
        generation: sequence number; increases by one at each transition.
        num_layers: L.
        num_frozen: n, the frozen prefix (embedding + blocks ``0..n-1``).
        pipeline_length: K, stages per replica.
        num_replicas: R, data-parallel replicas (K * R = N).
        boundaries: ``K + 1`` block indices; stage ``k`` trains blocks
            ``[boundaries[k], boundaries[k+1])``; ``boundaries[0] == num_frozen`` and
            ``boundaries[-1] == L``. Stage 0 also runs the embedding and the frozen prefix; the
            last stage runs the head.
        num_microbatches: M, micro-batches per replica per step.
        schedule: ``gpipe`` or ``1f1b``.
        cache: whether the frozen prefix's activations come from the cache.
        stage_loads: predicted per-stage time per step, in the cost table's unit.
        rollback_to: set on the plan the accuracy guard orders after a harmful freeze: the run
            returns to the state it had at the start of this epoch (with this plan's smaller
            frozen prefix) and trains on from there.
        activation_checkpointing: every trainable block recomputes its forward in its backward
            (``pipeline.activation_checkpointing``).
        probe_blocks: the leading active blocks whose updates the workers test on the probe
            split over this plan's interval (``freeze.policy=probe``; 0: no test).
    """

    generation: int
    num_layers: int
    num_frozen: int
    pipeline_length: int
    num_replicas: int
    boundaries: tuple[int, ...]
    num_microbatches: int
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    cache: bool = False
    stage_loads: tuple[float, ...] = ()
    rollback_to: int | None = None
    activation_checkpointing: bool = False
    probe_blocks: int = 0

    def __post_init__(self) -> None:
        k = self.pipeline_length
        b = self.boundaries
        if len(b) != k + 1 or b[0] != self.num_frozen or b[-1] != self.num_layers:
            raise ValueError(f"boundaries {b} do not describe {k} stages over blocks "
                             f"[{self.num_frozen}, {self.num_layers})")
        pairs = list(zip(b, b[1:]))
        if any(lo > hi for lo, hi in pairs) or (k > 1 and any(lo == hi for lo, hi in pairs)):
            raise ValueError(f"boundaries {b} must increase, with every stage holding a block")

    @property
    def num_workers(self) -> int:
        """N = K * R."""
        return self.pipeline_length * self.num_replicas

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of a rank."""
        return divmod(rank, self.pipeline_length)

    def rank_of(self, replica: int, stage: int) -> int:
        """The rank that runs ``stage`` of ``replica``."""
        return replica * self.pipeline_length + stage

    def stage_blocks(self, stage: int) -> range:
        """Active blocks trained by ``stage``."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_layers(self, stage: int) -> list[str]:
        """Every layer name a stage holds, frozen ones included, in pipeline order."""
        names: list[str] = []
        if stage == 0:
            names.append("embed")
            names.extend(f"block.{i}" for i in range(self.num_frozen))
        names.extend(f"block.{i}" for i in self.stage_blocks(stage))
        if stage == self.pipeline_length - 1:
            names.append("head")
        return names

    def describe(self) -> str:
        """One line: ``g2: frozen 4/12, K 2 [4-7|8-11], R 2, M 8, 1f1b, cache off``."""
        stages = "|".join(
            f"{lo}-{hi - 1}" if hi > lo else "-"
            for lo, hi in zip(self.boundaries, self.boundaries[1:])
        )
        return (
            f"g{self.generation}: frozen {self.num_frozen}/{self.num_layers}, "
            f"K {self.pipeline_length} [{stages}], R {self.num_replicas}, "
            f"M {self.num_microbatches}, {self.schedule}, cache {'on' if self.cache else 'off'}"
            + (", checkpointed" if self.activation_checkpointing else "")
        )


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def replica_batch(batch_size: int, num_replicas: int,
                  batch_policy: Literal["fixed_global", "per_replica"] = "fixed_global",
                  accumulation_steps: int = 1) -> int:
    """Samples one replica processes per pass (per step without gradient accumulation), at
    least 1: the one batch split every planner, the simulator and the benchmarks use.

    Args:
        batch_size: B, ``data.batch_size``.
        num_replicas: R.
        batch_policy: ``fixed_global`` (the replicas share B) or ``per_replica`` (each takes B).
        accumulation_steps: A, passes per optimizer step; a pass takes 1 / A of the step's share.
    """
    step = batch_size // num_replicas if batch_policy == "fixed_global" else batch_size
    return max(1, step // accumulation_steps)


def too_few_microbatches(batch: int, k: int, accumulation_steps: int = 1) -> ValueError:
    """The error for a replica batch that cannot give 1F1B's K micro-batches (both planners).

    Args:
        batch: samples one replica runs per pass.
        k: the pipeline length K.
        accumulation_steps: A; above 1 the message names the batch per pass and offers fewer
            passes as a fix.
    """
    per_pass, fewer = "", ""
    if accumulation_steps > 1:
        per_pass = f" per pass (optimizer.accumulation_steps={accumulation_steps})"
        fewer = ", lower optimizer.accumulation_steps"
    return ValueError(
        f"a replica batch of {batch}{per_pass} cannot fill {k} pipeline stages under 1f1b (it "
        f"needs at least {k} micro-batches); raise data.batch_size{fewer}, lower "
        "pipeline.pipeline_length, or use pipeline.schedule=gpipe")


def pinned_length(k: int, active: int, num_frozen: int) -> int:
    """K for a planner that is not elastic: ``k`` itself, which needs ``k`` active blocks."""
    if active < k:
        raise ValueError(
            f"num_frozen={num_frozen} leaves {active} trainable blocks for a pipeline pinned at "
            f"K={k} (pipeline.elastic=false); freeze at most {num_frozen + active - k} blocks "
            "(freeze.max_frozen) or let K shrink (pipeline.elastic=true)"
        )
    return k


def start_pipeline_length(configured: int | str, num_layers: int, num_workers: int) -> int:
    """K of a run's first plan: ``configured`` (``pipeline.pipeline_length``) when it is a number
    that divides the N workers the run got, else the largest divisor of N that leaves every
    stage a block."""
    if isinstance(configured, int) and num_workers % configured == 0:
        return configured
    return max(d for d in divisors(num_workers) if d <= max(num_layers, 1))


@dataclass(frozen=True)
class PlanSettings:
    """What every planner is told about the run.

    Attributes:
        batch_size: ``data.batch_size``.
        batch_policy: ``fixed_global`` (each replica takes B / R) or ``per_replica`` (each B).
        schedule: pipeline schedule for every plan.
        initial_pipeline_length: K at the start; None: the planner's own choice (the paper's
            rule: N; the cost planner: the fastest predicted K that fits).
        num_microbatches: force M for every K > 1; None: chosen per K.
        memory_budget: most bytes one stage may hold; None: the planner's default.
        optimizer_state_factor: bytes held per parameter byte of an active layer (weights,
            gradient and optimizer moments: 4 for AdamW, 3 for SGD with momentum).
        elastic: False pins K at the initial plan's (and R = N / K with it) as blocks freeze:
            the frozen prefix still moves onto stage 0 and the active blocks are re-partitioned
            over the same K stages (the paper's "freeze only" ablation). At most L - K blocks
            may then freeze, so that every stage keeps a trainable block.
        accumulation_steps: A, passes per optimizer step (``optimizer.accumulation_steps``):
            a pass takes 1 / A of the replica's batch, and M and the memory are sized for it.
        activation_checkpointing: plans recompute every trainable block's forward in its
            backward; the partition weighs that forward (:meth:`CostTable.with_recompute`).
    """

    batch_size: int
    batch_policy: Literal["fixed_global", "per_replica"] = "fixed_global"
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    initial_pipeline_length: int | None = None
    num_microbatches: int | None = None
    memory_budget: float | None = None
    optimizer_state_factor: float = 4.0
    elastic: bool = True
    accumulation_steps: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be at least 1")

    def replica_batch(self, num_replicas: int) -> int:
        """Samples one replica processes per pass (:func:`replica_batch`)."""
        return replica_batch(self.batch_size, num_replicas, self.batch_policy,
                             self.accumulation_steps)


def device_batch(plan: Plan, settings: PlanSettings) -> int:
    """Samples each device of ``plan`` runs per forward: a replica's share of a pass
    (:meth:`PlanSettings.replica_batch`), over the plan's M micro-batches at K > 1."""
    rows = settings.replica_batch(plan.num_replicas)
    return max(1, rows // plan.num_microbatches) if plan.pipeline_length > 1 else rows


def feed_line(plan: Plan, settings: PlanSettings, minimum: int) -> tuple[str, bool]:
    """One line saying what each device of ``plan`` receives, and whether it falls below
    ``minimum`` (0: never), the samples a forward needs to keep a device busy.

    Under ``fixed_global`` each fork of a replica shrinks every replica's share of the batch;
    ``per_replica`` keeps it at ``batch_size``, and the line says so when it is short."""
    b = device_batch(plan, settings)
    rows = settings.replica_batch(plan.num_replicas)
    where = f"{rows} samples per replica pass" + (
        f", {plan.num_microbatches} micro-batches" if plan.pipeline_length > 1 else "")
    line = f"each device runs {b} samples per forward ({where})"
    short = 0 < b < minimum
    if short:
        line += (f", under the {minimum} that keep a GPU busy: raise data.batch_size, lower "
                 f"pipeline.num_microbatches, or set batch_policy=per_replica so each replica "
                 f"keeps data.batch_size as replicas fork (pipeline.min_device_batch sets the "
                 f"threshold)")
    return line, short


@dataclass(frozen=True)
class TrialLayout:
    """A first layout the workers time before the first plan is chosen.

    Attributes:
        plan: the layout (its generation numbers it among the trials).
        predicted_rate: the planner's predicted samples per second.
        update_s: the predicted optimizer step, which a trial does not run (it updates
            nothing) and its measured time does not hold.
    """

    plan: Plan
    predicted_rate: float
    update_s: float

    def rate(self, pass_s: float, samples: int) -> float:
        """Samples per second of a step whose passes and reduce took ``pass_s`` seconds."""
        return samples / (pass_s + self.update_s)


class Planner(Protocol):
    """What the controller asks of a planner (:class:`PaperPlanner`, or
    :class:`pt_ray.costs.costplan.CostModelPlanner`)."""

    num_workers: int
    costs: CostTable
    settings: PlanSettings
    memory_budget: float
    initial_pipeline_length: int

    def initial_plan(self) -> Plan:
        """Generation 0: nothing frozen."""

    def start_on(self, plan: Plan) -> None:
        """The run starts on ``plan`` (a planner whose memory budget is the start's largest
        stage sets it here)."""

    def trial_plans(self, margin: float) -> tuple[TrialLayout, ...]:
        """First layouts to time before choosing among them (empty: :meth:`initial_plan`
        stands), numbered as generations from 0; ``margin``: how close their predictions are."""

    def next_plan(self, prev: Plan, num_frozen: int) -> Plan:
        """The plan after the frozen prefix grows to ``num_frozen`` (``prev`` when nothing
        changes)."""

    def replan(self, prev: Plan, num_workers: int) -> Plan:
        """A plan for a different device count, keeping ``num_frozen``."""

    def stage_memory(self, plan: Plan) -> list[float]:
        """The planner's predicted peak bytes per stage of ``plan``."""

    def cache_reason(self, plan: Plan) -> str:
        """Why ``plan`` reads the cache or not, in one line."""

    def replica_batch(self, num_replicas: int) -> int:
        """Samples one replica processes per pass."""


class CacheRule(Protocol):
    """Which plans a rule planner's cache serves (:class:`pt_ray.cache.policy.CachePolicy`
    decides; the planner only asks)."""

    def serves(self, num_frozen: int) -> bool:
        """Whether plans with ``num_frozen`` frozen blocks read the cache."""

    def why(self, num_frozen: int) -> str | None:
        """Why, in words."""


class PaperPlanner:
    """Chooses Plans by the paper's rule over an exact partition of measured costs.

    Args:
        num_workers: N, devices in use.
        costs: per-layer costs (profiled at start; parameter counts only as a fallback).
        settings: what every planner is told (``initial_pipeline_length`` None: N, one
            pipeline over all devices; ``memory_budget`` None: the largest stage of the initial
            plan). The memory estimate is the same with activation checkpointing: it already
            counts one output per sample for each active layer, which is what a checkpointed
            block keeps.
        frozen_weight: a frozen layer's time as a fraction of its forward time (1: it runs its
            forward; 0: ignored, which is what the 2021 code did in effect).
        cache: which plans read the activation cache (the run's
            :class:`pt_ray.cache.policy.CachePolicy`, fixed for a rule planner by its
            ``for_rules``); None: none. While the cache serves it, the frozen prefix weighs
            nothing on stage 0.
    """

    def __init__(self, num_workers: int, costs: CostTable, settings: PlanSettings, *,
                 frozen_weight: float = 1.0, cache: CacheRule | None = None) -> None:
        k0 = num_workers if settings.initial_pipeline_length is None \
            else settings.initial_pipeline_length
        if num_workers % k0:
            raise ValueError(
                f"pipeline_length={k0} does not divide num_workers={num_workers}; "
                f"choose one of {divisors(num_workers)}"
            )
        if k0 > max(1, costs.num_layers):
            raise ValueError(
                f"pipeline_length={k0} exceeds the model's {costs.num_layers} blocks; every "
                f"stage needs a block, so choose one of "
                f"{[d for d in divisors(num_workers) if d <= costs.num_layers]}"
            )
        self.num_workers = num_workers
        self.settings = settings
        self.costs = costs.with_recompute() if settings.activation_checkpointing else costs
        self.initial_pipeline_length = k0
        self.frozen_weight = frozen_weight
        self.cache = cache
        self.memory_model = MemoryModel(optimizer_state_factor=settings.optimizer_state_factor,
                                        frozen_param_factor=frozen_weight)
        self.memory_budget = (
            settings.memory_budget
            if settings.memory_budget is not None
            else max(self._stage_memory(self._partition(0, k0), 0, k0))
        )

    # -- costs ---------------------------------------------------------------------------------

    def replica_batch(self, num_replicas: int) -> int:
        """Samples one replica processes per pass (:func:`replica_batch`)."""
        return self.settings.replica_batch(num_replicas)

    def _time(self, c: LayerCost, frozen: bool) -> float:
        return c.forward_s * self.frozen_weight if frozen else c.forward_s + c.backward_s

    def cached(self, num_frozen: int) -> bool:
        """Whether plans with ``num_frozen`` frozen blocks read the prefix from the cache."""
        return self.cache is not None and self.cache.serves(num_frozen)

    def cache_reason(self, plan: Plan) -> str:
        """Why ``plan`` reads the cache or not, in one line."""
        why = "no cache" if self.cache is None else self.cache.why(plan.num_frozen)
        return (f"cache {'on' if plan.cache else 'off'} at {plan.num_frozen} frozen blocks: "
                f"pipeline.policy=paper, {why}")

    def _partition(self, num_frozen: int, k: int) -> Partition:
        c = self.costs
        prefix = 0.0 if self.cached(num_frozen) else self._time(c.embed, num_frozen > 0) + sum(
            self._time(b, True) for b in c.blocks[:num_frozen]
        )
        active = [self._time(b, False) for b in c.blocks[num_frozen:]]
        return partition(active, k, first_extra=prefix, last_extra=self._time(c.head, False))

    def _stage_memory(self, part: Partition, num_frozen: int, k: int) -> list[float]:
        """Predicted peak bytes per stage of a partition (parameters, optimizer state, stored
        activations for backward)."""
        bounds = tuple(num_frozen + b for b in part.boundaries)
        return self._memory(bounds, num_frozen, k, lambda: self.microbatches_for(
            k, self.num_workers // k))

    def stage_memory(self, plan: Plan) -> list[float]:
        """Predicted peak bytes per stage of ``plan``, as the rule weighs a partition (what a
        run's records set beside the measured memory)."""
        return self._memory(plan.boundaries, plan.num_frozen, plan.pipeline_length,
                            lambda: plan.num_microbatches)

    def _memory(self, bounds: Sequence[int], num_frozen: int, k: int,
                microbatches: Callable[[], int]) -> list[float]:
        # The paper's rule: every stage keeps the activations of the samples 1F1B holds on
        # stage 0 (at most K micro-batches in flight), GPipe the whole replica batch; one
        # output per sample per active layer, and a frozen layer weighs its parameters times
        # ``frozen_weight``.
        samples = self.replica_batch(self.num_workers // k)
        if self.settings.schedule == "1f1b" and k > 1:
            m = microbatches()
            samples = max(1, samples * min(m, k) // m)
        return self.memory_model.stage_bytes(self.costs, bounds, num_frozen, [samples] * k)

    def microbatches_for(self, k: int, num_replicas: int) -> int:
        """M for a pipeline of K stages: forced, or the largest divisor of the replica batch up
        to 4K (bubble ``(K-1)/(M+K-1)`` at most about 20%); 1 without a pipeline. With 1F1B the
        smallest divisor of at least K if none up to 4K is (torch rejects M < K)."""
        b = self.replica_batch(num_replicas)
        if k == 1:
            return 1
        if self.settings.num_microbatches is not None:
            return self.settings.num_microbatches
        m = max(d for d in divisors(b) if d <= 4 * k)
        if self.settings.schedule == "1f1b" and m < k:
            enough = [d for d in divisors(b) if d >= k]
            if not enough:
                raise too_few_microbatches(b, k, self.settings.accumulation_steps)
            m = enough[0]
        return m

    # -- plans ---------------------------------------------------------------------------------

    def _make(self, generation: int, num_frozen: int, k: int, part: Partition) -> Plan:
        r = self.num_workers // k
        return Plan(
            generation=generation,
            num_layers=self.costs.num_layers,
            num_frozen=num_frozen,
            pipeline_length=k,
            num_replicas=r,
            boundaries=tuple(num_frozen + b for b in part.boundaries),
            num_microbatches=self.microbatches_for(k, r),
            schedule=self.settings.schedule,
            cache=self.cached(num_frozen),
            stage_loads=part.loads,
            activation_checkpointing=self.settings.activation_checkpointing,
        )

    def initial_plan(self) -> Plan:
        """Generation 0: nothing frozen, the initial pipeline length."""
        k = self.initial_pipeline_length
        return self._make(0, 0, k, self._partition(0, k))

    def start_on(self, plan: Plan) -> None:
        """Nothing: the budget is the initial plan's largest stage from the start."""

    def trial_plans(self, margin: float) -> tuple[TrialLayout, ...]:
        """None: the paper's rule fixes the start (K = N, or as configured)."""
        return ()

    def pipeline_length_for(self, num_frozen: int, current: int) -> int:
        """The paper's rule: the shortest pipeline (a divisor of N, at most ``current``) whose
        largest stage fits the memory budget; ``current`` (capped by the active blocks) if none
        does. Not elastic: ``current``."""
        active = self.costs.num_layers - num_frozen
        if not self.settings.elastic:
            return pinned_length(current, active, num_frozen)
        candidates = [d for d in divisors(self.num_workers) if d <= min(current, max(active, 1))]
        for k in candidates:
            part = self._partition(num_frozen, k)
            if max(self._stage_memory(part, num_frozen, k)) <= self.memory_budget * (1 + 1e-9):
                return k
        return candidates[-1]

    def next_plan(self, prev: Plan, num_frozen: int) -> Plan:
        """The plan after the frozen prefix grows to ``num_frozen`` (the same plan, same
        generation, when nothing changes)."""
        if num_frozen < prev.num_frozen:
            raise ValueError(
                f"num_frozen may only grow: {prev.num_frozen} -> {num_frozen} requested"
            )
        if num_frozen == prev.num_frozen:
            return prev
        k = self.pipeline_length_for(num_frozen, prev.pipeline_length)
        return self._make(prev.generation + 1, num_frozen, k, self._partition(num_frozen, k))

    def replan(self, prev: Plan, num_workers: int) -> Plan:
        """A plan for a different device count (a restart with a new N), keeping ``num_frozen``.
        K is chosen afresh for the new N even when not elastic (the old K may not divide it);
        later plans keep the new K."""
        k0 = max(d for d in divisors(num_workers) if d <= max(1, self.costs.num_layers))
        settings = replace(self.settings, initial_pipeline_length=k0,
                           memory_budget=self.memory_budget)
        planner = PaperPlanner(num_workers, self.costs, settings,
                               frozen_weight=self.frozen_weight, cache=self.cache)
        k = planner.pipeline_length_for(prev.num_frozen, planner.initial_pipeline_length)
        return planner._make(prev.generation + 1, prev.num_frozen, k,
                             planner._partition(prev.num_frozen, k))


# -- ownership and migration (pure: which rank holds what, and what must move) --------------------


def is_trainable(plan: Plan, layer: str) -> bool:
    """Whether ``layer`` (``embed``, ``block.i``, ``head``) trains under ``plan``."""
    if layer == "head":
        return True
    if layer == "embed":
        return plan.num_frozen == 0
    return int(layer.split(".", 1)[1]) >= plan.num_frozen


def stage_of(plan: Plan, layer: str) -> int:
    """The stage that holds ``layer`` (the frozen prefix lives on stage 0)."""
    if layer == "embed":
        return 0
    if layer == "head":
        return plan.pipeline_length - 1
    block = int(layer.split(".", 1)[1])
    if block < plan.num_frozen:
        return 0
    for s in range(plan.pipeline_length):
        if block in plan.stage_blocks(s):
            return s
    raise ValueError(f"{layer} is outside the plan's {plan.num_layers} blocks")


def holders(plan: Plan, layer: str) -> list[int]:
    """Ranks holding ``layer`` under ``plan`` (one per replica, replica 0 first)."""
    s = stage_of(plan, layer)
    return [plan.rank_of(r, s) for r in range(plan.num_replicas)]


@dataclass(frozen=True)
class Transfer:
    """One layer copied from the rank that holds its latest state to a rank that needs it.

    Attributes:
        layer: layer name.
        src: sending rank (replica 0's holder under the old plan).
        dst: receiving rank.
        with_state: whether optimizer state travels too (the layer still trains).
    """

    layer: str
    src: int
    dst: int
    with_state: bool


def transfers(old: Plan, new: Plan) -> list[Transfer]:
    """What a transition from ``old`` to ``new`` must move, in one order every rank agrees on.

    Replicas of a layer are identical after each step's data-parallel reduction, so replica 0's
    copy is the source; ranks that already held the layer keep their copy.
    """
    if old.num_workers != new.num_workers or old.num_layers != new.num_layers:
        raise ValueError(f"cannot migrate {old.describe()} -> {new.describe()} in place")
    names = ["embed", *(f"block.{i}" for i in range(new.num_layers)), "head"]
    out = []
    for layer in names:
        before = holders(old, layer)
        for dst in holders(new, layer):
            if dst not in before:
                out.append(Transfer(layer, before[0], dst, is_trainable(new, layer)))
    return out
