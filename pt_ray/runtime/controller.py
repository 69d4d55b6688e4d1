"""What a worker needs from the run's controller, and a controller without Ray.

Torch runtime layer. The Ray service's controller actor (:mod:`pt_ray.service.controller`)
implements :class:`Controller` over Ray; :class:`LocalController` implements it over the WORLD
process group alone, for the forked gloo tests and runs without Ray.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Protocol

import torch

from pt_ray.control.state import ControlState
from pt_ray.core.plan import CostTable, LayerCost, Plan
from pt_ray.runtime.comm import Comm
from pt_ray.reporting.summary import EpochRecord

__all__ = ["Controller", "LocalController"]


class Controller(Protocol):
    """What a worker needs from the controller (the Ray actor, or :class:`LocalController`)."""

    def submit_costs(self, rank: int, costs: CostTable) -> None: ...

    def trial_plans(self) -> tuple[Plan, ...]:
        """The first layouts to time before decision 0's plan is chosen (empty: none); blocks
        until every rank's costs are in."""
        ...

    def submit_trial(self, rank: int, seconds: list[float]) -> None:
        """Seconds per step of each trial layout, the slowest rank's (the same on every rank;
        one copy is kept)."""
        ...

    def plan_for(self, decision: int) -> Plan:
        """The plan from decision ``decision`` on; blocks until it is decided."""
        ...

    def submit_norms(self, decision: int, rank: int, norms: dict[int, float],
                     record: EpochRecord | None = None) -> None:
        """Interval ``decision``'s per-block norms, already merged over the ranks (the same on
        every rank; one copy is kept). ``record``: the epoch that ends the interval, taken
        before the norms (the accuracy guard must see it before the next decision)."""
        ...


class LocalController:
    """A controller without Ray: every rank keeps an identical :class:`ControlState` and feeds it
    the same inputs (the cost profiles exchanged as tensors over WORLD: nothing is pickled
    through a group; records and norms arrive alike on every rank).

    Args:
        state: this rank's copy of the control state.
        comm: the run's communication (default: on the CPU, for gloo; an NCCL run passes the
            rank's CUDA :class:`Comm`).
    """

    def __init__(self, state: ControlState, comm: Comm | None = None) -> None:
        self.state = state
        self._comm = comm

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            self._comm = Comm(torch.device("cpu"))
        return self._comm

    def submit_costs(self, rank: int, costs: CostTable) -> None:
        for r, row in enumerate(self.comm.all_gather(_costs_to_tensor(costs))):
            self.state.submit_costs(r, _costs_from_tensor(row.cpu()))

    def trial_plans(self) -> tuple[Plan, ...]:
        trials = self.state.trial_plans()
        if trials is None:
            raise RuntimeError("trial layouts asked before every rank's costs were submitted")
        return trials

    def submit_trial(self, rank: int, seconds: list[float]) -> None:
        self.state.submit_trial(seconds)  # each rank's own copy of the state

    def plan_for(self, decision: int) -> Plan:
        plan = self.state.plan_for(decision)
        if plan is None:
            raise RuntimeError(f"decision {decision} asked before its inputs were submitted")
        return plan

    def submit_norms(self, decision: int, rank: int, norms: dict[int, float],
                     record: EpochRecord | None = None) -> None:
        if record is not None:
            self.state.record(record)  # each rank's own copy of the state
        self.state.submit_norms(decision, norms)


def _costs_to_tensor(costs: CostTable) -> torch.Tensor:
    """``[samples, L, then LayerCost's numbers per layer (embed, blocks, head)]`` as float64
    (an unknown ``saved_bytes`` as NaN)."""
    values = [float(costs.samples), float(costs.num_layers)]
    for layer in (costs.embed, *costs.blocks, costs.head):
        values += [math.nan if getattr(layer, f.name) is None else float(getattr(layer, f.name))
                   for f in fields(LayerCost)]
    return torch.tensor(values, dtype=torch.float64)


def _costs_from_tensor(row: torch.Tensor) -> CostTable:
    values = row.tolist()
    samples, num_layers = int(values[0]), int(values[1])
    width = len(fields(LayerCost))
    layers = [LayerCost(*(None if math.isnan(v) else v
                          for v in values[2 + i * width:2 + (i + 1) * width]))
              for i in range(num_layers + 2)]
    return CostTable(layers[0], tuple(layers[1:-1]), layers[-1], samples=samples)
