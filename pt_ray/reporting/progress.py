"""Progress of long epochs: tqdm's bar on a terminal, a few plain lines in a job or a pipe.

No torch, no Ray. Meant for rank 0 only (pass ``enabled=rank == 0``); disabled, every call is
a no-op. The engine calls its ``on_step(epoch, step)`` hook before each training step, with
``step`` the number of steps already done in the epoch: :class:`RunProgress` is such a hook,
and :class:`EpochProgress` is one epoch's progress.

On a terminal (the stream is a TTY) a tqdm bar redraws in place at most every
``min_interval_s``. Elsewhere (a Ray job's log, a pipe, a notebook's captured output) it
writes one plain line each time another ``every`` fraction of the epoch is
done (default: at 25%, 50% and 75%), and only once ``min_line_interval_s`` has passed since
the epoch began or since the last line, so short epochs write nothing and logs stay short::

    epoch  3/20: 50% (23/45 steps, 41.2 steps/s, ETA 00:01)

``close(line)`` ends the epoch: the bar is cleared and ``line`` written in its place.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Literal, TextIO

from tqdm import tqdm

__all__ = ["EpochProgress", "RunProgress"]

Mode = Literal["auto", "bar", "lines"]


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class EpochProgress:
    """Progress of one epoch's training steps.

    Args:
        total_steps: steps in the epoch.
        epoch: 0-based epoch index (shown from 1).
        epochs: epochs in the run.
        enabled: False makes every method a no-op (e.g. on ranks other than 0).
        stream: where to write (default: ``sys.stdout`` at construction).
        mode: ``bar`` (tqdm's bar), ``lines`` (plain lines) or ``auto`` (a bar when the stream
            is a TTY).
        every: in ``lines`` mode, write a line each time this fraction of the epoch is done.
        min_interval_s: in ``bar`` mode, the shortest time between redraws.
        min_line_interval_s: in ``lines`` mode, the shortest time from the epoch's start or
            the last line to the next line.
        clock: seconds, monotonic, for ``lines`` mode (tests pass a fake).
    """

    def __init__(self, total_steps: int, epoch: int, epochs: int, enabled: bool = True, *,
                 stream: TextIO | None = None, mode: Mode = "auto", every: float = 0.25,
                 min_interval_s: float = 0.1, min_line_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps={total_steps} must be >= 0")
        if not 0 < every <= 1:
            raise ValueError(f"every={every} must lie in (0, 1]")
        self.enabled = enabled
        self.total = total_steps
        self.epoch = epoch
        self.stream = stream if stream is not None else sys.stdout
        self.desc = f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs}"
        self.bar = mode == "bar" or (mode == "auto" and _is_tty(self.stream))
        self.every = every
        self.min_line_interval_s = min_line_interval_s
        self.clock = clock
        self.done = 0
        self._start = self._last_line = clock()
        self._next_fraction = every
        self._closed = not enabled
        self._tqdm = (tqdm(total=total_steps, desc=self.desc, file=self.stream, unit="step",
                           mininterval=min_interval_s, leave=False, dynamic_ncols=True)
                      if enabled and self.bar else None)

    def update(self, step: int) -> None:
        """Record that ``step`` steps of the epoch are done (clamped to the total)."""
        if self._closed:
            return
        done = max(self.done, min(int(step), self.total))
        if self._tqdm is not None:
            self._tqdm.update(done - self.done)
            self.done = done
            return
        self.done = done
        if not self.total:
            return
        fraction = done / self.total
        if fraction < self._next_fraction or done == self.total:
            return
        while self._next_fraction <= fraction:
            self._next_fraction += self.every
        now = self.clock()
        if now - self._last_line >= self.min_line_interval_s:
            self._last_line = now
            rate = done / max(now - self._start, 1e-9)
            eta = tqdm.format_interval((self.total - done) / rate)
            self.stream.write(f"{self.desc}: {fraction:.0%} ({done}/{self.total} steps, "
                              f"{rate:,.1f} steps/s, ETA {eta})\n")
            self.stream.flush()

    def close(self, line: str | None = None) -> None:
        """End the epoch: clear the bar and write ``line`` (if given) on a line of its own."""
        if self._closed:
            return
        self._closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        if line:
            self.stream.write(line.rstrip("\n") + "\n")
            self.stream.flush()


class RunProgress:
    """An ``on_step(epoch, step)`` hook that keeps one :class:`EpochProgress` per epoch.

    Args:
        epochs: epochs in the run.
        steps_per_epoch: steps in an epoch, or a function of the epoch (when R, and with it
            the number of steps, changes under ``batch_policy=per_replica``).
        enabled: False makes it a no-op (e.g. on ranks other than 0).
        **kwargs: passed to each :class:`EpochProgress` (``stream``, ``mode``, ...).
    """

    def __init__(self, epochs: int, steps_per_epoch: int | Callable[[int], int],
                 enabled: bool = True, **kwargs) -> None:
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.enabled = enabled
        self.kwargs = kwargs
        self.current: EpochProgress | None = None

    def _total(self, epoch: int) -> int:
        s = self.steps_per_epoch
        return s(epoch) if callable(s) else s

    def __call__(self, epoch: int, step: int) -> None:
        """The engine's hook: called before step ``step`` (0-based) of ``epoch``."""
        if not self.enabled:
            return
        if self.current is None or self.current.epoch != epoch:
            self.end_epoch()
            self.current = EpochProgress(self._total(epoch), epoch, self.epochs, True,
                                         **self.kwargs)
        self.current.update(step)

    def end_epoch(self, line: str | None = None) -> None:
        """Close the current epoch's progress (writing ``line``, e.g. the epoch's summary)."""
        if self.current is not None:
            self.current.close(line)
            self.current = None
