"""The controller's state machine: cost profiles and gradient norms in, one Plan per decision out.

Pure module. The Ray controller actor wraps it (adding blocking waits and a name); tests and the
process-group-only engine use it directly. Decisions are counted: one opens every epoch and,
when decisions come every k steps (:func:`decision_interval`), one more follows every k steps
inside it. Decision ``d`` is taken from the gradient norms that every rank gathered during
interval ``d - 1`` (the steps since decision ``d - 1``; an epoch's end closes its last interval);
every rank asks for decision ``d``'s plan and gets the same one, so all switch at the same step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from statistics import median
from typing import Any, Literal

from pt_ray.cache.policy import cache_policy
from pt_ray.cache.size import memo_limit
from pt_ray.core.config import CacheConfig, FreezeConfig, PipelineConfig
from pt_ray.costs.costmodel import CacheLayout
from pt_ray.costs.costplan import CostModelPlanner, cache_break_even
from pt_ray.core.freeze import (FreezeGuard, FreezePolicy, FreezeSettings, GuardVerdict,
                                policy_class, policy_traits)
from pt_ray.costs.hwprofile import HardwareProfile, load_hardware
from pt_ray.core.plan import (
    CostTable,
    LayerCost,
    PaperPlanner,
    feed_line,
    Plan,
    Planner,
    PlanSettings,
    start_pipeline_length,
)
from pt_ray.control.trials import FirstLayoutTrials
from pt_ray.control.verdicts import VerdictActions
from pt_ray.reporting.summary import EpochRecord

__all__ = [
    "ControlSettings",
    "ControlState",
    "DecisionSettings",
    "build_control_state",
    "decision_interval",
    "decisions_per_epoch",
    "merge_costs",
    "policy_for",
    "transition_line",
]

logger = logging.getLogger(__name__)


def merge_costs(tables: list[CostTable]) -> CostTable:
    """One table from every rank's profile: the median of each time and the largest byte count
    (the ranks profile the same layers on like devices; the median drops a rank that was
    disturbed while it measured)."""

    def merge(costs: list[LayerCost]) -> LayerCost:
        return LayerCost(
            median(c.forward_s for c in costs),
            median(c.backward_s for c in costs),
            max(c.activation_bytes for c in costs),
            max(c.param_bytes for c in costs),
            None if any(c.saved_bytes is None for c in costs)
            else max(c.saved_bytes or 0.0 for c in costs),
            median(c.forward_fixed_s for c in costs),
            median(c.backward_fixed_s for c in costs),
        )

    first = tables[0]
    return CostTable(
        merge([t.embed for t in tables]),
        tuple(merge([t.blocks[i] for t in tables]) for i in range(first.num_layers)),
        merge([t.head for t in tables]),
        samples=first.samples,
    )


def _probing(plan: Plan, blocks: int) -> Plan:
    """``plan`` with the leading active blocks its interval tests on the probe."""
    return plan if plan.probe_blocks == blocks else replace(plan, probe_blocks=blocks)


def _plan(plain: Mapping[str, Any]) -> Plan:
    """A plan from its ``asdict`` form (checkpoints keep plans as plain data)."""
    return Plan(**{**plain, "boundaries": tuple(plain["boundaries"]),
                   "stage_loads": tuple(plain["stage_loads"])})


def transition_line(label: str, old: Plan, new: Plan) -> str:
    """``epoch 3: frozen 4 -> 7 of 12 blocks; K 4 -> 2, R 1 -> 2, M 8``."""
    line = (
        f"{label}: frozen {old.num_frozen} -> {new.num_frozen} of {new.num_layers} blocks; "
        f"K {old.pipeline_length} -> {new.pipeline_length}, "
        f"R {old.num_replicas} -> {new.num_replicas}, M {new.num_microbatches}"
    )
    if old.cache != new.cache:
        line += f", cache {'off -> on' if new.cache else 'on -> off'}"
    return line


class ControlState:
    """Decides freezes and plans for one run.

    Args:
        num_workers: N, the ranks that submit costs.
        policy: the freeze policy (L from the model).
        make_planner: builds the planner once the merged cost table is known.
        decision_label: how log lines name a decision point (``"epoch"`` or ``"interval"``).
        guard: the accuracy guard, fed each epoch's record (default: off).
        trial_margin: first layouts predicted within this fraction of the fastest are timed
            by the workers before one is chosen (:meth:`trial_plans`); 0: never.

    With ``interval=epoch``, decision ``d`` opens epoch ``d`` until a rollback: the plan that
    orders one (``rollback_to = q``) opens epoch ``q`` again, and the decisions after it open
    the epochs after ``q`` in turn. A run resumed on another number of workers holds no
    snapshot from before its restart, so a verdict against a freeze made before it keeps the
    freeze instead (:class:`pt_ray.control.verdicts.VerdictActions`).
    """

    def __init__(
        self,
        num_workers: int,
        policy: FreezePolicy,
        make_planner: Callable[[CostTable], Planner],
        decision_label: str = "epoch",
        guard: FreezeGuard | None = None,
        min_device_batch: int = 0,
        trial_margin: float = 0.0,
    ) -> None:
        self.num_workers = num_workers
        self.trial_margin = trial_margin
        self.trials: FirstLayoutTrials | tuple[()] | None = None  # None until costs are in
        self.start_trials: list[dict[str, Any]] = []  # what the trials measured
        self.start_plan: Plan | None = None  # the layout the run started on
        self.min_device_batch = min_device_batch
        self.policy = policy
        self.guard = guard or FreezeGuard(points=None)
        self.make_planner = make_planner
        self.decision_label = decision_label
        self.planner: Planner | None = None
        self.costs: CostTable | None = None
        self.plans: dict[int, Plan] = {}
        self.timeline: list[EpochRecord] = []
        self.decisions: list[dict[str, Any]] = []
        self.verdicts = VerdictActions()  # what the guard's verdict did
        self._cost_tables: dict[int, CostTable] = {}
        self._plain_memo: dict[int, tuple[Any, dict[str, Any]]] = {}

    @property
    def _planner(self) -> Planner:
        """The planner, once the merged cost table has made it."""
        assert self.planner is not None, "a plan was asked for before the costs arrived"
        return self.planner

    # -- inputs --------------------------------------------------------------------------------

    def submit_costs(self, rank: int, costs: CostTable) -> None:
        """A rank's profile. Once all N are in, the planner and decision 0's plan exist."""
        if self.planner is not None:
            return  # a restarted worker re-profiling; the plan is already fixed
        self._cost_tables[rank] = costs
        if len(self._cost_tables) == self.num_workers:
            self.costs = merge_costs([self._cost_tables[r] for r in sorted(self._cost_tables)])
            self.planner = self.make_planner(self.costs)
            layouts = self.planner.trial_plans(self.trial_margin)
            if not layouts:
                self.trials = ()
                self._first_plan(self.planner.initial_plan())
                return
            self.trials = FirstLayoutTrials(layouts, self.planner.replica_batch,
                                            self.trial_margin)

    def trial_plans(self) -> tuple[Plan, ...] | None:
        """The first layouts the workers time before decision 0's plan is chosen (empty when
        the prediction alone chose it, or it is already chosen); None until every rank's costs
        are in."""
        if self.trials is None:
            return None
        return () if 0 in self.plans or not self.trials else self.trials.plans

    def submit_trial(self, seconds: Sequence[float]) -> None:
        """The trial layouts' seconds per step; decision 0's plan is the fastest measured
        (:meth:`FirstLayoutTrials.choose`)."""
        if 0 not in self.plans and self.trials:  # else already chosen (a worker resubmitting)
            self._first_plan(self.trials.choose(seconds))
            self.start_trials = self.trials.measured

    def _first_plan(self, plan: Plan) -> None:
        """Decision 0's plan: ``plan``, with what the policy freezes before any training."""
        self.start_plan = plan
        self._planner.start_on(plan)
        first = self.policy.decide(0, 0, None)
        if first.num_frozen:
            plan = self._planner.next_plan(plan, first.num_frozen)
        self.plans[0] = plan = _probing(plan, first.probe)
        logger.info("initial plan %s", plan.describe())
        self._say_feed(plan)
        if plan.num_frozen:
            logger.info("%s 0: %s", self.decision_label, self._planner.cache_reason(plan))

    def submit_norms(self, decision: int, norms: Mapping[int, float]) -> None:
        """The per-block gradient norms of every trained block during interval ``decision``
        (the workers merge their stages' values among themselves first:
        :func:`pt_ray.runtime.norms.merge_block_norms`); takes decision ``decision + 1``."""
        if decision + 1 in self.plans:
            return  # already decided (a restarted worker resubmitting)
        self._decide(decision + 1, {int(k): float(v) for k, v in norms.items()})

    def record(self, rec: EpochRecord) -> None:
        """Append (or replace, after a restart) one epoch of the timeline, and show it to the
        accuracy guard. Every rank's records must arrive before its norms for the next
        decision, so that the guard's verdict takes effect there. The record's memory gets
        the planner's estimate per rank (:meth:`memory_estimates`)."""
        rec = self.memory_estimates(rec)
        self.timeline = [r for r in self.timeline if r.epoch != rec.epoch] + [rec]
        self.timeline.sort(key=lambda r: r.epoch)
        verdict = self.guard.observe(rec.epoch, rec.num_frozen, rec.eval_metric)
        if verdict is not None:
            logger.warning("accuracy guard: %s", verdict.describe())

    def memory_estimates(self, rec: EpochRecord) -> EpochRecord:
        """``rec`` with each rank's ``estimate_bytes``: the planner's predicted peak for the
        rank's stage under the plan that trained the epoch.

        That plan is the latest decided: the decision after it needs norms that every rank
        submits after its record. A record whose layout is not that plan's (none should be)
        keeps its estimates at 0 rather than get another plan's.
        """
        if not rec.memory or self.planner is None or not self.plans:
            return rec
        plan = self.plans[max(self.plans)]
        layout = (plan.num_frozen, plan.pipeline_length, plan.num_replicas, plan.num_microbatches)
        if layout != (rec.num_frozen, rec.pipeline_length, rec.num_replicas,
                      rec.num_microbatches):
            return rec
        estimate = self.planner.stage_memory(plan)
        return replace(rec, memory=tuple(replace(m, estimate_bytes=float(estimate[m.stage]))
                                         for m in rec.memory))

    # -- outputs -------------------------------------------------------------------------------

    def plan_for(self, decision: int) -> Plan | None:
        """The plan in force from decision point ``decision`` on, or None if not yet decided."""
        return self.plans.get(decision)

    def _decide(self, decision: int, norms: dict[int, float]) -> None:
        assert self.planner is not None, "norms arrived before costs"
        prev = self.plans[decision - 1]
        verdict, kept = self.verdicts.due(self.guard.verdict), ""
        if verdict is not None:
            if self.verdicts.can_roll_back(verdict):
                self._roll_back(decision, prev, verdict)
                return
            kept = self.verdicts.keep_freeze(decision, verdict, self.num_workers)
        result = self.guard.hold(self.policy.decide(decision, prev.num_frozen, norms),
                                 prev.num_frozen)
        if kept:
            result = replace(result, reason=f"{kept}; {result.reason}")
        plan = self.planner.next_plan(prev, result.num_frozen)
        changed = plan is not prev
        self.plans[decision] = plan = _probing(plan, 0 if self.guard.stopped else result.probe)
        self.decisions.append(
            {"decision": decision, "num_frozen": plan.num_frozen, "bound": result.bound,
             "reason": result.reason, "generation": plan.generation}
        )
        if changed:
            logger.info("%s (%s)", transition_line(f"{self.decision_label} {decision}", prev,
                                                   plan), result.reason)
            logger.info("%s %d: %s", self.decision_label, decision,
                        self.planner.cache_reason(plan))
            if plan.num_replicas != prev.num_replicas or (
                    plan.num_microbatches != prev.num_microbatches):
                self._say_feed(plan)

    def _say_feed(self, plan: Plan) -> None:
        """Log what each device of ``plan`` receives per forward; a warning when it is fewer
        samples than ``min_device_batch``."""
        line, short = feed_line(plan, self._planner.settings, self.min_device_batch)
        (logger.warning if short else logger.info)("%s: %s", plan.describe(), line)

    def _roll_back(self, decision: int, prev: Plan, v: GuardVerdict) -> None:
        """Order the guard's rollback at decision ``decision`` (:class:`VerdictActions`)."""
        plan, self.timeline = self.verdicts.roll_back(decision, prev, v, self.plans, self.timeline)
        self.plans[decision] = plan
        self.decisions.append(
            {"decision": decision, "num_frozen": plan.num_frozen, "bound": plan.num_frozen,
             "reason": f"rollback: {v.describe()}", "generation": plan.generation})
        logger.warning("%s: rollback to the start of epoch %d (%s)",
                       transition_line(f"{self.decision_label} {decision}", prev, plan),
                       v.freeze_epoch, v.describe())

    @property
    def rollbacks(self) -> list[dict[str, Any]]:
        """The guard's rollbacks (:attr:`VerdictActions.rollbacks`)."""
        return self.verdicts.rollbacks

    @property
    def discarded(self) -> list[EpochRecord]:
        """The records of the epochs a rollback undid."""
        return self.verdicts.discarded

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume decisions exactly (plain data; its parts are shared
        between calls, so treat it as read-only)."""
        policy_state = getattr(self.policy, "state_dict", None)
        return {
            "costs": self._plain(self.costs) if self.costs else None,
            "plans": {d: self._plain(p) for d, p in self.plans.items()},
            "timeline": [self._plain(r) for r in self.timeline],
            "decisions": list(self.decisions),
            "policy": policy_state() if policy_state else None,
            "guard": self.guard.state_dict(),
            "start_trials": list(self.start_trials),
            "start_plan": self._plain(self.start_plan) if self.start_plan else None,
            **self.verdicts.state_dict(),
        }

    def _plain(self, item: Any) -> dict[str, Any]:
        """``asdict(item)`` of a frozen record, plan or cost table, made once per object: every
        checkpoint saves the whole timeline and every plan, and ``asdict`` walks each anew."""
        hit = self._plain_memo.get(id(item))
        if hit is None or hit[0] is not item:
            hit = self._plain_memo[id(item)] = (item, asdict(item))
        return hit[1]

    def resume(self, state: Mapping[str, Any], next_decision: int) -> Plan:
        """Roll back to a checkpoint's state and return the plan to resume with.

        Anything decided after the checkpoint is dropped (it will be decided again from the same
        inputs). When the run resumes on a different number of workers (an elastic restart), the
        plan is re-made for the new N, keeping the frozen prefix.
        """
        self.load_state_dict(state)
        self.plans = {d: p for d, p in self.plans.items() if d <= next_decision}
        self.decisions = [d for d in self.decisions if d["decision"] <= next_decision]
        plan = self.plans[next_decision]
        if plan.num_workers != self.num_workers:
            assert self.planner is not None
            self.verdicts.resized_at = max((r.epoch for r in self.timeline), default=-1) + 1
            new = self.planner.replan(plan, self.num_workers)
            logger.info("resumed on %d workers instead of %d: %s", self.num_workers,
                        plan.num_workers, new.describe())
            self.plans[next_decision] = plan = new
        return plan

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the planner is rebuilt from the saved costs)."""
        self._plain_memo.clear()  # for the objects this replaces
        if state["costs"] is not None:
            c = state["costs"]
            self.costs = CostTable(
                LayerCost(**c["embed"]),
                tuple(LayerCost(**b) for b in c["blocks"]),
                LayerCost(**c["head"]),
                samples=c["samples"],
            )
            self.planner = self.make_planner(self.costs)
        self.plans = {int(d): _plan(p) for d, p in state["plans"].items()}
        if state.get("start_plan") is not None:
            self.start_plan = _plan(state["start_plan"])
            self._planner.start_on(self.start_plan)
        self.timeline = [EpochRecord.from_dict(r) for r in state["timeline"]]
        self.decisions = list(state["decisions"])
        if state.get("policy") is not None and hasattr(self.policy, "load_state_dict"):
            self.policy.load_state_dict(state["policy"])
        if state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])
        self.verdicts = VerdictActions.from_state(state)
        self.start_trials = list(state.get("start_trials", []))


@dataclass(frozen=True)
class DecisionSettings:
    """When freeze decisions come and how the policy is built (:func:`decision_interval`,
    :func:`policy_for`).

    Attributes:
        freeze: the ``freeze`` section.
        epochs: epochs of the run.
        warmup_epochs: ``freeze.warmup_epochs`` resolved (``auto``: a tenth of the epochs).
    """

    freeze: FreezeConfig
    epochs: int
    warmup_epochs: float


@dataclass(frozen=True)
class ControlSettings:
    """What the controller's state is built from (:func:`build_control_state`).

    Attributes:
        decisions: when decisions come, and the freeze policy's settings.
        cache: the ``cache`` section (its policy and the planner's cache layout).
        pipeline: the ``pipeline`` section (the planner's start, schedule and budget).
        batch_size: B, ``data.batch_size``.
        batch_policy: ``fixed_global`` (B over the R replicas) or ``per_replica`` (B each).
        accumulation_steps: A, ``optimizer.accumulation_steps``.
    """

    decisions: DecisionSettings
    cache: CacheConfig
    pipeline: PipelineConfig
    batch_size: int
    batch_policy: Literal["fixed_global", "per_replica"]
    accumulation_steps: int


def decision_interval(settings: DecisionSettings, steps_per_epoch: int) -> int | None:
    """Steps between the decisions inside an epoch, or None when only epochs start them.

    ``freeze.interval=steps`` gives ``interval_steps``; ``auto`` decides per epoch in runs of at
    least :data:`AUTO_MIN_EPOCHS` epochs, and in shorter runs cuts each epoch into
    ``ceil(AUTO_DECISIONS / epochs)`` intervals, so that a fine-tuning run of a few epochs still
    gets :data:`AUTO_DECISIONS` decisions. (A policy's windows count decisions: deciding twice
    an epoch in a 14-epoch from-scratch run halves the time a block must stay converged, and
    the ViT-Tiny shape then froze from epoch 10 and lost 3 points on seed 0; ``probe`` counts
    no windows and gets its decisions in runs of any length.) ``paper`` and
    ``schedule`` reproduce rules written per epoch, and ``none`` decides nothing: ``auto`` is
    per epoch for them. Each policy's :attr:`pt_ray.core.freeze.PolicyTraits.auto_interval`
    says which it gets. An interval as long as the epoch is per epoch.
    """
    f, epochs = settings.freeze, settings.epochs
    auto = policy_class(f.policy).traits.auto_interval
    if f.interval == "epoch" or (f.interval == "auto" and auto == "epoch"):
        return None
    if f.interval == "steps":
        k = f.interval_steps
    elif epochs >= AUTO_MIN_EPOCHS and auto == "short_runs":
        return None
    else:
        per_epoch = -(-AUTO_DECISIONS // epochs)
        k = -(-steps_per_epoch // per_epoch)
    return k if k < steps_per_epoch else None


AUTO_DECISIONS = 16
"""``freeze.interval=auto``: the decisions a run shorter than :data:`AUTO_MIN_EPOCHS` gets."""

AUTO_MIN_EPOCHS = 8
"""``freeze.interval=auto`` decides per epoch in runs of at least this many epochs."""


def decisions_per_epoch(settings: DecisionSettings, steps_per_epoch: int) -> int:
    """Decisions each epoch opens or holds (the last interval may be shorter)."""
    k = decision_interval(settings, steps_per_epoch)
    return 1 if k is None else -(-steps_per_epoch // k)


def policy_for(settings: DecisionSettings, num_layers: int, steps_per_epoch: int,
               pinned_length: int | None = None) -> FreezePolicy:
    """The run's freeze policy. The warm-up is given in epochs (``auto``: a tenth of the run)
    and converted to decisions (``ceil(warmup_epochs * decisions per epoch)``). With the
    pipeline pinned at K stages (``pipeline.elastic=false``) at most L - K blocks freeze."""
    f = settings.freeze
    per_epoch = decisions_per_epoch(settings, steps_per_epoch)
    warmup = math.ceil(settings.warmup_epochs * per_epoch - 1e-9)
    max_frozen = f.max_frozen
    policy = policy_class(f.policy)
    if pinned_length is not None and policy.traits.freezes:
        cap = num_layers - pinned_length
        wanted = num_layers - 1 if max_frozen is None else max_frozen
        if wanted > cap:
            logger.info("pipeline.elastic=false pins K=%d: at most %d of %d blocks will freeze "
                        "(freeze.max_frozen %s -> %d)", pinned_length, cap, num_layers,
                        "default" if max_frozen is None else max_frozen, cap)
            max_frozen = cap
    return policy.build(FreezeSettings.from_config(
        f, num_layers=num_layers, warmup=warmup, decisions=per_epoch * settings.epochs,
        max_frozen=max_frozen))


GPU_BUSY_BATCH = 32
"""``pipeline.min_device_batch=auto`` on GPU workers: fewer samples per forward leave a GPU's
matrix units waiting on kernel launches for a Transformer block of BERT-base or ViT-B width
(on CPU workers, ``auto`` warns never)."""


def build_control_state(
    settings: ControlSettings,
    num_layers: int,
    num_workers: int,
    steps_per_epoch: int,
    hardware: str | HardwareProfile = "local-cpu",
    deterministic_transform: bool = True,
) -> ControlState:
    """The controller's state for a run: its freeze policy and planner from its settings.

    Args:
        settings: what the run's config says about decisions, the cache and the pipeline.
        num_layers: L, from the built model.
        num_workers: N, the workers actually running (may differ from the config after an
            elastic restart).
        steps_per_epoch: optimizer steps per epoch at the configured batch size.
        hardware: the profile ``pipeline.hardware=auto`` resolves to on these workers: a
            shipped profile's name, or a profile built from the detected device.
        deterministic_transform: whether the training split's transform is deterministic
            (the activation cache is only valid then, unless the user opts in).
    """
    s, d = settings, settings.decisions
    cache = cache_policy(s.cache, d.freeze, deterministic_transform)
    logger.info("activation cache %s: %s", "off" if cache.mode == "off" else "allowed",
                cache.reason)
    p = s.pipeline
    k0 = start_pipeline_length(p.pipeline_length, num_layers, num_workers)
    policy = policy_for(d, num_layers, steps_per_epoch,
                        pinned_length=None if p.elastic else k0)
    forced_m = p.num_microbatches if isinstance(p.num_microbatches, int) else None
    # The samples an epoch trains on: the cache's rows, to within a batch.
    layout = CacheLayout(steps_per_epoch * s.batch_size, s.cache.block_size,
                         memo_limit(s.cache))
    budget = p.memory_budget_bytes if isinstance(p.memory_budget_bytes, int) else None
    if p.hardware != "auto":
        hardware = p.hardware
    hw = hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware)

    # pipeline_length=auto: the cost planner starts at the K it predicts fastest among those
    # whose stages fit a device (a model that fits one device need not start as a pipeline).
    choose_start = p.pipeline_length == "auto" and p.elastic and p.policy != "paper"
    plan_settings = PlanSettings(
        batch_size=s.batch_size, batch_policy=s.batch_policy, schedule=p.schedule,
        initial_pipeline_length=None if choose_start else k0, num_microbatches=forced_m,
        memory_budget=budget, elastic=p.elastic,
        accumulation_steps=s.accumulation_steps,
        activation_checkpointing=p.activation_checkpointing)

    def make_planner(costs: CostTable) -> Planner:
        if p.policy == "paper":
            # A read's rows: a replica's share of a pass with every worker a replica, the most
            # a read can be amplified.
            rows = plan_settings.replica_batch(num_workers)
            rule = cache.for_rules(
                lambda: cache_break_even(costs, hw, layout=layout, samples=rows))
            return PaperPlanner(num_workers, costs, plan_settings, cache=rule)
        # By default (as the paper) a stage may hold what the largest stage held at the start.
        planner = CostModelPlanner(num_workers, costs, hw, plan_settings, cache=cache,
                                   cache_layout=layout, budget_from_start=budget is None)
        planner.start_on(planner.initial_plan())  # until trials choose another start
        return planner

    label = "epoch" if decision_interval(d, steps_per_epoch) is None else "decision"
    guard = FreezeGuard(d.freeze.guard_points if policy_traits(d.freeze.policy).freezes
                        else None, d.freeze.rollback)
    gpu_workers = not (isinstance(hardware, str) and hardware == "local-cpu")
    floor = p.min_device_batch if p.min_device_batch != "auto" else (
        GPU_BUSY_BATCH if gpu_workers else 0)
    return ControlState(num_workers, policy, make_planner, decision_label=label, guard=guard,
                        min_device_batch=floor, trial_margin=p.start_trial_margin)

