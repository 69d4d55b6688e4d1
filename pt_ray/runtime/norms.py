"""Per-block gradient norms, the signal of the freeze policies: measured block by block
(:func:`block_grad_norms`) and averaged over a decision interval (:class:`GradNormMeter`), the
same way by the reference trainer and the distributed engine.

Torch runtime layer, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from pt_ray.core.freeze import LOSS_KEY
from pt_ray.models.base import ModelAdapter

__all__ = ["GradNormMeter", "block_grad_norms", "merge_block_norms", "norm_row"]


@dataclass
class GradNormMeter:
    """Mean per-block gradient L2 norm over the steps since the last reset.

    Norms accumulate as tensors on the gradients' device (no host read per step); :meth:`mean`
    reads them back once per decision interval.
    """

    sums: dict[int, torch.Tensor | float] = field(default_factory=dict)
    steps: int = 0
    # add_vector's running sum: (first block, 1-D tensor), folded into ``sums`` when read.
    _vector: tuple[int, torch.Tensor] | None = None

    def add(self, norms: dict[int, torch.Tensor | float]) -> None:
        for block, value in norms.items():
            if torch.is_tensor(value):
                value = value.detach().double()
            self.sums[block] = self.sums[block] + value if block in self.sums else value
        self.steps += 1

    def add_loss(self, value: torch.Tensor | float) -> None:
        """The step's training loss (this rank's share of it), kept under
        :data:`~pt_ray.core.freeze.LOSS_KEY` beside the norms; call it once for each step whose
        norms were added."""
        if torch.is_tensor(value):
            value = value.detach().double()
        self.sums[LOSS_KEY] = self.sums[LOSS_KEY] + value if LOSS_KEY in self.sums else value

    def add_vector(self, first: int, norms: torch.Tensor) -> None:
        """One step's norms of blocks ``first, first + 1, ..`` as one tensor (one addition per
        step, whatever the block count)."""
        if self._vector is not None and self._vector[0] == first and (
                self._vector[1].shape == norms.shape):
            self._vector = (first, self._vector[1] + norms.detach().double())
        else:
            self._fold()
            self._vector = (first, norms.detach().double())
        self.steps += 1

    def _fold(self) -> None:
        if self._vector is not None:
            first, vec = self._vector
            self._vector = None
            for i, value in enumerate(vec.cpu().tolist()):
                b = first + i
                self.sums[b] = self.sums[b] + value if b in self.sums else value

    def mean(self) -> dict[int, float]:
        self._fold()
        return {b: float(s) / self.steps for b, s in self.sums.items()} if self.steps else {}

    def state_dict(self) -> dict:
        """Plain numbers, for checkpoints."""
        self._fold()
        return {"sums": {b: float(s) for b, s in self.sums.items()}, "steps": self.steps}

    def reset(self) -> None:
        self.sums.clear()
        self._vector = None
        self.steps = 0

    def load_state_dict(self, state: dict, blocks: Collection[int] | None = None) -> None:
        """Start again from :meth:`state_dict`'s numbers (only those of ``blocks`` if given)."""
        self.reset()
        self.sums.update({b: v for b, v in state["sums"].items()
                          if blocks is None or b in blocks})
        self.steps = state["steps"]


def block_grad_norms(adapter: ModelAdapter, blocks: range) -> dict[int, torch.Tensor]:
    """L2 norm of each listed block's current gradient, as 0-d tensors on its device (blocks
    without gradients skipped)."""
    out = {}
    for i in blocks:
        grads = [p.grad for p in adapter.blocks[i].parameters() if p.grad is not None]
        if grads:
            out[i] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))
    return out


def norm_row(norms: dict[int, float], num_layers: int) -> list[float]:
    """A rank's mean block norms as one row of ``num_layers + 1`` numbers for a gather across
    ranks: NaN for the blocks this rank does not train, then its share of the mean training
    loss (0 where it has none)."""
    row = [math.nan] * num_layers + [float(norms.get(LOSS_KEY, 0.0))]
    for block, value in norms.items():
        if block != LOSS_KEY:
            row[block] = float(value)
    return row


def merge_block_norms(rows: Sequence[Sequence[float]]) -> dict[int, float]:
    """One norm per trained block from every rank's :func:`norm_row`, in rank order: the first
    rank that trains a block gives its value (a stage's replicas hold equal values, reduced
    over their data-parallel group before the norms were taken); the loss shares are summed
    (last stages hold their replica's mean loss / R) under :data:`LOSS_KEY`."""
    merged: dict[int, float] = {}
    loss = 0.0
    for row in rows:
        for block, value in enumerate(row[:-1]):
            if not math.isnan(value):
                merged.setdefault(block, float(value))
        loss += row[-1]
    if merged:
        merged[LOSS_KEY] = loss
    return merged
