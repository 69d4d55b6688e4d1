"""Checkpoints of an elastic run: per-layer shards from every rank plus one metadata file.

Each rank writes ``shard-rank<r>.pt`` with its share of its stage's layers (the stage's
layers dealt out among its replicas by bytes, since every replica holds them alike): parameters
and, for layers that still train, their optimizer state, and beside it ``shard-rank<r>.json``,
the shard's size, CRC-32 and the names of the layers it holds (the index by which a restoring
rank reads only the shards of its own layers). Rank 0 also writes ``meta.json`` (epoch, step,
samples seen, the plan, the controller's state, and ``num_shards``). Shards are keyed by layer
name, not by rank, so a restart under any plan (or any number of workers) finds
every layer it needs wherever it was saved.

A shard is pt-ray's own flat file (:func:`write_shard`): a magic number, a small pickled header
(the layers' structure with every tensor replaced by its place, and each tensor's dtype, shape
and offset), then every tensor's bytes at 64-byte aligned offsets, streamed straight from the
tensors and hashed on the way in one pass. ``torch.save`` would spend about 60 microseconds on
each tensor it pickles (a shard of a few layers with their AdamW state holds hundreds of small
ones), and copying them into one buffer first, saving that, and reading the file back to hash
it went over the bytes four times. Shards written before (one ``torch.save``, packed into one
buffer or not) still load.

Ray Train copies each rank's files into the checkpoint folder; a process that dies during the
copy leaves a folder that lacks files or holds a truncated one. :func:`damage` finds that from
the manifests, and :func:`latest_checkpoint` skips such a folder for the one before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pt_ray.models.base import ModelAdapter, layer_module, layer_names

__all__ = ["META", "damage", "deal_layers", "latest_checkpoint", "load_layers",
           "load_parameters", "read_meta", "read_shard", "usable_checkpoint", "write_meta",
           "write_shard"]

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
    (tensors on the CPU), and then its manifest (size, CRC-32 and the layer names,
    ``__norms__`` left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-rank{rank}.pt"
    skeleton, tensors = _flatten(layers)
    specs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((t.dtype, tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    header = pickle.dumps({"skeleton": skeleton, "specs": specs},
                          protocol=pickle.HIGHEST_PROTOCOL)
    lead = _MAGIC + struct.pack("<Q", len(header)) + header
    pieces = [lead, _ZEROS[:_aligned(len(lead)) - len(lead)]]
    for t, (_, _, _, nbytes) in zip(tensors, specs):
        if nbytes:
            pieces += [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()),
                       _ZEROS[:_aligned(nbytes) - nbytes]]
    # CRC-32, as zip files (and torch.save) check their records: it finds a truncated or
    # changed shard, which is all a checksum here must do, at a fraction of a cryptographic
    # hash's cost (nothing adversarial writes these files).
    crc, size = 0, 0
    with path.open("wb") as f:
        def put(data) -> None:
            nonlocal crc, size
            f.write(data)
            crc = zlib.crc32(data, crc)
            size += len(data)

        # Small pieces go out joined (a shard holds hundreds of small tensors, and each write
        # and hash update costs microseconds); a large one straight from its tensor.
        batch, pending = [], 0
        for piece in pieces:
            if len(piece) >= _DIRECT_BYTES:
                if batch:
                    put(b"".join(batch))
                    batch, pending = [], 0
                put(piece)
                continue
            batch.append(piece)
            pending += len(piece)
            if pending >= _DIRECT_BYTES:
                put(b"".join(batch))
                batch, pending = [], 0
        if batch:
            put(b"".join(batch))
    manifest = {"file": path.name, "bytes": size, "crc32": crc,
                "layers": sorted(n for n in layers if not n.startswith("__"))}
    path.with_suffix(".json").write_text(json.dumps(manifest))
    return path


def read_shard(path: Path) -> dict[str, Any]:
    """The layers a shard holds, each tensor its own copy: pt-ray's flat file
    (:func:`write_shard`), or one ``torch.save`` of them (packed into one buffer or not)
    as shards were written before."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            return _unpack(torch.load(path, map_location="cpu", weights_only=False))
    data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    (length,) = struct.unpack("<Q", data[len(_MAGIC):len(_MAGIC) + 8].numpy().tobytes())
    lead = len(_MAGIC) + 8 + length
    header = pickle.loads(data[len(_MAGIC) + 8:lead].numpy().tobytes())
    return _unpack({_PACKED: 1, "skeleton": header["skeleton"], "specs": header["specs"],
                    "buffer": data[_aligned(lead):]})


# The first bytes of a shard in pt-ray's flat format.
_MAGIC = b"PTRAYSH1"
# Marks a packed object (an earlier shard format); a tensor's place is ``(_SLOT, index)``.
_PACKED, _SLOT = "__pt_ray_packed__", "__pt_ray_tensor__"
_ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype views it in place
_ZEROS = memoryview(bytes(_ALIGN))
_DIRECT_BYTES = 1 << 20  # pieces at least this large are written (and hashed) on their own


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` (nested dicts, lists and tuples) with every tensor replaced by its place in the
    returned list; other values are kept as they are."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return (_SLOT, len(tensors) - 1)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj), tensors


def _unpack(packed: Any) -> Any:
    """The object a packed one (skeleton, specs, one byte buffer) describes, each tensor its
    own copy; anything that is not packed (a shard of plain ``torch.save``) as it is."""
    if not (isinstance(packed, dict) and packed.get(_PACKED) == 1):
        return packed
    buffer = packed["buffer"]
    tensors = []
    for dtype, shape, start, nbytes in packed["specs"]:
        raw = buffer[start:start + nbytes]
        tensors.append(raw.view(dtype).view(shape).clone() if nbytes
                       else torch.empty(shape, dtype=dtype))

    def walk(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 2 and x[0] == _SLOT:
            return tensors[x[1]]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(packed["skeleton"])


def _checksum(path: Path, kind: str) -> str | int:
    """The file's ``crc32`` (what shards' manifests hold) or ``sha256`` (manifests written
    before)."""
    digest, crc = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            if kind == "crc32":
                crc = zlib.crc32(chunk, crc)
            else:
                digest.update(chunk)
    return crc if kind == "crc32" else digest.hexdigest()


def damage(directory: Path) -> str | None:
    """Why the checkpoint in ``directory`` cannot be used (a file missing, unreadable,
    truncated or changed), or None when it is complete.

    A checkpoint written before shards had manifests (no ``num_shards`` in its metadata) is
    judged by its metadata alone.
    """
    directory = Path(directory)
    try:
        meta = read_meta(directory)
    except (OSError, ValueError) as err:
        return f"{META} unreadable ({type(err).__name__}: {err})"
    for rank in range(meta.get("num_shards", 0)):
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
        kind = "crc32" if "crc32" in expected else "sha256"
        if _checksum(shard, kind) != expected[kind]:
            return f"{shard.name} does not match its {'CRC-32' if kind == 'crc32' else 'SHA-256'}"
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
    """Write the run-level metadata (rank 0 only)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / META
    path.write_text(json.dumps(meta))  # the controller's state: tens of KB, read by programs
    return path


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
    read: a rank restoring its stage reads its own layers, not the whole model. A checkpoint
    whose manifests lack the names (written before they had them) is read whole.

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
        layers = read_shard(shard)
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


def _shards_holding(directory: Path, wanted: set[str]) -> list[Path]:
    """The shard files that hold a layer of ``wanted``, by their manifests; every shard when a
    manifest is missing or names no layers (an older checkpoint).

    The gradient-norm meter of a block travels in the shard of the rank that trained it, which
    is the shard holding the block, so the shards read carry the norms of the wanted blocks.
    """
    shards = sorted(directory.glob("shard-rank*.pt"))
    chosen = []
    for shard in shards:
        try:
            listed = json.loads(shard.with_suffix(".json").read_text()).get("layers")
        except (OSError, ValueError):
            listed = None
        if listed is None:
            return shards
        if wanted & set(listed):
            chosen.append(shard)
    return chosen


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
