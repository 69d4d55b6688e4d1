"""State migration between plans: parameters and optimizer state follow their layers.

At a transition every rank walks the same list of transfers (``plan.transfers``): the rank that
holds a layer's latest state (replica 0's holder under the old plan) sends the layer's whole
``state_dict`` (parameters and persistent buffers, e.g. running statistics) and, for layers that
keep training, their optimizer state (moments and step counts) to each rank that needs it under
the new plan. Nothing is re-initialised; the head and the optimizer's
moments carry over (the 2021 code lost both). Transfers are point-to-point in one global order,
so every rank meets its partner at the same transfer and none can deadlock. Everything moves as
tensors on the run's communication device (the state's keys as codes), never pickled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pt_ray.core.plan import Plan, is_trainable, transfers
from pt_ray.runtime.comm import Comm

__all__ = ["LayerStates", "collect_layer_state", "migrate"]

LayerStates = dict[str, list[dict[str, torch.Tensor]]]
"""Optimizer state per layer: for each parameter of the layer (in ``parameters()`` order), the
optimizer's per-parameter state dict (empty if it never stepped)."""


def collect_layer_state(optimizer: torch.optim.Optimizer | None, module: nn.Module) -> list[dict]:
    """The optimizer state of a module's parameters, in ``parameters()`` order."""
    if optimizer is None:
        return [{} for _ in module.parameters()]
    return [dict(optimizer.state.get(p, {})) for p in module.parameters()]


# Wire codes of the optimizer-state keys that migrate (AdamW and SGD); append only.
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _send_state(comm: Comm, states: list[dict], dst: int) -> None:
    """Per parameter, its state's keys as codes (a count, then the codes), then the values."""
    codes: list[int] = []
    values: list[torch.Tensor] = []
    for state in states:
        present = [k for k in sorted(state) if state[k] is not None]
        unknown = [k for k in present if k not in STATE_KEYS]
        if unknown:
            raise ValueError(
                f"optimizer state keys {unknown} cannot migrate; "
                f"known keys: {', '.join(STATE_KEYS)}"
            )
        codes += [len(present), *(STATE_KEYS.index(k) for k in present)]
        values += [torch.as_tensor(state[k]) for k in present]
    comm.send([torch.tensor(codes, dtype=torch.int64), *values], dst)


def _recv_state(comm: Comm, src: int, params: list[torch.nn.Parameter]) -> list[dict]:
    """The states :func:`_send_state` sent, each value on its parameter's device; ``step``
    stays a CPU scalar, where torch's optimizers keep it unless capturable."""
    codes, *values = comm.recv(src)
    codes_list, flat = codes.tolist(), iter(values)
    out, i = [], 0
    for p in params:
        count = codes_list[i]
        keys = [STATE_KEYS[c] for c in codes_list[i + 1:i + 1 + count]]
        i += 1 + count
        out.append({k: next(flat).to("cpu" if k == "step" else p.device) for k in keys})
    return out


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of ``module``'s ``state_dict`` (sharing storage with its parameters and
    buffers), in the order every rank's copy of the same layer lists them."""
    return [v for v in module.state_dict(keep_vars=True).values() if torch.is_tensor(v)]


def migrate(
    comm: Comm,
    modules: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer | None,
    old: Plan,
    new: Plan,
    rank: int,
    midway: Callable[[], None] | None = None,
) -> LayerStates:
    """Move parameters and optimizer state from ``old`` to ``new``; call on every rank.

    Args:
        comm: the run's communication (every tensor moves on its device).
        modules: every layer's module by name. A rank sends only layers it holds; a layer it
            receives must have storage already (the engine materialises it empty first), and
            the engine releases what it gave away afterwards.
        optimizer: this rank's optimizer under ``old`` (its per-parameter state is read).
        old: the plan being left.
        new: the plan being entered.
        rank: this rank.
        midway: called once, after this rank's sends that precede its first receive and before
            that receive (after all its transfers when it receives nothing): fault injection.

    Returns:
        The optimizer state of every layer this rank trains under ``new``: kept from its own
        optimizer, or received.
    """
    states: LayerStates = {}
    for t in transfers(old, new):
        if rank not in (t.src, t.dst):
            continue
        params = list(modules[t.layer].parameters())
        tensors = _state_tensors(modules[t.layer])
        if rank == t.dst and midway is not None:
            midway()
            midway = None
        if rank == t.src:
            comm.send([v.detach() for v in tensors], t.dst)
            if t.with_state:
                _send_state(comm, collect_layer_state(optimizer, modules[t.layer]), t.dst)
        else:
            received = comm.recv(t.src)
            with torch.no_grad():
                for v, value in zip(tensors, received, strict=True):
                    v.copy_(value)
            if t.with_state:
                states[t.layer] = _recv_state(comm, t.src, params)
    if midway is not None:
        midway()
    for layer in new.stage_layers(new.coords(rank)[1]):
        if layer not in states and is_trainable(new, layer):
            states[layer] = collect_layer_state(optimizer, modules[layer])
    return states
