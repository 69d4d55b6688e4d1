"""Collectives of a training step: data-parallel gradient averaging, global-norm clipping, and
point-to-point transfer of stage states (for pipelined evaluation and migration)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "all_reduce_grads",
    "clip_grad_norm",
    "recv_tensors",
    "send_tensors",
]

# Gradients are reduced in buckets of about this many bytes: one collective per bucket instead of
# one per parameter.
_BUCKET_BYTES = 25 * 2**20

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8]


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group, world: int) -> None:
    """Average the gradients of ``params`` over a data-parallel group (bucketed).

    Only parameters that are trained here are passed in: frozen parameters are never reduced.
    """
    if group is None or world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= _BUCKET_BYTES:
            _reduce_bucket(bucket, group, world)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, group, world)


def _reduce_bucket(bucket: list[torch.Tensor], group, world: int) -> None:
    flat = _flatten_dense_tensors(bucket)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(world)
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
        g.copy_(reduced)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float | None, group) -> float:
    """Clip to a global norm over every stage of the pipeline; returns the norm before clipping.

    Each stage holds part of the model, so the squared norms are summed over the pipeline group.
    The coefficient is torch's ``clip_grad_norm_``'s, ``max_norm / (norm + 1e-6)`` capped at 1.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    total = sq.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return float(total)


def send_tensors(tensors: Sequence[torch.Tensor], dst: int) -> None:
    """Send a tuple of tensors to a rank: a header of dtypes and shapes, then the data."""
    header = [len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    head = torch.tensor(header, dtype=torch.int64)
    dist.send(torch.tensor([head.numel()], dtype=torch.int64), dst)
    dist.send(head, dst)
    for t in tensors:
        dist.send(t.detach().contiguous(), dst)


def recv_tensors(src: int, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """Receive what :func:`send_tensors` sent."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src)
    head = torch.zeros(int(n), dtype=torch.int64)
    dist.recv(head, src)
    values = head.tolist()
    count, i = values[0], 1
    out = []
    for _ in range(count):
        dtype, ndim = _DTYPES[values[i]], values[i + 1]
        shape = values[i + 2:i + 2 + ndim]
        i += 2 + ndim
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return tuple(out)
