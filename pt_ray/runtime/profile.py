"""Per-layer cost profiler: forward and backward time, activation and parameter bytes.

AutoPipe balances stages on measured costs (the 2021 code used parameter counts). Each layer is
timed on its own, on the current device, with the real input it sees in the model: the embedding on
the batch, block ``i`` on block ``i-1``'s output, the head (with the loss) on the last block's
output. Backward is timed as one ``autograd.grad`` call for the layer's input and parameter
gradients. The median of a few repetitions after a warm-up is kept. Blocks of the same structure
(class and parameter shapes, on an input of the same size: every block of a ViT or a BERT) do the
same work, so only the first of a group is measured and the others take its figures: noise on one
block cannot move a stage boundary, and L identical blocks cost 5 passes (a warm-up, 3 timed, one
counting bytes) with the default 3 repetitions, not L + 4, so profiling stays a small share of a
run's start-up however deep the model is. A block that changes its input's size is timed once more
in every later position (the next block's input is its real output), and blocks of a group measured
more than once share their median time. Each layer's forward is also run once under
:class:`pt_ray.runtime.memory.SavedActivations`, which counts the bytes autograd keeps for its
backward (``LayerCost.saved_bytes``): the planner's memory estimate then uses the model's own
figure, not a rule of thumb; blocks of one group keep the same bytes, so it is counted for the
first of them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from pt_ray.data.base import Batch, SampleDataset, gather
from pt_ray.models.base import ModelAdapter, State
from pt_ray.core.plan import CostTable, LayerCost
from pt_ray.runtime.memory import SavedActivations
from pt_ray.runtime.owned import to_device
from pt_ray.runtime.precision import Precision

__all__ = ["profile_costs", "profile_share"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(state: State | torch.Tensor) -> int:
    tensors = state if isinstance(state, tuple) else (state,)
    return sum(t.numel() * t.element_size() for t in tensors)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _time_layer(
    fn: Callable[[], State | torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    params: list[torch.nn.Parameter],
    device: torch.device,
    repeats: int,
    to_scalar: Callable[[State | torch.Tensor], torch.Tensor],
    warmup: bool = True,
) -> tuple[float, float, State | torch.Tensor]:
    fwd, bwd = [], []
    out: State | torch.Tensor = ()
    wrt = [t for t in inputs if t.requires_grad] + params
    skip = int(warmup)
    for rep in range(repeats + skip):  # a warm-up repetition is discarded
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        t1 = time.perf_counter()
        scalar = to_scalar(out)
        if wrt and scalar.requires_grad:
            torch.autograd.grad(scalar, wrt, allow_unused=True)
        _sync(device)
        t2 = time.perf_counter()
        if rep >= skip:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), out


def _saved_bytes(
    fn: Callable[[], State | torch.Tensor],
    params: list[torch.nn.Parameter],
    to_scalar: Callable[[State | torch.Tensor], torch.Tensor],
) -> int:
    """The most bytes autograd holds for the backward of ``fn`` (and its ``to_scalar``: the
    head's loss), parameters aside; the graph is dropped unused."""
    saved = SavedActivations(exclude=params)
    with saved.counting():
        to_scalar(fn())
    return saved.peak


def _detach(state: State) -> State:
    return tuple(
        t.detach().requires_grad_(t.is_floating_point() and i == 0) for i, t in enumerate(state)
    )


def _sum_first(out: State | torch.Tensor) -> torch.Tensor:
    first = out[0] if isinstance(out, tuple) else out
    return first.float().sum()


def profile_costs(
    adapter: ModelAdapter, batch: Batch, repeats: int = 3, precision: Precision | None = None
) -> CostTable:
    """Measure every layer's costs on one micro-batch, in the run's precision.

    The model is left in the mode it was in; gradients it held are left alone (``autograd.grad``
    does not touch ``.grad``).

    Args:
        adapter: the model, cut into layers.
        batch: one micro-batch on the device to profile on (its size is
            ``CostTable.samples``). The layers may be elsewhere (on the host, where the model
            was built): each visits that device only while it is timed.
        repeats: timed repetitions per layer (median kept), after one warm-up.
        precision: the run's precision (default fp32): layers run under its autocast and
            their outputs are cast to its compute dtype, so activation bytes are the bytes a
            stage sends (bf16 halves them).

    Returns:
        A :class:`CostTable` whose times are seconds per micro-batch of ``len(batch)`` samples,
        with each layer's fixed part (:func:`_with_fixed_parts`) when the batch has more than
        one sample.
    """
    prec = precision or Precision("fp32")
    with prec.autocast():
        full = _profile(adapter, batch, repeats, prec)
        if len(batch) < 2:
            return full
        small = max(1, len(batch) // SMALL_FRACTION)
        return _with_fixed_parts(full, _profile(adapter, batch.slice(0, small), repeats, prec))


def profile_share(adapter: ModelAdapter, dataset: SampleDataset, samples: int,
                  device: torch.device, precision: Precision) -> CostTable:
    """:func:`profile_costs` on the first ``samples`` of ``dataset`` (at least one, at most
    all), moved to ``device``. Each layer visits the device only while it is timed: the whole
    model never needs to fit there."""
    batch = gather(dataset, list(range(max(1, min(samples, len(dataset))))))
    on_device = Batch(batch.indices, tuple(t.to(device) for t in batch.inputs),
                      batch.target.to(device))
    return profile_costs(adapter, on_device, precision=precision)


SMALL_FRACTION = 8
"""The second profile runs on this fraction of the first's samples: about the smallest
micro-batch the planner weighs (a replica's share over up to 16 micro-batches per stage)."""


def _with_fixed_parts(full: CostTable, small: CostTable) -> CostTable:
    """``full`` with each layer's fixed time per micro-batch, from the same layer timed on fewer
    samples: ``t(b) = fixed + per_sample * b`` through both points.

    Work in proportion to the samples is the rule on a busy device, but not for what a
    micro-batch pays whatever its size: a dense embedding gradient (MiniLM-L6's word embeddings,
    47 MB, are written whole for 2 samples as for 16), kernel launches, matrices too small to
    fill the device. Without it, a pipeline of 16 micro-batches of 2 samples was predicted as
    fast as one pass of 16 on each replica, and ran at two thirds of its speed. Each fixed part
    is kept within ``[0, min(t_small, t_full)]``, so timing noise can neither make it negative
    nor let it exceed what either measurement took.
    """
    n, m = full.samples, small.samples

    def fixed(t_full: float, t_small: float) -> float:
        return min(max((t_small * n - t_full * m) / (n - m), 0.0), t_small, t_full)

    def combine(a: LayerCost, b: LayerCost) -> LayerCost:
        return replace(a, forward_fixed_s=fixed(a.forward_s, b.forward_s),
                       backward_fixed_s=fixed(a.backward_s, b.backward_s))

    return replace(full, embed=combine(full.embed, small.embed),
                   blocks=tuple(combine(a, b) for a, b in zip(full.blocks, small.blocks)),
                   head=combine(full.head, small.head))


def _profile(adapter: ModelAdapter, batch: Batch, repeats: int, prec: Precision) -> CostTable:
    device = batch.target.device
    n = len(batch)
    embed_params = [p for p in adapter.embed.parameters() if p.requires_grad]
    with _visiting(adapter.embed, device):
        f, b, state = _time_layer(
            lambda: prec.cast_state(adapter.embed(*batch.inputs)), batch.inputs, embed_params,
            device, repeats,
            _sum_first,
        )
        saved = _saved_bytes(lambda: prec.cast_state(adapter.embed(*batch.inputs)),
                             embed_params, _sum_first)
    embed = LayerCost(f, b, _bytes(state) / n, _param_bytes(adapter.embed), saved / n)
    blocks = []
    # The first block of each structure (and input size), measured: the rest of its group
    # does the same work and keeps the same tensors for backward.
    first_of: dict[tuple, LayerCost] = {}
    preserves: dict[tuple, bool] = {}  # whether the first's output was its input's size
    for block in adapter.blocks:
        inp = _detach(state)
        params = [p for p in block.parameters() if p.requires_grad]
        key = (_structure(block), _bytes(inp))
        known = key in first_of
        if known and preserves[key]:
            # Its output is the size of its input, as the first's was: the next block's input
            # stays the first's output, and this block is not run at all.
            blocks.append(replace(first_of[key], param_bytes=_param_bytes(block)))
            continue
        # The first block of a structure is timed `repeats` times after a warm-up; one that
        # changes its input's size is also timed once, with its kernels warm, in each later
        # position (the next needs its real output), and the times are pooled below.
        with _visiting(block, device):
            f, b, state = _time_layer(
                lambda blk=block, x=inp: prec.cast_state(blk(*x)), inp, params, device,
                1 if known else repeats, _sum_first, warmup=not known,
            )
            saved = first_of[key].saved_bytes * n if known else _saved_bytes(
                lambda blk=block, x=inp: prec.cast_state(blk(*x)), params, _sum_first)
        cost = LayerCost(f, b, _bytes(state) / n, _param_bytes(block), saved / n)
        if not known:
            first_of[key], preserves[key] = cost, _bytes(state) == key[1]
        blocks.append(cost)
    blocks = _pool_alike(adapter, blocks)
    inp = _detach(state)
    params = [p for p in adapter.head.parameters() if p.requires_grad]

    def loss(out: torch.Tensor) -> torch.Tensor:
        return adapter.loss(out, batch.target)

    with _visiting(adapter.head, device):
        f, b, out = _time_layer(
            lambda: prec.logits(adapter.head(*inp)), inp, params, device, repeats, loss,
        )
        saved = _saved_bytes(lambda: prec.logits(adapter.head(*inp)), params, loss)
    head = LayerCost(f, b, _bytes(out) / n, _param_bytes(adapter.head), saved / n)
    return CostTable(embed, tuple(blocks), head, samples=n)


def _pool_alike(adapter: ModelAdapter, blocks: list[LayerCost]) -> list[LayerCost]:
    """Each block's times replaced by the medians over the blocks of the same structure."""
    groups: dict[tuple, list[int]] = {}
    for i, (block, cost) in enumerate(zip(adapter.blocks, blocks)):
        groups.setdefault((_structure(block), cost.activation_bytes), []).append(i)
    out = list(blocks)
    for members in groups.values():
        fwd = statistics.median(blocks[i].forward_s for i in members)
        bwd = statistics.median(blocks[i].backward_s for i in members)
        for i in members:
            out[i] = replace(blocks[i], forward_s=fwd, backward_s=bwd)
    return out


@contextmanager
def _visiting(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """``module`` on ``device`` while it is timed, then back where it was: a model built on the
    host reaches the device one layer at a time, so one too large for the device is profiled
    too (and no rank ever holds it all there)."""
    home = next((t.device for t in module.parameters()), device)
    to_device(module, device)
    try:
        yield
    finally:
        to_device(module, home)


def _structure(block: torch.nn.Module) -> tuple:
    """What makes two blocks do the same work: their class and parameter shapes."""
    return type(block).__name__, tuple(tuple(p.shape) for p in block.parameters())
