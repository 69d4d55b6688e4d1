"""AutoFreeze: policies that decide how many leading blocks are frozen.

Pure module. A policy is asked at each decision point (an epoch boundary, or every k steps) and
returns the new length of the frozen prefix; it never acts. The frozen prefix is the embedding
plus blocks ``0..n-1``; ``n`` never decreases.

Policies:

* ``probe``: asks data the run never trains on. At each decision it names the leading active
  blocks to test over the next interval (``ceil(alpha * active)`` of them, halved after each
  test they fail); at the interval's end the workers measure the probe loss with those blocks'
  updates since the interval's start reverted, and the blocks freeze when what those updates
  were worth, projected over the decisions left, is at most ``threshold`` of the probe loss.
* ``settled`` (the default): ``converged``'s test, or, once the run's training loss has stopped
  falling (a plateau), a block whose gradient norm has stopped rising against its own level; the
  frozen prefix grows over the leading blocks that pass, by at most ``ceil(alpha * active)``
  blocks per decision. It freezes what a from-scratch run has converged and what a fine-tuned
  pretrained model has settled, and nothing while the run still learns.
* ``converged``: freeze only what has converged. A block passes its convergence
  test when its gradient norm has stayed at or below ``ratio`` of the largest norm it has had
  for ``window`` consecutive decisions; the frozen prefix grows over the leading blocks that
  pass (it stays contiguous), by at most ``ceil(alpha * active)`` blocks per decision.
* ``paper`` (He et al., "PipeTransformer", ICML 2021, Sec. 3.1): the paper's rule. With
  ``n' = n(T-1)``:
    1. bound ``b = n' + ceil(alpha * (L - n'))`` (the tunable geometric upper bound);
    2. for every active block ``l in [n', L)`` take its gradient norm at T relative to its own
       first recorded norm; the block with the smallest ratio is taken as converged;
    3. ``n(T) = min(b, l* + 1)`` (freeze up to the converged block, never past the bound).
* ``schedule``: what the 2021 code actually ran, ``n(e) = ceil(L (1 - (1 - alpha)^e))``.
* ``none``: never freeze (the baseline).

All honour ``max_frozen`` (default ``L - 1``) and a warm-up during which nothing freezes.

Each policy is one class that carries its ``name``, its :class:`PolicyTraits` (when it decides
under ``freeze.interval=auto``, whether it freezes at all, what it reads) and how it is built
from :class:`FreezeSettings`; :data:`FREEZE_POLICIES` lists them, and ``freeze.policy``'s
choices, the simulator's and the run's per-policy behaviour derive from it.

Where ``converged`` and ``paper`` differ: ``paper`` takes the block whose norm fell most
relative to its first one as converged and freezes everything up to it, bounded by alpha. When
the deepest block's norm falls fastest, which is common in Vision Transformers trained from
scratch, that is the alpha schedule whatever the gradients say. ``converged`` asks every block
to pass its own test, so it freezes later and never while the leading blocks still learn.

:class:`FreezeGuard` watches the eval metric: a drop after a freeze beyond ``guard_points``
stops all further freezing and (with ``rollback``) names the epoch to return to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from pt_ray.core.config import FreezeConfig

__all__ = [
    "FREEZE_POLICIES",
    "LOSS_KEY",
    "ConvergedFreeze",
    "SettledFreeze",
    "FreezeDecision",
    "FreezeGuard",
    "GuardVerdict",
    "FreezePolicy",
    "FreezeSettings",
    "NoFreeze",
    "POLICIES",
    "PROBE_NOW",
    "PROBE_REVERTED",
    "PaperFreeze",
    "PolicyTraits",
    "ProbeFreeze",
    "ScheduleFreeze",
    "build_freeze_policy",
    "frozen_timeline",
    "policy_class",
    "policy_traits",
    "schedule_frozen",
]

# Rounding guard: alpha * L in floating point (e.g. (1 - 1/3) ** 3) must not round 4.0000001 up.
_EPS = 1e-9

LOSS_KEY = -1
"""The key under which a decision's inputs carry the interval's mean training loss, beside the
per-block gradient norms (block indices are never negative)."""

PROBE_NOW = -2
"""Inputs key: the interval's probe loss with the parameters as they are at its end."""
PROBE_REVERTED = -3
"""Inputs key: the probe loss with the probed blocks as they were at the interval's start."""


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
    probe: int = 0
    """Leading active blocks the workers test over the next interval (``probe`` only)."""


class FreezePolicy(Protocol):
    """Decides the frozen-prefix length at each decision point."""

    name: ClassVar[str]
    traits: ClassVar[PolicyTraits]
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
            grad_norms: per active block index, the mean gradient norm since the last
                decision (after the data-parallel reduction), and under :data:`LOSS_KEY` the
                mean training loss over the same steps.
        """
        ...


@dataclass(frozen=True)
class PolicyTraits:
    """What the run around a policy needs to know of it, so that no caller branches on its name.

    Attributes:
        auto_interval: what ``freeze.interval=auto`` gives it: a decision per epoch
            (``epoch``: rules written per epoch, or no rule); decisions inside epochs in runs
            shorter than ``control.state.AUTO_MIN_EPOCHS`` and one per epoch in longer ones
            (``short_runs``: its windows count decisions, so deciding more often shortens
            them); decisions inside epochs in runs of any length (``always``).
        freezes: whether it ever freezes a block (the accuracy guard, the activation cache,
            per-block gradient norms and a pinned pipeline's cap apply only then).
        reads_norms: whether its decisions read per-block gradient norms (a prediction of its
            timeline needs a trace of them).
        probe_split: whether it holds training samples out as a probe split and has the
            workers measure the probe loss with the blocks under test reverted.
    """

    auto_interval: Literal["epoch", "short_runs", "always"]
    freezes: bool = True
    reads_norms: bool = False
    probe_split: bool = False

    @property
    def per_epoch(self) -> bool:
        """Whether ``freeze.interval=auto`` decides once per epoch in every run."""
        return self.auto_interval == "epoch"


@dataclass(frozen=True)
class FreezeSettings:
    """What a policy is built from: the model's block count, the run's decision points and the
    ``freeze`` section's figures (each policy takes the ones it uses).

    Attributes:
        num_layers: L, the model's block count.
        alpha: the freeze threshold in (0, 1].
        max_frozen: most blocks ever frozen; None means ``L - 1``.
        warmup: decision points at the start during which nothing freezes.
        ratio: ``freeze.converge_ratio``.
        window: ``freeze.converge_window``.
        plateau: ``freeze.plateau``.
        tolerance: ``freeze.settle_tolerance``.
        threshold: ``freeze.probe_threshold``.
        decisions: decision points in the whole run.
    """

    num_layers: int
    alpha: float
    max_frozen: int | None = None
    warmup: int = 1
    ratio: float = 0.3
    window: int = 2
    plateau: float = 0.01
    tolerance: float = 0.1
    threshold: float = 0.01
    decisions: int = 16

    @classmethod
    def from_config(cls, freeze: FreezeConfig, *, num_layers: int, warmup: int, decisions: int,
                    max_frozen: int | None) -> FreezeSettings:
        """The settings of a run's ``freeze`` section (``max_frozen`` as the caller capped it)."""
        return cls(num_layers=num_layers, alpha=freeze.alpha, max_frozen=max_frozen,
                   warmup=warmup, ratio=freeze.converge_ratio, window=freeze.converge_window,
                   plateau=freeze.plateau, tolerance=freeze.settle_tolerance,
                   threshold=freeze.probe_threshold, decisions=decisions)

    @property
    def cap(self) -> int:
        """``max_frozen`` resolved (``L - 1`` when unset).

        Raises:
            ValueError: ``max_frozen`` exceeds ``num_layers``.
        """
        cap = self.num_layers - 1 if self.max_frozen is None else self.max_frozen
        if cap > self.num_layers:
            raise ValueError(
                f"freeze.max_frozen={self.max_frozen} exceeds the model's {self.num_layers} "
                f"blocks; choose at most {self.num_layers}"
            )
        return cap


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def schedule_frozen(decision: int, num_layers: int, alpha: float) -> int:
    """The 2021 code's schedule ``n(e) = ceil(L (1 - (1 - alpha)^e))`` (uncapped)."""
    if decision <= 0:
        return 0
    return min(num_layers, _ceil(num_layers * (1.0 - (1.0 - alpha) ** decision)))


@dataclass
class _Base:
    name: ClassVar[str]
    traits: ClassVar[PolicyTraits]
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

    @classmethod
    def arguments(cls, s: FreezeSettings) -> dict[str, Any]:
        """The constructor's arguments from ``s`` (a subclass adds the ones it takes)."""
        return dict(num_layers=s.num_layers, alpha=s.alpha, max_frozen=s.cap, warmup=s.warmup)

    @classmethod
    def build(cls, s: FreezeSettings) -> _Base:
        """The policy ``s`` describes."""
        return cls(**cls.arguments(s))

    def decide(self, decision: int, num_frozen: int,
               grad_norms: Mapping[int, float] | None = None) -> FreezeDecision:
        """See :meth:`FreezePolicy.decide`."""
        raise NotImplementedError

    def _clamp(self, decision: int, current: int, wanted: int) -> int:
        if decision < self.warmup:
            return current
        return max(current, min(wanted, self.max_frozen))


@dataclass
class NoFreeze(_Base):
    """Never freezes: the no-freeze baseline."""

    name: ClassVar[str] = "none"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="epoch", freezes=False)

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        return FreezeDecision(num_frozen, num_frozen, "policy none: never freezes")


@dataclass
class ScheduleFreeze(_Base):
    """The 2021 code's geometric schedule (no gradient signal)."""

    name: ClassVar[str] = "schedule"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="epoch")

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

    name: ClassVar[str] = "paper"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="epoch", reads_norms=True)
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


@dataclass
class ConvergedFreeze(_Base):
    """Freezes the leading blocks that have converged, at most alpha of the active ones per
    decision.

    A block's record is its gradient norm at each decision that saw it. It passes its test when
    each of its last ``window`` norms was at most ``ratio`` times the largest norm it had had
    up to then (so a norm that first rises, as when a fresh head starts training on a
    pretrained body, is measured from its peak, not from its first value).

    Args (beyond the common ones):
        ratio: the fraction of its peak norm a block's norm must have fallen to.
        window: consecutive decisions the test must hold for.
    """

    ratio: float = 0.3
    window: int = 2
    name: ClassVar[str] = "converged"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="short_runs", reads_norms=True)
    history: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.ratio < 1:
            raise ValueError(f"freeze.converge_ratio={self.ratio} must lie in (0, 1)")
        if self.window < 1:
            raise ValueError(f"freeze.converge_window={self.window} must be at least 1")

    @classmethod
    def arguments(cls, s: FreezeSettings) -> dict[str, Any]:
        return {**super().arguments(s), "ratio": s.ratio, "window": s.window}

    def converged(self, layer: int) -> bool:
        """Whether ``layer`` passes its convergence test on the norms seen so far."""
        seen = self.history.get(layer, [])
        if len(seen) < self.window + 1:  # the peak must come before the window
            return False
        for i in range(len(seen) - self.window, len(seen)):
            peak = max(seen[:i])
            if peak <= 0 or seen[i] > self.ratio * peak:
                return False
        return True

    def _observe(self, num_frozen: int, grad_norms: Mapping[int, float] | None) -> int:
        """Record the active blocks' norms; returns this decision's alpha bound."""
        for layer, norm in sorted((grad_norms or {}).items()):
            if layer >= num_frozen and math.isfinite(norm):
                self.history.setdefault(layer, []).append(float(norm))
        return min(
            self.num_layers, num_frozen + _ceil(self.alpha * (self.num_layers - num_frozen))
        )

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        bound = self._observe(num_frozen, grad_norms)
        if decision < self.warmup:
            return FreezeDecision(num_frozen, bound, f"warm-up (decision {decision})")
        passed = num_frozen
        while passed < self.num_layers and self.converged(passed):
            passed += 1
        new = self._clamp(decision, num_frozen, min(bound, passed))
        if passed == num_frozen:
            layer = num_frozen
            seen = self.history.get(layer, [])
            now = f"{seen[-1] / max(seen):.3f} of its peak" if seen and max(seen) > 0 else "no norm"
            reason = (f"block {layer} has not converged ({now}; needs <= {self.ratio:g} for "
                      f"{self.window} decisions)")
        else:
            reason = (f"blocks {num_frozen}..{passed - 1} converged (norm <= {self.ratio:g} of "
                      f"peak for {self.window} decisions); frozen {num_frozen} -> {new} "
                      f"(bound {bound}, cap {self.max_frozen})")
        return FreezeDecision(new, bound, reason)

    def state_dict(self) -> dict[str, dict[int, list[float]]]:
        """The policy's memory (each block's norm history), for checkpoints."""
        return {"history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: Mapping[str, Mapping[int, Sequence[float]]]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.history = {int(k): [float(x) for x in v] for k, v in state["history"].items()}


@dataclass
class SettledFreeze(ConvergedFreeze):
    """Freezes the leading blocks that have converged, or that have settled once the run has
    stopped learning, at most alpha of the active ones per decision.

    Two tests, each judged on a block's own history (one mean gradient norm per decision):

    1. converged (:class:`ConvergedFreeze`'s test): the norm has stayed at or below ``ratio``
       of its peak for ``window`` decisions, as when a from-scratch run has fit its data;
    2. settled: the run's training loss has reached a plateau, falling over the last
       ``window`` decisions by at most ``plateau`` of the run's first recorded loss against the
       ``window`` decisions before, and the block's mean norm over the last ``window``
       decisions is at most ``1 + tolerance`` times its mean over the ``window`` before.

    A fine-tuned pretrained block seldom falls to a fraction of its peak: its norm rises while
    the fresh head grows, then holds its level while the loss still falls. Holding its level
    alone does not make it safe to freeze (it still learns), so the second test also waits for
    the loss. The loss is measured on the scale of the run's first loss, so that a loss that
    keeps halving near zero (a from-scratch run fitting its data) counts as a plateau.

    Args (beyond :class:`ConvergedFreeze`'s):
        plateau: the largest fall of the windowed mean loss, as a fraction of the first loss,
            that counts as a plateau.
        tolerance: how far a settled block's windowed mean norm may rise.
    """

    plateau: float = 0.01
    tolerance: float = 0.1
    name: ClassVar[str] = "settled"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="short_runs", reads_norms=True)
    losses: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.plateau < 1:
            raise ValueError(f"freeze.plateau={self.plateau} must lie in (0, 1)")
        if self.tolerance < 0:
            raise ValueError(f"freeze.settle_tolerance={self.tolerance} must be non-negative")

    @classmethod
    def arguments(cls, s: FreezeSettings) -> dict[str, Any]:
        return {**super().arguments(s), "plateau": s.plateau, "tolerance": s.tolerance}

    def plateaued(self) -> bool:
        """Whether the training loss has stopped falling on the scale of its first value."""
        w, seen = self.window, self.losses
        if len(seen) < 2 * w or seen[0] <= 0:
            return False
        before = sum(seen[-2 * w:-w]) / w
        now = sum(seen[-w:]) / w
        return before - now <= self.plateau * seen[0]

    def settled(self, layer: int) -> bool:
        """Whether ``layer``'s norm has stopped rising against its own level."""
        w, seen = self.window, self.history.get(layer, [])
        if len(seen) < 2 * w:
            return False
        return sum(seen[-w:]) <= (1 + self.tolerance) * sum(seen[-2 * w:-w])

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        loss = (grad_norms or {}).get(LOSS_KEY)
        if loss is not None and math.isfinite(loss):
            self.losses.append(float(loss))
        bound = self._observe(num_frozen, grad_norms)
        if decision < self.warmup:
            return FreezeDecision(num_frozen, bound, f"warm-up (decision {decision})")
        flat = self.plateaued()
        passed, how = num_frozen, []
        while passed < self.num_layers:
            if self.converged(passed):
                how.append(ConvergedFreeze.name)
            elif flat and self.settled(passed):
                how.append(self.name)
            else:
                break
            passed += 1
        new = self._clamp(decision, num_frozen, min(bound, passed))
        loss_now = (f"loss {self.losses[-1]:.4g}, {'a plateau' if flat else 'still falling'}"
                    if self.losses else "no loss yet")
        if passed == num_frozen:
            layer = num_frozen
            seen = self.history.get(layer, [])
            now = f"{seen[-1] / max(seen):.3f} of its peak" if seen and max(seen) > 0 else "no norm"
            reason = f"block {layer} has neither converged nor settled ({now}; {loss_now})"
        else:
            kinds = ", ".join(f"{k} {how.count(k)}" for k in (ConvergedFreeze.name, self.name)
                              if k in how)
            reason = (f"blocks {num_frozen}..{passed - 1} passed ({kinds}; {loss_now}); frozen "
                      f"{num_frozen} -> {new} (bound {bound}, cap {self.max_frozen})")
        return FreezeDecision(new, bound, reason)

    def state_dict(self) -> dict[str, Any]:
        """The policy's memory (norm histories and losses), for checkpoints."""
        return {**super().state_dict(), "losses": list(self.losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        super().load_state_dict(state)
        self.losses = [float(x) for x in state.get("losses", [])]


@dataclass
class ProbeFreeze(_Base):
    """Freezes the leading blocks whose updates are no longer worth their cost on held-out data.

    A gradient norm says whether a block still moves, not whether its moves still help. At each
    decision this policy asks the workers to test the next ``c`` leading active blocks over the
    coming interval: they keep those blocks' parameters at its start and, at its end, measure the
    loss on a probe split the run never trains on as the parameters are (:data:`PROBE_NOW`,
    ``L``) and with the ``c`` blocks put back as they were (:data:`PROBE_REVERTED`). What the
    blocks' updates of one interval were worth on the probe is ``U = L_reverted - L``.

    1. Projected over the decisions left in the run, ``U x left`` is what freezing the blocks
       now would give up if every later interval's updates were worth as much (they are worth
       less as the learning rate decays, so the projection errs towards training on).
    2. The blocks pass when ``U x left <= threshold x L``: what they would still add is at
       most ``threshold`` of the probe loss. They freeze when they pass ``window`` tests in a
       row (the probe is a few hundred samples: one interval's ``U`` is noisy, and a block
       whose updates happened to hurt the probe once is not done learning).
    3. ``c`` starts at ``ceil(alpha * active)`` and halves (to 1) after each failed test, so a
       block still learning behind a settled one does not hold the settled one back; a pass
       resets it. Tests start one decision before the warm-up ends.

    Measured against the whole interval's gain instead (``U`` over what every trained layer's
    updates gained), the rule froze two of six blocks a tenth into fine-tuning the digits: the
    fresh head gains most early, so every block's share looks small, and the run lost 5 points.

    Args (beyond the common ones):
        threshold: the share of the probe loss the tested blocks may still be worth.
        decisions: decision points in the whole run (for the decisions left).
        window: tests in a row the same blocks must pass.
    """

    threshold: float = 0.01
    decisions: int = 16
    window: int = 2
    passes: int = 0  # tests in a row the blocks under test have passed
    name: ClassVar[str] = "probe"
    traits: ClassVar[PolicyTraits] = PolicyTraits(auto_interval="always", probe_split=True)
    asked: list[int] | None = None  # [num_frozen, blocks] under test this interval
    span: int | None = None  # blocks to test after a failed test (None: alpha's step)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.threshold < 1:
            raise ValueError(f"freeze.probe_threshold={self.threshold} must lie in [0, 1)")

    @classmethod
    def arguments(cls, s: FreezeSettings) -> dict[str, Any]:
        return {**super().arguments(s), "threshold": s.threshold, "decisions": s.decisions,
                "window": s.window}

    def _verdict(self, decision: int, num_frozen: int, inputs: Mapping[int, float]
                 ) -> tuple[int, str]:
        """The frozen prefix after this interval's test, and why."""
        now, back = inputs.get(PROBE_NOW), inputs.get(PROBE_REVERTED)
        asked = self.asked
        if asked is None or asked[0] != num_frozen or now is None or back is None:
            return num_frozen, "no probe this interval"
        blocks, left = asked[1], max(self.decisions - decision, 1)
        worth, allowed = (back - now) * left, self.threshold * now
        figures = (f"probe loss {now:.4g}; blocks {num_frozen}..{num_frozen + blocks - 1} were "
                   f"worth {back - now:+.4g} this interval, {worth:+.4g} over the {left} left "
                   f"(allowed {allowed:.4g})")
        if worth > allowed:
            self.span, self.passes = max(1, blocks // 2), 0
            return num_frozen, figures
        self.passes += 1
        if self.passes < self.window:
            self.span = blocks  # the same blocks again
            return num_frozen, f"{figures}; passed {self.passes} of {self.window}"
        self.span, self.passes = None, 0
        return num_frozen + blocks, figures

    def decide(self, decision, num_frozen, grad_norms=None) -> FreezeDecision:
        active = self.num_layers - num_frozen
        bound = min(self.num_layers, num_frozen + _ceil(self.alpha * active))
        if decision < self.warmup:
            new, reason = num_frozen, f"warm-up (decision {decision})"
        else:
            passed, reason = self._verdict(decision, num_frozen, grad_norms or {})
            new = self._clamp(decision, num_frozen, min(bound, passed))
            if new > num_frozen:
                reason = f"{reason}; frozen {num_frozen} -> {new} (cap {self.max_frozen})"
        step = self.span or _ceil(self.alpha * (self.num_layers - new))
        blocks = max(0, min(step, self.max_frozen - new))
        if decision + 1 < self.warmup or decision + 1 >= self.decisions:
            blocks = 0  # a test would end inside the warm-up, or after the last step
        self.asked = [new, blocks] if blocks else None
        return FreezeDecision(new, bound, reason, probe=blocks)

    def state_dict(self) -> dict[str, Any]:
        """The test under way and the span after a failed one, for checkpoints."""
        return {"asked": self.asked, "span": self.span, "passes": self.passes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.asked = None if state["asked"] is None else [int(x) for x in state["asked"]]
        self.span = None if state["span"] is None else int(state["span"])
        self.passes = int(state["passes"])


FREEZE_POLICIES: dict[str, type[_Base]] = {
    cls.name: cls for cls in (SettledFreeze, ProbeFreeze, ConvergedFreeze, PaperFreeze,
                              ScheduleFreeze, NoFreeze)}
"""The freeze policies by name, the default first: each class carries its ``name``, its
``traits`` (:class:`PolicyTraits`) and how it is built (``build(FreezeSettings)``). A new
policy is a class here plus its entry in this table; ``freeze.policy``'s choices derive from
it."""

POLICIES = tuple(FREEZE_POLICIES)
"""The freeze policies' names, the default first."""


def policy_class(policy: str) -> type[_Base]:
    """The class registered as ``policy``.

    Raises:
        ValueError: no policy has that name.
    """
    if policy not in FREEZE_POLICIES:
        raise ValueError(f"freeze.policy={policy!r} is not one of {list(POLICIES)}")
    return FREEZE_POLICIES[policy]


def policy_traits(policy: str) -> PolicyTraits:
    """The traits of the policy named ``policy`` (see :func:`policy_class`)."""
    return policy_class(policy).traits


def build_freeze_policy(policy: str, **settings: Any) -> _Base:
    """Build a policy from plain arguments (``num_layers`` comes from the model).

    Args:
        policy: a name of :data:`POLICIES` (``settled``, ``probe``, ``converged``, ``paper``,
            ``schedule`` or ``none``).
        settings: the fields of :class:`FreezeSettings` (``num_layers`` and ``alpha`` at
            least); each policy takes the ones it uses.
    """
    return policy_class(policy).build(FreezeSettings(**settings))


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


@dataclass(frozen=True)
class GuardVerdict:
    """What the accuracy guard concluded after a harmful freeze.

    Attributes:
        epoch: the epoch whose evaluation showed the drop.
        before: the last eval metric before the freeze.
        after: the eval metric of ``epoch``.
        freeze_epoch: the first epoch trained with the harmful freeze (a rollback returns to
            the state at its start).
        num_frozen: the frozen-prefix length before that freeze (what a rollback restores).
        rollback: whether the run returns to the start of ``freeze_epoch``.
    """

    epoch: int
    before: float
    after: float
    freeze_epoch: int
    num_frozen: int
    rollback: bool

    def describe(self) -> str:
        action = (f"rolling back to the start of epoch {self.freeze_epoch} with "
                  f"{self.num_frozen} blocks frozen" if self.rollback else
                  "the blocks already frozen stay frozen")
        return (f"eval metric fell from {self.before:.4f} to {self.after:.4f} after the freeze "
                f"of epoch {self.freeze_epoch}: freezing stops; {action}")


@dataclass
class FreezeGuard:
    """Stops freezing when the eval metric drops after a freeze.

    Fed every epoch's frozen-prefix length and eval metric (NaN when the epoch was not
    evaluated; metrics are higher-is-better fractions such as accuracy), it compares the first
    evaluation after the prefix grew with the last evaluation before it. A drop of more than
    ``points`` percentage points stops all further freezing for the rest of the run.

    Args:
        points: the largest drop (in points, 100 x the metric) a freeze may cause; None turns
            the guard off.
        rollback: whether a verdict asks the run to return to the start of the harmful
            freeze's first epoch.
    """

    points: float | None = 1.0
    rollback: bool = False
    epochs: list[tuple[int, int, float]] = field(default_factory=list)
    verdict: GuardVerdict | None = None

    @property
    def stopped(self) -> bool:
        """Whether freezing has been stopped for the rest of the run."""
        return self.verdict is not None

    def observe(self, epoch: int, num_frozen: int, metric: float) -> GuardVerdict | None:
        """Record one trained epoch; returns a verdict the first time a freeze proves harmful.

        An epoch trained again after a rollback replaces the records from it on.
        """
        self.epochs = [e for e in self.epochs if e[0] < epoch] + [(epoch, num_frozen, metric)]
        if self.points is None or self.stopped or not math.isfinite(metric):
            return None
        earlier = [e for e in self.epochs[:-1] if math.isfinite(e[2])]
        if not earlier:
            return None
        last_epoch, last_frozen, last_metric = earlier[-1]
        if num_frozen <= last_frozen or 100.0 * (last_metric - metric) <= self.points:
            return None
        freeze_epoch = next(e for e, n, _ in self.epochs if e > last_epoch and n > last_frozen)
        self.verdict = GuardVerdict(epoch, last_metric, metric, freeze_epoch, last_frozen,
                                    self.rollback)
        return self.verdict

    def hold(self, result: FreezeDecision, num_frozen: int) -> FreezeDecision:
        """``result`` as the guard lets it stand: unchanged until a verdict, then no growth."""
        v = self.verdict
        if v is None or result.num_frozen <= num_frozen:
            return result
        return FreezeDecision(num_frozen, num_frozen, f"guard: freezing stopped at epoch {v.epoch}")

    def state_dict(self) -> dict:
        """The guard's memory, for checkpoints."""
        v = self.verdict
        return {"epochs": [list(e) for e in self.epochs],
                "verdict": None if v is None else {f: getattr(v, f) for f in (
                    "epoch", "before", "after", "freeze_epoch", "num_frozen", "rollback")}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.epochs = [(int(e), int(n), float(m)) for e, n, m in state["epochs"]]
        self.verdict = None if state["verdict"] is None else GuardVerdict(**state["verdict"])
