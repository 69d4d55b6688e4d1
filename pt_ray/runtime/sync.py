"""Collectives of a training step: data-parallel gradient averaging, and global-norm clipping
that also unscales fp16 gradients and finds an inf/nan on any rank.

Every call goes through :class:`pt_ray.runtime.comm.Comm`, so gradients and norms sit on the
group's device. Nothing here reads a value back to the host unless the caller asks for it
(fp16's skip decision), so a step has no host synchronisation that DDP would not have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pt_ray.runtime.comm import Comm

__all__ = ["all_reduce_grads", "clip_grad_norm", "grad_norm"]

# Gradients are reduced in buckets of about this many bytes: one collective per bucket instead of
# one per parameter.
_BUCKET_BYTES = 25 * 2**20


def all_reduce_grads(comm: Comm, params: Sequence[torch.nn.Parameter], group, world: int) -> None:
    """Average the gradients of ``params`` over a data-parallel group (bucketed).

    Only parameters that are trained here are passed in: frozen parameters are never reduced.
    """
    if group is None or world == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for g in (p.grad for p in params if p.grad is not None):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= _BUCKET_BYTES:
            _reduce_bucket(comm, bucket, group, world)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(comm, bucket, group, world)


def _reduce_bucket(comm: Comm, bucket: list[torch.Tensor], group, world: int) -> None:
    flat = comm.all_reduce(_flatten_dense_tensors(bucket), group=group)
    flat.div_(world)
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
        g.copy_(reduced)


def grad_norm(comm: Comm | None, params: Sequence[torch.nn.Parameter], group) -> torch.Tensor:
    """The L2 norm of the gradients of ``params``, summed in squares over ``group`` (every stage
    of the pipeline holds part of the model): a 0-d fp32 tensor on the gradients' device."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else getattr(comm, "device", torch.device("cpu"))
    if grads:
        sq = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=device)
    if group is not None:
        sq = comm.all_reduce(sq, group=group).to(device)
    return sq.sqrt()


def clip_grad_norm(
    comm: Comm | None,
    params: Sequence[torch.nn.Parameter],
    max_norm: float | None,
    group,
    inv_scale: float = 1.0,
) -> torch.Tensor:
    """Unscale and clip to a global norm over every stage of the pipeline.

    The coefficient is torch's ``clip_grad_norm_``'s, ``max_norm / (norm + 1e-6)`` capped at 1,
    where ``norm`` is the unscaled norm; gradients are multiplied by ``coefficient *
    inv_scale`` in one pass. The norm is returned as a tensor (not read back): an inf/nan in any
    gradient of the pipeline makes it non-finite on every rank of the group.

    Args:
        comm: the run's communication (None in one process: ``group`` must be None).
        params: this stage's trained parameters (gradients already reduced over replicas).
        max_norm: the clip threshold (None: no clipping, unscaling only).
        group: the pipeline group (None: one stage).
        inv_scale: 1 / the loss scale (fp16), else 1.

    Returns:
        The unscaled global norm before clipping (0-d tensor).
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = grad_norm(comm, params, group) * inv_scale
    if not grads or (max_norm is None and inv_scale == 1.0):
        return total
    factor = torch.full((), inv_scale, dtype=torch.float32, device=total.device)
    if max_norm is not None:
        factor = factor * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return total
