"""What one rank saves and restores: its checkpoint shard and metadata, its rollback snapshots,
and the counters that decide the rest of the run. Every path goes through the one layer-state
codec (:mod:`pt_ray.runtime.layerstate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pt_ray.core.plan import Plan
from pt_ray.models.base import frozen_layer_names
from pt_ray.runtime.checkpoint import load_layers, read_meta, read_rollback, write_shard
from pt_ray.runtime.layerstate import capture_layers, load_layers_into
from pt_ray.runtime.layout import Layout
from pt_ray.runtime.migrate import LayerStates
from pt_ray.runtime.norms import GradNormMeter
from pt_ray.runtime.precision import LossScaler
from pt_ray.runtime.rollback import Rollback
from pt_ray.runtime.settings import RankSettings
from pt_ray.runtime.step import Stepper

__all__ = ["RankState"]

logger = logging.getLogger(__name__)


class RankState:
    """One rank's saved and restorable state.

    Args:
        settings: what the saved state is told about the run.
        layout: the rank's layout (what it holds).
        stepper: the rank's steps (their counters).
        norms: the rank's gradient-norm meter.
        scaler: the fp16 loss scaler, or None.
        on_shard: called as ``on_shard(path, epoch)`` once this rank's checkpoint shard after
            ``epoch`` is written (:class:`pt_ray.runtime.engine.EngineHooks`).
    """

    def __init__(self, settings: RankSettings, layout: Layout, stepper: Stepper,
                 norms: GradNormMeter, scaler: LossScaler | None,
                 on_shard: Callable[[Path, int], None] | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.stepper = stepper
        self.norms = norms
        self.scaler = scaler
        self.on_shard = on_shard
        self.rank, self.world = layout.rank, layout.world
        self.rollback = Rollback(layout.device)
        self.rolled_back = False

    # -- rollback ------------------------------------------------------------------------------

    def may_freeze(self, num_frozen: int | None = None) -> bool:
        """Whether a later decision could still grow the frozen prefix, ``num_frozen`` blocks
        (default: the plan in force's): no rollback has stopped freezing, and the prefix is
        below its cap."""
        if self.rolled_back:  # a rollback stops freezing for good
            return False
        if num_frozen is None and self.layout.plan is None:
            return True
        cap = self.settings.max_frozen
        num_frozen = self.layout.plan.num_frozen if num_frozen is None else num_frozen
        return num_frozen < (self.layout.adapter.num_layers - 1 if cap is None else cap)

    def keep_snapshot(self, epoch: int) -> None:
        """Keep, as host copies, what this rank holds under the plan in force, and the
        counters and random state that decide the rest of the run (epoch ``epoch`` starts)."""
        layout = self.layout
        names = layout.plan.stage_layers(layout.topo.stage)
        self.rollback.keep(
            epoch,
            capture_layers(layout.modules, names, layout.trained(names), layout.optimizer,
                           copy=True),
            self._counters(), self.norms.state_dict(),
            self.scaler.state_dict() if self.scaler is not None else None)

    def roll_back(self, plan: Plan) -> LayerStates:
        """Put back the snapshot of epoch ``plan.rollback_to``: the layers ``plan`` gives this
        rank's stage (given storage again where they were given away; a snapshot taken from a
        checkpoint holds every layer), the counters, norms and loss scale. Returns the
        optimizer state the plan's optimizer takes."""
        snap = self.rollback.undo(plan.rollback_to)
        self.rolled_back = True
        self.layout.forget()
        frozen = set(frozen_layer_names(plan.num_frozen))
        for name, module in self.layout.modules.items():
            if name not in frozen:
                for p in module.parameters():
                    p.requires_grad_(True)
        stage = plan.coords(self.rank)[1]
        names = plan.stage_layers(stage)
        states = load_layers_into(self.layout.modules, {n: snap.layers[n] for n in names},
                                  set(names) - frozen, self.layout.device)
        self._set_counters(snap.counters, snap.scaler)
        self.norms.load_state_dict(snap.norms, set(plan.stage_blocks(stage)))
        return states

    def _counters(self) -> dict[str, int]:
        return {"global_step": self.stepper.global_step,
                "samples_seen": self.stepper.samples_seen}

    def _set_counters(self, counters: dict, scaler: dict | None) -> None:
        self.stepper.global_step = counters["global_step"]
        self.stepper.samples_seen = counters["samples_seen"]
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_shard(self, directory: Path, epoch: int) -> None:
        """Write this rank's part of the checkpoint after ``epoch``: its primary layers'
        parameters and optimizer state, the gradient norms gathered since the last decision,
        and the rollback snapshots still waiting for the guard's verdict."""
        layout = self.layout
        mine = layout.primary_layers()
        layers = capture_layers(layout.modules, mine, layout.trained(mine), layout.optimizer,
                                copy=False)
        if mine:
            layers["__norms__"] = self.norms.state_dict()
        if self.rollback.snapshots:
            layers["__rollback__"] = self.rollback.state_dict()
        path = write_shard(Path(directory), self.rank, layers)
        if self.on_shard is not None:
            self.on_shard(path, epoch)

    def meta(self, epoch: int) -> dict:
        """Run-level state after ``epoch`` (rank 0 writes it beside the shards)."""
        return {
            "epoch": epoch,
            **self._counters(),
            "rolled_back": self.rolled_back,
            "num_frozen": self.layout.plan.num_frozen,  # the prefix the next epoch starts from
            "num_workers": self.world,
            "num_shards": self.world,  # every rank writes one, with its manifest
            "precision": self.layout.precision.name,
            **({"loss_scale": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load(self, directory: Path, plan: Plan) -> tuple[dict, LayerStates]:
        """Load a checkpoint's layers of this rank's stage under ``plan``, its counters, norms
        and (with ``freeze.rollback``) snapshots. Returns its metadata and the optimizer state
        the plan's optimizer takes."""
        meta = read_meta(directory)
        self.rolled_back = bool(meta["rolled_back"])
        self._set_counters(meta, meta.get("loss_scale"))
        stage = plan.coords(self.rank)[1]
        names = plan.stage_layers(stage)
        loaded, norms = load_layers(directory, names)
        states = load_layers_into(self.layout.modules, loaded, self.layout.trained(names, plan),
                                  self.layout.device)
        self.norms.load_state_dict(norms, set(plan.stage_blocks(stage)))
        if self.settings.rollback:
            self._load_snapshots(Path(directory), meta)
        return meta, states

    def _load_snapshots(self, directory: Path, meta: dict) -> None:
        """The rollback snapshots of a resumed run: those this rank's shard kept (freezes that
        still wait for the guard's verdict), when the run resumes on as many workers as wrote
        them (the same rank then held the same stage when they were taken); and, while blocks
        may still freeze, the checkpoint itself as the snapshot of the epoch it resumes at,
        every layer of it (the plan a rollback would enter is not known yet)."""
        if meta["num_workers"] == self.world:
            self.rollback.load_state_dict(read_rollback(directory, self.rank))
        elif self.rank == 0:
            logger.warning("resumed on %d workers, not %d: freezes made before this checkpoint "
                           "can no longer be rolled back", self.world, meta["num_workers"])
        if self.rolled_back or not self.may_freeze(meta["num_frozen"]):
            return
        layers, norms = load_layers(directory, list(self.layout.modules))
        self.rollback.keep(meta["epoch"] + 1, layers,
                           {"global_step": meta["global_step"],
                            "samples_seen": meta["samples_seen"]},
                           norms, meta.get("loss_scale"))
