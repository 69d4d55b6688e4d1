"""What each part of the engine is told about the run: small frozen settings, built once from
the config (as the planners take :class:`pt_ray.core.plan.PlanSettings`).

The engine's parts (:class:`pt_ray.runtime.step.Stepper`, :class:`pt_ray.runtime.layout.Layout`,
:class:`pt_ray.runtime.rankstate.RankState`) each keep their own settings, never the whole
:class:`pt_ray.core.config.RunConfig`: a part's settings name every field of the run it reads.
:func:`engine_settings` is the one place that reads the config for them (the reference trainer's
:class:`pt_ray.runtime.reference.ReferenceSettings` come from
:func:`pt_ray.runtime.reference.build_reference` alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pt_ray.control.state import decision_interval
from pt_ray.core.config import OptimizerConfig, RunConfig
from pt_ray.core.freeze import policy_traits

__all__ = [
    "EngineSettings",
    "LayoutSettings",
    "RankSettings",
    "StepSettings",
    "engine_settings",
]

BatchPolicy = Literal["fixed_global", "per_replica"]


@dataclass(frozen=True)
class StepSettings:
    """What a rank's steps need (:class:`pt_ray.runtime.step.Stepper`).

    Attributes:
        optimizer: the optimizer's section (learning rate and its schedule, clipping,
            accumulation passes A).
        batch_policy: ``fixed_global`` (B over the R replicas) or ``per_replica`` (B each).
        loader_workers: background processes that read the training samples
            (``data.num_workers``; 0: read in the training process).
        total_samples: the run's training samples (the learning-rate schedule's length).
    """

    optimizer: OptimizerConfig
    batch_policy: BatchPolicy
    loader_workers: int
    total_samples: int


@dataclass(frozen=True)
class LayoutSettings:
    """What a rank's layout needs (:class:`pt_ray.runtime.layout.Layout`).

    Attributes:
        optimizer: the optimizer's section (what each plan's optimizer is built with).
        batch_size: B, ``data.batch_size``.
        batch_policy: ``fixed_global`` or ``per_replica`` (a pass's micro-batch size).
        compile: ``pipeline.compile`` (``auto``: on CUDA).
        collective_timeout_s: every subgroup's bound on a collective or point-to-point wait.
        block_norms: whether steps record per-block gradient norms (they feed freeze decisions
            only: off when ``freeze.policy=none``).
    """

    optimizer: OptimizerConfig
    batch_size: int
    batch_policy: BatchPolicy
    compile: Literal["auto", "on", "off"]
    collective_timeout_s: float
    block_norms: bool


@dataclass(frozen=True)
class RankSettings:
    """What a rank's saved state needs (:class:`pt_ray.runtime.rankstate.RankState`).

    Attributes:
        max_frozen: ``freeze.max_frozen`` (None: all blocks but the last may freeze).
        rollback: ``freeze.rollback``: checkpoints carry the snapshots still waiting for the
            accuracy guard's verdict.
    """

    max_frozen: int | None
    rollback: bool


@dataclass(frozen=True)
class EngineSettings:
    """What one rank's engine needs (:class:`pt_ray.runtime.engine.ElasticWorker`), its parts'
    settings among them.

    Attributes:
        step: the steps' settings.
        layout: the layout's settings.
        rank: the saved state's settings.
        epochs: epochs of the run.
        batch_size: B, ``data.batch_size``.
        eval_batch_size: samples per evaluation forward.
        eval_epochs: the epochs (from 0) that end with an evaluation.
        every_steps: ``logging.every_steps`` (0: no step reports).
        interval: steps between the decisions inside an epoch (None: one per epoch;
            :func:`pt_ray.control.state.decision_interval`).
    """

    step: StepSettings
    layout: LayoutSettings
    rank: RankSettings
    epochs: int
    batch_size: int
    eval_batch_size: int
    eval_epochs: frozenset[int]
    every_steps: int
    interval: int | None

    @property
    def batch_policy(self) -> BatchPolicy:
        return self.step.batch_policy

    @property
    def rollback(self) -> bool:
        return self.rank.rollback

    def replicas_batch(self, num_replicas: int) -> int:
        """Samples per step over ``num_replicas`` replicas (the global batch)."""
        b = self.batch_size
        return b if self.batch_policy == "fixed_global" else b * num_replicas


def engine_settings(cfg: RunConfig, steps_per_epoch: int) -> EngineSettings:
    """The engine's settings for ``cfg``, whose sampler takes ``steps_per_epoch`` steps an
    epoch."""
    f, p, o = cfg.freeze, cfg.pipeline, cfg.optimizer
    return EngineSettings(
        step=StepSettings(optimizer=o, batch_policy=cfg.batch_policy,
                          loader_workers=cfg.data.num_workers,
                          total_samples=cfg.epochs * steps_per_epoch * cfg.data.batch_size),
        layout=LayoutSettings(optimizer=o, batch_size=cfg.data.batch_size,
                              batch_policy=cfg.batch_policy, compile=p.compile,
                              collective_timeout_s=p.collective_timeout_s,
                              block_norms=policy_traits(f.policy).freezes),
        rank=RankSettings(max_frozen=f.max_frozen, rollback=f.rollback),
        epochs=cfg.epochs, batch_size=cfg.data.batch_size,
        eval_batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
        eval_epochs=frozenset(e for e in range(cfg.epochs) if cfg.evaluates_after(e)),
        every_steps=cfg.logging.every_steps,
        interval=decision_interval(cfg, steps_per_epoch))
