"""Global-norm clipping across a pipeline that also unscales fp16 gradients and finds an inf/nan
on any rank (DDP averages the gradients over the replicas before it), and the per-block norms
that come from the same pass (:class:`ParamBlocks`: which block each parameter belongs to).

Every call goes through :class:`pt_ray.runtime.comm.Comm`, so gradients and norms sit on the
group's device. Nothing here reads a value back to the host unless the caller asks for it
(fp16's skip decision), so a step has no host synchronisation that DDP would not have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pt_ray.runtime.comm import Comm

__all__ = ["ParamBlocks", "clip_grad_norm"]


def clip_grad_norm(
    comm: Comm | None,
    params: Sequence[torch.nn.Parameter],
    max_norm: float | None,
    group,
    inv_scale: float = 1.0,
    blocks: ParamBlocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        blocks: which block each of ``params`` belongs to: the per-block norms then come from
            the same per-parameter norms as the global one (one pass over the gradients, not
            two).

    Returns:
        The unscaled global norm before clipping (0-d tensor), and with ``blocks`` the
        per-block L2 norms of the gradients as they were (still scaled under fp16), as a 1-D
        fp64 tensor over ``blocks.first ..``; else None.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else getattr(comm, "device", torch.device("cpu"))
    per_block = None
    if grads:
        sq = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2)
        if blocks is not None:
            per_block = blocks.norms(sq, None if len(grads) == len(params) else params)
        sq = sq.sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=device)
    if group is not None:
        sq = comm.all_reduce(sq, group=group).to(device)
    total = sq.sqrt() * inv_scale
    if not grads or (max_norm is None and inv_scale == 1.0):
        return total, per_block
    factor = torch.full((), inv_scale, dtype=torch.float32, device=total.device)
    if max_norm is not None:
        factor = factor * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return total, per_block


class ParamBlocks:
    """Which block (counted from ``first``) each trained parameter of a stage belongs to; -1 for
    the embedding and the head.

    Args:
        params: the stage's trained parameters, in the order the step passes them.
        block_params: per block index, its parameters (the blocks this stage trains).
        first: the stage's first block.
        count: how many blocks from ``first``.
        device: where the index lives (the gradients' device).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 block_params: dict[int, Sequence[torch.nn.Parameter]], first: int, count: int,
                 device: torch.device) -> None:
        self.first, self.count, self.device = first, count, device
        self._of = {id(p): b - first for b, ps in block_params.items() for p in ps}
        self._members = self._membership(self.ids_for(params, all_grads=True))

    def norms(self, sq: torch.Tensor, params: Sequence[torch.nn.Parameter] | None = None
              ) -> torch.Tensor:
        """Per-block L2 norms (fp64, over ``first ..``) from the per-parameter squared norms
        ``sq`` of every trained parameter, or of those of ``params`` that have a gradient: one
        matrix-vector product with a 0/1 membership matrix, which no step has to build (and
        no boolean indexing, which would make a GPU wait for the host every step)."""
        members = self._members if params is None else self._membership(self.ids_for(params))
        return torch.mv(members, sq.double()).sqrt()

    def _membership(self, ids: torch.Tensor) -> torch.Tensor:
        """``[count, len(ids)]`` fp64: 1 where parameter j belongs to block i (the embedding's
        and the head's columns, -1, are all 0)."""
        blocks = torch.arange(self.count, device=ids.device).unsqueeze(1)
        return (ids.unsqueeze(0) == blocks).double()

    def ids_for(self, params: Sequence[torch.nn.Parameter], all_grads: bool = False
                ) -> torch.Tensor:
        """The index over those of ``params`` that have a gradient (all, when ``all_grads``)."""
        return torch.tensor([self._of.get(id(p), -1) for p in params
                             if all_grads or p.grad is not None],
                            dtype=torch.long, device=self.device)
