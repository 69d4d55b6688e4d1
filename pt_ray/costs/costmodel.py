"""Cost model: analytic layer costs, and the predicted time of a step or a transition under a
Plan on a cluster (:mod:`pt_ray.costs.hwprofile`, re-exported here).

Pure module (stdlib). A step of one replica is simulated event by event
(:mod:`pt_ray.costs.pipesim`), so the bubble, stage imbalance and transfer delays all emerge from
the schedule; then each stage's data-parallel group all-reduces its gradients and steps its
optimizer:

1. stage ``k`` per micro-batch: forward (and backward, if it trains anything) of its blocks, the
   embedding on stage 0 while it trains, the head and loss on the last stage, plus the
   profile's fixed per-micro-batch overhead for each; with activation checkpointing each
   block's backward also runs its forward again (:meth:`pt_ray.core.plan.CostTable.with_recompute`);
2. the frozen prefix (embedding + blocks ``0..n-1``, forward only) runs on stage 0: per
   micro-batch inside the schedule (pt-ray's runtime) or over the whole batch before the
   pipeline starts (the 2021 code's ``pipe(frozen(x))``); with the cache it is a read of the
   cached level (whole blocks per row when the cache outgrows a worker's memo:
   :func:`cache_read_factor`) plus the forward of the blocks frozen since (plus the write of
   the new level);
3. point-to-point transfers cost ``bytes / bandwidth + latency``, intra- or inter-node by where
   the two ranks sit (pipeline-major ranks, ``devices_per_node`` per node);
4. ring all-reduce over R replicas: ``2 (R-1)/R * bytes / bandwidth + 2 (R-1) * latency``, with
   the inter-node bandwidth shared by the groups that cross nodes at once;
5. the optimizer streams the active parameters' state through device memory.

With gradient accumulation, steps 1-3 repeat once per pass before 4 and 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pt_ray.costs.hwprofile import (
    HardwareProfile,
    calibrate,
    fit_efficiency,
    list_hardware,
    load_hardware,
)
from pt_ray.costs.pipesim import run_schedule
from pt_ray.core.plan import CostTable, LayerCost, Plan, holders, is_trainable
from pt_ray.core.shapes import ModelShape, layer_shapes

__all__ = [
    "CacheLayout",
    "HardwareProfile",
    "PT_2021",
    "PT_RAY",
    "RUNTIMES",
    "Runtime",
    "StepBreakdown",
    "allreduce_time",
    "analytic_costs",
    "cache_read_factor",
    "calibrate",
    "fit_efficiency",
    "list_hardware",
    "load_hardware",
    "step_time",
    "transition_time",
]

PARAM_BYTES = 4  # fp32 master weights and gradients


# -- analytic costs ---------------------------------------------------------------------------


def analytic_costs(shape: ModelShape, hw: HardwareProfile, micro_batch: int = 1) -> CostTable:
    """Per-layer costs of ``shape`` on ``hw`` for a micro-batch of ``micro_batch`` samples.

    Forward time is FLOPs over the sustained rate (never below the time to write the output
    through device memory); backward is twice the forward (input and weight gradients).
    Activation bytes are the layer's output per sample; parameters are fp32.
    """
    act = hw.activation_bytes_per_element

    def cost(layer) -> LayerCost:
        fwd = micro_batch * max(layer.flops / hw.sustained_flops,
                                3 * layer.out_elements * act / hw.memory_bandwidth)
        return LayerCost(fwd, 2 * fwd, layer.out_elements * act, layer.params * PARAM_BYTES)

    embed, block, head = layer_shapes(shape)
    return CostTable(cost(embed), tuple(cost(block) for _ in range(shape.num_layers)),
                     cost(head), samples=micro_batch)


# -- one step -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """How a runtime executes a plan (what the cost model must mimic).

    Attributes:
        name: ``pt-ray`` or ``2021``.
        prefix: ``pipelined`` (stage 0 runs the frozen prefix per micro-batch, in the schedule)
            or ``serial`` (over the whole batch before the pipeline starts).
        cache_writes: ``sync`` (writes cost the step time) or ``async`` (a helper process).
        transition_overhead_s: fixed cost per transition on top of the profile's.
        per_microbatch_overhead_s: the runtime's own cost per micro-batch and stage, replacing
            the profile's (None: the profile's).
        cache_bandwidth: the runtime's own cache read/write rate per device, replacing the
            profile's (None: the profile's).
        freeze_only: what freezing without AutoPipe and AutoDP (the paper's "freeze only"
            ablation) does to a step: ``pinned`` (K and R stay; the frozen prefix moves onto
            stage 0 and the active blocks re-balance over the same K stages, as pt-ray's
            ``pipeline.elastic=false`` does; at most L - K blocks freeze) or ``unchanged``
            (the layout and the compute stay the baseline's; only the optimizer skips frozen
            layers, and every freeze still rebuilds the pipeline: a transition).
    """

    name: str
    prefix: Literal["pipelined", "serial"]
    cache_writes: Literal["sync", "async"]
    transition_overhead_s: float = 0.0
    per_microbatch_overhead_s: float | None = None
    cache_bandwidth: float | None = None
    freeze_only: Literal["pinned", "unchanged"] = "pinned"

    def overhead(self, hw: HardwareProfile) -> float:
        """Fixed cost of one forward or backward of one micro-batch on one stage."""
        if self.per_microbatch_overhead_s is None:
            return hw.per_microbatch_overhead_s
        return self.per_microbatch_overhead_s

    def cache_rate(self, hw: HardwareProfile) -> float:
        """Bytes per second one device reads or writes the cache."""
        return hw.cache_bandwidth if self.cache_bandwidth is None else self.cache_bandwidth


PT_RAY = Runtime("pt-ray", "pipelined", "sync")
"""pt-ray: stage 0 runs the prefix inside the schedule; the cache is written with ``ray.put``."""
PT_2021 = Runtime("2021", "serial", "async", transition_overhead_s=30.0,
                  per_microbatch_overhead_s=0.0132, cache_bandwidth=0.28e9,
                  freeze_only="unchanged")
"""The 2021 code (He et al.'s repository at 187b78b), as measured there:

* ``pipe(frozen(x))``: the frozen prefix runs over the whole batch before the pipeline;
* a daemon process writes the cache (asynchronous);
* 20-40 s per transition (``log/performance_analysis.log``: 4-18 s model reload plus 5-23 s
  DDP rebuild);
* 13.2 ms per micro-batch and stage: torchgpipe's Python scheduling. Fitted, jointly with the
  device efficiency of ``paper-rtx5000``, to the published no-freeze micro-batch sweep at K=8,
  batch 400 (``log/Chunk_num_analysis.md``: M = 8, 16, 24, 32 give 200, 210, 210, 180 images/s
  per pipeline; the fit predicts 202, 212, 200, 185 and, held out, 188 for M = 6 against 188);
* 0.28 GB/s per process for cache reads: one POSIX shared-memory segment per sample, copied in
  Python. From the paper's throughput figure: with every block frozen a step is little more
  than a cache read, and both cache-on curves plateau at the same rate per process (about
  7,400 samples/s over 16 processes and 1,000 over 2, i.e. 460-500 samples/s of 605 KB);
* "freeze only" saved no compute: in the paper's throughput figure (Fig. 9a; the PyTorch blog's
  ``experiments_throughput.png``) that curve stays at or just below the baseline's in every
  epoch, including epochs 7-9 where all 12 blocks are frozen and a step that skipped the
  frozen backward would be forward-only (about 3x faster). The code that ran that arm is not
  in the repository (``AutoElasticPipe.enable(False)`` is never called there), so the
  mechanism is inferred from the measurement: the baseline's step, plus a transition at each
  freeze (``AutoDataParallel.transform`` rebuilds the pipe and DDP whenever the frozen count
  changes).
"""
RUNTIMES = {r.name: r for r in (PT_RAY, PT_2021)}


@dataclass(frozen=True)
class StepBreakdown:
    """Predicted time of one training step (every replica in parallel).

    Attributes:
        step_s: the whole step, from the first input to the last optimizer update.
        pipeline_s: the schedule's makespan on the slowest replica (serial prefix included),
            over every gradient-accumulation pass of the step.
        prefix_s: stage 0's frozen-prefix work per step (forward, or cache read/advance/write).
        allreduce_s: the longest stage all-reduce.
        optimizer_s: the longest stage optimizer step.
        bubble_fraction: idle share of the stages during one pass's schedule.
        samples: samples per step over all replicas.
    """

    step_s: float
    pipeline_s: float
    prefix_s: float
    allreduce_s: float
    optimizer_s: float
    bubble_fraction: float
    samples: int

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.samples / self.step_s if self.step_s > 0 else math.inf


def allreduce_time(num_bytes: float, replicas: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2 (R-1)/R * bytes / bandwidth + 2 (R-1) * latency``."""
    if replicas <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (replicas - 1) / replicas * num_bytes / bandwidth + 2 * (replicas - 1) * latency


@dataclass(frozen=True)
class CacheLayout:
    """How the activation cache keeps and reads its rows, which sets what a read costs.

    The training order is a plain permutation, so the rows one stage 0 reads in a pass are a
    random draw of the cache's samples, spread over its blocks.

    Attributes:
        num_samples: samples the cache holds a row of (those an epoch trains on).
        block_size: least samples per cache object (``cache.block_size``).
        memo_bytes: most bytes of read objects a stage-0 worker keeps between steps
            (``cache.worker_memo_bytes``); None: no limit.
    """

    num_samples: int
    block_size: int
    memo_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.num_samples <= 0 or self.block_size <= 0:
            raise ValueError(f"num_samples={self.num_samples} and block_size={self.block_size} "
                             "must be positive")

    @property
    def num_blocks(self) -> int:
        """Cache objects per depth (:class:`pt_ray.data.sampler.CacheBlocks`)."""
        return max(1, self.num_samples // self.block_size)

    def cache_bytes(self, row_bytes: float) -> float:
        """The whole cache at one depth."""
        return row_bytes * self.num_samples

    def fits(self, row_bytes: float) -> bool:
        """Whether the whole cache fits a stage-0 worker's memo."""
        return self.memo_bytes is None or self.cache_bytes(row_bytes) <= self.memo_bytes

    def blocks_touched(self, samples: float) -> float:
        """Expected distinct blocks ``samples`` random samples fall in:
        ``B (1 - (1 - 1/B)^samples)`` of ``B`` blocks, about ``min(samples, B)``."""
        b = self.num_blocks
        return b * (1.0 - (1.0 - 1.0 / b) ** samples)


def cache_read_factor(costs: CostTable, level: int, samples: float,
                      layout: CacheLayout | None) -> float:
    """Bytes one stage 0 reads per byte of cached rows it uses, reading ``samples`` rows at
    depth ``level`` in one pass (random rows: the plain order).

    1. The whole cache fits the worker's memo: the first read of an epoch fetches every block
       (zero-copy views on the node's store), and each pass moves only its rows: 1.
    2. It does not: the pass's rows fall in :meth:`CacheLayout.blocks_touched` blocks; each
       that the memo lacks (a ``1 - memo / cache`` share: it keeps the most recently read) is
       read whole, ``num_samples / num_blocks`` rows, on top of the rows used.

    Args:
        costs: per-layer costs (``activation_bytes``: a row's bytes at each depth).
        level: the depth read, at least 1.
        samples: rows read in one pass (a replica's share of the pass).
        layout: the cache's layout; None: rows are read alone (factor 1).
    """
    if layout is None or samples <= 0:
        return 1.0
    row = costs.blocks[level - 1].activation_bytes
    if row <= 0 or layout.fits(row):
        return 1.0
    missed = 1.0 - (layout.memo_bytes or 0.0) / layout.cache_bytes(row)
    block_rows = layout.num_samples / layout.num_blocks
    return 1.0 + layout.blocks_touched(samples) * missed * block_rows / samples


def _prefix_time(costs: CostTable, hw: HardwareProfile, runtime: Runtime, n: int, samples: float,
                 cache: bool, cache_state: str, cached_level: int | None,
                 layout: CacheLayout | None = None) -> float:
    """Stage 0's frozen-prefix work for ``samples`` samples."""
    if n == 0:
        return 0.0
    scale = samples / costs.samples

    def forward(lo: int) -> float:
        layers = [*([costs.embed] if lo == 0 else []), *costs.blocks[lo:n]]
        return sum(c.forward_at(scale) for c in layers)

    def io(level: int) -> float:
        return costs.blocks[level - 1].activation_bytes * samples / runtime.cache_rate(hw)

    if not cache:
        return forward(0)
    write = io(n) if runtime.cache_writes == "sync" else 0.0
    if cache_state == "miss":
        return forward(0) + write
    level = n if cached_level is None else cached_level
    if not 0 < level <= n:
        raise ValueError(f"cached_level={level} must lie in [1, num_frozen={n}]")
    read = io(level) * cache_read_factor(costs, level, samples, layout)
    return read + forward(level) + (write if level < n else 0.0)


def step_time(
    plan: Plan,
    costs: CostTable,
    hw: HardwareProfile,
    batch_per_replica: int,
    *,
    runtime: Runtime = PT_RAY,
    cache_state: Literal["hit", "miss"] = "hit",
    cached_level: int | None = None,
    optimizer_traffic: float = 5.0,
    passes: int = 1,
    cache_layout: CacheLayout | None = None,
) -> StepBreakdown:
    """Predict one step of ``plan``.

    Args:
        plan: the layout (K, R, boundaries, M, schedule, cache).
        costs: per-layer costs (times for ``costs.samples`` samples; a micro-batch of another
            size costs each layer's fixed part once and the rest in proportion:
            :meth:`pt_ray.core.plan.LayerCost.forward_at`).
        hw: the cluster.
        batch_per_replica: samples each replica takes per step.
        runtime: how the runtime places the frozen prefix and writes the cache.
        cache_state: with ``plan.cache``: ``hit`` (entries at ``cached_level`` exist) or
            ``miss`` (none yet: full prefix forward, then a write).
        cached_level: the level the cache holds (default: ``plan.num_frozen``, steady state).
        optimizer_traffic: bytes the optimizer streams per active parameter byte (SGD with
            momentum: 5; AdamW: 7).
        passes: gradient-accumulation passes per step (``optimizer.accumulation_steps``),
            each a whole schedule over ``batch_per_replica`` samples, fill and drain included,
            run one after another; the all-reduce and the optimizer step follow the last.
        cache_layout: how the cache is kept, for the cost of a read
            (:func:`cache_read_factor`); None: a read moves only the rows it uses.
    """
    if passes < 1:
        raise ValueError(f"passes={passes} must be at least 1")
    k, r, n, m = plan.pipeline_length, plan.num_replicas, plan.num_frozen, plan.num_microbatches
    if plan.activation_checkpointing:
        costs = costs.with_recompute()
    scale = batch_per_replica / m / costs.samples
    fwd, bwd, grads = _stage_work(plan, costs, scale, runtime.overhead(hw))
    prefix = _prefix_time(costs, hw, runtime, n, batch_per_replica, plan.cache, cache_state,
                          cached_level, cache_layout)
    ready = [0.0] * k
    if runtime.prefix == "serial":
        ready[0] = prefix
    else:
        fwd[0] += prefix / m
    sched = _slowest_pipeline(plan, costs, hw, fwd, bwd, ready, batch_per_replica)
    ar, opt = _reduce_and_update(plan, hw, grads, optimizer_traffic)
    earlier = (passes - 1) * sched.makespan_s  # the passes before the last
    step = earlier + max(sched.stage_end_s[s] + ar[s] + opt[s] for s in range(k))
    return StepBreakdown(
        step_s=step,
        pipeline_s=earlier + sched.makespan_s,
        prefix_s=prefix * passes,
        allreduce_s=max(ar),
        optimizer_s=max(opt),
        bubble_fraction=sched.bubble_fraction,
        samples=batch_per_replica * r * passes,
    )


def _stage_work(plan: Plan, costs: CostTable, scale: float, overhead: float
                ) -> tuple[list[float], list[float], list[float]]:
    """Per stage: one micro-batch's forward and backward seconds (the overhead included; no
    backward where nothing trains) and the bytes of the parameters it trains."""
    k, n = plan.pipeline_length, plan.num_frozen
    fwd, bwd, grads = [], [], []
    for s in range(k):
        layers = [costs.blocks[i] for i in plan.stage_blocks(s)]
        if s == 0 and n == 0:
            layers.append(costs.embed)
        if s == k - 1:
            layers.append(costs.head)
        b = sum(c.backward_at(scale) for c in layers)
        fwd.append(sum(c.forward_at(scale) for c in layers) + overhead)
        bwd.append(b + overhead if b > 0 else 0.0)
        grads.append(sum(c.param_bytes for c in layers))
    return fwd, bwd, grads


def _slowest_pipeline(plan: Plan, costs: CostTable, hw: HardwareProfile, fwd: list[float],
                      bwd: list[float], ready: list[float], batch_per_replica: int):
    """The schedule of the replica whose pipeline is slowest over its links (replicas on the
    same links share one simulation)."""
    k, r, m = plan.pipeline_length, plan.num_replicas, plan.num_microbatches
    # Stage outputs per micro-batch, and the links each replica's pipeline uses.
    out_bytes = []
    for s in range(k - 1):
        last = plan.boundaries[s + 1] - 1
        out_bytes.append(costs.blocks[last].activation_bytes * batch_per_replica / m)
    results = {}
    for rep in range(r):
        links = tuple(hw.link(plan.rank_of(rep, s), plan.rank_of(rep, s + 1)) for s in range(k - 1))
        if links not in results:
            send = [nb / bw + lat for nb, (bw, lat) in zip(out_bytes, links)]
            results[links] = run_schedule(fwd, bwd, m, plan.schedule, send, send, ready)
    return max(results.values(), key=lambda x: x.makespan_s)


def _reduce_and_update(plan: Plan, hw: HardwareProfile, grads: list[float],
                       optimizer_traffic: float) -> tuple[list[float], list[float]]:
    """Per stage: the data-parallel all-reduce of its gradients and its optimizer step."""
    k, r = plan.pipeline_length, plan.num_replicas
    # Data-parallel groups: one per stage; those crossing nodes share each node's uplink.
    spans = [len({hw.node_of(plan.rank_of(rep, s)) for rep in range(r)}) > 1 for s in range(k)]
    sharing = max(1, sum(spans))
    ar, opt = [], []
    for s in range(k):
        if spans[s]:
            bw, lat = hw.inter_node_bandwidth / sharing, hw.inter_node_latency
        else:
            bw, lat = hw.intra_node_bandwidth, hw.intra_node_latency
        ar.append(allreduce_time(grads[s], r, bw, lat))
        opt.append(grads[s] * optimizer_traffic / hw.memory_bandwidth)
    return ar, opt


def transition_time(old: Plan, new: Plan, costs: CostTable, hw: HardwareProfile, *,
                    runtime: Runtime = PT_RAY, optimizer_state_factor: float = 2.0) -> float:
    """Predicted time of a transition from ``old`` to ``new``: every layer a rank newly holds
    comes from replica 0's holder under ``old`` (parameters, plus optimizer state when it still
    trains); a rank receives one layer at a time, ranks receive in parallel; plus the fixed
    costs of regrouping."""
    if old == new:
        return 0.0
    names = ["embed", *(f"block.{i}" for i in range(new.num_layers)), "head"]

    def layer(name: str) -> LayerCost:
        if name in ("embed", "head"):
            return getattr(costs, name)
        return costs.blocks[int(name.split(".")[1])]

    incoming: dict[int, float] = {}
    for name in names:
        before = holders(old, name)
        state = 1 + (optimizer_state_factor if is_trainable(new, name) else 0)
        for dst in holders(new, name):
            if dst in before:
                continue
            bw, lat = hw.link(before[0], dst)
            incoming[dst] = incoming.get(dst, 0.0) + layer(name).param_bytes * state / bw + lat
    return max(incoming.values(), default=0.0) + hw.group_setup_s + runtime.transition_overhead_s
