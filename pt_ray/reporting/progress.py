"""Progress of long epochs: a live bar on a terminal, a few plain lines in a job or a pipe.

No torch, no Ray. Meant for rank 0 only (pass ``enabled=rank == 0``); disabled, every call is
a no-op. The engine calls its ``on_step(epoch, step)`` hook before each training step, with
``step`` the number of steps already done in the epoch: :class:`RunProgress` is such a hook,
and :class:`EpochProgress` is one epoch's bar.

On a terminal (the stream is a TTY) the bar redraws in place with ``\\r`` at most every
``min_interval_s``::

    epoch  3/20 [##########----------]  23/45 steps  41.2 steps/s  ETA 0:01

Elsewhere (a Ray job's log, a pipe, a notebook) it writes one plain line each time another
``every`` fraction of the epoch is done (default: at 25%, 50% and 75%), and only once
``min_line_interval_s`` has passed since the epoch began or since the last line, so short
epochs write nothing and logs stay short.
``close(line)`` ends the epoch: on a terminal the bar is replaced by ``line``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import Literal, TextIO

__all__ = ["EpochProgress", "RunProgress"]

Mode = Literal["auto", "bar", "lines"]


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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
        mode: ``bar`` (redraw with ``\\r``), ``lines`` (plain lines) or ``auto`` (a bar when
            the stream is a TTY).
        every: in ``lines`` mode, write a line each time this fraction of the epoch is done.
        min_interval_s: in ``bar`` mode, the shortest time between redraws.
        min_line_interval_s: in ``lines`` mode, the shortest time from the epoch's start or
            the last line to the next line.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        total_steps: int,
        epoch: int,
        epochs: int,
        enabled: bool = True,
        *,
        stream: TextIO | None = None,
        mode: Mode = "auto",
        every: float = 0.25,
        min_interval_s: float = 0.1,
        min_line_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps={total_steps} must be >= 0")
        if not 0 < every <= 1:
            raise ValueError(f"every={every} must lie in (0, 1]")
        self.enabled = enabled
        self.total = total_steps
        self.epoch = epoch
        self.epochs = epochs
        self.stream = stream if stream is not None else sys.stdout
        self.bar = mode == "bar" or (mode == "auto" and _is_tty(self.stream))
        self.every = every
        self.min_interval_s = min_interval_s
        self.min_line_interval_s = min_line_interval_s
        self.clock = clock
        self.done = 0
        self._start = clock()
        self._last_draw = float("-inf")
        self._last_line = self._start
        self._next_fraction = every
        self._drawn_width = 0
        self._closed = False

    def _prefix(self) -> str:
        width = len(str(self.epochs))
        return f"epoch {self.epoch + 1:>{width}}/{self.epochs}"

    def _rate(self) -> float:
        elapsed = self.clock() - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def _status(self, pad: bool = True) -> str:
        rate = self._rate()
        # Padded on a bar so that it does not jitter as the count grows.
        steps = f"{self.done:>{len(str(self.total)) if pad else 0}}/{self.total} steps"
        if rate <= 0:
            return steps
        eta = (self.total - self.done) / rate
        return f"{steps}  {rate:,.1f} steps/s  ETA {_clock_text(eta)}"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _draw(self) -> None:
        columns = shutil.get_terminal_size((80, 24)).columns
        status = self._status()
        # Bar width: what is left of the line, kept between 10 and 40 characters.
        width = max(10, min(40, columns - len(self._prefix()) - len(status) - 6))
        filled = width * self.done // self.total if self.total else width
        text = f"{self._prefix()} [{'#' * filled}{'-' * (width - filled)}]  {status}"
        text = text[: max(columns - 1, 20)]
        pad = " " * max(0, self._drawn_width - len(text))
        self._write(f"\r{text}{pad}")
        self._drawn_width = len(text)

    def update(self, step: int) -> None:
        """Record that ``step`` steps of the epoch are done (clamped to the total)."""
        if not self.enabled or self._closed:
            return
        self.done = max(self.done, min(int(step), self.total))
        if self.bar:
            now = self.clock()
            if now - self._last_draw >= self.min_interval_s or self.done == self.total:
                self._last_draw = now
                self._draw()
            return
        if not self.total:
            return
        fraction = self.done / self.total
        if fraction < self._next_fraction or self.done == self.total:
            return
        while self._next_fraction <= fraction:
            self._next_fraction += self.every
        now = self.clock()
        if now - self._last_line >= self.min_line_interval_s:
            self._last_line = now
            self._write(f"{self._prefix()}: {fraction:.0%} ({self._status(pad=False)})\n")

    def close(self, line: str | None = None) -> None:
        """End the epoch: clear the bar and write ``line`` (if given) on a line of its own."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.bar and self._drawn_width:
            self._write("\r" + " " * self._drawn_width + "\r")
        if line:
            self._write(line.rstrip("\n") + "\n")


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
