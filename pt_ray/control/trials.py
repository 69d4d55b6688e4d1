"""The first layouts the workers time when the cost model cannot tell them apart.

Pure module. The cost planner lists the first layouts (one per pipeline length) predicted
within ``pipeline.start_trial_margin`` of the fastest (:meth:`pt_ray.core.plan.Planner
.trial_plans`); every rank enters each in turn, rehearses a few steps of it without updating
anything (:meth:`pt_ray.runtime.step.Stepper.rehearse`), and the slowest rank's seconds per step
come back here. The first plan is the layout that then gives the most samples per second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pt_ray.core.plan import Plan, TrialLayout

__all__ = ["FirstLayoutTrials", "layout_line"]

logger = logging.getLogger(__name__)


def layout_line(plan: Plan) -> str:
    """``K 2 R 1 M 4``: a layout in log lines."""
    return f"K {plan.pipeline_length} R {plan.num_replicas} M {plan.num_microbatches}"


class FirstLayoutTrials:
    """Close first layouts, timed by the workers before the first plan is chosen.

    Args:
        layouts: what the planner predicts of each (numbered as generations from 0).
        replica_batch: samples one replica processes per pass, given R.
        margin: how close their predictions are (for the log line).
    """

    def __init__(self, layouts: Sequence[TrialLayout], replica_batch: Callable[[int], int],
                 margin: float) -> None:
        self.layouts = tuple(layouts)
        self.replica_batch = replica_batch
        self.measured: list[dict[str, Any]] = []
        logger.info("start: %d first layouts predicted within %.0f%% of the fastest (%s); "
                    "timing a few steps of each", len(self.layouts), 100 * margin,
                    ", ".join(f"{layout_line(t.plan)} {t.predicted_rate:.1f} samples/s"
                              for t in self.layouts))

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(t.plan for t in self.layouts)

    def choose(self, seconds: Sequence[float]) -> Plan:
        """The first plan, from each layout's seconds per step (passes and reduce, the slowest
        rank's): the most samples per second once the predicted optimizer step, which a trial
        does not run, is added. It takes the generation after the trials', so every rank
        migrates to it from the last layout timed; :attr:`measured` keeps the figures."""
        if len(seconds) != len(self.layouts):
            raise ValueError(f"{len(seconds)} timings for {len(self.layouts)} trial layouts")
        rates = [t.rate(s, t.plan.num_replicas * self.replica_batch(t.plan.num_replicas))
                 for t, s in zip(self.layouts, seconds)]
        best = max(range(len(rates)), key=rates.__getitem__)
        self.measured = [
            {"layout": layout_line(t.plan), "pipeline_length": t.plan.pipeline_length,
             "predicted_rate": t.predicted_rate, "measured_rate": r, "pass_s": s}
            for t, s, r in zip(self.layouts, seconds, rates)]
        logger.info("start: measured %s; K %d is fastest", ", ".join(
            f"{m['layout']} {m['measured_rate']:.1f} samples/s" for m in self.measured),
            self.layouts[best].plan.pipeline_length)
        return replace(self.layouts[best].plan, generation=len(self.layouts))
