"""What a worker needs from the run's controller, and a controller without Ray.

Torch runtime layer. The Ray service's controller actor (:mod:`pt_ray.service.controller`)
implements :class:`Controller` over Ray; :class:`LocalController` implements it over the WORLD
process group alone, for the forked gloo tests and runs without Ray.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from pt_ray.control import ControlState
from pt_ray.plan import CostTable, Plan
from pt_ray.summary import EpochRecord

__all__ = ["Controller", "LocalController"]


class Controller(Protocol):
    """What a worker needs from the controller (the Ray actor, or :class:`LocalController`)."""

    def submit_costs(self, rank: int, costs: CostTable) -> None: ...

    def plan_for(self, decision: int) -> Plan:
        """The plan from decision ``decision`` on; blocks until it is decided."""
        ...

    def submit_norms(self, decision: int, rank: int, norms: dict[int, float]) -> None: ...

    def record(self, rec: EpochRecord) -> None: ...


class LocalController:
    """A controller without Ray: every rank keeps an identical :class:`ControlState` and feeds it
    the same inputs, exchanged with ``all_gather_object`` over WORLD."""

    def __init__(self, state: ControlState) -> None:
        self.state = state

    def submit_costs(self, rank: int, costs: CostTable) -> None:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, costs)
        for r, c in enumerate(gathered):
            self.state.submit_costs(r, c)

    def plan_for(self, decision: int) -> Plan:
        plan = self.state.plan_for(decision)
        if plan is None:
            raise RuntimeError(f"decision {decision} asked before its inputs were submitted")
        return plan

    def submit_norms(self, decision: int, rank: int, norms: dict[int, float]) -> None:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, norms)
        for r, n in enumerate(gathered):
            self.state.submit_norms(decision, r, n)

    def record(self, rec: EpochRecord) -> None:
        self.state.record(rec)
