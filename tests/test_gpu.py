"""The engine on one CUDA GPU as one rank of a pure NCCL group (skipped without CUDA).

An NCCL group of world size 1 still rejects CPU tensors, so a run through steps, freeze
transitions, evaluation and epoch ends proves the device contract for real: every counter,
timing, metric and norm of the run reaches NCCL on the GPU. ``bench/gpu_check.sh`` runs these.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.base import DatasetSplits, TensorSampleDataset
from pt_ray.data.registry import build_dataset
from pt_ray.models.base import iter_layers
from pt_ray.cache.store import InMemoryStore
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.runtime.reference import build_reference
from pt_ray.service.settings import run_settings

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

VIT = {
    "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 64,
              "num_heads": 4, "mlp_ratio": 2.0, "patch_size": 4},
    "data": {"name": "synthetic_image", "num_samples": 256, "image_size": 16, "batch_size": 32},
    "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
    "pipeline": {"num_workers": 1},
    "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
    "epochs": 3,
}
BERT = {
    "model": {"family": "hf", "name": "bert", "depth": 4, "width": 64, "num_heads": 4,
              "mlp_ratio": 2.0, "dropout": 0.0},
    "data": {"name": "synthetic_text", "num_samples": 256, "seq_len": 16, "batch_size": 32},
    "freeze": VIT["freeze"], "pipeline": VIT["pipeline"], "optimizer": VIT["optimizer"],
    "epochs": 3,
}


CPU_ENV = "PT_RAY_GPU_TESTS_ON_CPU"
"""Set to 1 to run these tests on the CPU with gloo (``bench/gpu_check.sh --dry-run``): the same
code path without CUDA, so the check cannot rot on machines without a GPU."""


@pytest.fixture(scope="module")
def cuda():
    """This process as rank 0 of a one-rank NCCL group on GPU 0 (gloo on the CPU with
    ``PT_RAY_GPU_TESTS_ON_CPU=1``)."""
    import os
    import tempfile

    if torch.cuda.is_available():
        device, backend = torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
    elif os.environ.get(CPU_ENV) == "1":
        device, backend = torch.device("cpu"), "gloo"
    else:
        pytest.skip("needs CUDA")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1, timeout=timedelta(seconds=120))
        yield device
        dist.destroy_process_group()


def on_device(splits: DatasetSplits, device: torch.device) -> DatasetSplits:
    """The splits with their tensors on ``device`` (batches are gathered there)."""

    def move(ds: TensorSampleDataset) -> TensorSampleDataset:
        return TensorSampleDataset(tuple(t.to(device) for t in ds.inputs), ds.target.to(device),
                                   ds.input_names, ds.deterministic_transform)

    return dataclasses.replace(splits, train=move(splits.train), eval=move(splits.eval))


def run_engine(cfg, device, store=None):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, 1,
                                  len(splits.train) // cfg.data.batch_size)
    comm = Comm(device)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter,
                           splits=on_device(splits, device),
                           controller=LocalController(control, comm), device=device,
                           store=store, comm=comm)
    frozen_at: dict[str, torch.Tensor] = {}

    def snapshot(rec):
        # Parameters of the frozen prefix, as they were when they froze.
        for name, module in iter_layers(adapter):
            if name not in frozen_at and not any(p.requires_grad for p in module.parameters()):
                frozen_at[name] = torch.cat([p.detach().flatten().clone()
                                             for p in module.parameters()])

    timeline = worker.fit(on_epoch=snapshot)
    for name, module in iter_layers(adapter):
        if name in frozen_at:
            now = torch.cat([p.detach().flatten() for p in module.parameters()])
            assert torch.equal(now, frozen_at[name]), f"{name} changed after it froze"
    worker.close()
    return worker, adapter, timeline


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("base", [VIT, BERT], ids=["vit", "bert"])
def test_engine_trains_on_one_gpu_through_nccl(cuda, base, precision):
    cfg = build_config({**base, "precision": precision})
    worker, adapter, timeline = run_engine(cfg, cuda)
    assert worker.comm.device == cuda
    assert [r.num_frozen for r in timeline] == [0, 2, 3]
    assert all(r.pipeline_length == 1 and r.num_replicas == 1 for r in timeline)
    assert all(torch.isfinite(torch.tensor(r.train_loss)) for r in timeline)
    assert timeline[-1].train_loss < timeline[0].train_loss
    assert 0.0 <= timeline[-1].eval_metric <= 1.0
    assert all(p.device == cuda and p.dtype == torch.float32 for p in adapter.model.parameters())
    if precision == "fp16":
        assert worker.scaler is not None and 0 < worker.scaler.scale < float("inf")


def test_fp32_on_gpu_computes_what_the_cpu_reference_computes(cuda):
    """Same data order, same seed: the GPU engine ends where the CPU reference does (different
    kernels, so to 1e-3 of how far training moved the parameters, with TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = build_config({**VIT, "precision": "fp32"})
    _, adapter, _ = run_engine(cfg, cuda)
    ref = build_reference(run_settings(cfg).reference)
    init = torch.cat([p.detach().flatten().clone() for p in ref.adapter.model.parameters()])
    ref.fit()
    ours = torch.cat([p.detach().flatten().cpu() for p in adapter.model.parameters()])
    theirs = torch.cat([p.detach().flatten() for p in ref.adapter.model.parameters()])
    assert float((ours - theirs).norm() / (theirs - init).norm()) < 1e-3


def test_cache_serves_cuda_activations_in_the_compute_dtype(cuda):
    cfg = build_config({**VIT, "precision": "bf16", "cache": {"mode": "on"}, "epochs": 4})
    store = InMemoryStore()
    worker, _, timeline = run_engine(cfg, cuda, store)
    assert [r.num_frozen for r in timeline] == [0, 2, 3, 3]
    assert timeline[-1].cache_hit_rate == 1.0  # depth 3 was written in epoch 2
    segments = store.read(range(worker.prefix.blocks.num_blocks), 3)
    assert segments and all(s.dtypes[0] == "bfloat16" and s.level == 3 for s in segments)


def test_cache_on_equals_cache_off_in_fp32_on_gpu(cuda):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The cache changes no order: both runs see the same samples each step.
    base = {**VIT, "precision": "fp32", "epochs": 4, "cache": {"mode": "on"}}
    _, _, cached = run_engine(build_config(base), cuda, InMemoryStore())
    _, _, plain = run_engine(build_config({**base, "cache": {"mode": "off"}}), cuda)
    assert cached[-1].cache_hit_rate > 0
    for a, b in zip(cached, plain):
        assert a.train_loss == pytest.approx(b.train_loss, abs=1e-4)


def test_profiling_brings_one_layer_at_a_time_to_the_gpu(cuda):
    from pt_ray.data.base import gather
    from pt_ray.runtime.profile import profile_costs

    cfg = build_config(VIT)
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)  # on the host, as every rank builds it
    layers = dict(iter_layers(adapter))
    seen: list[tuple[str, list[str]]] = []

    def note(name):
        def hook(module, args):
            on = sorted(n for n, m in layers.items()
                        if any(p.device == cuda for p in m.parameters()))
            seen.append((name, on))
        return hook

    for name, module in layers.items():
        module.register_forward_pre_hook(note(name))
    costs = profile_costs(adapter, gather(on_device(splits, cuda).train, list(range(8))))
    assert costs.num_layers == adapter.num_layers and costs.samples == 8
    # The blocks after the first take its figures without running (identical ViT blocks).
    assert {name for name, _ in seen} == {"embed", "block.0", "head"}
    assert all(c == costs.blocks[0] for c in costs.blocks)
    if cuda.type == "cuda":  # on the CPU (the dry run) host and device are one
        # While a layer runs, it alone is on the GPU; afterwards the model is back on the host.
        assert all(on == [name] for name, on in seen)
        assert all(p.device.type == "cpu" for p in adapter.model.parameters())
