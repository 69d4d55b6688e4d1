"""The run's controller as a named Ray actor: decides freezes and plans, keeps the timeline.

A thin asynchronous shell around :class:`pt_ray.control.state.ControlState`: it adds the blocking
``plan_for`` every rank calls at a decision point (it returns once every rank's inputs are in, so
all switch at the same step) and outlives worker restarts, because the driver owns it, not
Ray Train's worker group.

A controller that is lost comes back: Ray restarts the actor (``max_restarts``), empty. It has
one way back, whoever asks first: it restores itself from the run's latest complete checkpoint,
which holds its whole state and what it was set up with (:meth:`ControllerActor._restore`).

* A worker whose call fails finds it again and asks it to restore (:meth:`ControllerActor
  .recover`); rank 0 then replays what it had sent since that checkpoint (the epoch record and
  the norms, merged over the workers: no other rank sends any) and every worker retries its
  call, so training goes on without a worker-group restart. Lost before the first checkpoint,
  when the latest checkpoint was not taken at the start of the workers' current decision (what
  they sent since is gone), or not back within ``pipeline.collective_timeout_s``, the call fails
  and Ray Train restarts the worker group.
* Lost after the workers' last call, it restores itself when the driver asks for the run's
  summary (:meth:`ControllerActor.summary`): the last checkpoint is taken after the last
  epoch's record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from pt_ray.cache.owners import cache_name, create_owners
from pt_ray.reporting.logs import setup_logging
from pt_ray.core.config import RunConfig
from pt_ray.control.state import ControlState, build_control_state
from pt_ray.service.settings import run_settings
from pt_ray.costs.hwprofile import HardwareProfile
from pt_ray.core.plan import CostTable, Plan
from pt_ray.reporting.summary import EpochRecord

__all__ = ["ControllerActor", "ControllerRestarted", "RayController", "controller_name"]

logger = logging.getLogger(__name__)


# The longest the controller, and a worker at an epoch's end, waits for the cache's owners to
# answer after they were started (an owner is one new process: a second or two).
_OWNERS_START_S = 60.0


def controller_name(run_id: str) -> str:
    """The actor name workers look the controller up by."""
    return f"pt-ray-controller:{run_id}"


class ControllerRestarted(RuntimeError):
    """A call reached a controller that Ray restarted and that nobody has restored yet: the
    caller treats it as a lost controller (:meth:`RayController._recover`)."""


@ray.remote(num_cpus=0, max_concurrency=64)
class ControllerActor:
    """One per run. Created by the driver; workers reach it by name.

    Args:
        config: the run configuration (as a dict, validated again here).
        checkpoints: the folder Ray Train writes the run's checkpoints into, where a restarted
            actor finds the state to restore (None: it cannot restore itself).
        cache_run: the run id the activation cache's owners are named after, where the
            config lets the cache turn on (None: it never does). The owners start here, with
            the controller, so their process starts overlap Ray Train's own controller start
            (on an embedded cluster, in start slots kept for them); started when the cache
            first turns on, an owner took about a second of CPU from that epoch's training
            steps on a small host.
    """

    def __init__(self, config: dict[str, Any], checkpoints: str | None = None,
                 cache_run: str | None = None) -> None:
        setup_logging()
        self.cache_run = cache_run
        self.cfg = RunConfig.model_validate(config)
        # node id -> cache owner (they die with this actor: a restarted one starts new ones).
        self.owners: dict[str, Any] = {}
        self.owners_since = time.monotonic()
        if cache_run is not None:
            c = self.cfg.cache
            self.owners = create_owners(cache_run, c.budget_fraction, c.budget_bytes)
            logger.info("activation cache: starting its owners on %d node(s)", len(self.owners))
        self.owners_up: asyncio.Task | None = None  # done once every owner answered
        self.checkpoints = Path(checkpoints) if checkpoints else None
        self.state: ControlState | None = None
        self.metric_name = "accuracy"
        self.restarts = 0
        self.startup_figures: dict[str, float] = {}
        self.changed = asyncio.Condition()
        # What the state was built with (build_control_state's arguments), saved with it.
        self.built_with: dict[str, Any] = {}
        # Set once a restarted actor has restored itself: the last epoch its checkpoint holds.
        self.recovered_after: int | None = None

    async def setup(
        self,
        num_layers: int,
        num_workers: int,
        steps_per_epoch: int,
        metric_name: str,
        hardware: str | HardwareProfile,
        deterministic_transform: bool = True,
    ) -> None:
        """Create the decision state on first call (idempotent; every rank calls it). A call with
        a different worker count (an elastic restart) replaces it; ``resume`` then restores.
        ``hardware`` is what ``pipeline.hardware=auto`` means on the workers' devices (a
        profile name, or a profile built from the detected GPU; the first call's wins);
        ``deterministic_transform`` whether the training data may be cached."""
        self.metric_name = metric_name
        if self.owners:  # they started with this actor: answered by the cache's first use
            self._owners_up()
        if self.state is None or self.state.num_workers != num_workers:
            self.state = build_control_state(run_settings(self.cfg).control, num_layers,
                                             num_workers, steps_per_epoch, hardware,
                                             deterministic_transform)
            self.built_with = {
                "num_layers": num_layers, "num_workers": num_workers,
                "steps_per_epoch": steps_per_epoch, "metric_name": metric_name,
                "hardware": asdict(hardware) if isinstance(hardware, HardwareProfile)
                else hardware, "deterministic_transform": deterministic_transform}

    def _state(self) -> ControlState:
        """The decision state; a restarted actor that has not been restored has none, which a
        worker may reach before it learns of the restart (its call then recovers)."""
        if self.state is None:
            raise ControllerRestarted("the controller restarted and holds no state yet")
        return self.state

    async def recover(self, decision: int | None) -> int:
        """A worker's way back to a restarted controller: restored from the run's latest
        complete checkpoint (:meth:`_restore`; the first caller restores, later ones get the
        same answer). Returns the last epoch the checkpoint holds: what a worker sent about
        later epochs must be sent again.

        Args:
            decision: the decision whose plan the caller trains under. The checkpoint must
                have been taken at its start: only then do the workers' resent records and
                norms rebuild exactly what was lost (with ``checkpoint_every`` > 1, or
                decisions every k steps, earlier inputs are gone).

        Raises:
            RuntimeError: :meth:`_restore` cannot, or the checkpoint is older than
                ``decision``'s start: the caller's worker group then restarts from the
                checkpoint instead.
        """
        after = await self._restore(decision)
        await self._notify()
        return after

    async def _restore(self, decision: int | None = None) -> int:
        """Restore a restarted, empty actor from the run's latest complete checkpoint: the
        state, what it was built with, the restarts and the start-up figures (the one path
        back, whoever asks first). Returns the last epoch the checkpoint holds.

        Raises:
            RuntimeError: this actor holds state it did not restore (a worker group restarted
                meanwhile and set it up again), no complete checkpoint exists, it predates
                the saved build arguments, or (``decision`` given) it was not taken at that
                decision's start.
        """
        if self.recovered_after is not None:  # the first caller's check stands for all
            return self.recovered_after
        if self.state is not None:
            raise RuntimeError("the controller was set up again since it restarted: "
                               "nothing to recover")
        # Imported here: the module brings torch, which the actor otherwise never needs, and
        # importing it would lengthen every run's start-up.
        from pt_ray.runtime.checkpoint import latest_checkpoint, read_meta

        folders = [p for p in self.checkpoints.glob("checkpoint_*") if p.is_dir()] \
            if self.checkpoints is not None else []
        checkpoint = latest_checkpoint(folders)
        if checkpoint is None:
            raise RuntimeError("the controller was lost before the run's first checkpoint")
        meta = read_meta(checkpoint)
        saved = meta["controller"]
        if decision is not None and meta["next_decision"] != decision:
            raise RuntimeError(
                f"the latest checkpoint ({checkpoint.name}) was taken at decision "
                f"{meta['next_decision']}, not at decision {decision}'s start: the inputs "
                "since are lost")
        if "actor" not in saved:
            raise RuntimeError(f"the latest checkpoint ({checkpoint.name}) does not hold what "
                               "the controller was set up with")
        own = saved["actor"]
        built = dict(own["built_with"])
        if isinstance(built["hardware"], dict):
            built["hardware"] = HardwareProfile(**built["hardware"])
        await self.setup(**built)
        self._state().resume(saved, meta["next_decision"])
        self.restarts, self.startup_figures = int(own["restarts"]), dict(own["startup"])
        self.recovered_after = int(meta["epoch"])
        logger.warning("controller restarted: state restored from %s (after epoch %d)",
                       checkpoint.name, self.recovered_after + 1)
        return self.recovered_after

    def _saved(self) -> dict[str, Any]:
        """What a checkpoint saves of the controller: the decision state, and what
        :meth:`_restore` needs beside it (under ``actor``)."""
        return {**self._state().state_dict(),
                "actor": {"built_with": self.built_with, "restarts": self.restarts,
                          "startup": self.startup_figures}}

    async def submit_costs(self, rank: int, costs: CostTable) -> None:
        self._state().submit_costs(rank, costs)
        await self._notify()

    async def trial_plans(self) -> tuple[Plan, ...]:
        """The first layouts to time; waits until every rank's costs are in."""
        async with self.changed:
            await self.changed.wait_for(lambda: self._state().trial_plans() is not None)
            return self._state().trial_plans()

    async def submit_trial(self, seconds: list[float]) -> None:
        """The trial layouts' seconds per step, the slowest rank's (rank 0 sends them)."""
        self._state().submit_trial(seconds)
        await self._notify()

    async def submit_norms(self, decision: int, norms: dict[int, float]) -> None:
        """Interval ``decision``'s norms, merged over the workers (rank 0 sends them)."""
        self._state().submit_norms(decision, norms)
        await self._notify()

    @ray.method(num_returns=2)
    async def end_interval(self, decision: int, norms: dict[int, float],
                           rec: EpochRecord | None = None, with_state: bool = False
                           ) -> tuple[Plan, dict[str, Any] | None]:
        """Rank 0's one call at the end of an interval: the epoch's record (if it ends one),
        then the interval's merged norms. Answered with the next decision's plan and, when the
        epoch checkpoints (``with_state``), the state the checkpoint saves, as two objects."""
        if rec is not None:
            self._state().record(rec)
        await self.submit_norms(decision, norms)
        plan = await self.plan_for(decision + 1)
        return plan, self._saved() if with_state else None

    async def plan_for(self, decision: int) -> Plan:
        """The plan from ``decision`` on; waits until every rank's inputs are in."""
        async with self.changed:
            await self.changed.wait_for(lambda: self._state().plan_for(decision) is not None)
            return self._state().plan_for(decision)

    async def record(self, rec: EpochRecord) -> None:
        """An epoch's record on its own (a recovering worker sends its last one again)."""
        self._state().record(rec)

    async def startup(self, figures: dict[str, float]) -> None:
        """Rank 0's start-up figures (see :meth:`RayController.startup`)."""
        self.startup_figures = dict(figures)

    async def state_dict(self) -> dict[str, Any]:
        return self._saved()

    async def checkpoint_state(self, decision: int) -> dict[str, Any]:
        """The state a checkpoint saves, once ``decision`` is made (every rank's norms are
        in): :meth:`plan_for` and :meth:`state_dict` in one round trip."""
        await self.plan_for(decision)
        return self._saved()

    async def resume(self, state: dict[str, Any], next_decision: int,
                     restart: bool = True) -> Plan:
        """Roll back to a checkpoint (rank 0 calls it): after a worker-group restart, or, with
        ``restart=False``, when a new run continues a stopped one (not counted as a restart)."""
        plan = self._state().resume(state, next_decision)
        self.restarts += int(restart)
        await self._notify()
        return plan

    async def timeline(self) -> list[EpochRecord]:
        """The timeline this actor holds now (empty for a restarted one nobody restored)."""
        return list(self.state.timeline) if self.state else []

    async def summary(self) -> dict[str, Any]:
        """Timeline, decisions, rollbacks, restarts, start-up and whether any plan read the
        cache, for the driver at the end of a run. A controller restarted after the workers'
        last call restores itself first (:meth:`_restore`; its ``RuntimeError`` says why it
        cannot)."""
        if self.state is None:
            await self._restore()
        state = self._state()
        rollbacks = [{**r, "discarded": [asdict(d) for d in state.discarded]}
                     for r in state.rollbacks]
        return {"timeline": list(state.timeline), "decisions": list(state.decisions),
                "metric_name": self.metric_name, "restarts": self.restarts,
                "rollbacks": rollbacks, "startup": self.startup_figures,
                "start_trials": list(state.start_trials),
                "cache_on": any(plan.cache for plan in state.plans.values())}

    async def cache_owners(self, wait: bool = False) -> dict[str, str]:
        """``{node id: actor name}`` of the cache's owners once every one answered (or the
        wait for them ended); ``{}`` before, and in a run whose config rules the cache out.
        A worker asks only once a plan reads or writes the cache. ``wait``: wait for owners
        still starting, up to a minute."""
        if not self.owners:
            return {}
        up = self._owners_up()
        if wait and not up.done():
            await asyncio.wait([up], timeout=_OWNERS_START_S)
        if not up.done():
            return {}
        return {node: cache_name(self.cache_run, node) for node in self.owners}

    def _owners_up(self) -> asyncio.Task:
        """The wait for every owner to answer, begun on first use (in the actor's loop)."""
        if self.owners_up is None:
            self.owners_up = asyncio.get_running_loop().create_task(self._wait_owners())
        return self.owners_up

    async def _wait_owners(self) -> None:
        """Until every owner answers (one that cannot is left out by the workers)."""
        done, _ = await asyncio.wait([asyncio.ensure_future(owner.lineage.remote())
                                      for owner in self.owners.values()],
                                     timeout=_OWNERS_START_S)
        failed = sum(1 for answer in done if answer.exception() is not None)
        logger.info("activation cache: %d of %d owners up %.1f s after they started",
                    len(done) - failed, len(self.owners), time.monotonic() - self.owners_since)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


# What a call that finds the controller lost raises: the actor died (or is restarting), or it
# restarted and answered empty (Ray raises the actor's exception as an instance of its class).
_LOST = (ray.exceptions.RayActorError, ControllerRestarted)


class RayController:
    """The worker-side handle: the engine's ``Controller`` protocol over the named actor.

    Args:
        name: the actor's name.
        timeout_s: the longest any call may wait, and the longest a lost controller may take
            to come back (``pipeline.collective_timeout_s``).
        checkpoints_after: whether an epoch ends with a checkpoint (``RunConfig
            .checkpoints_after``): rank 0 then asks for the checkpoint's state with the
            epoch's norms, in the same call.
    """

    def __init__(self, name: str, timeout_s: float = 3600.0,
                 checkpoints_after: Callable[[int], bool] | None = None) -> None:
        self.actor = ray.get_actor(name)
        self.timeout_s = timeout_s
        self.checkpoints_after = checkpoints_after or (lambda _epoch: False)
        self._set_up = False  # whether this worker has set the controller up
        self._record: EpochRecord | None = None  # rank 0's last record
        self._norms: tuple[int, dict[int, float]] | None = None  # rank 0's last norms
        self._decision: int | None = None  # the decision whose plan this worker trains under
        # Answers asked for ahead, by (method, decision): the next plan once the interval's
        # norms are sent, and rank 0's checkpoint state (see send_checkpoint_state).
        self._early: dict[tuple[str, int], ray.ObjectRef] = {}

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except _LOST as err:
            logger.warning("controller lost during %s (%s); waiting for it to come back",
                           method, type(err).__name__)
        self._recover()
        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)

    def _recover(self) -> None:
        """Wait for the restarted controller, have it restore itself, and send again what it
        lost (rank 0's record before the norms, as in a fault-free epoch)."""
        if not self._set_up:
            raise RuntimeError("the controller was lost before this worker set it up")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                after = ray.get(self.actor.recover.remote(self._decision),
                                timeout=max(1.0, deadline - time.monotonic()))
                break
            except ray.exceptions.RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if self._record is not None and self._record.epoch > after:
            ray.get(self.actor.record.remote(self._record), timeout=self.timeout_s)
        if self._norms is not None:
            ray.get(self.actor.submit_norms.remote(*self._norms), timeout=self.timeout_s)

    def setup(
        self,
        num_layers: int,
        num_workers: int,
        steps_per_epoch: int,
        metric_name: str,
        hardware: str | HardwareProfile,
        deterministic_transform: bool = True,
    ) -> None:
        self._call("setup", num_layers, num_workers, steps_per_epoch, metric_name, hardware,
                   deterministic_transform)
        self._set_up = True

    def submit_costs(self, rank: int, costs: CostTable) -> None:
        self._call("submit_costs", rank, costs)

    def trial_plans(self) -> tuple[Plan, ...]:
        return self._call("trial_plans")

    def submit_trial(self, rank: int, seconds: list[float]) -> None:
        if rank == 0:  # every rank holds the same figures
            self._call("submit_trial", seconds)

    def _ask_ahead(self, method: str, decision: int) -> None:
        """Send ``method(decision)`` now and keep its answer for :meth:`_answer` (replacing an
        unused earlier one of the same method)."""
        self._early = {k: v for k, v in self._early.items() if k[0] != method}
        self._early[(method, decision)] = getattr(self.actor, method).remote(decision)

    def _answer(self, method: str, decision: int) -> Any:
        """``method(decision)``'s answer: the one asked for ahead if there is one, else a
        round trip; a controller lost meanwhile recovers first."""
        ref = self._early.pop((method, decision), None)
        if ref is not None:
            try:
                value = ray.get(ref, timeout=self.timeout_s)
            except _LOST as err:
                logger.warning("controller lost during %s (%s); waiting for it to come back",
                               method, type(err).__name__)
                self._recover()
            else:
                return value
        return self._call(method, decision)

    def plan_for(self, decision: int) -> Plan:
        plan = self._answer("plan_for", decision)
        self._decision = decision
        return plan

    def submit_norms(self, decision: int, rank: int, norms: dict[int, float],
                     record: EpochRecord | None = None) -> None:
        # Every rank holds the same merged norms and record: rank 0 sends them in one call,
        # answered with the next plan, and nobody waits now; every other rank asks for that
        # plan. The round trips overlap the epoch's checkpoint and report instead of delaying
        # the next epoch, and no rank waits for another's call to the controller: a lost one is
        # found by the next answer a rank reads (rank 0 then sends its record and norms again).
        if rank != 0:
            self._ask_ahead("plan_for", decision + 1)
            return
        if record is not None:
            self._record = record
        self._norms = (decision, norms)
        with_state = record is not None and self.checkpoints_after(record.epoch)
        plan, state = self.actor.end_interval.remote(decision, norms, record, with_state)
        self._early = {k: v for k, v in self._early.items() if k[0] != "plan_for"}
        self._early[("plan_for", decision + 1)] = plan
        if with_state:
            self._early = {k: v for k, v in self._early.items() if k[0] != "checkpoint_state"}
            self._early[("checkpoint_state", decision + 1)] = state

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def send_checkpoint_state(self, decision: int) -> None:
        """Ask now for what :meth:`checkpoint_state` will return, so that the round trip (and
        the decision it waits for) overlaps the caller's writing of its shard; asked already
        when the epoch's norms went with the question."""
        if ("checkpoint_state", decision) not in self._early:
            self._ask_ahead("checkpoint_state", decision)

    def checkpoint_state(self, decision: int) -> dict[str, Any]:
        """The controller's state once ``decision`` is made: what a checkpoint saves with the
        shards (the answer asked for by :meth:`send_checkpoint_state`, if it was)."""
        state = self._answer("checkpoint_state", decision)
        self._decision = decision
        return state

    def startup(self, figures: dict[str, float]) -> None:
        """Note where rank 0's start-up went: ``entered_at`` (when the worker function began,
        ``time.time()``), ``dataset_s``, ``model_s`` and ``setup_s`` (controller set-up,
        profiling and the first plan, which waits for every rank; or the restore from a
        checkpoint). The latest group's figures win; a restarted controller has none."""
        self._call("startup", figures)

    def resume(self, state: dict[str, Any], next_decision: int, restart: bool = True) -> Plan:
        return self._call("resume", state, next_decision, restart)

    def cache_owners(self, wait: bool) -> dict[str, str]:
        """The cache owners' names once they answer (:meth:`ControllerActor.cache_owners`;
        the :class:`pt_ray.cache.owners.RayStore` asks). A lost controller raises Ray's
        error rather than recover here: the store asks again later."""
        return ray.get(self.actor.cache_owners.remote(wait), timeout=self.timeout_s)
