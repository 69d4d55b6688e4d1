"""Replaying a measured run with the cost model: the plans its timeline recorded, predicted epoch
by epoch, the one overhead constant calibrated against it, and what a run on Ray Train pays
around its epochs (evaluation, the report cadence).

Pure module. ``bench/predict_local.py`` compares such a replay with a measured
``compare.json``. The steps it takes from here:

1. :func:`recorded_plan`: a timeline records (n, K, R, M) but not the stage boundaries; they are
   the cost planner's partition of the profile (:func:`pt_ray.costs.costplan.stage_partition`).
2. :func:`replay_epochs`: each recorded epoch's plan, its predicted step (a mix of cache hits
   and misses at the recorded hit rate), epoch (steps x step), transition and evaluation.
3. :func:`solve_overhead`: the per-micro-batch overhead ``o`` at which a prediction meets a
   measured figure (bisection; the prediction grows with ``o``).
4. :func:`epoch_ends`: the time from the first epoch's report to the last one's, with Ray
   Train taking one report per poll from each rank's one-slot queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pt_ray.core.plan import CostTable, Plan, replica_batch
from pt_ray.costs.costmodel import PT_RAY, HardwareProfile, Runtime, step_time, transition_time
from pt_ray.costs.costplan import stage_partition

__all__ = ["RecordedEpoch", "epoch_ends", "eval_time", "recorded_plan", "replay_epochs",
           "solve_overhead"]


def recorded_plan(costs: CostTable, hw: HardwareProfile, num_frozen: int, k: int, r: int, m: int,
                  schedule: Literal["gpipe", "1f1b"] = "1f1b", cache: bool = False,
                  runtime: Runtime = PT_RAY) -> Plan:
    """The plan of a recorded (n, K, R, M), with the boundaries the cost planner cuts from
    ``costs`` (a timeline does not record them)."""
    part = stage_partition(costs, num_frozen, k, cache, hw, runtime)
    return Plan(generation=0, num_layers=costs.num_layers, num_frozen=num_frozen,
                pipeline_length=k, num_replicas=r,
                boundaries=tuple(num_frozen + b for b in part.boundaries),
                num_microbatches=m, schedule=schedule, cache=cache, stage_loads=part.loads)


def eval_time(plan: Plan, costs: CostTable, hw: HardwareProfile,
              shards: Sequence[Sequence[int]]) -> float:
    """Predicted evaluation: forward only, each replica's batches piped through its stages
    (stage s starts a batch once it has finished the previous one and stage s - 1 has sent
    it), the profile scaled per sample, plus the per-micro-batch overhead per stage and batch.

    Args:
        plan: the layout evaluated.
        costs: per-layer costs of ``costs.samples`` samples.
        hw: the cluster's profile (links, the per-micro-batch overhead).
        shards: per replica, the sizes of its eval batches.

    Returns:
        Seconds of the slowest replica.
    """
    c, k = costs, plan.pipeline_length
    per = 1.0 / c.samples
    stage_f = []
    for s in range(k):
        f = sum(c.blocks[i].forward_s for i in range(plan.boundaries[s], plan.boundaries[s + 1]))
        if s == 0:
            f += c.embed.forward_s + sum(b.forward_s for b in c.blocks[:plan.num_frozen])
        if s == k - 1:
            f += c.head.forward_s
        stage_f.append(f * per)
    worst = 0.0
    for rep, batches in enumerate(shards):
        done = [0.0] * k
        for size in batches:
            prev = 0.0
            for s in range(k):
                send = 0.0
                if s:
                    bw, lat = hw.link(plan.rank_of(rep, s - 1), plan.rank_of(rep, s))
                    send = c.blocks[plan.boundaries[s] - 1].activation_bytes * size / bw + lat
                work = stage_f[s] * size + hw.per_microbatch_overhead_s
                done[s] = max(done[s], prev + send) + work
                prev = done[s]
        worst = max(worst, done[-1])
    return worst


@dataclass(frozen=True)
class RecordedEpoch:
    """One predicted epoch of a recorded timeline.

    Attributes:
        plan: the recorded layout with the planner's boundaries.
        steps: optimizer steps in the epoch.
        step_s: predicted seconds of one step.
        transition_s: predicted seconds of the transition into ``plan`` (0 when unchanged).
        eval_s: predicted seconds of the epoch's evaluation (0 without shards).
    """

    plan: Plan
    steps: int
    step_s: float
    transition_s: float
    eval_s: float

    @property
    def epoch_s(self) -> float:
        return self.steps * self.step_s


def replay_epochs(timeline: Sequence[Mapping], costs: Mapping[int, CostTable],
                  hw: HardwareProfile, *, batch_size: int,
                  batch_policy: Literal["fixed_global", "per_replica"] = "fixed_global",
                  schedule: Literal["gpipe", "1f1b"] = "1f1b", num_train: int,
                  eval_shards: Callable[[int], Sequence[Sequence[int]]] | None = None,
                  optimizer_traffic: float = 5.0) -> list[RecordedEpoch]:
    """Predict each epoch of a recorded timeline from the plan it ran.

    Args:
        timeline: records with ``num_frozen``, ``pipeline_length``, ``num_replicas``,
            ``num_microbatches`` and optionally ``cache_hit_rate`` (a summary's timeline).
        costs: per-layer costs by micro-batch size (replica batch / M).
        hw: the cluster's profile.
        batch_size: B; batch_policy, schedule: as the run's config.
        num_train: training samples; an epoch takes the whole batches of the replicas that fit
            (the engine drops the last partial one).
        eval_shards: per R, each replica's eval batch sizes; None: no evaluation predicted.
        optimizer_traffic: see :func:`pt_ray.costs.costmodel.step_time`.
    """
    out: list[RecordedEpoch] = []
    prev: Plan | None = None
    level: int | None = None
    for rec in timeline:
        n, k, r, m = (rec["num_frozen"], rec["pipeline_length"], rec["num_replicas"],
                      rec["num_microbatches"])
        rb = replica_batch(batch_size, r, batch_policy)
        table = costs[rb // m]
        hit = float(rec.get("cache_hit_rate") or 0.0)
        plan = recorded_plan(table, hw, n, k, r, m, schedule, hit > 0)
        if plan.cache:
            # A mix of hits (at the level the cache held) and misses (prefix + write).
            hit_s = step_time(plan, table, hw, rb, cache_state="hit", cached_level=level or n,
                              optimizer_traffic=optimizer_traffic).step_s
            miss_s = step_time(plan, table, hw, rb, cache_state="miss",
                               optimizer_traffic=optimizer_traffic).step_s
            step = hit * hit_s + (1 - hit) * miss_s
        else:
            step = step_time(plan, table, hw, rb, optimizer_traffic=optimizer_traffic).step_s
        global_batch = batch_size if batch_policy == "fixed_global" else batch_size * r
        moved = prev is not None and replace(prev, cache=False) != replace(plan, cache=False)
        out.append(RecordedEpoch(
            plan=plan, steps=num_train // global_batch, step_s=step,
            transition_s=transition_time(prev, plan, table, hw) if moved and prev else 0.0,
            eval_s=eval_time(plan, table, hw, eval_shards(r)) if eval_shards else 0.0))
        prev = plan
        level = n if plan.cache else None
    return out


def solve_overhead(predict: Callable[[float], float], target: float, hi: float = 0.1) -> float:
    """The per-micro-batch overhead ``o >= 0`` with ``predict(o) == target`` (the prediction
    grows with ``o``), by bisection; 0 if even ``o = 0`` predicts more."""
    if predict(0.0) >= target:
        return 0.0
    lo = 0.0
    while predict(hi) < target:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(mid) < target else (lo, mid)
    return (lo + hi) / 2


def epoch_ends(works: Sequence[float], report_s: float, poll_s: float, phases: int = 16) -> float:
    """Expected time from the first epoch's checkpoint to the last epoch's.

    An epoch's checkpoint is written ``report_s`` after its work (training, transition, eval);
    its report then waits for the rank's one-slot result queue, which Ray Train's controller
    empties at its polls, every ``poll_s``, taking a report at the first poll after it was put.
    The next epoch starts once the report is in the queue. Averaged over ``phases`` phases of
    the polls.
    """
    if len(works) < 2:
        return 0.0
    total = 0.0
    for ph in range(phases):
        phase = poll_s * ph / phases
        t = first = works[0] + report_s
        taken = -math.inf
        for w in works[1:]:
            put = max(t, taken)  # the slot is free once the previous report was taken
            if poll_s > 0:
                taken = phase + (math.floor((put - phase) / poll_s + 1e-9) + 1) * poll_s
            else:
                taken = put
            t = put + w + report_s
        total += t - first
    return total / phases
