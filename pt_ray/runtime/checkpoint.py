"""Checkpoints of an elastic run: per-layer shards from every rank plus one metadata file.

Each rank writes ``shard-rank<r>.pt`` with the layers whose authoritative copy it holds
(replica 0's holders): parameters and, for layers that still train, their optimizer state. Rank 0
also writes ``meta.json`` (epoch, step, samples seen, the plan, the controller's state). Shards
are keyed by layer name, not by rank, so a restart under any plan (or any number of workers)
finds every layer it needs wherever it was saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pt_ray.models.base import ModelAdapter, layer_module, layer_names

__all__ = ["META", "load_layers", "load_parameters", "read_meta", "write_meta", "write_shard"]

META = "meta.json"


def write_shard(
    directory: Path, rank: int, layers: dict[str, dict[str, Any]]
) -> Path:
    """Write one rank's layers: ``{layer: {"params": state_dict, "optim": [state per param]}}``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-rank{rank}.pt"
    torch.save(layers, path)
    return path


def write_meta(directory: Path, meta: dict[str, Any]) -> Path:
    """Write the run-level metadata (rank 0 only)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / META
    path.write_text(json.dumps(meta, indent=1))
    return path


def read_meta(directory: Path) -> dict[str, Any]:
    """The metadata of a checkpoint directory."""
    path = Path(directory) / META
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a pt-ray checkpoint directory")
    return json.loads(path.read_text())


def load_layers(
    directory: Path, names: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Find and load the listed layers from every shard in ``directory`` (each read once).

    Returns:
        ``(layers, norms)``: the layers by name, and the gradient-norm meter of the interval in
        progress merged over shards (``{"sums": {block: value}, "steps": n}``).

    Raises:
        FileNotFoundError: a layer is in no shard (the checkpoint is incomplete).
    """
    found: dict[str, dict[str, Any]] = {}
    norms: dict[str, Any] = {"sums": {}, "steps": 0}
    wanted = set(names)
    for shard in sorted(Path(directory).glob("shard-rank*.pt")):
        layers = torch.load(shard, map_location="cpu", weights_only=False)
        for name in wanted & set(layers):
            found[name] = layers[name]
        meter = layers.get("__norms__")
        if meter:
            norms["sums"].update(meter["sums"])
            norms["steps"] = meter["steps"]
    missing = wanted - set(found)
    if missing:
        raise FileNotFoundError(
            f"checkpoint {directory} holds no shard with layers {sorted(missing)}"
        )
    return found, norms


def load_parameters(directory: Path, adapter: ModelAdapter) -> dict[str, Any]:
    """Load every layer's parameters from a checkpoint into ``adapter``'s model (optimizer state
    and gradient norms are left out); returns the checkpoint's metadata.

    Raises:
        FileNotFoundError: ``directory`` is no checkpoint, or a layer is in no shard.
    """
    meta = read_meta(directory)
    names = layer_names(adapter.num_layers)
    layers, _ = load_layers(directory, names)
    with torch.no_grad():
        for name in names:
            layer_module(adapter, name).load_state_dict(layers[name]["params"])
    return meta
