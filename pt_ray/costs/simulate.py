"""Predict a whole run, epoch by epoch, before paying for it; and the paper's ablations.

Pure module. A run is its freeze timeline (``n`` per epoch, from a freeze policy), the plan the
planner makes for each ``n``, and the predicted step of that plan (:func:`step_time`); an epoch
is ``ceil(dataset / global batch)`` steps, plus the transition into its plan. The same machinery
prices the paper's ablations (He et al., ICML 2021, Fig. "speedup breakdown"), each against the
no-freeze baseline (K0, R0 = N / K0, nothing frozen):

* ``freeze_only``: layers freeze, K0 and R0 stay. Under pt-ray's runtime the frozen prefix moves
  onto stage 0 and the active blocks re-balance over the K0 stages (``pipeline.elastic=false``;
  at most L - K0 blocks freeze); under the 2021 runtime the step stays the baseline's and each
  freeze costs a transition (see :data:`pt_ray.costs.costmodel.PT_2021` for the evidence);
* ``freeze_autopipe_autocache``: K shrinks, no replicas are added (freed devices idle), cache on;
* ``freeze_autopipe_autodp``: K shrinks and R = N / K grows; no cache;
* ``all``: AutoFreeze, AutoPipe, AutoDP and AutoCache together (the run itself).

The cache follows the runtime: the first epoch with the cache on misses (full prefix forward and
a write); later epochs read the previous level and run only the blocks frozen since.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from pt_ray.cache.policy import CachePolicy
from pt_ray.costs.costmodel import PT_RAY, HardwareProfile, Runtime, step_time, transition_time
from pt_ray.costs.costplan import CostModelPlanner
from pt_ray.core.freeze import (FREEZE_POLICIES, ScheduleFreeze, build_freeze_policy,
                                frozen_timeline, policy_traits)
from pt_ray.core.plan import CostTable, PaperPlanner, Plan, PlanSettings, replica_batch

__all__ = [
    "SCENARIOS",
    "SIMULATED_POLICIES",
    "build_planner",
    "chunks_2021",
    "EpochPrediction",
    "RunPrediction",
    "SimulationResult",
    "simulate",
]

# name: (freeze, autopipe, autodp, cache)
SCENARIOS: dict[str, tuple[bool, bool, bool, bool]] = {
    "baseline": (False, False, False, False),
    "freeze_only": (True, False, False, False),
    "freeze_autopipe_autocache": (True, True, False, True),
    "freeze_autopipe_autodp": (True, True, True, False),
    "all": (True, True, True, True),
}
LABELS = {
    "baseline": "no freeze (baseline)",
    "freeze_only": "freeze only",
    "freeze_autopipe_autocache": "freeze + AutoPipe + AutoCache",
    "freeze_autopipe_autodp": "freeze + AutoPipe + AutoDP",
    "all": "freeze + AutoPipe + AutoDP + AutoCache",
}


SIMULATED_POLICIES = tuple(sorted(
    (name for name, cls in FREEZE_POLICIES.items() if cls.traits.per_epoch and cls.traits.freezes),
    key=lambda name: name != ScheduleFreeze.name))
"""The freeze policies a prediction runs (the default first): those whose rule is written per
epoch, as the prediction goes epoch by epoch, and that freeze (never freezing is the baseline)."""


@dataclass(frozen=True)
class EpochPrediction:
    """One predicted epoch.

    Attributes:
        epoch: 0-based index.
        num_frozen: frozen blocks during the epoch.
        pipeline_length: K.
        num_replicas: R (devices in use: K * R).
        num_microbatches: M.
        cache: ``off``, ``miss`` (first epoch with the cache: all samples computed and written)
            or ``hit``.
        throughput: predicted samples per second.
        step_time_s: predicted step time.
        epoch_time_s: steps * step time.
        transition_time_s: the transition into this epoch's plan.
        bubble_fraction: idle share of the pipeline stages in a step.
    """

    epoch: int
    num_frozen: int
    pipeline_length: int
    num_replicas: int
    num_microbatches: int
    cache: Literal["off", "miss", "hit"]
    throughput: float
    step_time_s: float
    epoch_time_s: float
    transition_time_s: float
    bubble_fraction: float


@dataclass(frozen=True)
class RunPrediction:
    """A predicted run: its name, a label, and its epochs."""

    name: str
    label: str
    epochs: tuple[EpochPrediction, ...]

    @property
    def total_time_s(self) -> float:
        """Training time, transitions included."""
        return sum(e.epoch_time_s + e.transition_time_s for e in self.epochs)


@dataclass(frozen=True)
class SimulationResult:
    """A predicted run against its baseline, and the ablations.

    Attributes:
        run: the run as configured (all four mechanisms, the cache as configured).
        baseline: no freezing, K0 and R0 throughout.
        ablations: ``freeze_only``, ``freeze_autopipe_autocache``, ``freeze_autopipe_autodp``
            (empty when not asked for).
        settings: the inputs, for the record.
    """

    run: RunPrediction
    baseline: RunPrediction
    ablations: dict[str, RunPrediction]
    settings: dict[str, Any]

    @property
    def speedup(self) -> float:
        """Baseline time over the run's time."""
        return self.baseline.total_time_s / self.run.total_time_s

    def speedups(self) -> dict[str, float]:
        """Every scenario's speedup over the baseline, baseline first, the run last."""
        runs = [self.baseline, *self.ablations.values(), self.run]
        return {r.name: self.baseline.total_time_s / r.total_time_s for r in runs}

    def to_dict(self) -> dict[str, Any]:
        speedups = self.speedups()

        def run(r: RunPrediction) -> dict[str, Any]:
            return {"name": r.name, "label": r.label, "total_time_s": r.total_time_s,
                    "speedup": speedups[r.name],
                    "epochs": [asdict(e) for e in r.epochs]}

        return {"settings": self.settings, "speedup": self.speedup, "run": run(self.run),
                "baseline": run(self.baseline),
                "ablations": {k: run(v) for k, v in self.ablations.items()}}


def chunks_2021(k: int) -> int:
    """The 2021 code's hard-coded micro-batch table (16 for K in 2, 4, 8; else 4K)."""
    return 16 if k in (2, 4, 8) else 4 * k


class _RulePlanner:
    """:class:`pt_ray.core.plan.PaperPlanner` with a rule planner's cache (on where the cache
    policy serves: :meth:`pt_ray.cache.policy.CachePolicy.serves`) and, for the 2021 code, its
    micro-batch table."""

    def __init__(self, inner: PaperPlanner, cache: CachePolicy, table: bool) -> None:
        self.inner, self.cache, self.table = inner, cache, table

    def _dress(self, plan: Plan) -> Plan:
        m = chunks_2021(plan.pipeline_length) if self.table else plan.num_microbatches
        return replace(plan, num_microbatches=m, cache=self.cache.serves(plan.num_frozen))

    def initial_plan(self) -> Plan:
        return self._dress(self.inner.initial_plan())

    def next_plan(self, prev: Plan, num_frozen: int) -> Plan:
        return self._dress(self.inner.next_plan(prev, num_frozen))


def build_planner(
    kind: Literal["cost", "paper", "2021"],
    costs: CostTable,
    hw: HardwareProfile,
    num_devices: int,
    *,
    cache: Literal["auto", "on", "off"] = "auto",
    cache_from: int = 3,
    runtime: Runtime = PT_RAY,
    activation_memory_factor: float = 24.0,
    optimizer_traffic: float = 5.0,
    elastic: bool = True,
    **common: Any,
):
    """The planner ``simulate`` uses: ``cost`` (:class:`CostModelPlanner`), ``paper``
    (:class:`pt_ray.core.plan.PaperPlanner` on these costs) or ``2021`` (the 2021 code's rule:
    parameter counts, frozen layers weighing nothing, its M table); the rule planners turn the
    cache on from ``cache_from`` frozen blocks (1 with ``cache="on"``); ``elastic=False`` pins
    K and R. ``common``: the other fields of :class:`pt_ray.core.plan.PlanSettings`."""
    settings = PlanSettings(elastic=elastic, **common)
    policy = CachePolicy(cache, f"cache.mode={cache}")
    if kind == "cost":
        return CostModelPlanner(num_devices, costs, hw, settings, cache=policy, runtime=runtime,
                                activation_memory_factor=activation_memory_factor,
                                optimizer_traffic=optimizer_traffic)
    # The rule planners' cache: on from cache_from frozen blocks (the 2021 code's 3) under auto.
    rule = replace(policy, min_frozen=cache_from, predicted=False)
    if kind == "paper":
        return _RulePlanner(PaperPlanner(num_devices, costs, settings), rule, table=False)
    if kind == "2021":
        params = CostTable.from_param_counts(costs.embed.param_bytes,
                                             [b.param_bytes for b in costs.blocks],
                                             costs.head.param_bytes)
        inner = PaperPlanner(num_devices, params, replace(settings, optimizer_state_factor=1.0),
                             frozen_weight=0.0)
        return _RulePlanner(inner, rule, table=True)
    raise ValueError(f"planner={kind!r} is not one of 'cost', 'paper', '2021'")


def simulate(
    costs: CostTable,
    hw: HardwareProfile,
    *,
    num_devices: int,
    dataset_size: int,
    epochs: int,
    batch_size: int,
    batch_policy: Literal["fixed_global", "per_replica"] = "fixed_global",
    initial_pipeline_length: int | None = None,
    schedule: Literal["gpipe", "1f1b"] = "1f1b",
    freeze_policy: str = ScheduleFreeze.name,
    alpha: float = 1 / 3,
    grad_norms: Sequence[Mapping[int, float]] = (),
    frozen: Sequence[int] | None = None,
    max_frozen: int | None = None,
    planner: Literal["cost", "paper", "2021"] = "cost",
    num_microbatches: int | None = None,
    cache: Literal["auto", "on", "off"] = "auto",
    cache_from: int = 3,
    runtime: Runtime = PT_RAY,
    memory_budget: float | None = None,
    activation_memory_factor: float = 24.0,
    optimizer_traffic: float = 5.0,
    ablations: bool = True,
    activation_checkpointing: bool = False,
) -> SimulationResult:
    """Predict a run and its baseline (and the ablations).

    Args:
        costs: per-layer costs in seconds (analytic or profiled).
        hw: the cluster.
        num_devices: N.
        dataset_size: training samples per epoch.
        epochs: epochs to predict.
        batch_size: global batch (``fixed_global``) or per replica (``per_replica``).
        batch_policy: see :class:`pt_ray.core.config.RunConfig`.
        initial_pipeline_length: K0 (None: N for the rule planners, predicted for ``cost``).
        schedule: ``gpipe`` or ``1f1b``.
        freeze_policy: one of :data:`SIMULATED_POLICIES`: ``schedule``
            (``n(e) = ceil(L (1 - (1 - alpha)^e))``) or ``paper`` (needs ``grad_norms``: per
            epoch, the block norms gathered during it, as every policy that reads norms).
        alpha: the freeze threshold.
        grad_norms: gradient-norm trace for a policy that reads norms (``paper``).
        frozen: an explicit timeline (n per epoch), overriding the policy.
        max_frozen: most blocks ever frozen (None: L - 1; the 2021 code froze all L).
        planner: ``cost`` (:class:`CostModelPlanner`), ``paper`` (:class:`pt_ray.core.plan.Planner`
            on these costs, cache from ``cache_from`` blocks) or ``2021`` (the 2021 code's rule:
            parameter counts, frozen layers weighing nothing, M from its table).
        num_microbatches: force M (None: per planner).
        cache: ``auto``, ``on`` or ``off``.
        cache_from: the rule planners turn the cache on from this many frozen blocks.
        runtime: :data:`pt_ray.costs.costmodel.PT_RAY` or :data:`pt_ray.costs.costmodel.PT_2021`.
        memory_budget: most bytes per stage (None: per planner).
        activation_memory_factor: see :class:`CostModelPlanner`.
        optimizer_traffic: see :func:`pt_ray.costs.costmodel.step_time`.
        ablations: also predict the three partial configurations.
        activation_checkpointing: every plan recomputes its trainable blocks' forward in their
            backward (``pipeline.activation_checkpointing``): slower steps, less memory.
    """
    layers = costs.num_layers
    if batch_policy == "fixed_global" and batch_size % num_devices:
        raise ValueError(f"batch_size={batch_size} is not divisible by num_devices={num_devices}; "
                         f"with batch_policy=fixed_global every replica takes an equal share")
    timeline = _freeze_timeline(layers, epochs, frozen, freeze_policy, alpha, max_frozen,
                                grad_norms)
    common: dict[str, Any] = dict(
        batch_size=batch_size, batch_policy=batch_policy, schedule=schedule,
        initial_pipeline_length=initial_pipeline_length, num_microbatches=num_microbatches,
        memory_budget=memory_budget, cache_from=cache_from, runtime=runtime,
        activation_memory_factor=activation_memory_factor, optimizer_traffic=optimizer_traffic,
        activation_checkpointing=activation_checkpointing)
    names = list(SCENARIOS) if ablations else ["baseline", "all"]
    runs = {}
    for name in names:
        want_cache = cache if SCENARIOS[name][3] else "off"
        pinned = name == "freeze_only" and runtime.freeze_only == "pinned"
        plans = build_planner(planner, costs, hw, num_devices, cache=want_cache,
                              elastic=not pinned, **common)
        line = timeline
        if pinned:  # every one of the K0 stages keeps a trainable block
            cap = layers - plans.initial_plan().pipeline_length
            line = [min(n, cap) for n in timeline]
        runs[name] = _run(name, line, plans, costs, hw, runtime, dataset_size, batch_size,
                          batch_policy, optimizer_traffic)
    settings = dict(num_devices=num_devices, dataset_size=dataset_size, epochs=epochs,
                    batch_size=batch_size, batch_policy=batch_policy, schedule=schedule,
                    freeze_policy=freeze_policy if frozen is None else "explicit",
                    alpha=alpha, frozen=list(timeline), planner=planner, cache=cache,
                    runtime=runtime.name, hardware=hw.name,
                    activation_checkpointing=activation_checkpointing)
    return SimulationResult(
        run=runs["all"],
        baseline=runs["baseline"],
        ablations={k: v for k, v in runs.items() if k not in ("all", "baseline")},
        settings=settings,
    )


def _freeze_timeline(layers: int, epochs: int, frozen: Sequence[int] | None,
                     freeze_policy: str, alpha: float,
                     max_frozen: int | None, grad_norms: Sequence[Mapping[int, float]]
                     ) -> list[int]:
    """Step 1 of :func:`simulate`: n per epoch, given (``frozen``) or from the freeze policy."""
    if frozen is not None:
        timeline = [min(int(n), layers) for n in frozen][:epochs]
        if len(timeline) < epochs or any(b < a for a, b in zip(timeline, timeline[1:])):
            raise ValueError(f"frozen={list(frozen)} must give a non-decreasing n for each of "
                             f"{epochs} epochs")
        return timeline
    if policy_traits(freeze_policy).reads_norms and not grad_norms:
        raise ValueError(f"freeze_policy={freeze_policy!r} needs a gradient-norm trace "
                         f"(grad_norms); use freeze_policy={ScheduleFreeze.name!r} or pass the "
                         "norms")
    policy = build_freeze_policy(freeze_policy, num_layers=layers, alpha=alpha,
                                 max_frozen=max_frozen)
    return frozen_timeline(policy, epochs, grad_norms)


def _run(name: str, timeline: Sequence[int], planner, costs: CostTable, hw: HardwareProfile,
         runtime: Runtime, dataset_size: int, batch_size: int,
         batch_policy: Literal["fixed_global", "per_replica"],
         optimizer_traffic: float) -> RunPrediction:
    freeze, autopipe, autodp, _ = SCENARIOS[name]
    # "freeze only": a pinned planner (pt-ray), or the baseline's plan throughout (2021).
    replans = autopipe or (freeze and runtime.freeze_only == "pinned")
    plan = start = planner.initial_plan()
    prev_exec: Plan | None = None
    prev_n = 0
    level: int | None = None
    out = []
    for epoch, n in enumerate(timeline):
        n = n if freeze else 0
        if replans:
            plan = planner.next_plan(plan, n)
        exec_plan = plan if autodp else replace(plan, num_replicas=start.num_replicas)
        state: Literal["off", "miss", "hit"] = "off"
        if exec_plan.cache:
            state = "hit" if level is not None else "miss"
        r = exec_plan.num_replicas
        per_replica = replica_batch(batch_size, r, batch_policy)
        st = step_time(exec_plan, costs, hw, per_replica, runtime=runtime,
                       cache_state="miss" if state == "miss" else "hit", cached_level=level,
                       optimizer_traffic=optimizer_traffic)
        steps = math.ceil(dataset_size / (per_replica * r))
        moved = prev_exec is not None and replace(prev_exec, cache=False, generation=0) != replace(
            exec_plan, cache=False, generation=0)
        trans = (transition_time(prev_exec, exec_plan, costs, hw, runtime=runtime)
                 if moved and prev_exec is not None else 0.0)
        if not replans and n != prev_n:  # the 2021 code rebuilds its pipe and DDP to freeze
            trans = hw.group_setup_s + runtime.transition_overhead_s
        out.append(EpochPrediction(
            epoch=epoch, num_frozen=n, pipeline_length=exec_plan.pipeline_length,
            num_replicas=r, num_microbatches=exec_plan.num_microbatches, cache=state,
            throughput=st.throughput, step_time_s=st.step_s, epoch_time_s=steps * st.step_s,
            transition_time_s=trans, bubble_fraction=st.bubble_fraction))
        level = n if exec_plan.cache else None
        prev_exec, prev_n = exec_plan, n
    return RunPrediction(name, LABELS[name], tuple(out))
