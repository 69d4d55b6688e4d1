"""A finished run's model, exported in its library's own format into ``RUN_DIR/model/``.

The reference engine holds the final parameters in memory and ``fit`` exports them as the run
ends. The Ray engine's final parameters are its last checkpoint's per-layer shards (the last
epoch always checkpoints): the model is rebuilt from the run's config, sized by its dataset as
the run sized it (``fit`` passes the preflight's datasets, so the data is not read again), and
the shards are loaded into it. The format is
:mod:`pt_ray.models.export`'s.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from pt_ray.core.config import DataConfig, ModelConfig, RunConfig
from pt_ray.data.base import DatasetSplits
from pt_ray.models.base import ModelAdapter
from pt_ray.models.export import README, export_model, folder_line
from pt_ray.reporting.summary import read_summary

__all__ = ["MODEL_DIR", "export_adapter", "export_checkpoint", "export_run", "find_checkpoint",
           "write_card"]

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
"""The export's folder inside a run folder."""


def _tokenizer(model: ModelConfig, tokenizer: Path | None) -> Any:
    """The run's tokenizer (``tokenizer``, the run's ``data.tokenizer``, else
    ``model.weights``), or None without one."""
    if model.family != "hf":
        return None
    from pt_ray.data.text import load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if model.weights is None:
        return None
    try:
        return load_tokenizer(model.weights)
    except (OSError, ValueError):  # a weights folder without tokenizer files
        logger.info("no tokenizer in %s: exporting the model alone", model.weights)
        return None


def export_adapter(adapter: ModelAdapter, out: Path, source: str, *, model: ModelConfig,
                   tokenizer: Path | None = None) -> Path:
    """Export a trained model (with its tokenizer) into ``out``.

    Args:
        adapter: the trained model.
        out: the export folder.
        source: where it came from, for the README (``run 'name' ...``).
        model: the run's ``model`` section (its family and weights).
        tokenizer: the run's ``data.tokenizer`` (None: the weights' own, if any).
    """
    return export_model(adapter, out, tokenizer=_tokenizer(model, tokenizer), source=source)


def export_checkpoint(checkpoint: str | Path, out: Path, *, model: ModelConfig,
                      data: DataConfig, seed: int, name: str,
                      splits: DatasetSplits | None = None,
                      adapter: ModelAdapter | None = None) -> Path:
    """Rebuild the run's model, load a checkpoint's parameters and export them into ``out``.

    Args:
        checkpoint: a checkpoint directory (shards and ``meta.json``).
        out: the export folder.
        model: the run's resolved ``model`` section.
        data: the run's ``data`` section (its datasets size the model; its tokenizer).
        seed: the run's ``seed``.
        name: the run's ``name``, for the README.
        splits: the run's datasets, which size the model (default: built from ``data``).
        adapter: the run's model built already (the driver's preflight), to load the
            checkpoint into; one on the meta device (shapes only) or None: built here.

    Raises:
        FileNotFoundError: the checkpoint or the dataset files are missing.
        ValueError: the model cannot be built from ``model``.
    """
    from pt_ray.data.registry import build_dataset
    from pt_ray.runtime.checkpoint import load_parameters
    from pt_ray.runtime.build import build_model_for, on_meta

    if adapter is None or on_meta(adapter):
        if splits is None:
            splits = build_dataset(data, seed=seed, tokenizer_dir=model.weights)
        adapter = build_model_for(model, seed, splits)
    meta = load_parameters(Path(checkpoint), adapter)
    logger.info("exporting the parameters after epoch %d from %s", meta["epoch"], checkpoint)
    return export_adapter(adapter, out,
                          f"run {name!r}, checkpoint after epoch {meta['epoch'] + 1}",
                          model=model, tokenizer=data.tokenizer)


def find_checkpoint(run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """The run's last checkpoint: the path in its summary, or the same folder under
    ``run_dir/ray`` when the run folder has moved since; None when the run recorded none."""
    recorded = summary.get("checkpoint")
    if not recorded:
        return None
    path = Path(recorded)
    moved = run_dir / "ray" / path.parent.name / path.name
    return next((p for p in (path, moved) if (p / "meta.json").is_file()), path)


def export_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Export a finished run's model into ``out`` (default: ``run_dir/model``).

    A Ray run is exported from its last checkpoint. A reference run wrote no checkpoint: its
    export from the end of the run is copied to ``out`` (nothing to do when ``out`` is it).

    Raises:
        FileNotFoundError: no ``summary.json`` (the run has not finished), or no checkpoint and
            no export to copy; each message names the path and the fix.
        ValueError: the model cannot be rebuilt from the run's config.
    """
    run_dir = Path(run_dir).expanduser()
    target = Path(out).expanduser() if out is not None else run_dir / MODEL_DIR
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(
            f"{summary_path} not found: pass the folder of a finished run (`pt-ray train` "
            "writes summary.json when the run ends)")
    summary = read_summary(summary_path)
    cfg = RunConfig.model_validate(summary["config"])
    checkpoint = find_checkpoint(run_dir, summary)
    if checkpoint is not None:
        if not (checkpoint / "meta.json").is_file():
            raise FileNotFoundError(
                f"checkpoint {checkpoint} not found (neither there nor under {run_dir / 'ray'}): "
                "copy the run folder with its ray/ subfolder")
        exported = export_checkpoint(checkpoint, target, model=cfg.model, data=cfg.data,
                                     seed=cfg.seed, name=cfg.name)
        return write_card(exported, summary)
    existing = run_dir / MODEL_DIR
    if not (existing / "config.json").is_file():
        engine = summary.get("engine", cfg.engine)
        why = " (engine=reference keeps its parameters in memory)" if engine == "reference" else ""
        raise FileNotFoundError(
            f"{existing} not found and {run_dir} holds no checkpoint{why}: train again to "
            "export at the end of the run, or use engine=ray, which checkpoints")
    if target.resolve() != existing.resolve():
        shutil.copytree(existing, target, dirs_exist_ok=True)
        readme = target / README
        if readme.is_file():
            readme.write_text(readme.read_text().replace(folder_line(existing),
                                                         folder_line(target)))
    return write_card(target, summary)


def write_card(out: Path, summary: dict[str, Any]) -> Path:
    """Write the export's model card (``README.md``, :mod:`pt_ray.reporting.card`) beside the
    export in ``out``, from the run's summary; returns ``out``."""
    from pt_ray.reporting.card import CARD, model_card
    from pt_ray.reporting.files import write_text_atomically

    load = (out / README).read_text() if (out / README).is_file() else ""
    write_text_atomically(out / CARD, model_card(summary, load))
    return out
