"""The accuracy guard's rollback: snapshots kept at the start of the epochs a freeze may still
undo, shared by the engine (each rank keeps what it holds) and the reference trainer (one
process keeps the whole model).

A snapshot holds layer entries of :mod:`pt_ray.runtime.layerstate`, the run's counters, the
gradient-norm meter, the loss scale and the random state. When the guard finds a freeze
harmful, :meth:`Rollback.undo` hands back the snapshot of the epoch the freeze opened and
forgets the rest; an evaluated epoch whose freezes passed clears them all
(:meth:`Rollback.passed`). The snapshots still pending at a checkpoint travel in the rank's
shard (:meth:`Rollback.state_dict`), so a restart between the freeze and the guard's verdict
can still undo it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["Rollback", "Snapshot"]


@dataclass
class Snapshot:
    """The state an epoch starts from (host copies).

    Attributes:
        layers: layer entries (:func:`pt_ray.runtime.layerstate.capture_layers`).
        counters: the run's counters (steps, samples, frozen prefix) by name.
        norms: the gradient-norm meter's state.
        scaler: the fp16 loss scaler's state, or None.
        rng: the host's random state.
        cuda_rng: the device's random state, or None off CUDA.
    """

    layers: dict[str, dict[str, Any]]
    counters: dict[str, int]
    norms: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: torch.Tensor
    cuda_rng: torch.Tensor | None


class Rollback:
    """The snapshots of one rank (or of the reference trainer), by the epoch whose start each
    holds.

    Args:
        device: where the random state of the device lives (CUDA), else the CPU.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.snapshots: dict[int, Snapshot] = {}

    def keep(self, epoch: int, layers: dict[str, dict[str, Any]], counters: dict[str, int],
             norms: dict[str, Any], scaler: dict[str, Any] | None) -> None:
        """Keep the state that epoch ``epoch`` starts from (the random state is taken here)."""
        cuda = self.device.type == "cuda"
        self.snapshots[epoch] = Snapshot(
            layers=layers, counters=dict(counters), norms=norms, scaler=scaler,
            rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None)

    def undo(self, epoch: int) -> Snapshot:
        """The snapshot of epoch ``epoch``, with the random state put back; every snapshot is
        forgotten (the guard rolls back once).

        Raises:
            RuntimeError: no snapshot of that epoch is held here.
        """
        snap = self.snapshots.pop(epoch, None)
        held = sorted(self.snapshots)
        self.snapshots.clear()
        if snap is None:
            raise RuntimeError(
                f"the accuracy guard ordered a rollback to the start of epoch {epoch}, but this "
                f"worker holds no snapshot of it (it holds {held or 'none'}); a run restarted "
                "on a different number of workers cannot roll back past its restart")
        torch.set_rng_state(snap.rng)
        if snap.cuda_rng is not None:
            torch.cuda.set_rng_state(snap.cuda_rng, self.device)
        return snap

    def passed(self) -> None:
        """An evaluated epoch passed the guard: no kept freeze can be undone any more."""
        self.snapshots.clear()

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The pending snapshots as plain data (what a checkpoint shard holds)."""
        return {epoch: {f.name: getattr(snap, f.name) for f in fields(snap)}
                for epoch, snap in self.snapshots.items()}

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        """Hold the snapshots of :meth:`state_dict` (those held before are dropped)."""
        self.snapshots = {int(epoch): Snapshot(**snap) for epoch, snap in state.items()}
