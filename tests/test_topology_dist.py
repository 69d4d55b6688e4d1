"""The process groups of a layout are built once and warmed up with one collective before use,
on 4 forked gloo ranks: a layout that returns (K 2, R 2 -> K 1, R 4 -> K 2, R 2) reuses its
groups, creates none, and its groups still reduce correctly."""

from __future__ import annotations

import pytest

from pt_ray.core.plan import Plan
from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def plan(generation: int, k: int, r: int) -> Plan:
    bounds = (0, 3, 6) if k == 2 else (0, 6)
    return Plan(generation=generation, num_layers=6, num_frozen=0, pipeline_length=k,
                num_replicas=r, boundaries=bounds, num_microbatches=k)


def enter_layouts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from pt_ray.runtime.comm import Comm
    from pt_ray.runtime.topology import TopologyCache

    created: list[list[int]] = []
    real_new_group = dist.new_group

    def counting_new_group(ranks, **kwargs):
        created.append(list(ranks))
        return real_new_group(ranks, **kwargs)

    dist.new_group = counting_new_group
    comm = Comm(torch.device("cpu"))
    warmed: list[int] = []

    def warm_up(group) -> None:
        warmed.append(dist.get_world_size(group))
        comm.barrier(group=group)

    cache = TopologyCache(warm_up=warm_up)
    first = cache.get(plan(0, 2, 2))
    after_first = (len(created), list(warmed))
    second = cache.get(plan(1, 1, 4))
    after_second = (len(created), list(warmed))
    again = cache.get(plan(2, 2, 2))
    # The reused groups still work: each data-parallel group sums its 2 replicas' ranks.
    total = comm.all_reduce(torch.tensor([float(rank)]), group=again.dp_group)
    result = {"after_first": after_first, "after_second": after_second,
              "after_again": (len(created), list(warmed)), "reused": again is first,
              "plan_generation": again.plan.generation, "dp_sum": float(total[0]),
              "dp_ranks": again.dp_ranks, "layouts": len(cache),
              "second_dp_world": dist.get_world_size(second.dp_group)}
    cache.close()
    dist.new_group = real_new_group
    return result


def test_a_returning_layout_reuses_its_warmed_up_groups():
    results = run_ranks(enter_layouts, 4)
    for rank, got in enumerate(results):
        # K 2, R 2: 2 pipeline groups and 2 data-parallel groups, all created by every rank;
        # this rank's two (pipeline of 2, data-parallel of 2) each warmed up once.
        assert got["after_first"] == (4, [2, 2]), (rank, got)
        # K 1, R 4: one data-parallel group of 4, warmed up.
        assert got["after_second"] == (5, [2, 2, 4]), (rank, got)
        # K 2, R 2 again: nothing created, nothing warmed again, the same object.
        assert got["after_again"] == got["after_second"], (rank, got)
        assert got["reused"] and got["plan_generation"] == 2 and got["layouts"] == 2
        assert got["second_dp_world"] == 4
        assert got["dp_sum"] == float(sum(got["dp_ranks"])), (rank, got)
