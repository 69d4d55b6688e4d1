"""Layer state on the host: the one codec that rollback snapshots, checkpoint shards and the
restore of either share.

A layer's entry is ``{"params": state_dict, "optim": [state per parameter]}`` with every
tensor on the CPU; ``optim`` is there for the layers that train (a frozen layer has no
optimizer state). :func:`capture_layers` makes the entries, :func:`load_layers_into` puts them
back into the modules and returns the optimizer state that the next optimizer takes
(:data:`pt_ray.runtime.migrate.LayerStates`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pt_ray.runtime.migrate import LayerStates, collect_layer_state
from pt_ray.runtime.owned import materialise

__all__ = ["capture_layers", "load_layers_into"]


def capture_layers(modules: Mapping[str, nn.Module], names: Iterable[str],
                   trained: Collection[str], optimizer: torch.optim.Optimizer | None, *,
                   copy: bool) -> dict[str, dict[str, Any]]:
    """The entries of ``names``: parameters and buffers, and for ``trained`` layers their
    optimizer state.

    Args:
        modules: every layer's module by name.
        names: the layers to capture.
        trained: the layers that train (their optimizer state comes along).
        optimizer: the optimizer that holds that state.
        copy: give every tensor its own host copy (a snapshot kept while training goes on);
            False lets a tensor already on the CPU be shared (what is written out at once).
    """

    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.clone() if copy else t

    entries: dict[str, dict[str, Any]] = {}
    for name in names:
        module = modules[name]
        entry: dict[str, Any] = {"params": {k: host(v) for k, v in module.state_dict().items()}}
        if name in trained:
            entry["optim"] = [{k: host(v) if torch.is_tensor(v) else v for k, v in st.items()}
                              for st in collect_layer_state(optimizer, module)]
        entries[name] = entry
    return entries


def load_layers_into(modules: Mapping[str, nn.Module], entries: Mapping[str, dict[str, Any]],
                     trained: Collection[str], device: torch.device) -> LayerStates:
    """Load the entries' parameters into their modules (given storage on ``device`` first if
    they had none here) and return the optimizer state of the ``trained`` layers, as the
    entries hold it (:func:`pt_ray.runtime.optim.adopt_states` places it on the devices)."""
    states: LayerStates = {}
    with torch.no_grad():
        for name, entry in entries.items():
            module = modules[name]
            materialise(module, device)
            module.load_state_dict(entry["params"])
            if name in trained and "optim" in entry:
                states[name] = list(entry["optim"])
    return states
