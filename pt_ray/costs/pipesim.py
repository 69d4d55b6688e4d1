"""Event simulation of one pipeline step: GPipe and 1F1B over K stages and M micro-batches.

Pure module; it knows per-stage times only (seconds per micro-batch), never hardware. Each stage
runs its operations one at a time in the schedule's fixed order; an operation starts when its
stage is free and its input has arrived:

1. ``F(m, k)`` needs ``F(m, k-1)`` finished plus the activation transfer ``k-1 -> k``;
2. ``B(m, k)`` needs ``B(m, k+1)`` finished plus the gradient transfer ``k+1 -> k`` (the last
   stage's backward needs its own forward, i.e. the loss);
3. GPipe (fill-drain, as torchgpipe ran it): every forward, then the backwards in reverse
   micro-batch order; 1F1B (PipeDream-flush): stage ``k`` runs ``min(K-1-k, M)`` warm-up
   forwards, then alternates one forward and one backward, then drains the backwards.

The bubble is not assumed anywhere: for K balanced stages without communication both schedules
end after ``(M + K - 1)(f + b)``, so each stage idles ``(K-1)/(M+K-1)`` of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["ScheduleResult", "stage_order", "run_schedule"]

Op = tuple[str, int]  # ("F" | "B", micro-batch index)


@dataclass(frozen=True)
class ScheduleResult:
    """Timing of one replica's pipeline step.

    Attributes:
        makespan_s: from the first operation's earliest start (time 0) to the last one's end.
        stage_end_s: per stage, when its last backward ends (its gradients are then complete).
        stage_busy_s: per stage, the time spent computing.
        stage_start_s: per stage, when its first operation started.
    """

    makespan_s: float
    stage_end_s: tuple[float, ...]
    stage_busy_s: tuple[float, ...]
    stage_start_s: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stages over the step: ``1 - sum(busy) / (K * makespan)``."""
        k = len(self.stage_busy_s)
        if self.makespan_s <= 0:
            return 0.0
        return 1.0 - sum(self.stage_busy_s) / (k * self.makespan_s)


def stage_order(schedule: Literal["gpipe", "1f1b"], stage: int, num_stages: int,
                num_microbatches: int) -> list[Op]:
    """The order in which ``stage`` runs its forwards and backwards under ``schedule``."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r} is not one of 'gpipe', '1f1b'")
    warmup = min(num_stages - 1 - stage, m)
    ops: list[Op] = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def run_schedule(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    schedule: Literal["gpipe", "1f1b"] = "1f1b",
    send_forward_s: Sequence[float] = (),
    send_backward_s: Sequence[float] = (),
    stage_ready_s: Sequence[float] = (),
) -> ScheduleResult:
    """Simulate one step of a K-stage pipeline.

    Args:
        forward_s: per stage, forward time of one micro-batch (s).
        backward_s: per stage, backward time of one micro-batch (s); 0 for a stage that trains
            nothing (its backwards are skipped, as autograd skips them).
        num_microbatches: M.
        schedule: ``gpipe`` or ``1f1b``.
        send_forward_s: ``K - 1`` activation transfer times, stage ``k`` to ``k + 1`` (s);
            empty: no communication cost.
        send_backward_s: ``K - 1`` gradient transfer times, stage ``k + 1`` to ``k`` (s).
        stage_ready_s: per stage, the earliest time it may start (e.g. stage 0 running the
            frozen prefix over the whole batch first); empty: all at 0.

    Returns:
        The step's :class:`ScheduleResult`.
    """
    k = len(forward_s)
    if k == 0 or len(backward_s) != k:
        raise ValueError(f"need one forward and one backward time per stage, got "
                         f"{len(forward_s)} and {len(backward_s)}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be at least 1")
    send_f = list(send_forward_s) or [0.0] * (k - 1)
    send_b = list(send_backward_s) or [0.0] * (k - 1)
    ready = list(stage_ready_s) or [0.0] * k
    if len(send_f) != k - 1 or len(send_b) != k - 1 or len(ready) != k:
        raise ValueError("send times need K-1 entries and ready times K entries")
    orders = _stage_orders(schedule, backward_s, num_microbatches)
    done: dict[tuple[str, int, int], float] = {}
    free = list(ready)
    start: list[float | None] = [None] * k
    busy = [0.0] * k
    ptr = [0] * k
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(k):
            while ptr[s] < len(orders[s]):
                kind, mb = orders[s][ptr[s]]
                dep = _inputs_ready(kind, mb, s, k, done, send_f, send_b)
                dur = forward_s[s] if kind == "F" else backward_s[s]
                if dep is None:
                    break
                t0 = max(free[s], dep)
                if start[s] is None:
                    start[s] = t0
                free[s] = t0 + dur
                busy[s] += dur
                done[(kind, mb, s)] = free[s]
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError(f"{schedule} schedule deadlocked at {ptr}")
    return ScheduleResult(
        makespan_s=max(free),
        stage_end_s=tuple(free),
        stage_busy_s=tuple(busy),
        stage_start_s=tuple(0.0 if t is None else t for t in start),
    )


def _stage_orders(schedule: Literal["gpipe", "1f1b"], backward_s: Sequence[float],
                  num_microbatches: int) -> list[list[Op]]:
    """Each stage's operations in order; forwards only where no backward reaches the stage."""
    k = len(backward_s)
    trains = any(b > 0 for b in backward_s)
    # A stage after the last training stage still owes the loss its backward hand-off; stages
    # before the first training stage never run a backward.
    first_trained = next((s for s in range(k) if backward_s[s] > 0), k)
    orders = []
    for s in range(k):
        ops = stage_order(schedule, s, k, num_microbatches)
        if not trains or s < first_trained:
            ops = [op for op in ops if op[0] == "F"]
        orders.append(ops)
    return orders


def _inputs_ready(kind: str, mb: int, s: int, k: int, done: dict[tuple[str, int, int], float],
                  send_f: Sequence[float], send_b: Sequence[float]) -> float | None:
    """When operation ``kind`` of micro-batch ``mb`` on stage ``s`` has its input (the previous
    stage's activation or the next stage's gradient, sent); None: not produced yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        dep = done.get(("F", mb, s - 1))
        return None if dep is None else dep + send_f[s - 1]
    if s == k - 1:
        return done.get(("F", mb, s))
    dep = done.get(("B", mb, s + 1))
    return None if dep is None else dep + send_b[s]
