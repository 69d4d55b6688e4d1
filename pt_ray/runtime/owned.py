"""Which layers a rank holds in storage: releasing given-away layers to the ``meta`` device and
materialising received ones, in place.

Torch runtime layer. Every rank builds the whole model from the seed on the host (so its initial
weights are those of the single-process reference trainer), then keeps, in storage, only the
layers its plan gives it (``Plan.stage_layers``: stage 0 also holds the frozen prefix it runs);
the rest keep their shapes on the ``meta`` device, without storage. A layer a rank receives at
a transition is first materialised empty on the rank's device, then migration copies its whole
state into it.

Tensors are swapped in place (:func:`torch.utils.swap_tensors`), never replaced in their
modules: a parameter can be registered in two modules (a timm ViT's ``pos_embed`` lives in the
model and in the adapter's embedding), and a new object in one of them would leave the other
holding the old storage, or training a stale copy. What moves is each parameter and each
persistent buffer (what ``state_dict`` holds, hence what migration and checkpoints carry).
Non-persistent buffers (e.g. a Hugging Face embedding's ``position_ids``) are constants of the
build that no ``state_dict`` carries: they stay materialised on every rank, a few bytes each.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils import swap_tensors

__all__ = ["held_param_bytes", "is_held", "materialise", "release", "to_device"]


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


def _swap(t: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``t`` the storage (and device) of ``value``, keeping the object and its flags."""
    if isinstance(t, nn.Parameter):
        value = nn.Parameter(value, requires_grad=t.requires_grad)
    try:
        swap_tensors(t, value)
    except RuntimeError:
        # Something dropped a moment ago (a DDP reducer of the plan just left) may still hold
        # the tensor until a collection breaks its reference cycle.
        gc.collect()
        swap_tensors(t, value)


def is_held(module: nn.Module) -> bool:
    """Whether every parameter and persistent buffer of ``module`` has storage."""
    return not any(t.is_meta for t in _tensors(module, persistent_only=True))


def release(module: nn.Module) -> None:
    """Free the storage of ``module``'s parameters and persistent buffers (and gradients): each
    becomes a ``meta`` tensor of the same shape and dtype."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=True):
            if not t.is_meta:
                t.grad = None
                _swap(t, torch.empty_like(t, device="meta"))


def materialise(module: nn.Module, device: torch.device) -> None:
    """Give every ``meta`` tensor of ``module`` uninitialised storage on ``device`` (its values
    arrive by migration, a checkpoint or a snapshot) and move the others there."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=False):
            if t.is_meta:
                _swap(t, torch.empty_like(t, device=device))
            elif t.device != device:
                _swap(t, t.detach().to(device))


def to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s tensors that have storage to ``device``; released ones stay
    released (``nn.Module.to`` cannot copy a meta tensor)."""
    with torch.no_grad():
        for t in _tensors(module, persistent_only=False):
            if not t.is_meta and t.device != device:
                _swap(t, t.detach().to(device))


def held_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters of ``modules`` that have storage."""
    return sum(p.numel() * p.element_size()
               for m in modules for p in _tensors(m, persistent_only=True)
               if isinstance(p, nn.Parameter) and not p.is_meta)
