"""The one owner of process groups: pipeline and data-parallel subgroups built from a Plan.

Ray Train hands every worker the WORLD group. At each transition the same workers are regrouped
in place (new subgroups of the live WORLD group, far cheaper than restarting the worker
group, which would start every process and reload the model): one pipeline group
per replica (its K stages) and one data-parallel group per stage index (its R copies). A layout
that returns (a rollback, a restore, a re-plan back to an earlier K) reuses the groups built for
it the first time (:class:`TopologyCache`); every group is warmed up with one collective right
after it is built, before any point-to-point traffic uses it (NCCL sets a communicator up lazily,
on its first collective; a first ``send`` between two ranks would set up a separate one). No
other module creates groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from pt_ray.core.plan import Plan

__all__ = ["Topology", "TopologyCache"]

logger = logging.getLogger(__name__)


@dataclass
class Topology:
    """Process groups of one plan, as seen from one rank.

    Attributes:
        plan: the plan the groups were built for.
        rank: this process's global rank.
        replica: this rank's replica index r.
        stage: this rank's stage index s.
        pipeline_group: the K ranks of this rank's replica (None when K = 1).
        pipeline_ranks: global ranks of this replica's stages, in stage order.
        dp_group: the R ranks holding this rank's stage (None when R = 1).
        dp_ranks: global ranks of this stage's replicas, in replica order.
        build_time_s: wall time the groups took to create.
    """

    plan: Plan
    rank: int
    replica: int
    stage: int
    pipeline_group: dist.ProcessGroup | None
    pipeline_ranks: list[int]
    dp_group: dist.ProcessGroup | None
    dp_ranks: list[int]
    build_time_s: float = 0.0
    _owned: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, plan: Plan, timeout=None,
              warm_up: Callable[[dist.ProcessGroup], None] | None = None) -> Topology:
        """Create every group of ``plan``; all ranks of WORLD must call this together.

        ``new_group`` is collective over WORLD, so every rank creates every group, in the same
        order (all pipeline groups, then all data-parallel groups), and keeps its own.
        ``warm_up(group)`` runs on each of this rank's groups once they all exist (one small
        collective: the engine passes ``Comm.barrier``).
        """
        world = dist.get_world_size()
        if world != plan.num_workers:
            raise ValueError(
                f"plan {plan.describe()} needs {plan.num_workers} workers but WORLD has {world}"
            )
        t0 = time.perf_counter()
        rank = dist.get_rank()
        replica, stage = plan.coords(rank)
        k, r = plan.pipeline_length, plan.num_replicas
        owned: list[dist.ProcessGroup] = []
        pipeline_group = dp_group = None
        kwargs = {} if timeout is None else {"timeout": timeout}
        pipeline_ranks = [plan.rank_of(replica, s) for s in range(k)]
        dp_ranks = [plan.rank_of(q, stage) for q in range(r)]
        if k > 1:
            for q in range(r):
                g = dist.new_group([plan.rank_of(q, s) for s in range(k)], **kwargs)
                owned.append(g)
                if q == replica:
                    pipeline_group = g
        if r > 1:
            for s in range(k):
                g = dist.new_group([plan.rank_of(q, s) for q in range(r)], **kwargs)
                owned.append(g)
                if s == stage:
                    dp_group = g
        if warm_up is not None:
            for g in (pipeline_group, dp_group):
                if g is not None:
                    warm_up(g)
        return cls(plan, rank, replica, stage, pipeline_group, pipeline_ranks, dp_group,
                   dp_ranks, time.perf_counter() - t0, owned)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.plan.pipeline_length - 1

    def destroy(self) -> None:
        """Destroy every group this object created (collective-free; call on every rank)."""
        for g in self._owned:
            # Groups this rank is not a member of come back as GroupMember.NON_GROUP_MEMBER.
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self._owned.clear()
        self.pipeline_group = self.dp_group = None


def layout_key(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """What a plan's groups depend on: the global rank of each (replica, stage), by replica."""
    return tuple(tuple(plan.rank_of(q, s) for s in range(plan.pipeline_length))
                 for q in range(plan.num_replicas))


class TopologyCache:
    """The groups of every layout this rank has entered, built once each.

    Every rank enters the same plans in the same order (decisions are global), so every rank
    asks for a layout not yet built at the same moment and ``new_group`` stays collective. Groups
    live until :meth:`close`; a layout's groups cost one communicator per group on NCCL, and a
    run enters at most a handful of layouts (K only shrinks, except through a rollback).
    """

    def __init__(self, timeout=None,
                 warm_up: Callable[[dist.ProcessGroup], None] | None = None) -> None:
        self.timeout = timeout
        self.warm_up = warm_up
        self._built: dict[tuple[tuple[int, ...], ...], Topology] = {}

    def get(self, plan: Plan) -> Topology:
        """The groups of ``plan``'s layout: built (on every rank together) the first time,
        reused afterwards (with ``plan`` as the topology's plan)."""
        key = layout_key(plan)
        topo = self._built.get(key)
        if topo is None:
            topo = Topology.build(plan, timeout=self.timeout, warm_up=self.warm_up)
            self._built[key] = topo
            logger.debug("built the groups of %s in %.3f s", plan.describe(), topo.build_time_s)
        topo.plan = plan
        return topo

    def __len__(self) -> int:
        return len(self._built)

    def close(self) -> None:
        """Destroy every group built (collective-free; call on every rank)."""
        for topo in self._built.values():
            topo.destroy()
        self._built.clear()
