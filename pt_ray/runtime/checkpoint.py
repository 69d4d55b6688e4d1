"""Checkpoints of an elastic run: per-layer shards from every rank plus one metadata file.

Each rank writes ``shard-rank<r>.safetensors`` with its share of its stage's layers (the stage's
layers dealt out among its replicas by bytes, since every replica holds them alike): parameters
and, for layers that still train, their optimizer state, and beside it ``shard-rank<r>.json``,
the shard's size, CRC-32 and the names of the layers it holds (the index by which a restoring
rank reads only the shards of its own layers). Rank 0 also writes ``meta.json`` (epoch, step,
samples seen, the plan, the controller's state, and ``num_shards``). Shards are keyed by layer
name, not by rank, so a restart under any plan (or any number of workers) finds
every layer it needs wherever it was saved.

A shard is a safetensors file: its tensors under their place in the layers' structure, and
that structure (nested dicts, lists, numbers) as JSON in the file's metadata. Reading one
unpickles nothing.

Ray Train copies each rank's files into the checkpoint folder; a process that dies during the
copy leaves a folder that lacks files or holds a truncated one. :func:`damage` finds that from
the manifests, and :func:`latest_checkpoint` skips such a folder for the one before it.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from collections.abc import Collection
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pt_ray.models.base import ModelAdapter, layer_module, layer_names
from pt_ray.reporting.files import sync_file, write_text_atomically

__all__ = ["META", "damage", "deal_layers", "latest_checkpoint", "load_layers",
           "load_parameters", "read_meta", "read_rollback", "read_shard", "usable_checkpoint",
           "write_meta", "write_shard"]

logger = logging.getLogger(__name__)

META = "meta.json"


def deal_layers(weights: dict[str, int], num_replicas: int) -> list[list[str]]:
    """Which of a stage's layers each of its replicas writes (every replica holds them all):
    largest first, each to the replica with the fewest bytes so far, ties to the last one, so
    that the shares come out within one layer's bytes of each other and replica 0 (whose rank 0
    also writes the run's metadata) takes the smaller share of a tie. Each share keeps the
    layers' order.

    Args:
        weights: bytes per layer, in the stage's order.
        num_replicas: R.
    """
    loads, shares = [0] * num_replicas, [set() for _ in range(num_replicas)]
    for name in sorted(weights, key=lambda n: -weights[n]):  # stable: ties keep their order
        to = min(range(num_replicas), key=lambda k: (loads[k], -k))
        loads[to] += weights[name]
        shares[to].add(name)
    return [[n for n in weights if n in share] for share in shares]


def write_shard(
    directory: Path, rank: int, layers: dict[str, dict[str, Any]]
) -> Path:
    """Write one rank's layers, ``{layer: {"params": state_dict, "optim": [state per param]}}``
    (tensors on the CPU), as a safetensors file whose metadata holds their structure, and then
    its manifest (size, CRC-32 and the layer names, ``__norms__`` and ``__rollback__`` left
    out)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-rank{rank}.safetensors"
    skeleton, tensors = _flatten(layers)
    save_file({str(i): t for i, t in enumerate(tensors)}, path,
              metadata={_STRUCTURE: json.dumps(skeleton)})
    # CRC-32, as zip files check their records: it finds a truncated or changed shard, which
    # is all a checksum here must do (nothing adversarial writes these files).
    manifest = {"file": path.name, "bytes": path.stat().st_size, "crc32": _crc32(path),
                "layers": sorted(n for n in layers if not n.startswith("__"))}
    # The manifest vouches for the shard, so the shard's bytes reach the disk first, and the
    # manifest lands whole (synced, then renamed into place) or not at all.
    sync_file(path)
    write_text_atomically(path.with_suffix(".json"), json.dumps(manifest))
    return path


def read_shard(path: Path, keys: Collection[str] | None = None) -> dict[str, Any]:
    """The layers a shard holds (:func:`write_shard`), or only those of ``keys`` (the others'
    tensors are not read). Nothing in the file is unpickled.

    Raises:
        ValueError: the file is not a shard pt-ray wrote.
    """
    path = Path(path)
    fix = "resume from a checkpoint pt-ray wrote"
    try:
        with safe_open(path, framework="pt") as f:
            structure = (f.metadata() or {}).get(_STRUCTURE)
            if structure is None:
                raise ValueError(f"{path} is not a pt-ray checkpoint shard (its metadata has "
                                 f"no {_STRUCTURE!r}); {fix}")
            skeleton = json.loads(structure)
            if keys is not None:
                skeleton = {"d": [[k, v] for k, v in skeleton["d"] if k in keys]}
            tensors = {i: f.get_tensor(str(i)) for i in _places(skeleton)}
    except SafetensorError as err:
        raise ValueError(f"{path} is not a pt-ray checkpoint shard ({err}); {fix}") from None
    return _rebuild(skeleton, tensors)


# The safetensors metadata key that holds a shard's structure.
_STRUCTURE = "pt_ray.structure"


def _flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` (nested dicts, lists and tuples of tensors, numbers, strings, booleans and
    None) as JSON-ready data, every tensor replaced by its place in the returned list (each
    contiguous and holding its own memory, as safetensors wants).

    A dict becomes ``{"d": [[key, value], ...]}`` (its keys keep their type, int or str), a
    tuple ``{"u": [...]}``, a tensor ``{"t": index}``; lists and plain values stay as they are.

    Raises:
        TypeError: a value of another type (it could not be read back without unpickling).
    """
    tensors: list[torch.Tensor] = []
    storages: set[int] = set()

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous()
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            if ptr in storages:  # a view of a tensor already written: its own copy
                t = t.clone()
            elif ptr is not None:
                storages.add(ptr)
            tensors.append(t)
            return {"t": len(tensors) - 1}
        if isinstance(x, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
                raise TypeError(f"a checkpoint shard's dict keys must be str or int: {list(x)}")
            return {"d": [[k, walk(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"u": [walk(v) for v in x]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"a checkpoint shard cannot hold a {type(x).__name__}: {x!r}")

    return walk(obj), tensors


def _places(skeleton: Any) -> list[int]:
    """The places of the tensors that ``skeleton`` holds."""
    if isinstance(skeleton, list):
        return [i for v in skeleton for i in _places(v)]
    if isinstance(skeleton, dict):
        if "t" in skeleton:
            return [skeleton["t"]]
        return [i for v in skeleton.get("u", [v for _, v in skeleton.get("d", [])])
                for i in _places(v)]
    return []


def _rebuild(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The object :func:`_flatten` turned into ``skeleton``, its tensors from ``tensors``."""
    if isinstance(skeleton, list):
        return [_rebuild(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "t" in skeleton:
            return tensors[skeleton["t"]]
        if "u" in skeleton:
            return tuple(_rebuild(v, tensors) for v in skeleton["u"])
        return {k: _rebuild(v, tensors) for k, v in skeleton["d"]}
    return skeleton


def _crc32(path: Path) -> int:
    """The file's CRC-32 (what shards' manifests hold)."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def damage(directory: Path) -> str | None:
    """Why the checkpoint in ``directory`` cannot be used (a file missing, unreadable,
    truncated or changed), or None when it is complete."""
    directory = Path(directory)
    try:
        meta = read_meta(directory)
    except (OSError, ValueError) as err:
        return f"{META} unreadable ({type(err).__name__}: {err})"
    if "num_shards" not in meta:
        return f"{META} names no shards (not written by this version of pt-ray)"
    for rank in range(meta["num_shards"]):
        manifest = directory / f"shard-rank{rank}.json"
        try:
            expected = json.loads(manifest.read_text())
        except (OSError, ValueError):
            return f"{manifest.name} missing or unreadable"
        shard = directory / expected["file"]
        if not shard.is_file():
            return f"{shard.name} missing"
        size = shard.stat().st_size
        if size != expected["bytes"]:
            return f"{shard.name} holds {size} bytes of {expected['bytes']}"
        if _crc32(shard) != expected.get("crc32"):
            return f"{shard.name} does not match its CRC-32"
    return None


def latest_checkpoint(folders: list[Path]) -> Path | None:
    """The newest complete checkpoint among ``folders`` (Ray Train names them
    ``checkpoint_<date>_<time>``, so the name orders them in time); each newer damaged one is
    logged with what is wrong and skipped. None when none is complete."""
    for folder in sorted(folders, key=lambda p: p.name, reverse=True):
        why = damage(folder)
        if why is None:
            return folder
        logger.warning("checkpoint %s skipped: %s; trying the one before it", folder, why)
    return None


def write_meta(directory: Path, meta: dict[str, Any]) -> Path:
    """Write the run-level metadata (rank 0 only): synced, then renamed into place, so a crash
    or a power loss leaves no half-written ``meta.json``."""
    # The controller's state: tens of KB, read by programs.
    return write_text_atomically(directory / META, json.dumps(meta))


def read_meta(directory: Path) -> dict[str, Any]:
    """The metadata of a checkpoint directory."""
    path = Path(directory) / META
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a pt-ray checkpoint directory")
    return json.loads(path.read_text())


def usable_checkpoint(directory: Path) -> Path:
    """``directory`` when its checkpoint is complete, else the newest complete one before it
    in the same run folder, with a warning that says why.

    Raises:
        FileNotFoundError: it is damaged and no complete checkpoint precedes it.
    """
    directory = Path(directory)
    why = damage(directory)
    if why is None:
        return directory
    older = [p for p in directory.parent.glob("checkpoint_*")
             if p.is_dir() and p.name < directory.name]
    logger.warning("checkpoint %s is damaged (%s); trying the one before it", directory, why)
    fallback = latest_checkpoint(older)
    if fallback is None:
        raise FileNotFoundError(f"checkpoint {directory} is damaged ({why}) and no complete "
                                "checkpoint precedes it")
    logger.warning("restoring from %s instead", fallback)
    return fallback


def load_layers(
    directory: Path, names: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Find and load the listed layers from the shards in ``directory`` that hold them (each
    read once).

    The shards' manifests name their layers, so only the shards holding a listed layer are
    read: a rank restoring its stage reads its own layers, not the whole model.

    Returns:
        ``(layers, norms)``: the layers by name, and the gradient-norm meter of the interval in
        progress merged over shards (``{"sums": {block: value}, "steps": n}``).

    Raises:
        FileNotFoundError: a layer is in no shard (the checkpoint is incomplete).
    """
    found: dict[str, dict[str, Any]] = {}
    norms: dict[str, Any] = {"sums": {}, "steps": 0}
    wanted = set(names)
    for shard in _shards_holding(Path(directory), wanted):
        layers = read_shard(shard, keys=wanted | {"__norms__"})
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


def read_rollback(directory: Path, rank: int) -> dict[int, dict[str, Any]]:
    """The rollback snapshots rank ``rank``'s shard holds (``{}`` when none was pending)."""
    shard = Path(directory) / f"shard-rank{rank}.safetensors"
    return read_shard(shard, keys=("__rollback__",)).get("__rollback__", {})


def _shards_holding(directory: Path, wanted: set[str]) -> list[Path]:
    """The shard files whose manifests name a layer of ``wanted`` (:func:`damage` has checked
    that every manifest is there).

    The gradient-norm meter of a block travels in the shard of the rank that trained it, which
    is the shard holding the block, so the shards read carry the norms of the wanted blocks.
    """
    return [shard for shard in sorted(directory.glob("shard-rank*.safetensors"))
            if wanted & set(json.loads(shard.with_suffix(".json").read_text())["layers"])]


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
