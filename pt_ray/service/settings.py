"""The one translation from a run's config to what the floors below the service are told.

:func:`run_settings` reads a :class:`pt_ray.core.config.RunConfig` once and returns each
floor's own settings: the controller's (:class:`pt_ray.control.state.ControlSettings`), a
rank's engine's (:class:`pt_ray.runtime.settings.EngineSettings`) and the reference trainer's
(:class:`pt_ray.runtime.settings.ReferenceSettings`). The entry (``pt_ray.api``), the
controller actor and the Ray workers call it; nothing below the service takes the whole
config. Settings carry whole config sections (``FreezeConfig``, ``CacheConfig``...) where a
part reads most of one. Torch-free, as the controller actor is.
"""

from __future__ import annotations

from dataclasses import dataclass

from pt_ray.control.state import ControlSettings, DecisionSettings
from pt_ray.core.config import RunConfig
from pt_ray.core.freeze import policy_traits
from pt_ray.runtime.settings import (EngineSettings, LayoutSettings, RankSettings,
                                     ReferenceSettings)

__all__ = ["RunSettings", "run_settings"]


@dataclass(frozen=True)
class RunSettings:
    """Each floor's settings for one run (:func:`run_settings`).

    Attributes:
        control: the controller's (:func:`pt_ray.control.state.build_control_state`).
        engine: a rank's (:class:`pt_ray.runtime.engine.ElasticWorker`).
        reference: the reference trainer's (:func:`pt_ray.runtime.reference.build_reference`).
    """

    control: ControlSettings
    engine: EngineSettings
    reference: ReferenceSettings


def run_settings(cfg: RunConfig) -> RunSettings:
    """Every floor's settings for the run ``cfg``, read from it once."""
    f, p, d, o = cfg.freeze, cfg.pipeline, cfg.data, cfg.optimizer
    decisions = DecisionSettings(freeze=f, epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs)
    eval_batch_size = d.eval_batch_size or d.batch_size
    eval_epochs = frozenset(e for e in range(cfg.epochs) if cfg.evaluates_after(e))
    freezes = policy_traits(f.policy).freezes
    control = ControlSettings(
        decisions=decisions, cache=cfg.cache, pipeline=p, batch_size=d.batch_size,
        batch_policy=cfg.batch_policy, accumulation_steps=o.accumulation_steps)
    engine = EngineSettings(
        layout=LayoutSettings(optimizer=o, batch_size=d.batch_size,
                              batch_policy=cfg.batch_policy, compile=p.compile,
                              collective_timeout_s=p.collective_timeout_s,
                              block_norms=freezes),
        rank=RankSettings(max_frozen=f.max_frozen, rollback=f.rollback),
        seed=cfg.seed, decisions=decisions, cache=cfg.cache, precision=cfg.precision,
        epochs=cfg.epochs, batch_size=d.batch_size, eval_batch_size=eval_batch_size,
        eval_epochs=eval_epochs, every_steps=cfg.logging.every_steps,
        loader_workers=d.num_workers)
    reference = ReferenceSettings(
        data=d, model=cfg.model, seed=cfg.seed, decisions=decisions,
        pinned_length=None if p.elastic else p.pipeline_length, num_workers=p.num_workers,
        optimizer=o, epochs=cfg.epochs, batch_size=d.batch_size,
        eval_batch_size=eval_batch_size, loader_workers=d.num_workers,
        activation_checkpointing=p.activation_checkpointing, precision=cfg.precision,
        guard_points=f.guard_points if freezes else None, rollback=f.rollback,
        eval_epochs=eval_epochs, every_steps=cfg.logging.every_steps)
    return RunSettings(control=control, engine=engine, reference=reference)
