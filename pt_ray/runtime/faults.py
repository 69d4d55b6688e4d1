"""Fault injection for tests: one environment variable names where in a run a rank fails.

``PT_RAY_FAULT="<point>:<epoch>:<step>:<rank>:<marker path>"`` makes rank ``<rank>`` fail at
``<point>`` of epoch ``<epoch>`` (from 0), once: the marker file records that the fault fired, so
the restarted run goes through. Several faults, each with its own marker, are separated by
``;``. ``<step>`` is the epoch's step for step points and ignored by
the others; for ``step``, ``controller`` and ``hang``, epoch ``epochs`` (one past the last)
with step 0 is after the workers' last call of the run, before they return. The points:

- ``step``: the rank kills its own process (SIGKILL) before that step.
- ``migration``: the rank kills itself in the middle of the transition that opens the epoch,
  after it has sent its layers' state and before it has received any (other ranks wait in a
  point-to-point call).
- ``checkpoint``: the rank kills itself while writing its checkpoint shard after the epoch,
  half of the file written.
- ``controller``: the rank kills the controller actor before that step (Ray restarts the actor
  empty, it rebuilds its state from the last checkpoint, and the workers go on without a
  restart of their group).
- ``hang``: the rank stops answering before that step (sleeps while its peers wait inside a
  collective) until its process is ended.
- ``stall``: the rank sleeps ``STALL_S`` seconds before that step, or with step 0 at the start of
  the transition that opens the epoch, before any layer moves (its peers wait for it), so that
  something else can land meanwhile (a stopped job, a lost node, in tests); then it goes on.
- ``eval``: the rank counts none of its correct predictions in the epoch's evaluation, so the
  eval metric falls as after a harmful freeze (the accuracy guard's input).

The engine has no fault branches: every point except ``step``, ``controller``, ``hang`` and
``stall`` at a step is one of its :class:`pt_ray.runtime.engine.EngineHooks` callbacks, which
:func:`fault_hooks` installs (nothing is installed without the variable); the service's worker
reaches the others before each step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pt_ray.runtime.engine import EngineHooks

__all__ = ["FAULT_ENV", "POINTS", "STALL_S", "FaultSwitch", "Faults", "fault_hooks", "kill_self",
           "stall"]

logger = logging.getLogger(__name__)

FAULT_ENV = "PT_RAY_FAULT"

POINTS = ("step", "migration", "checkpoint", "controller", "hang", "eval", "stall")
STALL_S = 30.0


def stall() -> None:
    """Hold this rank for ``STALL_S`` seconds (the ``stall`` point)."""
    time.sleep(STALL_S)


def kill_self() -> None:
    """End this process at once, as a lost machine would (no cleanup, no goodbye)."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultSwitch:
    """The fault this rank injects, if any (see the module docstring)."""

    point: str
    epoch: int
    step: int
    marker: Path
    delay_s: float = 0.0

    @classmethod
    def from_env(cls, rank: int, delay_s: float = 0.0,
                 env: dict[str, str] | None = None) -> Faults | None:
        """This rank's faults from ``PT_RAY_FAULT`` (None when unset or all for other ranks);
        ``delay_s``: wait this long before a fault fires (e.g. for Ray Train to register
        the previous checkpoint).

        Raises:
            ValueError: the variable is malformed or names an unknown point.
        """
        spec = (os.environ if env is None else env).get(FAULT_ENV)
        if not spec:
            return None
        mine = [s for s in (cls._parse(one, delay_s) for one in spec.split(";")) if s[1] == rank]
        return Faults(tuple(s for s, _ in mine)) if mine else None

    @classmethod
    def _parse(cls, spec: str, delay_s: float) -> tuple[FaultSwitch, int]:
        """One fault and its rank."""
        try:
            point, epoch, step, target, marker = spec.split(":", 4)
            epoch_i, step_i, target_i = int(epoch), int(step), int(target)
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected "
                             "<point>:<epoch>:<step>:<rank>:<marker path>") from None
        if point not in POINTS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point {point!r}; "
                             f"choose one of {', '.join(POINTS)}")
        return cls(point, epoch_i, step_i, Path(marker), delay_s), target_i

    def due(self, point: str, epoch: int, step: int = 0) -> bool:
        """Whether the fault fires here (and has not fired yet); marks it fired if so."""
        if point != self.point or epoch != self.epoch or self.marker.exists():
            return False
        if point in ("step", "controller", "hang", "stall") and step != self.step:
            return False
        time.sleep(self.delay_s)
        self.marker.write_text(f"{point} fault at epoch {epoch} step {step} (pid {os.getpid()})\n")
        logger.warning("injecting the %s fault at epoch %d step %d", point, epoch, step)
        return True

    def at(self, point: str, epoch: int, step: int = 0,
           action: Callable[[], None] = kill_self) -> None:
        """Run ``action`` (by default: kill this process) when the fault is due here."""
        if self.due(point, epoch, step):
            action()


@dataclass(frozen=True)
class Faults:
    """The faults one rank injects (each fires once, at its own point)."""

    switches: tuple[FaultSwitch, ...]

    def due(self, point: str, epoch: int, step: int = 0) -> bool:
        """Whether one of the faults fires here (marking it fired)."""
        return any(s.due(point, epoch, step) for s in self.switches)

    def at(self, point: str, epoch: int, step: int = 0,
           action: Callable[[], None] = kill_self) -> None:
        """Run ``action`` (by default: kill this process) when a fault is due here."""
        if self.due(point, epoch, step):
            action()


def fault_hooks(faults: Faults | None, hooks: EngineHooks) -> EngineHooks:
    """``hooks`` with the engine's fault points installed for ``faults`` (unchanged for None):

    - ``stall`` (step 0): the rank sleeps when a plan is about to replace the one in force;
    - ``migration``: the rank kills itself inside that migration, after its sends;
    - ``checkpoint``: the rank cuts its shard to half and kills itself once it is written;
    - ``eval``: the rank counts none of its correct predictions.
    """
    if faults is None:
        return hooks

    def damage_shard(path: Path, epoch: int) -> None:
        if faults.due("checkpoint", epoch):
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
            kill_self()  # half of the shard written

    return replace(
        hooks,
        on_transition=lambda epoch: faults.at("stall", epoch, action=stall),
        in_migration=lambda epoch: faults.at("migration", epoch),
        on_shard=damage_shard,
        on_eval=lambda epoch, correct: 0 if faults.due("eval", epoch) else correct,
    )
