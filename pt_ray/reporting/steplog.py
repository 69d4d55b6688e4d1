"""Progress while a run goes: the ``logging.every_steps`` reports (loss, throughput, learning
rate every N optimizer steps) and where they go.

Pure module (no torch, no Ray; tensorboardX's protos load on the first TensorBoard write).
The engines decide when a step reports and fill a :class:`StepRecord` (:class:`StepWindow` keeps the
cadence and the throughput window); a :class:`StepReporter` hands each record to Ray Train's
``report`` and to a :class:`StepWriter`, which appends TensorBoard scalars to
``<run folder>/tensorboard`` and flushes them, so TensorBoard shows them while the run goes.
The tags (the global step is the scalar's step):

- ``step/loss``: the step's training loss (the mean over its global batch);
- ``step/samples_per_s``: training samples per second over the steps since the last report;
- ``step/lr``: the learning rate of the step;
- ``step/num_frozen``: frozen blocks during the step;
- ``step/epoch``: the step's epoch, from 1 as in the per-epoch lines.

The end-of-run timeline (:mod:`pt_ray.reporting.tensorboard`) writes its own event file into the
same folder under other tags (``train/loss``, ... at epoch steps); TensorBoard reads both as one
run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["STEP_JOURNAL", "STEP_TAGS", "StepJournal", "StepRecord", "StepReporter", "StepWindow",
           "StepWriter", "StepWriters", "step_writers"]

logger = logging.getLogger(__name__)

# tag -> StepRecord field
STEP_TAGS: dict[str, str] = {
    "step/loss": "train_loss",
    "step/samples_per_s": "samples_per_s",
    "step/lr": "lr",
    "step/num_frozen": "num_frozen",
    "step/epoch": "epoch",
}


@dataclass(frozen=True)
class StepRecord:
    """One ``logging.every_steps`` report, as rank 0 sees it (every rank holds the same one).

    Attributes:
        epoch: 0-based epoch of the step.
        global_step: optimizer steps of the run so far, this one included (N, 2N, ...; after
            the accuracy guard's rollback the steps trained again report again).
        epoch_step: steps of the epoch so far, this one included.
        epoch_steps: steps in the epoch under the current plan.
        train_loss: the step's training loss: the mean loss over its global batch (the mean
            of the replicas' means; one all-reduce on the Ray engine), the figure the epoch's
            ``train_loss`` averages over its steps.
        samples_per_s: global training samples per second over the window: the steps since
            the previous report (or since the worker started or restored).
        lr: the learning rate the step used.
        num_frozen: frozen blocks during the step.
        window_s: wall time of the window's steps on rank 0 (the training loop's time:
            evaluation, checkpoints and the epoch's decision excluded).
        window_steps: steps in the window.
    """

    epoch: int
    global_step: int
    epoch_step: int
    epoch_steps: int
    train_loss: float
    samples_per_s: float
    lr: float
    num_frozen: int
    window_s: float
    window_steps: int

    def metrics(self) -> dict[str, Any]:
        """The record as ``ray.train.report`` metrics: its fields plus ``"report": "step"``
        (the per-epoch reports carry the epoch's record instead)."""
        return {"report": "step", **asdict(self)}


class StepWindow:
    """Which steps report, and the samples, steps and seconds since the last report.

    Args:
        every: report every this many global steps (> 0).
    """

    def __init__(self, every: int) -> None:
        if every <= 0:
            raise ValueError(f"every={every}: a step window needs every >= 1")
        self.every = every
        self.samples = 0
        self.steps = 0
        self.seconds = 0.0

    def due(self, global_step: int) -> bool:
        """Whether the step that brought the run to ``global_step`` steps reports."""
        return global_step % self.every == 0

    def add(self, samples: int, seconds: float) -> None:
        """Count a step: its global batch and its wall time."""
        self.samples += samples
        self.steps += 1
        self.seconds += seconds

    def take(self, seconds: float | None = None) -> tuple[float, float, int]:
        """End the window: ``(samples_per_s, window_s, window_steps)``, and start a new one.

        Args:
            seconds: the window's wall time to use (rank 0's, so that every rank reports the
                same figures); default: this window's own.
        """
        seconds = self.seconds if seconds is None else seconds
        out = (self.samples / max(seconds, 1e-9), seconds, self.steps)
        self.samples, self.steps, self.seconds = 0, 0, 0.0
        return out


class StepWriter:
    """Live TensorBoard scalars of the step reports in ``logdir``: its own event file
    (``events.out.tfevents.<time>.<host>.<pid>.steps``), opened on the first record and
    written synchronously, each record flushed to the OS at once (no fsync; tensorboardX's
    ``SummaryWriter`` would queue it to a thread that writes within ``flush_secs``).

    Args:
        logdir: the run's TensorBoard folder (created).
    """

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir).expanduser()
        self._file = None

    def _event(self, **fields: Any) -> bytes:
        from tensorboardX.proto.event_pb2 import Event

        return Event(wall_time=time.time(), **fields).SerializeToString()

    def _append(self, data: bytes) -> None:
        """One TFRecord: length, its masked CRC-32C, the data, the data's masked CRC-32C."""
        from tensorboardX.record_writer import masked_crc32c

        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))

    def write(self, rec: StepRecord) -> None:
        """Append ``rec``'s scalars at step ``rec.global_step`` and flush them."""
        from tensorboardX.proto.summary_pb2 import Summary

        if self._file is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
                    f".{os.getpid()}.steps")
            self._file = open(self.logdir / name, "ab")
            self._append(self._event(file_version="brain.Event:2"))
        # step/epoch counts from 1, as the per-epoch lines do.
        values = [Summary.Value(tag=tag, simple_value=float(getattr(rec, key))
                                + (key == "epoch")) for tag, key in STEP_TAGS.items()]
        self._append(self._event(step=rec.global_step, summary=Summary(value=values)))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StepJournal:
    """The step reports as JSON lines in ``path`` (``<run folder>/steps.jsonl``), appended and
    flushed one by one, across restarts and resumes: what a tracker (MLflow) reads when the run
    ends. Same interface as :class:`StepWriter`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.logdir = self.path.parent
        self._file = None

    def write(self, rec: StepRecord) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        self._file.write(json.dumps({"time": time.time(), **asdict(rec)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StepWriters:
    """Several writers as one (each record to every writer, in order)."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers
        self.logdir = writers[0].logdir

    def write(self, rec: StepRecord) -> None:
        for writer in self.writers:
            writer.write(rec)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def step_writers(run_dir: str | Path, tensorboard: bool, journal: bool) -> Any | None:
    """The writers of a run's step reports: TensorBoard's live scalars, the JSON-lines
    journal, both or none."""
    writers = ([StepWriter(Path(run_dir) / "tensorboard")] if tensorboard else []) + (
        [StepJournal(Path(run_dir) / STEP_JOURNAL)] if journal else [])
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else StepWriters(writers)


STEP_JOURNAL = "steps.jsonl"


class StepReporter:
    """Where step reports go: ``report(metrics)`` (Ray Train's, called on every rank: it is a
    barrier) and a :class:`StepWriter` (rank 0's, when TensorBoard is on).

    ``report`` takes a record only when the training time since its previous report (step
    or epoch, the epoch's report counted at the epoch's end) and the time left to the epoch's
    end are both at least ``min_gap_s``, estimated from the window's time per step: Ray Train
    collects one report per worker each time it polls the workers, and blocks the training
    loop on a report made before the previous one was collected. The decision depends on the
    record alone, so every rank that sees the same records makes the same calls. The writer
    takes every record; one that fails is logged once and dropped (TensorBoard never fails a
    run).

    Args:
        report: called with :meth:`StepRecord.metrics` (None: nowhere).
        writer: the live TensorBoard writer (None: none).
        min_gap_s: the shortest training time between two calls of ``report`` (0: every
            record).
    """

    def __init__(self, report: Callable[[dict[str, Any]], None] | None = None,
                 writer: StepWriter | None = None, min_gap_s: float = 0.0) -> None:
        self.report = report
        self.writer = writer
        self.min_gap_s = min_gap_s
        self._since = 0.0  # training seconds since `report` last ran (or the epoch began)
        self.reported = 0  # records passed to `report`

    def _takes(self, rec: StepRecord) -> bool:
        """Whether ``report`` takes ``rec`` (see the class docstring)."""
        step_s = rec.window_s / max(rec.window_steps, 1)
        if rec.window_steps >= rec.epoch_step:
            # The window holds the epoch's start: an epoch's report came in between (or the
            # worker started there).
            since = rec.epoch_step * step_s
        else:
            since = self._since + rec.window_s
        left = (rec.epoch_steps - rec.epoch_step) * step_s
        takes = since >= self.min_gap_s and left >= self.min_gap_s
        self._since = 0.0 if takes else since
        return takes

    def __call__(self, rec: StepRecord) -> None:
        if self.writer is not None:
            try:
                self.writer.write(rec)
            except Exception as err:  # a plot must not fail the run
                logger.warning("step scalars not written to %s: %s", self.writer.logdir, err)
                with contextlib.suppress(Exception):
                    self.writer.close()
                self.writer = None
        if self.report is not None and self._takes(rec):
            self.report(rec.metrics())
            self.reported += 1

    def close(self) -> None:
        """Close the writer (its event file stays)."""
        if self.writer is not None:
            self.writer.close()
