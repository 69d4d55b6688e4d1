"""Continuing a stopped run: ``pt-ray train --resume RUN_DIR`` and ``fit(resume_from=RUN_DIR)``.

A run on Ray checkpoints after every ``checkpoint_every`` epochs into ``RUN_DIR/ray/<run
id>/checkpoint_<time>``: every layer's parameters and optimizer state, the freeze state, the
plan, the controller's timeline and decisions, the learning-rate position, the data position and
the RNG state. A resumed run reads the run's ``config.yaml``, takes the newest complete
checkpoint (a damaged one, e.g. cut short when the process died while writing it, is skipped
with a warning) and goes on from there as a worker-group restart would, into the same folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError, RunConfig, load_config

__all__ = ["CHANGEABLE_ON_RESUME", "ResumePoint", "resume_point"]

CHANGEABLE_ON_RESUME = ("pipeline.", "logging.")
"""Override prefixes a resumed run accepts: where and on how many workers it runs, and what it
logs. Anything else would make it a different run than the one it continues."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped run goes on from.

    Attributes:
        config: the run's configuration with the accepted overrides applied.
        run_dir: the run's folder (the resumed run writes into it).
        checkpoint: the newest complete checkpoint folder.
        meta: that checkpoint's metadata (``epoch`` is the last epoch it holds, from 0).
    """

    config: RunConfig
    run_dir: Path
    checkpoint: Path
    meta: dict[str, Any]

    @property
    def next_epoch(self) -> int:
        """The first epoch the resumed run trains (from 0)."""
        return int(self.meta["epoch"]) + 1


def resume_point(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ResumePoint:
    """Find where the run in ``run_dir`` stopped, checking everything before anything starts.

    Raises:
        ConfigError: ``run_dir`` holds no pt-ray run, an override changes more than
            :data:`CHANGEABLE_ON_RESUME`, the run used the reference engine (no checkpoints),
            it left no complete checkpoint, or it already finished every epoch.
    """
    from pt_ray.runtime.checkpoint import latest_checkpoint, read_meta

    run_dir = Path(run_dir).expanduser().absolute()
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ConfigError(
            f"resume: {str(config_path)!r} not found; pass the folder of a run pt-ray started "
            "(it holds config.yaml and ray/)")
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if not key.startswith(CHANGEABLE_ON_RESUME):
            raise ConfigError(
                f"{key} cannot change when a run resumes (only pipeline.* and logging.* can); "
                f"start a new run to change it")
    cfg = load_config(config_path, list(overrides))
    if cfg.engine != "ray":
        raise ConfigError(
            f"resume: the run in {str(run_dir)!r} used engine={cfg.engine}, which writes no "
            "checkpoints; only engine=ray runs can resume")
    folders = [p for p in (run_dir / "ray").glob("*/checkpoint_*") if p.is_dir()]
    checkpoint = latest_checkpoint(folders)
    if checkpoint is None:
        damaged = f" ({len(folders)} damaged)" if folders else ""
        raise ConfigError(
            f"resume: no complete checkpoint under {str(run_dir / 'ray')!r}{damaged}; the run "
            "stopped before its first checkpoint (see checkpoint_every): start it again")
    meta = read_meta(checkpoint)
    point = ResumePoint(cfg, run_dir, checkpoint, meta)
    if point.next_epoch >= cfg.epochs:
        raise ConfigError(
            f"resume: the run in {str(run_dir)!r} already finished all {cfg.epochs} epochs; "
            "nothing to resume (start a new run to train longer)")
    return point
