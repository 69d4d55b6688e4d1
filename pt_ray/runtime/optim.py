"""Optimizer with one parameter group per layer, and the learning-rate schedule by progress.

Per-layer groups are what let a layer leave the optimizer when it freezes (or move to another
rank at a transition) with its state, while every other layer's moments and step counts stay
exactly as they were. The 2021 code rebuilt the optimizer and its schedule every epoch; here
both live for the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pt_ray.core.config import OptimizerConfig

__all__ = [
    "adopt_states",
    "build_optimizer",
    "layer_param_groups",
    "lr_factor",
    "merge_groups",
    "remove_layers",
    "set_lr",
]


def layer_param_groups(
    modules: Iterable[tuple[str, nn.Module]], weight_decay: float
) -> list[dict]:
    """Two groups per layer (decayed matrices, undecayed biases and norm weights).

    Args:
        modules: ``(layer name, module)`` pairs, e.g. from ``iter_layers``.
        weight_decay: decay for matrices; 1-D parameters (biases, norms) get none.

    Returns:
        Param-group dicts with an extra ``"layer"`` key naming their layer; empty groups omitted.
    """
    groups = []
    for name, module in modules:
        decay, no_decay = [], []
        for p in module.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        if decay:
            groups.append({"params": decay, "layer": name, "weight_decay": weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "layer": name, "weight_decay": 0.0})
    return groups


def merge_groups(groups: list[dict]) -> list[dict]:
    """Per-layer groups merged into one group per weight decay (two at most).

    The engine rebuilds its optimizer at every transition, carrying each parameter's state, so
    it needs no per-layer groups; and torch's optimizers pay a fixed cost per group per step
    (a set of multi-tensor kernels each), which with two groups per layer made a small model's
    step measurably slower than DDP's. The update of every parameter is the same either way.
    """
    merged: dict[float, dict] = {}
    for group in groups:
        key = group["weight_decay"]
        merged.setdefault(key, {"params": [], "weight_decay": key})["params"].extend(
            group["params"])
    return list(merged.values())


FUSED_DEVICES = ("cpu", "cuda")
"""Where ``optimizer.fused=auto`` runs AdamW's fused kernels: the devices pt-ray trains on,
both of which torch has them for. On the CPU they replace torch's default there, a Python loop
over the parameters (one small kernel per operation and tensor; ``bench/engine_tax.py`` with
``--set optimizer.fused=off`` measures what it costs); on CUDA, the multi-tensor kernels."""


def build_optimizer(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """An AdamW or SGD optimizer over per-layer groups (see :func:`layer_param_groups`).

    AdamW runs torch's fused kernels when ``optimizer.fused`` says so: ``auto`` where the
    parameters live on a device of :data:`FUSED_DEVICES`, ``on`` on any device, ``off`` never
    (torch's default kernels instead)."""
    if cfg.name == "adamw":
        device = next((p.device for g in groups for p in g["params"]), None)
        fused = cfg.fused == "on" or (cfg.fused == "auto" and device is not None
                                      and device.type in FUSED_DEVICES)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas,
                                 weight_decay=cfg.weight_decay, fused=fused or None)
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def adopt_states(optimizer: torch.optim.Optimizer,
                 states: Iterable[tuple[nn.Parameter, dict]]) -> None:
    """Give ``optimizer`` each parameter's carried state (from a migration, a checkpoint or a
    snapshot), every tensor on the parameter's device; the ``step`` counter on the host, where
    torch keeps it, except for fused AdamW, whose kernels read it on the device."""
    fused = bool(optimizer.defaults.get("fused"))
    for p, state in states:
        if not state:
            continue
        placed = {}
        for k, v in state.items():
            if torch.is_tensor(v):
                v = v.to(p.device if k != "step" or fused else "cpu")
                if k == "step":
                    v = v.to(torch.float32)
            placed[k] = v
        optimizer.state[p] = placed


def remove_layers(optimizer: torch.optim.Optimizer, layers: Iterable[str]) -> dict[str, list]:
    """Take layers out of an optimizer, returning their groups and per-parameter state.

    Other layers' groups and state are untouched (same tensors, same step counts).

    Returns:
        ``{layer: [(group_without_params, [state per param])...]}`` for what was removed.
    """
    wanted = set(layers)
    removed: dict[str, list] = {}
    kept = []
    for group in optimizer.param_groups:
        if group.get("layer") in wanted:
            states = [optimizer.state.pop(p, {}) for p in group["params"]]
            meta = {k: v for k, v in group.items() if k != "params"}
            removed.setdefault(group["layer"], []).append((meta, states))
        else:
            kept.append(group)
    optimizer.param_groups[:] = kept
    return removed


def lr_factor(progress: float, cfg: OptimizerConfig) -> float:
    """Learning-rate multiplier at ``progress`` in [0, 1] of the run's samples.

    Linear warm-up over ``warmup_fraction``, then cosine decay to ``min_lr_ratio`` (or constant).
    Progress is measured in samples, so the schedule is the same whatever the batch policy.
    """
    progress = min(max(progress, 0.0), 1.0)
    w = cfg.warmup_fraction
    if w > 0 and progress < w:
        return progress / w
    if cfg.schedule == "constant":
        return 1.0
    t = (progress - w) / (1 - w) if w < 1 else 1.0
    floor = cfg.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
