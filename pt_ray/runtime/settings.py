"""What each part of the engine is told about the run: small frozen settings, built once from
the config (as the planners take :class:`pt_ray.core.plan.PlanSettings`).

The engine's parts (:class:`pt_ray.runtime.step.Stepper`, :class:`pt_ray.runtime.layout.Layout`,
:class:`pt_ray.runtime.rankstate.RankState`) each keep their own settings, never the whole
:class:`pt_ray.core.config.RunConfig`: a part's settings name every field of the run it reads.
:func:`pt_ray.service.settings.run_settings`, on the service's floor, is the one place that
reads the config for them and for the reference trainer's :class:`ReferenceSettings` (here, beside
the engine's, so that the service reads them without loading torch); the steps' settings wait
for the sampler (:meth:`EngineSettings.step_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pt_ray.control.state import DecisionSettings
from pt_ray.core.config import CacheConfig, DataConfig, ModelConfig, OptimizerConfig

__all__ = [
    "EngineSettings",
    "LayoutSettings",
    "RankSettings",
    "ReferenceSettings",
    "StepSettings",
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
        layout: the layout's settings.
        rank: the saved state's settings.
        seed: the run's ``seed`` (the sample order, the cache's blocks).
        decisions: when freeze decisions come (:func:`pt_ray.control.state.decision_interval`),
            and the ``freeze`` section (the probe split, whether the cache may turn on).
        cache: the ``cache`` section (stage 0's cached prefix and its tiers).
        precision: ``precision`` (``auto``: bf16 on GPUs that support it, fp32 elsewhere).
        epochs: epochs of the run.
        batch_size: B, ``data.batch_size``.
        eval_batch_size: samples per evaluation forward.
        eval_epochs: the epochs (from 0) that end with an evaluation.
        every_steps: ``logging.every_steps`` (0: no step reports).
        loader_workers: background processes that read the training samples
            (``data.num_workers``; 0: read in the training process).
    """

    layout: LayoutSettings
    rank: RankSettings
    seed: int
    decisions: DecisionSettings
    cache: CacheConfig
    precision: Literal["auto", "fp32", "bf16", "fp16"]
    epochs: int
    batch_size: int
    eval_batch_size: int
    eval_epochs: frozenset[int]
    every_steps: int
    loader_workers: int

    @property
    def batch_policy(self) -> BatchPolicy:
        return self.layout.batch_policy

    @property
    def rollback(self) -> bool:
        return self.rank.rollback

    def replicas_batch(self, num_replicas: int) -> int:
        """Samples per step over ``num_replicas`` replicas (the global batch)."""
        b = self.batch_size
        return b if self.batch_policy == "fixed_global" else b * num_replicas

    def step_settings(self, steps_per_epoch: int) -> StepSettings:
        """The steps' settings, once the sampler says how many steps an epoch takes."""
        return StepSettings(optimizer=self.layout.optimizer, batch_policy=self.batch_policy,
                            loader_workers=self.loader_workers,
                            total_samples=self.epochs * steps_per_epoch * self.batch_size)


@dataclass(frozen=True)
class ReferenceSettings:
    """What the reference trainer is told about the run (:class:`ReferenceTrainer`).

    Attributes:
        data: the ``data`` section (the datasets :func:`build_reference` builds by default).
        model: the ``model`` section (the model it builds by default).
        seed: the run's ``seed`` (the model's initialisation, the sample order).
        decisions: when freeze decisions come, and the freeze policy's settings.
        pinned_length: ``pipeline.pipeline_length`` when ``pipeline.elastic=false`` pins it (the
            Ray run then freezes at most L - K0 blocks); None when the pipeline is elastic.
        num_workers: N, ``pipeline.num_workers`` (what a pinned ``auto`` length resolves
            against).
        optimizer: the optimizer's section.
        epochs: epochs of the run.
        batch_size: B, the global batch.
        eval_batch_size: samples per evaluation forward.
        loader_workers: background processes that read the samples (``data.num_workers``).
        activation_checkpointing: recompute the trainable blocks in the backward, as the
            engine's stages do.
        precision: ``precision`` (``auto``: fp32 in one CPU process).
        guard_points: the accuracy guard's tolerance (None: no guard).
        rollback: ``freeze.rollback``: the guard returns to the start of a harmful freeze's
            epoch.
        eval_epochs: the epochs (from 0) that end with an evaluation.
        every_steps: ``logging.every_steps`` (0: no step reports).
    """

    data: DataConfig
    model: ModelConfig
    seed: int
    decisions: DecisionSettings
    pinned_length: int | Literal["auto"] | None
    num_workers: int
    optimizer: OptimizerConfig
    epochs: int
    batch_size: int
    eval_batch_size: int
    loader_workers: int
    activation_checkpointing: bool
    precision: Literal["auto", "fp32", "bf16", "fp16"]
    guard_points: float | None
    rollback: bool
    eval_epochs: frozenset[int]
    every_steps: int
