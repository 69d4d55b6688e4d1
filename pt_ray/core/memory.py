"""The memory model of a pipeline stage: the bytes a stage holds at its peak, as both planners
(:class:`pt_ray.core.plan.PaperPlanner` and :class:`pt_ray.costs.costplan.CostModelPlanner`)
estimate it, and as a run's records set beside the measured memory.

Pure module. A stage holds

1. each trainable layer's parameters with their gradient and optimizer state
   (``optimizer_state_factor`` bytes per parameter byte);
2. on stage 0, the frozen prefix's parameters (``frozen_param_factor`` bytes per parameter
   byte: 1 for the weights alone);
3. what each trainable layer keeps for backward, per sample whose backward is still to come
   (the samples *in flight*, which the schedule sets: see the planners): one output per
   sample, or its measured ``saved_bytes`` (else ``activation_factor`` outputs' worth); the
   head keeps its output once;
4. under activation checkpointing, a trainable block keeps only its input per sample in flight
   and the backward holds one block's activations of one micro-batch while it recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pt_ray.core.plan import CostTable, LayerCost

__all__ = ["MemoryModel"]


@dataclass(frozen=True)
class MemoryModel:
    """How a planner weighs a stage's bytes.

    Attributes:
        optimizer_state_factor: bytes held per parameter byte of a trainable layer (weights,
            gradient and optimizer moments: 4 for AdamW, 3 for SGD with momentum).
        frozen_param_factor: bytes held per parameter byte of a frozen layer.
        activation_factor: what a trainable layer keeps for backward per sample: None, its
            output (``activation_bytes``); a number, its measured ``saved_bytes`` or else that
            many outputs' worth (:meth:`LayerCost.kept_bytes`).
    """

    optimizer_state_factor: float = 4.0
    frozen_param_factor: float = 1.0
    activation_factor: float | None = None

    def _kept(self, layer: LayerCost, factor: float | None) -> float:
        return layer.activation_bytes if factor is None else layer.kept_bytes(factor)

    def stage_bytes(self, costs: CostTable, boundaries: Sequence[int], num_frozen: int,
                    in_flight: Sequence[float], *, per_microbatch: float = 0.0,
                    checkpointing: bool = False) -> list[float]:
        """Predicted peak bytes of each stage.

        Args:
            costs: per-layer costs (activation bytes per sample, parameter bytes).
            boundaries: ``K + 1`` block indices, as :attr:`Plan.boundaries`.
            num_frozen: n, the frozen prefix stage 0 holds.
            in_flight: per stage, the samples whose activations wait for their backward.
            per_microbatch: samples in one micro-batch (the recompute term of checkpointing).
            checkpointing: trainable blocks recompute their forward in their backward.
        """
        k = len(boundaries) - 1
        factor, osf = self.activation_factor, self.optimizer_state_factor
        head_factor = None if factor is None else 1.0
        mem = []
        for s in range(k):
            samples = in_flight[s]
            blocks = costs.blocks[boundaries[s]:boundaries[s + 1]]
            total = 0.0
            for b in blocks:
                kept = b.activation_bytes if checkpointing else self._kept(b, factor)
                total += b.param_bytes * osf + kept * samples
            if checkpointing and blocks:
                total += max(self._kept(b, factor) for b in blocks) * per_microbatch
            if s == 0:
                frozen = num_frozen > 0
                total += costs.embed.param_bytes * (self.frozen_param_factor if frozen else osf)
                total += sum(b.param_bytes * self.frozen_param_factor
                             for b in costs.blocks[:num_frozen])
                total += 0 if frozen else self._kept(costs.embed, factor) * samples
            if s == k - 1:
                total += costs.head.param_bytes * osf
                total += self._kept(costs.head, head_factor) * samples
            mem.append(total)
        return mem
