"""When the activation cache turns on: the one place that decides it.

Pure module (the config in, a frozen decision out; no torch, no Ray). Every consumer asks the
:class:`CachePolicy` built here rather than testing the config itself:

* the cost planner weighs the choices :meth:`CachePolicy.choices` leaves it, plan by plan
  (:class:`pt_ray.costs.costplan.CostModelPlanner`);
* the rule planners (:class:`pt_ray.core.plan.PaperPlanner`, the simulator's paper and 2021
  planners in :mod:`pt_ray.costs.simulate`) turn it on where :meth:`CachePolicy.serves` says,
  from the depth :meth:`CachePolicy.for_rules` fixes once from the profiled costs;
* stage 0 builds its cached prefix only where :func:`cache_policy` leaves the cache a chance
  (:func:`pt_ray.cache.prefix.cached_prefix_for`);
* the driver, before any dataset is loaded, sizes the cache and starts its owners where
  :func:`may_turn_on` says the config alone does not rule the cache out.

The decision is a function of the config, the dataset's transform and the profiled costs
alone, so the reference trainer, every rank and a resumed run agree on it. Which plans really
read the cache is each plan's ``cache`` flag (:class:`pt_ray.core.plan.Plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from pt_ray.core.config import CacheConfig, FreezeConfig
from pt_ray.core.freeze import policy_traits

__all__ = ["AUTO", "CachePolicy", "cache_policy", "may_turn_on"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePolicy:
    """What the activation cache may do in a run.

    Attributes:
        mode: ``off`` (never), ``on`` (whenever a block is frozen) or ``auto`` (where the
            planner predicts a gain, or from a depth fixed once: see ``predicted``).
        reason: why, in words, for the run log.
        min_frozen: with ``auto``, the fewest frozen blocks the cache may serve
            (``cache.min_frozen``; None: any depth for a predicting planner, never for a
            rule planner).
        predicted: with ``auto``, whether a planner weighs the cache on against off by
            predicted throughput from ``min_frozen`` on (the cost planner); False: the cache
            is on from ``min_frozen`` on (the rule planners, :meth:`for_rules`).
    """

    mode: Literal["auto", "on", "off"]
    reason: str = ""
    min_frozen: int | None = None
    predicted: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"cache mode {self.mode!r} is not one of 'auto', 'on', 'off'")
        if self.min_frozen is not None and self.min_frozen < 1:
            raise ValueError(f"min_frozen={self.min_frozen} must be at least 1 (a frozen "
                             f"block) or None")

    def describe(self) -> str:
        """The decision as one log line (``activation cache off: cache.mode=off``)."""
        return f"activation cache {self.mode}: {self.reason}"

    @property
    def first(self) -> int | None:
        """The fewest frozen blocks at which the cache may serve; None: at none."""
        if self.mode == "off":
            return None
        if self.mode == "on":
            return 1
        return (self.min_frozen or 1) if self.predicted else self.min_frozen

    def choices(self, num_frozen: int) -> tuple[bool, ...]:
        """The cache choices a planner has for plans with ``num_frozen`` frozen blocks:
        ``(False,)`` off, ``(True,)`` on, ``(False, True)`` its prediction decides."""
        first = self.first
        if num_frozen == 0 or first is None or num_frozen < first:
            return (False,)
        return (False, True) if self.mode == "auto" and self.predicted else (True,)

    def serves(self, num_frozen: int) -> bool:
        """Whether a rule planner's plans with ``num_frozen`` frozen blocks read the cache."""
        return self.choices(num_frozen) == (True,)

    def why(self, num_frozen: int) -> str | None:
        """Why plans with ``num_frozen`` frozen blocks read the cache or not, when the policy
        alone decides; None when a planner's prediction does."""
        if num_frozen == 0:
            return "nothing is frozen"
        if self.mode != "auto":
            return f"cache.mode={self.mode}"
        if self.first is None:
            return "no cache read beats the prefix's forward"
        if num_frozen < self.first:
            return f"fewer frozen blocks than cache.min_frozen={self.first}"
        return None if self.predicted else f"on from {self.first} frozen blocks"

    def for_rules(self, break_even: Callable[[], int | None]) -> CachePolicy:
        """This policy for a planner that predicts nothing per plan (``pipeline.policy=paper``):
        ``auto`` turns the cache on from ``cache.min_frozen``, else from ``break_even()``, the
        fewest frozen blocks where a cache read beats recomputing the prefix
        (:func:`pt_ray.costs.costplan.cache_break_even`; None: never).

        The 2021 code hard-coded 3 frozen blocks for every model; the break-even is the
        comparison such a threshold stands for."""
        if self.mode != "auto" or not self.predicted:
            return replace(self, predicted=False)
        depth = self.min_frozen
        if depth is None:
            depth = break_even()
            if depth is not None:
                logger.info("cache.mode=auto: the cache turns on from %d frozen blocks, where a "
                            "read beats the prefix's forward", depth)
            else:
                logger.info("cache.mode=auto: the cache stays off: no cache read beats the "
                            "prefix's forward")
        return replace(self, min_frozen=depth, predicted=False)


AUTO = CachePolicy("auto", "cache.mode=auto: on in the plans where the planner predicts a gain")
"""The default: ``cache.mode=auto`` under a planner that predicts, from any frozen depth."""


def cache_policy(cache: CacheConfig, freeze: FreezeConfig,
                 deterministic_transform: bool) -> CachePolicy:
    """Whether the cache may turn on in this run.

    The cache is only valid when the frozen prefix sees the same input every epoch: with a random
    training transform it would freeze one augmented view, so it stays off unless the user opts
    in. It never changes the sample order (:func:`pt_ray.data.sampler.training_sampler`), so
    ``cache.mode=auto`` leaves the choice to the planner, plan by plan, from the profiled costs.

    Args:
        cache: the run's ``cache`` section.
        freeze: the run's ``freeze`` section (whether anything ever freezes).
        deterministic_transform: the training split's ``deterministic_transform``.
    """
    c, f = cache, freeze
    if c.mode == "off":
        return CachePolicy("off", "cache.mode=off")
    if not policy_traits(f.policy).freezes or f.max_frozen == 0:
        return CachePolicy("off", f"nothing ever freezes (freeze.policy={f.policy}, "
                                  f"max_frozen={f.max_frozen})")
    if not deterministic_transform and not c.allow_random_transform:
        return CachePolicy("off", (
            "the training transform is random (data.augment=true), so cached activations "
            "would keep one augmented view per sample; set cache.allow_random_transform=true "
            "to cache anyway"))
    reason = "cache.mode=on: on whenever a block is frozen" if c.mode == "on" else AUTO.reason
    if not deterministic_transform:
        reason += " (random transform allowed by cache.allow_random_transform)"
    return CachePolicy(c.mode, reason, min_frozen=c.min_frozen)


def may_turn_on(cache: CacheConfig, freeze: FreezeConfig) -> bool:
    """The config-only answer, for the driver before any dataset is loaded: False when the
    config alone rules the cache out (``cache.mode=off``, nothing ever freezes); True when
    some dataset could turn it on (:func:`cache_policy` with a deterministic transform). The
    driver sizes the cache and starts its owners only then; the dataset's transform and the
    planner's predictions may still keep it off."""
    return cache_policy(cache, freeze, deterministic_transform=True).mode != "off"
