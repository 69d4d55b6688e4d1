"""The single-process reference trainer: AutoFreeze invariants, the schedule, evaluation, and
equivalence with a plain PyTorch loop."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from pt_ray.core.config import RunConfig, build_config
from pt_ray.core.freeze import LOSS_KEY, PROBE_NOW, PROBE_REVERTED
from pt_ray.data import DatasetSplits, GlobalSampler, TensorSampleDataset, synthetic_image
from pt_ray.data.base import finish_batch, gather_stored
from pt_ray.models import build_adapter, frozen_layer_names, layer_module
from pt_ray.models.base import forward_layers
from pt_ray.runtime.reference import build_reference, evaluate
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit

L = 4
BATCH = 32
SAMPLES = 256
STEPS_PER_EPOCH = SAMPLES // BATCH  # 8


def vit_config(**sections: Any) -> RunConfig:
    """A tiny timm ViT on 8x8 synthetic images; ``sections`` replace or extend the defaults."""
    base: dict[str, Any] = dict(
        model=dict(
            family="timm", name="vit_base_patch16_224", depth=L, width=32, num_heads=2,
            mlp_ratio=2.0, patch_size=4,
        ),
        data=dict(name="synthetic_image", num_samples=SAMPLES, image_size=8, batch_size=BATCH),
        freeze=dict(policy="schedule", alpha=0.5, warmup_epochs=1),
        optimizer=dict(name="adamw", lr=1e-3, warmup_fraction=0.25),
        epochs=4,
    )
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return build_config(base)


def _clone_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _optimizer_params(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def _active_layer_names(num_frozen: int) -> list[str]:
    frozen = set(frozen_layer_names(num_frozen))
    return [n for n in ["embed", *(f"block.{i}" for i in range(L)), "head"] if n not in frozen]


# -- AutoFreeze invariants -------------------------------------------------------------------


def test_schedule_freezing_keeps_frozen_layers_fixed_and_active_state_intact():
    trainer = build_reference(run_settings(vit_config()).reference)
    a, opt = trainer.adapter, trainer.optimizer
    transitions: list[tuple[int, int]] = []
    frozen_snapshots: dict[str, dict[str, torch.Tensor]] = {}
    original_freeze_to = trainer.freeze_to

    def checked_freeze_to(num_frozen: int) -> None:
        before = trainer.num_frozen
        head_before = _clone_params(a.head)
        # Optimizer state of every layer that stays active: the state dict objects, the moment
        # tensors and their values, and the step counts.
        staying = [
            p for name in _active_layer_names(num_frozen)
            for p in layer_module(a, name).parameters()
        ]
        state_objs = {id(p): opt.state[p] for p in staying if p in opt.state}
        state_vals = {
            id(p): {k: (v, v.clone()) for k, v in opt.state[p].items()}
            for p in staying if p in opt.state
        }
        original_freeze_to(num_frozen)
        transitions.append((before, trainer.num_frozen))

        _assert_same(head_before, _clone_params(a.head))  # the head is never re-initialised
        assert len(state_objs) == len(staying)  # every active parameter had been stepped
        for p in staying:
            assert opt.state[p] is state_objs[id(p)]
            for k, (tensor, value) in state_vals[id(p)].items():
                assert opt.state[p][k] is tensor, k
                assert torch.equal(opt.state[p][k], value), k
            assert p.requires_grad
        in_opt = _optimizer_params(opt)
        assert {id(p) for p in staying} == in_opt
        for name in frozen_layer_names(trainer.num_frozen):
            for p in layer_module(a, name).parameters():
                assert not p.requires_grad and p.grad is None
                assert id(p) not in in_opt and p not in opt.state
            frozen_snapshots.setdefault(name, _clone_params(layer_module(a, name)))

    trainer.freeze_to = checked_freeze_to
    last_block_before_final_epoch = None
    timeline = []
    for epoch in range(4):
        if epoch == 3:
            last_block_before_final_epoch = _clone_params(a.blocks[L - 1])
        timeline.append(trainer.train_epoch(epoch))

    # n(e) = ceil(L (1 - (1 - alpha)^e)) = 0, 2, 3, 4 -> capped at L - 1 = 3; never decreasing.
    assert [r.num_frozen for r in timeline] == [0, 2, 3, 3]
    assert transitions == [(0, 2), (2, 3)]
    assert set(frozen_snapshots) == {"embed", "block.0", "block.1", "block.2"}
    for name, snapshot in frozen_snapshots.items():
        _assert_same(snapshot, _clone_params(layer_module(a, name)))
    # The active block did train in the last epoch, so the check above is not vacuous.
    after = _clone_params(a.blocks[L - 1])
    assert any(not torch.equal(after[k], v) for k, v in last_block_before_final_epoch.items())
    assert all(math.isfinite(r.train_loss) for r in timeline)


def test_frozen_prefix_runs_in_eval_mode_without_grad_in_every_epoch():
    # With dropout the mode matters; epoch 3 has no transition, so the modes must survive the
    # previous epoch's evaluation (which switches the whole model to eval and back).
    trainer = build_reference(run_settings(vit_config(model=dict(dropout=0.2))).reference)
    seen: list[tuple[int, bool, bool]] = []  # (block, dropout.training, grad enabled)
    current_epoch = [0]
    per_epoch: dict[int, list[tuple[int, bool, bool]]] = {}

    for i, block in enumerate(trainer.adapter.model.blocks):
        drops = [m for m in block.modules() if isinstance(m, nn.Dropout)]
        assert drops, "the model must have dropout for this test to mean anything"

        def hook(module, inputs, output, i=i, drops=drops):
            seen.append((i, all(d.training for d in drops), torch.is_grad_enabled()))
        block.register_forward_hook(hook)

    original_step = trainer.train_step

    def step(batch):
        seen.clear()
        loss = original_step(batch)
        per_epoch.setdefault(current_epoch[0], []).append(
            (trainer.num_frozen, list(seen))
        )
        return loss

    trainer.train_step = step
    for epoch in range(4):
        current_epoch[0] = epoch
        trainer.train_epoch(epoch)

    expected_frozen = {0: 0, 1: 2, 2: 3, 3: 3}
    for epoch, steps in per_epoch.items():
        assert len(steps) == STEPS_PER_EPOCH
        for num_frozen, calls in steps:
            assert num_frozen == expected_frozen[epoch]
            assert [c[0] for c in calls] == list(range(L))
            for block, training, grad in calls:
                active = block >= num_frozen
                assert training == active, (epoch, block)
                assert grad == active, (epoch, block)
    # After training the frozen prefix is still in eval mode, the active layers in train mode.
    assert not trainer.adapter.embed.training
    assert [b.training for b in trainer.adapter.model.blocks] == [False, False, False, True]


# -- learning-rate schedule -------------------------------------------------------------------


def test_learning_rate_follows_global_progress_across_epochs_and_freezes():
    cfg = vit_config(epochs=3, optimizer=dict(warmup_fraction=0.25, min_lr_ratio=0.0))
    trainer = build_reference(run_settings(cfg).reference)
    lrs: list[list[float]] = []
    original_step = trainer.optimizer.step

    def step(*args, **kwargs):
        lrs.append([g["lr"] for g in trainer.optimizer.param_groups])
        return original_step(*args, **kwargs)

    trainer.optimizer.step = step
    trainer.fit()

    total = 3 * STEPS_PER_EPOCH  # 24 steps; warm-up over the first 6
    assert len(lrs) == total
    for group_lrs in lrs:
        assert len(set(group_lrs)) == 1  # one schedule for every group
    lr = [g[0] for g in lrs]
    for s in range(total):
        progress = s / total
        if progress < 0.25:
            factor = progress / 0.25
        else:
            factor = 0.5 * (1 + math.cos(math.pi * (progress - 0.25) / 0.75))
        assert lr[s] == pytest.approx(1e-3 * factor, rel=1e-12, abs=1e-15), s
    assert lr[3] == pytest.approx(0.5e-3)  # half-way through warm-up
    assert lr[6] == pytest.approx(1e-3)  # peak
    assert lr[15] == pytest.approx(0.5e-3)  # half-way through the cosine
    # Epochs 1 and 2 continue the decay instead of restarting the warm-up.
    assert lr[8] < lr[7] and lr[16] < lr[15]
    assert lr[8] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 9)))


# -- evaluation -------------------------------------------------------------------------------


class _RecordingDataset(TensorSampleDataset):
    def __init__(self, base: TensorSampleDataset) -> None:
        super().__init__(base.inputs, base.target, base.input_names)
        self.requested: list[int] = []

    def batch(self, indices):
        self.requested.extend(int(i) for i in indices)
        return super().batch(indices)


def test_evaluate_scores_every_eval_sample_exactly_once():
    base = synthetic_image(64, 50, image_size=8, num_classes=5, seed=3)
    eval_set = _RecordingDataset(base.eval)
    splits = DatasetSplits(
        name="recorded", task="classification", train=base.train, eval=eval_set,
        num_classes=5, image_size=8, in_chans=3,
    )
    cfg = vit_config(model=dict(dropout=0.3))
    adapter = build_adapter(
        cfg.model, num_classes=5, image_size=8, in_chans=3, seed=cfg.seed
    )
    # Train mode before; evaluate must score in eval mode (dropout off) and restore it.
    adapter.model.train()

    metric = evaluate(adapter, splits, batch_size=16)  # 50 = 16 + 16 + 16 + 2

    assert sorted(eval_set.requested) == list(range(50))
    adapter.model.eval()
    with torch.no_grad():
        logits = adapter.model(eval_set.inputs[0])  # the whole model, one full batch
    expected = int((logits.argmax(-1) == eval_set.target).sum()) / 50
    assert metric == expected
    assert 0.0 < metric < 1.0  # a partial score, so a dropped or doubled batch would show
    adapter.model.train()
    assert evaluate(adapter, splits, batch_size=50) == metric
    assert all(m.training for m in adapter.model.modules())
    # A frozen prefix kept in eval mode stays there (model.train() would have flipped it).
    adapter.model.blocks[0].eval()
    evaluate(adapter, splits, batch_size=16)
    assert [b.training for b in adapter.model.blocks] == [False] + [True] * (L - 1)
    assert not any(m.training for m in adapter.model.blocks[0].modules())


# -- equivalence with plain PyTorch -----------------------------------------------------------


def test_no_freeze_epoch_equals_a_plain_pytorch_loop():
    cfg = vit_config(
        epochs=1, freeze=dict(policy="none"),
        optimizer=dict(lr=2e-3, warmup_fraction=0.25, weight_decay=0.05, grad_clip=0.5),
    )
    trainer = build_reference(run_settings(cfg).reference)
    splits = trainer.splits
    trainer.fit()

    # The same model from the same seed, trained by a hand-written loop over the same order.
    torch.manual_seed(cfg.seed)
    import timm

    model = timm.create_model(
        "vit_base_patch16_224", pretrained=False, num_classes=splits.num_classes, img_size=8,
        in_chans=3, depth=L, embed_dim=32, num_heads=2, mlp_ratio=2.0, patch_size=4,
    )
    model.train()
    reference_init = build_adapter(
        cfg.model, num_classes=splits.num_classes, image_size=8, in_chans=3, seed=cfg.seed
    ).model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference_init[k]), k

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=2e-3, betas=(0.9, 0.999),
    )
    sampler = GlobalSampler(len(splits.train), BATCH, cfg.seed)
    total = STEPS_PER_EPOCH
    for s in range(total):
        progress = s / total
        if progress < 0.25:
            factor = progress / 0.25
        else:
            factor = 0.5 * (1 + math.cos(math.pi * (progress - 0.25) / 0.75))
        for g in opt.param_groups:
            g["lr"] = 2e-3 * factor
        idx = torch.from_numpy(sampler.step_indices(0, s).copy())
        x, y = splits.train.inputs[0][idx], splits.train.target[idx]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        opt.step()

    ours = dict(trainer.adapter.model.named_parameters())
    moved = 0.0
    for name, p in model.named_parameters():
        mine, theirs = ours[name].detach().clone(), p.detach().clone()
        if name.endswith("attn.qkv.bias"):
            # The key bias has no true gradient (softmax ignores a shift shared by every key),
            # so AdamW turns the rounding noise of its zero gradient into steps: that third of
            # the vector agrees to noise only (1.7e-6 measured), the rest to 1e-6.
            key = slice(p.numel() // 3, 2 * p.numel() // 3)
            assert torch.allclose(mine[key], theirs[key], rtol=0, atol=1e-5), name
            mine[key] = theirs[key] = 0.0
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6), name
        moved = max(moved, float((p.detach() - reference_init[name]).abs().max()))
    assert moved > 1e-3  # the parameters did train, so agreement is not trivial


# -- gradient accumulation --------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_accumulation_in_four_chunks_equals_the_whole_batch_across_a_freeze():
    # Clip 2.0 cuts some steps' gradients and not others (their norms span about 1.6-4), so a
    # wrongly weighted chunk would change the parameters even under AdamW, which is otherwise
    # blind to a constant gradient scale; the block norms and losses are compared too.
    runs = {}
    for steps in (1, 4):
        cfg = vit_config(epochs=2, model=dict(dropout=0.0),
                         optimizer=dict(grad_clip=2.0, accumulation_steps=steps))
        trainer = build_reference(run_settings(cfg).reference)
        sizes: list[int] = []
        trainer.adapter.head.register_forward_hook(
            lambda module, args, out, sizes=sizes:
                sizes.append(out.shape[0]) if module.training else None)
        timeline = trainer.fit()
        runs[steps] = (trainer, timeline, sizes)
    (one, one_timeline, one_sizes), (four, four_timeline, four_sizes) = runs[1], runs[4]
    # Each step ran as 4 passes of 8 samples (2 epochs x 8 steps), the other as 1 pass of 32.
    assert one_sizes == [BATCH] * 16 and four_sizes == [BATCH // 4] * 64
    assert [r.num_frozen for r in four_timeline] == [r.num_frozen for r in one_timeline] == [0, 2]
    for a, b in zip(four_timeline, one_timeline):
        assert a.train_loss == pytest.approx(b.train_loss, abs=1e-6)
    assert four.norms.mean() == pytest.approx(one.norms.mean(), rel=1e-5)
    theirs = dict(one.adapter.model.named_parameters())
    for name, p in four.adapter.model.named_parameters():
        assert torch.allclose(p, theirs[name], rtol=0, atol=1e-5), name
    # The parameters did train, so agreement is not trivial.
    initial = build_reference(
        run_settings(vit_config(epochs=2)).reference).adapter.model.state_dict()
    assert any(not torch.allclose(p, initial[n], atol=1e-3)
               for n, p in four.adapter.model.named_parameters())


# -- step-interval decisions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("warmup_epochs", "frozen_at_step", "epoch_end"),
    [
        # n(k) = ceil(4 (1 - 0.75^k)) = 0, 1, 2, 3, 3 (4 capped at L - 1 = 3).
        (0, [0] * 3 + [1] * 3 + [2] * 2 + [3] * 8, [2, 3]),
        # A one-epoch warm-up covers epoch 0's three decisions (steps 0-7): nothing freezes
        # there, then decision 3, which opens epoch 1 at step 8, jumps to n(3) = 3.
        (1, [0] * 8 + [3] * 8, [0, 3]),
    ],
)
def test_step_interval_decisions_freeze_mid_epoch_at_the_right_steps(
    warmup_epochs, frozen_at_step, epoch_end
):
    cfg = vit_config(
        epochs=2,
        freeze=dict(
            policy="schedule", alpha=0.25, interval="steps", interval_steps=3,
            warmup_epochs=warmup_epochs,
        ),
    )
    trainer = build_reference(run_settings(cfg).reference)
    assert trainer.sampler.steps_per_epoch == 8
    calls: list[tuple[int, int, tuple[int, ...]]] = []  # (decision, global step, norm blocks)
    original_decide = trainer.policy.decide

    def decide(decision, num_frozen, grad_norms=None):
        blocks = tuple(sorted(k for k in grad_norms or {} if k != LOSS_KEY))
        calls.append((decision, trainer.global_step, blocks))
        if decision > 0:  # the interval's mean training loss comes with its norms
            assert 0 < grad_norms[LOSS_KEY] < 10
        return original_decide(decision, num_frozen, grad_norms)

    trainer.policy.decide = decide
    seen_frozen: list[int] = []
    original_step = trainer.train_step

    def step(batch):
        seen_frozen.append(trainer.num_frozen)
        return original_step(batch)

    trainer.train_step = step
    timeline = trainer.fit()

    # Each epoch opens with a decision and takes one more every 3 of its steps (its last
    # interval, steps 6-7, closes at the epoch's end): decisions 0-2 at steps 0, 3, 6 and 3-5
    # at steps 8, 11, 14.
    steps = [8 * e + 3 * k for e in range(2) for k in range(3)]
    assert [(d, s) for d, s, _ in calls] == list(enumerate(steps))
    assert seen_frozen == frozen_at_step
    assert [r.num_frozen for r in timeline] == epoch_end
    # With no warm-up the prefix grows at steps 3 and 6, inside epoch 0, then as epoch 1 opens.
    changes = [s for s in range(1, 16) if seen_frozen[s] != seen_frozen[s - 1]]
    assert changes == ([3, 6, 8] if warmup_epochs == 0 else [8])
    # Each decision sees the norms of exactly the blocks active since the previous one.
    active = [0] + [frozen_at_step[steps[k] - 1] for k in range(1, 6)]
    assert [blocks for _, _, blocks in calls] == [
        () if k == 0 else tuple(range(active[k], L)) for k in range(6)
    ]


# -- Hugging Face BERT ------------------------------------------------------------------------


def test_tiny_bert_trains_with_finite_decreasing_loss():
    cfg = build_config(dict(
        model=dict(family="hf", name="bert", depth=2, width=32, num_heads=2, mlp_ratio=2.0),
        data=dict(
            name="synthetic_text", seq_len=16, num_samples=128, batch_size=8, num_classes=2
        ),
        freeze=dict(policy="schedule", alpha=0.5, warmup_epochs=2),
        optimizer=dict(lr=3e-3, warmup_fraction=0.1),
        epochs=3,
    ))
    trainer = build_reference(run_settings(cfg).reference)
    first = trainer.train_epoch(0)
    assert math.isfinite(first.train_loss) and 0.0 <= first.eval_metric <= 1.0
    rest = [trainer.train_epoch(e) for e in (1, 2)]
    losses = [first.train_loss] + [r.train_loss for r in rest]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] > losses[1] > losses[2]
    assert losses[2] < losses[0] - 0.1  # learning, not noise around ln 2
    assert rest[-1].eval_metric > 0.8
    # The last epoch trains with block 0 frozen (n(2) = ceil(2 * 0.75) = 2, capped at L - 1).
    assert [first.num_frozen] + [r.num_frozen for r in rest] == [0, 0, 1]


# -- evaluation cadence -------------------------------------------------------------------------


def test_eval_every_scores_every_kth_epoch_and_the_last(monkeypatch):
    import pt_ray.runtime.reference as reference

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(reference, "evaluate", counted)
    every = build_reference(run_settings(vit_config(eval_every=3, epochs=4)).reference).fit()
    evaluations = len(calls)
    always = build_reference(run_settings(vit_config(epochs=4)).reference).fit()
    scored = [not math.isnan(r.eval_metric) for r in every]
    assert scored == [False, False, True, True]
    # An epoch that is not scored does not evaluate at all (not just report NaN): two passes
    # over the eval set for the scored epochs 2 and 3, against four when every epoch scores.
    assert (evaluations, len(calls) - evaluations) == (2, 4)
    # Skipping an evaluation changes nothing else: the scored epochs and losses agree.
    assert [r.eval_metric for r in every][2:] == [r.eval_metric for r in always][2:]
    assert [r.train_loss for r in every] == [r.train_loss for r in always]


def test_the_probe_shares_the_prefix_only_while_it_cannot_change():
    # The state entering the tested blocks is kept: for both passes of a test, and across
    # tests once blocks are frozen. Each figure must equal the whole model run afresh.
    trainer = build_reference(run_settings(vit_config(
        freeze=dict(policy="probe", probe_samples=24))).reference)
    probe, adapter = trainer.probe, trainer.adapter
    assert probe is not None and len(probe.indices) == 24
    probe.batch_size = 10  # three batches, the last short

    @torch.no_grad()
    def whole_model_loss() -> float:
        adapter.model.eval()
        batch = finish_batch(probe.dataset, gather_stored(probe.dataset, probe.indices.tolist()))
        loss = float(adapter.loss(forward_layers(adapter, batch.inputs), batch.target))
        adapter.model.train()
        return loss

    def nudge(*modules: nn.Module) -> None:  # an interval's training, as far as the probe sees
        with torch.no_grad():
            for m in modules:
                for p in m.parameters():
                    p.add_(0.05 * torch.randn_like(p))

    def test(num_frozen: int, tested: int, *trained: nn.Module) -> dict[int, float]:
        probe.start(num_frozen, tested)
        before = [_clone_params(adapter.blocks[i]) for i in range(num_frozen, num_frozen + tested)]
        nudge(*trained)
        figures = probe.measure(num_frozen)
        assert figures[PROBE_NOW] == pytest.approx(whole_model_loss(), abs=1e-6)
        now = [_clone_params(adapter.blocks[i]) for i in range(num_frozen, num_frozen + tested)]
        for i, kept in enumerate(before):  # the tested blocks as the interval found them
            adapter.blocks[num_frozen + i].load_state_dict(kept)
        assert figures[PROBE_REVERTED] == pytest.approx(whole_model_loss(), abs=1e-6)
        for i, trained_now in enumerate(now):
            adapter.blocks[num_frozen + i].load_state_dict(trained_now)
        return figures

    torch.manual_seed(0)
    blocks = adapter.blocks
    test(0, 2, adapter.embed, blocks[0], blocks[1], blocks[2])
    test(0, 1, adapter.embed, blocks[0])  # the embedding moved: the kept state is stale
    first = test(1, 1, blocks[1], blocks[3])
    second = test(1, 1, blocks[1], blocks[2])  # block 0 and the embedding frozen: kept
    assert first[PROBE_NOW] != second[PROBE_NOW]
    test(2, 1, blocks[2])  # one more block frozen: computed again
