"""Whether a run's workers fit the Ray cluster: what they ask for, what the cluster holds, and
the one line that says what is missing and which fields to change.

Pure module (stdlib and the config). :mod:`pt_ray.service.placement` reads the cluster and
waits; this module only decides, so the rule and its messages are tested without a cluster.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pt_ray.core.config import ConfigError, PipelineConfig

__all__ = [
    "ClusterView",
    "Demand",
    "PlacementCheck",
    "PlacementError",
    "check_placement",
    "demand_for",
    "has_autoscaler",
    "timeout_message",
    "waiting_line",
    "workers_fitting",
]

Resources = Mapping[str, float]

_EPS = 1e-9
# Ray names a node that no node provider launched ``node_<its 56-hex-digit id>``.
_ANONYMOUS_NODE_TYPE = re.compile(r"node_[0-9a-f]{56}")


class PlacementError(ConfigError):
    """The cluster cannot place the run's workers: never (no autoscaler, too small) or not
    within ``pipeline.placement_timeout_s`` (other jobs hold the resources). Raised before any
    actor or worker starts, or when Ray Train itself gives up placing them."""


@dataclass(frozen=True)
class Demand:
    """What a run's workers ask Ray for before the first one starts.

    Attributes:
        workers: workers that must be placed: ``pipeline.min_workers`` when set (an elastic
            run starts with as few), else ``pipeline.num_workers``.
        bundle: one worker's resources, e.g. ``{"CPU": 1.0}`` or ``{"CPU": 1.0, "GPU": 1.0}``;
            all on one node.
        elastic: ``pipeline.min_workers`` is set.
    """

    workers: int
    bundle: dict[str, float] = field(hash=False)
    elastic: bool = False

    def __str__(self) -> str:
        """``4 x {CPU: 1}``."""
        return f"{self.workers} x {{{', '.join(f'{k}: {v:g}' for k, v in self.bundle.items())}}}"


def demand_for(p: PipelineConfig, use_gpu: bool) -> Demand:
    """The demand of the pipeline section ``p`` on the chosen device (pt-ray's and Ray Train's
    controller and cache actors take no CPU, so the workers are all of it)."""
    bundle = {"CPU": p.cpus_per_worker, **({"GPU": 1.0} if use_gpu else {})}
    return Demand(p.min_workers or p.num_workers, bundle, elastic=p.min_workers is not None)


@dataclass(frozen=True)
class ClusterView:
    """The cluster's resources as the driver read them.

    Attributes:
        nodes_total: each live node's resources.
        nodes_free: the same nodes' unreserved resources, in the same order.
        autoscaler: an autoscaler may add nodes (see :func:`has_autoscaler`).
        max_total: the most the autoscaler's configuration lets the cluster hold, per
            resource; None when unknown.
    """

    nodes_total: tuple[Resources, ...]
    nodes_free: tuple[Resources, ...]
    autoscaler: bool = False
    max_total: Resources | None = None

    def total(self, resource: str) -> float:
        return sum(n.get(resource, 0.0) for n in self.nodes_total)

    def free(self, resource: str) -> float:
        return sum(n.get(resource, 0.0) for n in self.nodes_free)


@dataclass(frozen=True)
class PlacementCheck:
    """What the driver does about a demand.

    Attributes:
        verdict: ``fits`` (start now), ``wait`` (the cluster could hold it, or an autoscaler
            may grow it: wait) or ``never`` (fail at once).
        message: empty when it fits; the waiting line, or the failure's one line.
    """

    verdict: Literal["fits", "wait", "never"]
    message: str = ""


def workers_fitting(nodes: Iterable[Resources], bundle: Resources) -> int:
    """How many workers of ``bundle`` (some amount positive) the ``nodes`` hold, each worker
    within one node."""
    need = {r: a for r, a in bundle.items() if a > 0}
    return sum(min(math.floor(n.get(r, 0.0) / a + _EPS) for r, a in need.items())
               for n in nodes)


def has_autoscaler(node_groups: Iterable[tuple[int, int]], node_types: Iterable[str],
                   pending_nodes: int) -> bool:
    """Whether an autoscaler may add nodes to the cluster, from what Ray 2.60 exposes.

    1. The autoscaler's cluster configuration in the GCS has a node group that can grow
       (``max_count`` -1 or above ``min_count``; ``node_groups`` gives ``(min, max)``), as
       Ray Data decides it.
    2. A node was launched by a node provider: its type has a name (``ray up`` and KubeRay
       name them), where Ray calls any other node ``node_<id>``.
    3. The autoscaler reports nodes pending or being launched.

    None of these: a fixed cluster (``ray start`` by hand, a local cluster).
    """
    if any(hi == -1 or hi > lo for lo, hi in node_groups):
        return True
    if any(t and not _ANONYMOUS_NODE_TYPE.fullmatch(t) for t in node_types):
        return True
    return pending_nodes > 0


def check_placement(demand: Demand, view: ClusterView) -> PlacementCheck:
    """Decide whether ``demand`` starts now, waits, or fails.

    1. It fails when the autoscaler's configuration caps the cluster below the demand, or when
       the nodes can never hold it and there is no autoscaler.
    2. It fits when the free resources hold it now, each worker within one node.
    3. Otherwise it waits: for other jobs to release resources, or for the autoscaler.

    Returns:
        The verdict with its message (the failure, or the first waiting line).
    """
    n = demand.workers
    if view.max_total is not None and workers_fitting([view.max_total], demand.bundle) < n:
        return PlacementCheck("never", (
            f"{demand} requested, the autoscaler lets the cluster grow to at most "
            f"{_amounts(view.max_total, demand.bundle)}; "
            f"{_fixes(demand, [view.max_total], 'raise the autoscaler limits')}"))
    fit = workers_fitting(view.nodes_total, demand.bundle)
    if fit < n and not view.autoscaler:
        return PlacementCheck("never", _never(demand, view, fit))
    if workers_fitting(view.nodes_free, demand.bundle) >= n:
        return PlacementCheck("fits")
    return PlacementCheck("wait", waiting_line(demand, view))


def waiting_line(demand: Demand, view: ClusterView, left_s: float | None = None,
                 timeout_s: float | None = None) -> str:
    """The periodic line while a run waits, e.g. ``waiting for 4 x {CPU: 1}: the cluster has
    2 of its 4 CPUs free; the autoscaler may add nodes``."""
    line = f"waiting for {demand}: the cluster has {_free_of(view, demand.bundle)} free"
    if view.autoscaler:
        return line + "; the autoscaler may add nodes"
    line += " (other jobs hold the rest)"
    if left_s is not None and timeout_s is not None:
        line += (f"; failing in {max(left_s, 0.0):.0f} s "
                 f"(pipeline.placement_timeout_s={timeout_s:g})")
    return line


def timeout_message(demand: Demand, view: ClusterView, waited_s: float, timeout_s: float) -> str:
    """The failure after ``pipeline.placement_timeout_s`` on a cluster without an autoscaler
    whose resources other jobs hold."""
    return (f"{demand} requested, the cluster has {_free_of(view, demand.bundle)} free after "
            f"waiting {waited_s:.0f} s (pipeline.placement_timeout_s={timeout_s:g}): other jobs "
            f"hold the rest; "
            + _fixes(demand, view.nodes_free, "raise pipeline.placement_timeout_s, or retry "
                     "when they finish"))


def _never(demand: Demand, view: ClusterView, fit: int) -> str:
    have = _amounts({r: view.total(r) for r in demand.bundle}, demand.bundle)
    nodes = len(view.nodes_total)
    text = f"{demand} requested, the cluster has {have}"
    if nodes > 1:
        text += f" on {nodes} nodes"
    text += " and no autoscaler"
    if all(view.total(r) >= a * demand.workers - _EPS for r, a in demand.bundle.items()):
        # Enough in total, but a worker's resources must all be on one node.
        largest = max(view.nodes_total, key=lambda node: node.get("CPU", 0.0))
        text += (f", but a worker must fit within one node and "
                 f"{f'only {fit} do' if fit else 'none does'} (the largest node has "
                 f"{_amounts(largest, demand.bundle)})")
    return f"{text}; " + _fixes(demand, view.nodes_total, "add nodes")


def _fixes(demand: Demand, nodes: Sequence[Resources], last: str) -> str:
    """``choose pipeline.num_workers <= 2 (...), pipeline.cpus_per_worker <= 0.5, or <last>``:
    the values with which ``demand`` fits ``nodes``."""
    choices = []
    fit = workers_fitting(nodes, demand.bundle)
    if fit >= 1:
        if demand.elastic:
            choices.append(f"pipeline.min_workers <= {fit}")
        else:
            choices.append(f"pipeline.num_workers <= {fit} (or pipeline.min_workers <= {fit} "
                           f"to start with fewer)")
    cpus = _fitting_cpus(nodes, demand)
    if 0 < cpus < demand.bundle.get("CPU", 0.0):
        choices.append(f"pipeline.cpus_per_worker <= {cpus:g}")
    if demand.bundle.get("GPU", 0.0) > 0:
        choices.append("pipeline.use_gpu=false to train on CPUs")
    return f"choose {', '.join(choices)}, or {last}" if choices else last


def _fitting_cpus(nodes: Sequence[Resources], demand: Demand) -> float:
    """The largest ``cpus_per_worker`` (to 0.01) with which ``demand.workers`` fit ``nodes``;
    0 when none does (another resource is short)."""
    n = demand.workers
    # The best value divides some node's CPUs into whole workers: try those, largest first.
    candidates = sorted({math.floor(node.get("CPU", 0.0) / k * 100 + _EPS) / 100
                         for node in nodes for k in range(1, n + 1)}, reverse=True)
    for cpus in candidates:
        if cpus > 0 and workers_fitting(nodes, {**demand.bundle, "CPU": cpus}) >= n:
            return cpus
    return 0.0


def _amounts(resources: Resources, bundle: Resources) -> str:
    """``2 CPUs`` or ``8 CPUs and 1 GPU``: the resources a worker asks for."""
    return " and ".join(_amount(resources.get(r, 0.0), r) for r in bundle)


def _free_of(view: ClusterView, bundle: Resources) -> str:
    """``2 of its 4 CPUs``."""
    return " and ".join(f"{view.free(r):g} of its {_amount(view.total(r), r)}" for r in bundle)


def _amount(n: float, resource: str) -> str:
    return f"{n:g} {resource}" + ("" if n == 1 else "s")
