"""AutoFreeze: policies that decide how many leading blocks are frozen.

Pure module. A policy is asked at each decision point (an epoch boundary, or every k steps) and
returns the new length of the frozen prefix; it never acts. The frozen prefix is the embedding
plus blocks ``0..n-1``; ``n`` never decreases.

Policies (He et al., "PipeTransformer", ICML 2021, Sec. 3.1):

* ``paper``: the paper's rule. With ``n' = n(T-1)``:
    1. bound ``b = n' + ceil(alpha * (L - n'))`` (the tunable geometric upper bound);
    2. for every active block ``l in [n', L)`` take its gradient norm at T relative to its own
       first recorded norm; the block with the smallest ratio is taken as converged;
    3. ``n(T) = min(b, l* + 1)`` (freeze up to the converged block, never past the bound).
* ``schedule``: what the 2021 code actually ran, ``n(e) = ceil(L (1 - (1 - alpha)^e))``.
* ``none``: never freeze (the baseline).

All honour ``max_frozen`` (default ``L - 1``) and a warm-up during which nothing freezes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "FreezeDecision",
    "FreezePolicy",
    "NoFreeze",
    "PaperFreeze",
    "ScheduleFreeze",
    "build_freeze_policy",
    "frozen_timeline",
    "schedule_frozen",
]

# Rounding guard: alpha * L in floating point (e.g. (1 - 1/3) ** 3) must not round 4.0000001 up.
_EPS = 1e-9


@dataclass(frozen=True)
class FreezeDecision:
    """What a policy decided at one decision point.

    Attributes:
        num_frozen: the new frozen-prefix length (never smaller than before).
        bound: the most the policy would have allowed at this point.
        reason: one human-readable line with the numbers behind the decision.
    """

    num_frozen: int
    bound: int
    reason: str


class FreezePolicy(Protocol):
    """Decides the frozen-prefix length at each decision point."""

    name: str
    num_layers: int
    max_frozen: int

    def decide(
        self,
        decision: int,
        num_frozen: int,
        grad_norms: Mapping[int, float] | None = None,
    ) -> FreezeDecision:
        """Return the new ``num_frozen``.

        Args:
            decision: index of this decision point (the epoch, or the k-step interval count);
                decision 0 is the start of training.
            num_frozen: the current frozen-prefix length.
            grad_norms: per active block index, the gradient norm accumulated since the last
                decision (after the data-parallel reduction). Only ``paper`` uses it.
        """
        ...


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def schedule_frozen(decision: int, num_layers: int, alpha: float) -> int:
    """The 2021 code's schedule ``n(e) = ceil(L (1 - (1 - alpha)^e))`` (uncapped)."""
    if decision <= 0:
        return 0
    return min(num_layers, _ceil(num_layers * (1.0 - (1.0 - alpha) ** decision)))


@dataclass
class _Base:
    num_layers: int
    alpha: float
    max_frozen: int
    warmup: int

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers={self.num_layers} must be positive")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"freeze.alpha={self.alpha} must lie in (0, 1]")
        if not 0 <= self.max_frozen <= self.num_layers:
            raise ValueError(
                f"freeze.max_frozen={self.max_frozen} must lie in [0, L={self.num_layers}]"
            )

    def _clamp(self, decision: int, current: int, wanted: int) -> int:
        if decision < self.warmup:
            return current
        return max(current, min(wanted, self.max_frozen))


@dataclass
class NoFreeze(_Base):
    """Never freezes: the no-freeze baseline."""

    name: Literal["none"] = "none"

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        return FreezeDecision(num_frozen, num_frozen, "policy none: never freezes")


@dataclass
class ScheduleFreeze(_Base):
    """The 2021 code's geometric schedule (no gradient signal)."""

    name: Literal["schedule"] = "schedule"

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        target = schedule_frozen(decision, self.num_layers, self.alpha)
        new = self._clamp(decision, num_frozen, target)
        return FreezeDecision(
            new, target, f"schedule n({decision}) = {target}, cap {self.max_frozen}"
        )


@dataclass
class PaperFreeze(_Base):
    """The paper's rule: gradient-norm convergence under the alpha bound.

    Keeps, per block, the first gradient norm it saw; a block's convergence score is its latest
    norm divided by that first norm. A block is judged only from its second observation on, so
    the first decision that sees norms only records them.
    """

    name: Literal["paper"] = "paper"
    first_norms: dict[int, float] = field(default_factory=dict)

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        bound = min(
            self.num_layers, num_frozen + _ceil(self.alpha * (self.num_layers - num_frozen))
        )
        ratios: dict[int, float] = {}
        for layer, norm in sorted((grad_norms or {}).items()):
            if layer < num_frozen or not math.isfinite(norm):
                continue
            if layer not in self.first_norms:
                self.first_norms[layer] = norm
            elif self.first_norms[layer] > 0:
                ratios[layer] = norm / self.first_norms[layer]
        if decision < self.warmup:
            return FreezeDecision(num_frozen, bound, f"warm-up (decision {decision})")
        if not ratios:
            return FreezeDecision(
                num_frozen, bound, "no block has two gradient-norm observations yet"
            )
        converged = min(ratios, key=lambda layer: (ratios[layer], layer))
        new = self._clamp(decision, num_frozen, min(bound, converged + 1))
        return FreezeDecision(
            new,
            bound,
            f"block {converged} converged most (norm ratio {ratios[converged]:.3f} of its "
            f"first); bound {bound}, cap {self.max_frozen}",
        )

    def state_dict(self) -> dict[str, dict[int, float]]:
        """The policy's memory (each block's first gradient norm), for checkpoints."""
        return {"first_norms": dict(self.first_norms)}

    def load_state_dict(self, state: Mapping[str, Mapping[int, float]]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.first_norms = {int(k): float(v) for k, v in state["first_norms"].items()}


def build_freeze_policy(
    policy: Literal["paper", "schedule", "none"],
    *,
    num_layers: int,
    alpha: float,
    max_frozen: int | None = None,
    warmup: int = 1,
) -> PaperFreeze | ScheduleFreeze | NoFreeze:
    """Build a policy from plain arguments (``num_layers`` comes from the model).

    Args:
        policy: ``paper``, ``schedule`` or ``none``.
        num_layers: L, the model's block count.
        alpha: the freeze threshold in (0, 1].
        max_frozen: most blocks ever frozen; None means ``L - 1``.
        warmup: decision points at the start during which nothing freezes.
    """
    cap = num_layers - 1 if max_frozen is None else max_frozen
    if cap > num_layers:
        raise ValueError(
            f"freeze.max_frozen={max_frozen} exceeds the model's {num_layers} blocks; "
            f"choose at most {num_layers}"
        )
    classes = {"paper": PaperFreeze, "schedule": ScheduleFreeze, "none": NoFreeze}
    if policy not in classes:
        raise ValueError(f"freeze.policy={policy!r} is not one of {sorted(classes)}")
    return classes[policy](num_layers=num_layers, alpha=alpha, max_frozen=cap, warmup=warmup)


def frozen_timeline(
    policy: FreezePolicy, decisions: int, norms: Sequence[Mapping[int, float]] = ()
) -> list[int]:
    """``n`` at each of ``decisions`` decision points, starting from 0.

    ``norms[i]`` holds the gradient norms gathered between decision ``i`` and ``i + 1``; it feeds
    decision ``i + 1``. Used by tests and by the simulator.
    """
    n = 0
    out = []
    for d in range(decisions):
        g = norms[d - 1] if 0 < d <= len(norms) else None
        n = policy.decide(d, n, g).num_frozen
        out.append(n)
    return out
