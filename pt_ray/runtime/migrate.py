"""State migration between plans: parameters and optimizer state follow their layers.

At a transition every rank walks the same list of transfers (``plan.transfers``): the rank that
holds a layer's latest state (replica 0's holder under the old plan) sends the layer's parameters
and, for layers that keep training, their optimizer state (moments and step counts) to each rank
that needs it under the new plan. Nothing is re-initialised; the head and the optimizer's
moments carry over (the 2021 code lost both). Transfers are point-to-point in one global order,
so every rank meets its partner at the same transfer and none can deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pt_ray.plan import Plan, is_trainable, transfers
from pt_ray.runtime.sync import recv_tensors, send_tensors

__all__ = ["LayerStates", "collect_layer_state", "migrate"]

LayerStates = dict[str, list[dict[str, torch.Tensor]]]
"""Optimizer state per layer: for each parameter of the layer (in ``parameters()`` order), the
optimizer's per-parameter state dict (empty if it never stepped)."""


def collect_layer_state(optimizer: torch.optim.Optimizer | None, module: nn.Module) -> list[dict]:
    """The optimizer state of a module's parameters, in ``parameters()`` order."""
    if optimizer is None:
        return [{} for _ in module.parameters()]
    return [dict(optimizer.state.get(p, {})) for p in module.parameters()]


def _send_state(states: list[dict], dst: int) -> None:
    keys = [sorted(s) for s in states]
    dist.send_object_list([keys], dst)
    send_tensors([torch.as_tensor(s[k]) for s, ks in zip(states, keys) for k in ks], dst)


def _recv_state(src: int) -> list[dict]:
    box = [None]
    dist.recv_object_list(box, src)
    keys = box[0]
    flat = iter(recv_tensors(src))
    return [{k: next(flat) for k in ks} for ks in keys]


def migrate(
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer | None,
    old: Plan,
    new: Plan,
    rank: int,
) -> LayerStates:
    """Move parameters and optimizer state from ``old`` to ``new``; call on every rank.

    Args:
        modules: every layer's module by name (every rank holds all modules; only the layers it
            holds under a plan are up to date).
        optimizer: this rank's optimizer under ``old`` (its per-parameter state is read).
        old: the plan being left.
        new: the plan being entered.
        rank: this rank.

    Returns:
        The optimizer state of every layer this rank trains under ``new``: kept from its own
        optimizer, or received.
    """
    states: LayerStates = {}
    for t in transfers(old, new):
        if rank not in (t.src, t.dst):
            continue
        params = list(modules[t.layer].parameters())
        if rank == t.src:
            send_tensors([p.detach() for p in params], t.dst)
            if t.with_state:
                _send_state(collect_layer_state(optimizer, modules[t.layer]), t.dst)
        else:
            received = recv_tensors(t.src, device=params[0].device if params else None)
            with torch.no_grad():
                for p, value in zip(params, received, strict=True):
                    p.copy_(value)
            if t.with_state:
                states[t.layer] = [
                    {k: v.to(p.device) if k != "step" else v for k, v in s.items()}
                    for p, s in zip(params, _recv_state(t.src))
                ]
    for layer in new.stage_layers(new.coords(rank)[1]):
        if layer not in states and is_trainable(new, layer):
            states[layer] = collect_layer_state(optimizer, modules[layer])
    return states
