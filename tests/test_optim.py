"""Per-layer optimizer groups, removing layers with their state, and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pt_ray.core.config import OptimizerConfig
from pt_ray.runtime.optim import (
    build_optimizer,
    layer_param_groups,
    lr_factor,
    remove_layers,
    set_lr,
)

pytestmark = pytest.mark.unit


# -- lr_factor --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("progress", "expected"),
    [
        (-0.5, 0.0),  # clamped to 0
        (0.0, 0.0),
        (0.05, 0.25),  # linear warm-up over the first 20%
        (0.1, 0.5),
        (0.2, 1.0),  # warm-up ends at the peak
        (0.4, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # a quarter into the cosine
        (0.6, 0.55),  # half-way: floor + (1 - floor) / 2
        (1.0, 0.1),  # the floor, min_lr_ratio
        (1.5, 0.1),  # clamped to 1
    ],
)
def test_warmup_then_cosine_to_floor(progress, expected):
    cfg = OptimizerConfig(warmup_fraction=0.2, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(progress, cfg) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("progress", "expected"), [(0.0, 0.0), (0.05, 0.5), (0.1, 1.0), (0.5, 1.0), (1.0, 1.0)]
)
def test_warmup_then_constant(progress, expected):
    cfg = OptimizerConfig(warmup_fraction=0.1, schedule="constant", min_lr_ratio=0.3)
    assert lr_factor(progress, cfg) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("progress", "expected"),
    [(0.0, 1.0), (0.25, 0.5 * (1 + math.cos(math.pi / 4))), (0.5, 0.5), (1.0, 0.0)],
)
def test_cosine_without_warmup_starts_at_peak(progress, expected):
    cfg = OptimizerConfig(warmup_fraction=0.0, schedule="cosine", min_lr_ratio=0.0)
    assert lr_factor(progress, cfg) == pytest.approx(expected, abs=1e-12)


# -- layer_param_groups -----------------------------------------------------------------------


def _two_layers() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    b = nn.Linear(3, 2)
    return [("a", a), ("b", b)]


def test_layer_groups_split_matrices_from_vectors_and_name_their_layer():
    layers = _two_layers()
    frozen = layers[1][1].bias
    frozen.requires_grad_(False)
    norm_only = ("norm", nn.LayerNorm(3))  # only 1-D params: one group, no empty decay group
    groups = layer_param_groups([*layers, norm_only], weight_decay=0.07)

    summary = [(g["layer"], g["weight_decay"], [tuple(p.shape) for p in g["params"]])
               for g in groups]
    assert summary == [
        ("a", 0.07, [(3, 4)]),
        ("a", 0.0, [(3,), (3,), (3,)]),  # linear bias, norm weight, norm bias
        ("b", 0.07, [(2, 3)]),  # b's bias does not require grad: left out
        ("norm", 0.0, [(3,), (3,)]),
    ]
    for g in groups:
        assert all((p.ndim >= 2) == (g["weight_decay"] > 0) for p in g["params"])
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert id(frozen) not in ids


def test_no_decay_groups_are_not_decayed_by_the_optimizer():
    layers = _two_layers()
    cfg = OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.5)
    opt = build_optimizer(cfg, layer_param_groups(layers, cfg.weight_decay))
    before = {id(p): p.detach().clone() for _, m in layers for p in m.parameters()}
    for _, m in layers:
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    opt.step()  # zero gradients: only decoupled weight decay moves anything
    for _, m in layers:
        for p in m.parameters():
            factor = 1 - 0.1 * 0.5 if p.ndim >= 2 else 1.0
            assert torch.allclose(p, before[id(p)] * factor, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("fused", "device", "expected"), [
    ("auto", "cpu", True),     # torch's default on the CPU is a Python loop over the tensors
    ("off", "cpu", None),
    ("auto", "meta", None),    # no fused kernels there: auto leaves torch's default
    ("on", "cpu", True),
])
def test_adamw_runs_fused_where_auto_finds_the_kernels(fused, device, expected):
    layers = [(n, m.to(device)) for n, m in _two_layers()]
    opt = build_optimizer(OptimizerConfig(name="adamw", lr=0.01, fused=fused),
                          layer_param_groups(layers, 0.1))
    assert opt.defaults["fused"] is expected


def test_build_optimizer_uses_config_hyperparameters():
    layers = _two_layers()
    adamw = build_optimizer(
        OptimizerConfig(name="adamw", lr=0.01, betas=(0.8, 0.9)), layer_param_groups(layers, 0.1)
    )
    assert isinstance(adamw, torch.optim.AdamW)
    assert {g["betas"] for g in adamw.param_groups} == {(0.8, 0.9)}
    sgd = build_optimizer(
        OptimizerConfig(name="sgd", lr=0.01, momentum=0.5), layer_param_groups(layers, 0.1)
    )
    assert isinstance(sgd, torch.optim.SGD)
    assert {g["momentum"] for g in sgd.param_groups} == {0.5}
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.1, 0.0, 0.1, 0.0]
    set_lr(sgd, 0.123)
    assert [g["lr"] for g in sgd.param_groups] == [0.123] * 4


# -- remove_layers ----------------------------------------------------------------------------


def test_remove_layers_returns_groups_and_state_and_leaves_others_identical():
    layers = _two_layers()
    a, b = layers[0][1], layers[1][1]
    cfg = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1)
    opt = build_optimizer(cfg, layer_param_groups(layers, cfg.weight_decay))
    for _ in range(3):
        loss = b(a(torch.randn(5, 4))).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    a_state = {id(p): opt.state[p] for p in a.parameters()}
    b_groups = [g for g in opt.param_groups if g["layer"] == "b"]
    b_state = {p: (opt.state[p], {k: v.clone() for k, v in opt.state[p].items()})
               for p in b.parameters()}

    removed = remove_layers(opt, ["a"])

    assert list(removed) == ["a"]
    (meta_d, states_d), (meta_n, states_n) = removed["a"]
    assert "params" not in meta_d and meta_d["layer"] == "a"
    assert (meta_d["weight_decay"], meta_n["weight_decay"]) == (0.1, 0.0)
    assert meta_d["lr"] == 0.01
    a_params = [a[0].weight, a[0].bias, a[1].weight, a[1].bias]
    # The returned state is a's own state objects, in group order, with 3 steps taken.
    assert [id(s) for s in states_d + states_n] == [id(a_state[id(p)]) for p in a_params]
    assert all(float(s["step"]) == 3 for s in states_d + states_n)
    # a is gone from groups and state; b's groups and state are the very same objects.
    assert opt.param_groups == b_groups
    assert all(opt.param_groups[i] is g for i, g in enumerate(b_groups))
    assert set(opt.state) == set(b.parameters())
    for p, (obj, values) in b_state.items():
        assert opt.state[p] is obj
        assert all(torch.equal(obj[k], v) for k, v in values.items())

    # The optimizer keeps training b only.
    a_before = [p.detach().clone() for p in a.parameters()]
    loss = b(a(torch.randn(5, 4))).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), a_before))
    assert all(float(opt.state[p]["step"]) == 4 for p in b.parameters())

    assert remove_layers(opt, ["a", "missing"]) == {}
    assert opt.param_groups == b_groups


def test_one_pass_gives_the_global_and_the_per_block_norms():
    # clip_grad_norm with a ParamBlocks: the per-block norms come from the same per-parameter
    # norms as the global one, and equal what block_grad_norms computes block by block.
    from pt_ray.models import build_adapter
    from pt_ray.core.config import ModelConfig
    from pt_ray.runtime.norms import GradNormMeter, block_grad_norms
    from pt_ray.runtime.clipping import ParamBlocks, clip_grad_norm

    adapter = build_adapter(ModelConfig(family="timm", name="vit_base_patch16_224", depth=4,
                                        width=32, num_heads=2, mlp_ratio=2.0, patch_size=4),
                            num_classes=10, image_size=8, in_chans=1, seed=0)
    torch.manual_seed(0)
    out = adapter.model(torch.randn(6, 1, 8, 8))
    out.square().mean().backward()
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    expected = block_grad_norms(adapter, range(1, 4))
    full = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    index = ParamBlocks(params, {b: list(adapter.blocks[b].parameters()) for b in range(1, 4)},
                       1, 3, torch.device("cpu"))
    total, per_block = clip_grad_norm(None, params, max_norm=None, group=None, blocks=index)
    assert float(total) == pytest.approx(float(full), rel=1e-6)
    assert per_block.tolist() == pytest.approx([float(expected[b]) for b in (1, 2, 3)], rel=1e-6)
    meter = GradNormMeter()
    meter.add_vector(1, per_block)
    meter.add_vector(1, per_block * 3)
    assert meter.mean() == pytest.approx({b: 2 * float(expected[b]) for b in (1, 2, 3)},
                                         rel=1e-6)
    assert meter.state_dict()["steps"] == 2
    # A parameter without a gradient (made frozen mid-block) counts for nothing in its block.
    dropped = next(iter(adapter.blocks[2].parameters()))
    gone = float(dropped.grad.norm())
    dropped.grad = None
    _, partial = clip_grad_norm(None, params, max_norm=None, group=None, blocks=index)
    left = (float(expected[2]) ** 2 - gone ** 2) ** 0.5
    assert partial.tolist() == pytest.approx([float(expected[1]), left, float(expected[3])],
                                             rel=1e-6)


@pytest.mark.unit
def test_block_norms_merge_over_ranks_in_rank_order_whatever_stage_holds_them():
    # Four ranks of K = 2, R = 2 on six blocks: stage 0 trains blocks 1-2 (block 0 frozen),
    # stage 1 blocks 3-5; a stage's replicas hold equal values, the first rank's is kept.
    import math

    from pt_ray.core.freeze import LOSS_KEY
    from pt_ray.runtime.norms import merge_block_norms, norm_row

    # Last stages (ranks 1 and 3) hold their replica's mean loss / R: the loss is their sum.
    stage0, stage1 = {1: 0.5, 2: 0.25}, {3: 1.0, 4: 2.0, 5: 4.0, LOSS_KEY: 0.75}
    rows = [norm_row(stage0, 6), norm_row(stage1, 6), norm_row(stage0, 6),
            norm_row({**stage1, 5: 9.0, LOSS_KEY: 0.5}, 6)]
    assert math.isnan(rows[0][0]) and rows[0][1:3] == [0.5, 0.25] and rows[0][6] == 0.0
    assert merge_block_norms(rows) == {1: 0.5, 2: 0.25, 3: 1.0, 4: 2.0, 5: 4.0, LOSS_KEY: 1.25}
    assert merge_block_norms([norm_row({}, 6)] * 2) == {}  # policy none: nothing measured
