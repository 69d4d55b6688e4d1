"""What the accuracy guard's verdict does to a run's decisions: a rollback, or, after a restart
on another number of workers, a kept freeze.

:class:`VerdictActions` holds what the verdicts did (the rollbacks ordered, the epochs they
discarded, a freeze kept across a resize) and builds the plan a rollback enters; the
controller's :class:`pt_ray.control.state.ControlState` asks it once per decision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pt_ray.core.freeze import GuardVerdict
from pt_ray.core.plan import Plan
from pt_ray.reporting.summary import EpochRecord

__all__ = ["VerdictActions"]

logger = logging.getLogger(__name__)


@dataclass
class VerdictActions:
    """The guard's verdicts carried out (one at most: a verdict stops freezing for good).

    Attributes:
        rollbacks: the rollbacks ordered, each the decision, the evaluated epoch, the epoch
            returned to, the blocks frozen after and undone, and the metric before and after.
        discarded: the records of the epochs a rollback undid.
        resized_at: the first epoch trained after a restart on another number of workers
            (None: none). No rank holds a snapshot from before it.
        kept: the verdict kept because of that restart (no rollback crosses a resize).
    """

    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    discarded: list[EpochRecord] = field(default_factory=list)
    resized_at: int | None = None
    kept: dict[str, Any] | None = None

    def due(self, verdict: GuardVerdict | None) -> GuardVerdict | None:
        """``verdict`` when it asks for a rollback not yet carried out (nor kept), else None."""
        if verdict is None or not verdict.rollback or self.rollbacks or self.kept:
            return None
        return verdict

    def can_roll_back(self, v: GuardVerdict) -> bool:
        """Whether every rank still holds the snapshot of the harmful freeze's first epoch."""
        return self.resized_at is None or v.freeze_epoch >= self.resized_at

    def roll_back(self, decision: int, prev: Plan, v: GuardVerdict, plans: Mapping[int, Plan],
                  timeline: list[EpochRecord]) -> tuple[Plan, list[EpochRecord]]:
        """The plan that reopens the harmful freeze's first epoch at decision ``decision``, with
        the layout that trained the epoch before it (a new generation), and the timeline left
        after the epochs it undoes."""
        q = v.freeze_epoch
        # No rollback has happened yet, so the prefix only grew: the layout that trained the
        # start of epoch q is the last plan with the prefix the guard restores.
        base = plans[max(d for d, p in plans.items() if p.num_frozen == v.num_frozen)]
        plan = replace(base, generation=prev.generation + 1, rollback_to=q, probe_blocks=0)
        self.discarded += [r for r in timeline if r.epoch >= q]
        self.rollbacks.append({"decision": decision, "epoch": v.epoch, "rollback_to": q,
                               "num_frozen": plan.num_frozen, "undone": prev.num_frozen,
                               "before": v.before, "after": v.after})
        return plan, [r for r in timeline if r.epoch < q]

    def keep_freeze(self, decision: int, v: GuardVerdict, num_workers: int) -> str:
        """The guard asks to undo a freeze made before a restart on another number of workers:
        no rank holds that epoch's snapshot any more, so the freeze stays and freezing stops
        (the guard holds it). Returns the reason; logs a warning."""
        self.kept = {"decision": decision, "epoch": v.epoch, "freeze_epoch": v.freeze_epoch,
                     "resized_at": self.resized_at, "before": v.before, "after": v.after}
        reason = (f"guard: eval metric fell from {v.before:.4f} to {v.after:.4f} after the "
                  f"freeze of epoch {v.freeze_epoch}, but the run resumed on {num_workers} "
                  f"workers at epoch {self.resized_at} and no snapshot crosses a resize: the "
                  "freeze is kept, freezing stops")
        logger.warning("decision %d: %s", decision, reason)
        return reason

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {"rollbacks": list(self.rollbacks),
                "discarded": [asdict(r) for r in self.discarded],
                "resized_at": self.resized_at, "kept": self.kept}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> VerdictActions:
        """Restore :meth:`state_dict`'s output (keys a checkpoint lacks read as none)."""
        return cls(list(state.get("rollbacks", [])),
                   [EpochRecord.from_dict(r) for r in state.get("discarded", [])],
                   state.get("resized_at"), state.get("kept"))
