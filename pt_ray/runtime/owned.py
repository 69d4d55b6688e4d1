"""Which layers a rank holds in storage: freeing the storage of given-away layers and giving
received ones storage again, without replacing any tensor object.

Torch runtime layer. Every rank builds the whole model from the seed on the host (so its initial
weights are those of the single-process reference trainer), then keeps, in storage, only the
layers its plan gives it (``Plan.stage_layers``: stage 0 also holds the frozen prefix it runs).
The rest keep their shapes, dtypes and devices, but their storage is resized to nothing, as
FSDP frees a shard: the memory is returned while the tensor objects, their shapes and their
autograd state stay as they are. A layer a rank receives at a transition first gets fresh,
uninitialised storage on the rank's device (``tensor.data = torch.empty_like(...)``), then
migration copies its whole state into it.

Nothing here swaps or replaces a tensor object. A parameter can be registered in two modules (a
timm ViT's ``pos_embed`` lives in the model and in the adapter's embedding), and a DDP reducer
or an autograd node may still refer to a parameter of the plan just left: all of them keep
seeing the same tensor. (An earlier version swapped tensor implementations in place with
``torch.utils.swap_tensors``, which must poison the autograd node of a trained parameter and
retry past lingering references; under it a rank of a mid-epoch transition test once died of
a double free.) What is freed is each parameter and each persistent buffer (what ``state_dict``
holds, hence what migration and checkpoints carry). Non-persistent buffers (e.g. a Hugging Face
embedding's ``position_ids``) are constants of the build that no ``state_dict`` carries: they
stay in storage on every rank, a few bytes each.

A released tensor must not be read: it has no data. The engine never reads one (its stages,
optimizer, checkpoints and memory figures cover owned layers only); :func:`is_held` tells them
apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["has_storage", "held_param_bytes", "is_held", "materialise", "release", "to_device"]


def _tensors(module: nn.Module, persistent_only: bool) -> Iterator[torch.Tensor]:
    """Every parameter, then every buffer (only persistent ones if asked) of ``module``, each
    once (a tensor registered in two submodules is one tensor)."""
    seen: set[int] = set()
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p
    for m in module.modules():
        skip = m._non_persistent_buffers_set if persistent_only else ()
        for name, b in m._buffers.items():
            if b is not None and name not in skip and id(b) not in seen:
                seen.add(id(b))
                yield b


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has its data (an empty tensor always has)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


def _free(t: torch.Tensor) -> None:
    """Return ``t``'s memory, keeping the tensor object, its shape and its dtype."""
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:  # storage that cannot be resized (e.g. memory-mapped weights)
        t.data = torch.empty_like(t)
        t.untyped_storage().resize_(0)


def is_held(module: nn.Module) -> bool:
    """Whether every parameter and persistent buffer of ``module`` has storage."""
    return all(has_storage(t) for t in _tensors(module, persistent_only=True))


def release(module: nn.Module) -> None:
    """Free the storage of ``module``'s parameters and persistent buffers (and drop their
    gradients); shapes, dtypes and devices stay."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=True):
            t.grad = None
            if has_storage(t) and t.numel():
                _free(t)


def materialise(module: nn.Module, device: torch.device) -> None:
    """Give every released tensor of ``module`` fresh, uninitialised storage on ``device`` (its
    values arrive by migration, a checkpoint or a snapshot) and move the others there."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=False):
            if not has_storage(t):
                t.data = torch.empty(t.shape, dtype=t.dtype, device=device)
            elif t.device != device:
                t.data = t.data.to(device)


def to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s tensors that have storage to ``device``; released ones stay released
    (they get storage on the device when :func:`materialise` gives it)."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=False):
            if has_storage(t) and t.device != device:
                t.data = t.data.to(device)


def held_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters of ``modules`` that have storage."""
    return sum(p.numel() * p.element_size()
               for m in modules for p in _tensors(m, persistent_only=True)
               if isinstance(p, nn.Parameter) and has_storage(p))
