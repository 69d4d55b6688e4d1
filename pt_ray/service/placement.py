"""Room for a run's workers on a cluster pt-ray attaches to: read the cluster, fail at once when
it can never hold them, else wait for them (:mod:`pt_ray.core.placement` decides)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable

import ray
from ray._private import ray_constants
from ray._private import state as ray_state
from ray.train import ControllerError
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group

from pt_ray.core.placement import (
    ClusterView,
    Demand,
    PlacementError,
    check_placement,
    has_autoscaler,
    timeout_message,
    waiting_line,
)

__all__ = ["REPORT_EVERY_S", "placement_failure", "read_cluster", "wait_for_room"]

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 30.0
"""How often a waiting run says what it waits for."""


def read_cluster() -> ClusterView:
    """The connected cluster's nodes (total and free resources) and whether an autoscaler may
    add nodes (:func:`pt_ray.core.placement.has_autoscaler` over what this reads)."""
    total = ray_state.total_resources_per_node()
    free = ray_state.available_resources_per_node()
    ids = sorted(total)
    groups, types, pending, ceiling = _autoscaler_evidence()
    return ClusterView(
        nodes_total=tuple(dict(total[i]) for i in ids),
        nodes_free=tuple(dict(free.get(i, {})) for i in ids),
        autoscaler=has_autoscaler(groups, types, pending),
        max_total=ceiling,
    )


def _autoscaler_evidence() -> tuple[list[tuple[int, int]], list[str], int, dict | None]:
    """What Ray 2.60 says about an autoscaler: the node groups (min, max) of the autoscaler's
    cluster configuration in the GCS and the most it lets the cluster hold, the node type
    names, and the nodes pending or being launched. Each source that cannot be read counts as
    silent (a read failure must not fail the run)."""
    groups: list[tuple[int, int]] = []
    types: list[str] = []
    pending = 0
    ceiling = None
    try:  # KubeRay and hosted clusters publish it; Ray Data and Ray Train read it too.
        config = ray_state.state.get_cluster_config()
        if config is not None:
            groups = [(g.min_count, g.max_count) for g in config.node_group_configs
                      if g.resources and g.max_count != 0]
            ceiling = ray_state.state.get_max_resources_from_cluster_config()
    except Exception as err:
        logger.debug("autoscaler cluster config unreadable: %s", err)
    try:  # The GCS's node types and autoscaler v2's state (what `ray status` shows).
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
        types += [n.ray_node_type_name for n in status.active_nodes + status.idle_nodes]
        pending += len(status.pending_launches) + len(status.pending_nodes)
    except Exception as err:
        logger.debug("cluster status unreadable: %s", err)
    try:  # Autoscaler v1's report in the GCS key-value store.
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        report = (json.loads(raw).get("autoscaler_report") or {}) if raw else {}
        types += list(report.get("active_nodes") or {})
        pending += (len(report.get("pending_nodes") or [])
                    + sum((report.get("pending_launches") or {}).values()))
    except Exception as err:
        logger.debug("autoscaler v1 report unreadable: %s", err)
    return groups, types, pending, ceiling


def wait_for_room(demand: Demand, timeout_s: float, *, report_every_s: float = REPORT_EVERY_S,
                  clock: Callable[[], float] = time.monotonic) -> ClusterView:
    """Return once the cluster has room for ``demand``, saying what it waits for meanwhile.

    1. Read the cluster (:func:`read_cluster`) and decide (:func:`check_placement`): fail at
       once when it can never hold the demand; return when it holds it now.
    2. Otherwise reserve the workers' bundles in a placement group (PACK, as Ray Train places
       its workers), so that Ray's scheduler answers, and an autoscaler sees the demand.
    3. Every ``report_every_s`` until it is placed, log the waiting line and read the cluster
       again; a cluster that can no longer hold the demand (a node left) fails at once, and
       one without an autoscaler fails after ``timeout_s``.
    4. Release the placement group: Ray Train places its own workers next.

    Args:
        demand: the workers to place (:func:`pt_ray.core.placement.demand_for`).
        timeout_s: ``pipeline.placement_timeout_s``; ignored with an autoscaler.
        report_every_s: seconds between waiting lines.
        clock: monotonic seconds.

    Returns:
        The last view read; its ``autoscaler`` tells whether Ray Train may wait without limit.

    Raises:
        PlacementError: the cluster can never hold the demand, or (no autoscaler) it did not
            have room within ``timeout_s``.
    """
    try:
        view = read_cluster()
    except Exception as err:  # e.g. over Ray Client (ray://): no GCS state API
        logger.warning("placement check skipped: the cluster's resources cannot be read (%s)",
                       err)
        return ClusterView((), ())
    check = check_placement(demand, view)
    if check.verdict == "never":
        raise PlacementError(check.message)
    if check.verdict == "fits":
        return view
    start = clock()
    probe = placement_group([dict(demand.bundle) for _ in range(demand.workers)],
                            strategy="PACK")
    try:
        while True:
            waited = clock() - start
            logger.warning(waiting_line(demand, view, timeout_s - waited, timeout_s))
            step = report_every_s if view.autoscaler else min(report_every_s,
                                                              timeout_s - waited)
            # Whole seconds: Ray's wait takes an integer timeout.
            if probe.wait(max(1, math.ceil(step))):
                logger.info("room for %s after %.0f s", demand, clock() - start)
                return view
            view = read_cluster()
            check = check_placement(demand, view)
            if check.verdict == "never":
                raise PlacementError(check.message)
            if check.verdict == "fits":  # freed while the probe was still queued
                return view
            waited = clock() - start
            if not view.autoscaler and waited >= timeout_s:
                raise PlacementError(timeout_message(demand, view, waited, timeout_s))
    finally:
        remove_placement_group(probe)


def placement_failure(err: BaseException, demand: Demand, timeout_s: float,
                      waited_s: float) -> PlacementError | None:
    """The one-line error for a Ray Train run that gave up placing its workers (each try
    bounded by ``timeout_s``, as many tries as its controller failure limit), from the cluster
    as it is now; None when ``err`` is another failure."""
    if not (isinstance(err, ControllerError)
            and isinstance(err.controller_failure, WorkerGroupStartupTimeoutError)):
        return None
    try:
        view = read_cluster()
    except Exception:  # Ray Train's own error then stands
        return None
    check = check_placement(demand, view)
    if check.verdict == "never":  # e.g. a node left the cluster during the run
        return PlacementError(check.message)
    return PlacementError(f"Ray Train could not place the workers: "
                          f"{timeout_message(demand, view, waited_s, timeout_s)}")
