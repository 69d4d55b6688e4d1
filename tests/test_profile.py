"""The per-layer cost profiler: one entry per block, real byte counts, and no side effects."""

from __future__ import annotations

import pytest
import torch

from pt_ray.core.config import ModelConfig
from pt_ray.data import gather, synthetic_image
from pt_ray.models import build_adapter
from pt_ray.runtime.profile import profile_costs

pytestmark = pytest.mark.unit

DEPTH, WIDTH, IMAGE, PATCH, CLASSES, BATCH = 3, 32, 8, 4, 5, 6
TOKENS = (IMAGE // PATCH) ** 2 + 1  # patches + the class token


def _vit():
    cfg = ModelConfig(
        family="timm", name="vit_base_patch16_224", depth=DEPTH, width=WIDTH, num_heads=2,
        mlp_ratio=2.0, patch_size=PATCH,
    )
    return build_adapter(cfg, num_classes=CLASSES, image_size=IMAGE, in_chans=3, seed=0)


def _batch():
    data = synthetic_image(16, 4, image_size=IMAGE, num_classes=CLASSES, seed=0)
    return gather(data.train, list(range(BATCH)))


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_profile_measures_every_block_with_real_sizes():
    adapter = _vit()
    costs = profile_costs(adapter, _batch(), repeats=2)

    assert costs.samples == BATCH
    assert costs.num_layers == DEPTH == len(costs.blocks)
    hidden_per_sample = TOKENS * WIDTH * 4  # fp32 [T, D]: B * T * D * 4 bytes over B samples
    for block, cost in zip(adapter.blocks, costs.blocks, strict=True):
        assert cost.forward_s > 0 and cost.backward_s > 0
        assert cost.param_bytes == _nbytes(block)
        assert cost.activation_bytes == hidden_per_sample
    # A ViT block: 2 LayerNorms (2D each), qkv (3D^2 + 3D), proj (D^2 + D), MLP with ratio 2.
    d = WIDTH
    assert costs.blocks[0].param_bytes == 4 * (4 * d + 3 * d * d + 3 * d + d * d + d
                                               + 2 * d * d + 2 * d + 2 * d * d + d)
    assert costs.embed.activation_bytes == hidden_per_sample
    assert costs.embed.param_bytes == _nbytes(adapter.embed) > 0
    assert costs.head.activation_bytes == CLASSES * 4  # logits per sample
    assert costs.head.param_bytes == _nbytes(adapter.head)
    assert _nbytes(adapter.embed) + sum(c.param_bytes for c in costs.blocks) + \
        costs.head.param_bytes == _nbytes(adapter.model)


def test_profile_leaves_gradients_and_modes_alone():
    adapter = _vit()
    batch = _batch()
    params = list(adapter.model.parameters())
    assert all(p.grad is None for p in params)
    profile_costs(adapter, batch, repeats=1)
    assert all(p.grad is None for p in params)
    assert adapter.model.training

    # Existing gradients (mid-accumulation) are kept as they were, bit for bit.
    loss = adapter.loss(adapter.model(batch.inputs[0]), batch.target)
    loss.backward()
    grads = [p.grad.clone() for p in params]
    adapter.model.eval()
    profile_costs(adapter, batch, repeats=1)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert not any(m.training for m in adapter.model.modules())


def test_blocks_of_one_structure_share_their_median_times():
    from pt_ray.core.plan import LayerCost
    from pt_ray.runtime.profile import _pool_alike

    adapter = _vit()
    costs = profile_costs(adapter, _batch(), repeats=2)
    # Identical ViT blocks: one time for all of them.
    assert len({(c.forward_s, c.backward_s) for c in costs.blocks}) == 1
    # The medians of what each block measured; a block of another shape keeps its own.
    measured = [LayerCost(0.1, 0.2, 8.0, 64.0), LayerCost(0.5, 0.4, 8.0, 64.0),
                LayerCost(0.3, 0.9, 8.0, 64.0)]
    pooled = _pool_alike(adapter, measured)
    assert [(c.forward_s, c.backward_s) for c in pooled] == [(0.3, 0.4)] * 3
    odd = [*measured[:2], LayerCost(0.3, 0.9, 16.0, 64.0)]
    pooled = _pool_alike(adapter, odd)
    got = [t for c in pooled for t in (c.forward_s, c.backward_s)]
    assert got == pytest.approx([0.3, 0.3, 0.3, 0.3, 0.3, 0.9])


def test_profile_counts_what_each_layer_keeps_for_backward():
    adapter = _vit()
    costs = profile_costs(adapter, _batch(), repeats=1)
    # A block saves several of its intermediates (norm inputs, attention, MLP hidden), never
    # its parameters: more than its output, less than a few dozen outputs' worth.
    for block in costs.blocks:
        assert block.saved_bytes is not None
        assert 2 * block.activation_bytes < block.saved_bytes < 40 * block.activation_bytes
    assert costs.embed.saved_bytes is not None and costs.head.saved_bytes > 0
    # Counting left no gradient or graph behind.
    assert all(p.grad is None for p in adapter.model.parameters())


def _count_forwards(blocks) -> list[int]:
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_identical_blocks_are_measured_once_for_their_group():
    adapter = _vit()
    calls = _count_forwards(adapter.blocks)
    costs = profile_costs(adapter, _batch(), repeats=3)
    # The first block: a warm-up, 3 timed passes and one counting its saved bytes, on the batch
    # and again on an eighth of it (its fixed part per micro-batch); the others take its figures
    # without running (their output is their input's size, as the first's).
    assert calls == [10] + [0] * (DEPTH - 1)
    assert len(set(costs.blocks)) == 1
    assert costs.blocks[0].forward_s > 0 and costs.blocks[0].backward_s > 0


class _Resize(torch.nn.Module):
    """A block that changes its input's size (``[B, n_in] -> [B, n_out]``)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.fc(x)),)


class _ResizingAdapter:
    """embed -> [8 -> 4, 4 -> 8, 8 -> 4, 4 -> 8] -> head: the third and fourth blocks repeat
    the first two's structures on inputs of the same sizes, but do not keep their size."""

    family, input_names, metric_name = "test", ("x",), "accuracy"

    def __init__(self) -> None:
        self.embed = _Resize(6, 8)
        self.blocks = torch.nn.ModuleList(
            [_Resize(8, 4), _Resize(4, 8), _Resize(8, 4), _Resize(4, 8)])
        self.head = torch.nn.Linear(8, 3)
        self.model = torch.nn.ModuleList([self.embed, self.blocks, self.head])

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, target)


def test_blocks_that_resize_their_input_run_in_every_position():
    from pt_ray.data.base import Batch

    adapter = _ResizingAdapter()
    calls = _count_forwards(adapter.blocks)
    gen = torch.Generator().manual_seed(0)
    batch = Batch(indices=torch.arange(5), inputs=(torch.randn(5, 6, generator=gen),),
                  target=torch.tensor([0, 1, 2, 0, 1]))
    costs = profile_costs(adapter, batch, repeats=3)
    # Each structure's first block is measured in full; its later twin runs once more (warm),
    # since the block after it needs its real output, and the pair shares one median time; all
    # of it twice, on the batch and on one sample (each layer's fixed part per micro-batch).
    assert calls == [10, 10, 2, 2]
    assert [c.activation_bytes for c in costs.blocks] == [4 * 4.0, 8 * 4.0] * 2
    assert costs.blocks[0].forward_s == costs.blocks[2].forward_s
    assert costs.blocks[1].backward_s == costs.blocks[3].backward_s
    assert costs.head.activation_bytes == 3 * 4
