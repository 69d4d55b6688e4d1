"""The peer pt-ray must beat: plain Ray Train data parallelism, written the way a Ray user who
does not use pt-ray writes it.

``TorchTrainer`` runs :func:`train_loop_per_worker` on N CPU workers (gloo). Each worker builds
the same dataset and the same model as pt-ray, from the same weights (``build_dataset`` and
``build_model_for`` with the run's seed, so ``model.weights`` loads as in pt-ray and a fresh
head draws the same values; the peer trains the wrapped ``nn.Module`` itself, not pt-ray's cut
of it: a timm ViT called on the pixels, or a Hugging Face classifier called on its named text
inputs, whose ``logits`` it scores),
wraps it with ``ray.train.torch.prepare_model`` (DDP), and reads its shard of the training split
through a ``DataLoader`` with a ``DistributedSampler`` (``shuffle=True``, the run's seed,
``set_epoch`` every epoch) and a per-worker batch of ``data.batch_size / N``; partial shards
and batches are dropped, so an epoch has ``floor(samples / batch_size)`` steps, as pt-ray's.
The optimizer is AdamW with weight decay on matrices only, the learning rate follows pt-ray's
warm-up and cosine schedule by samples seen (``lr_factor``), and gradients are clipped with
``clip_grad_norm_``. On pt-ray's cadence (``eval_every`` and ``checkpoint_every``, 1 by
default) the whole eval set is scored (each rank scores every N-th sample, the counts are
summed) and rank 0 attaches a checkpoint of the model's ``state_dict`` to ``ray.train.report``,
which every rank calls every epoch (pt-ray's checkpoints also hold the optimizer state). As
pt-ray's run does, Ray Train keeps the latest two checkpoints.

For a diagnostic, ``sample_order="pt-ray"`` (``compare.py --peer-order pt-ray``) swaps the
``DistributedSampler`` for pt-ray's own global order (:class:`PtRayOrder`: each step covers the
samples pt-ray's step covers, this rank its contiguous share), so that the peer and pt-ray train
on the same batches and an accuracy gap between them is not the draw of the order. The headline
keeps the ``DistributedSampler``: it is what a Ray user writes.

What is measurement, not training: the epoch's training time is taken around the training
loop only; the ranks' times, losses and correct counts are combined with one ``all_reduce``
after the loop; each report carries the epochs so far, so that the driver reads the whole
timeline from the last one. Classification only (timm ViTs and Hugging Face classifiers; not
question answering), with ``batch_policy=fixed_global``; on CPUs in fp32 (gloo), or with
``pipeline.use_gpu`` on one GPU per worker (NCCL, ``prepare_model`` placing the model, batches
copied from pinned memory) in fp32 or under bf16 autocast, as a user's loop would.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from pt_ray.core.config import RunConfig
from pt_ray.data.base import SampleDataset
from pt_ray.data.registry import build_dataset
from pt_ray.runtime.optim import lr_factor
from pt_ray.runtime.build import build_model_for

__all__ = ["SAMPLE_ORDERS", "PeerRun", "PtRayOrder", "check_config", "input_names", "logits",
           "run_peer", "train_loop_per_worker"]

SAMPLE_ORDERS = ("distributed", "pt-ray")
"""The peer's training order: a ``DistributedSampler``'s (the standard way), or pt-ray's."""


def check_config(cfg: RunConfig) -> None:
    """Refuse what the peer cannot run like for like with pt-ray.

    Raises:
        ValueError: naming the field, its value and the fix.
    """
    if cfg.data.name in ("squad_json", "qa_table"):
        raise ValueError(f"data.name={cfg.data.name}: the peer arm trains classifiers only (a "
                         "question-answering model's loss differs); run with --no-peer-arm")
    if cfg.batch_policy != "fixed_global":
        raise ValueError(f"batch_policy={cfg.batch_policy}: the peer arm keeps the global batch "
                         "fixed (data.batch_size / N per worker); use batch_policy=fixed_global")
    gpu, dtype = peer_device(cfg)
    if dtype is None:
        raise ValueError(f"pipeline.use_gpu={cfg.pipeline.use_gpu}, precision={cfg.precision}: "
                         "the peer arm trains in fp32, or in bf16 on GPUs; set precision=fp32 "
                         "(or bf16 with pipeline.use_gpu=true), or run with --no-peer-arm")


def peer_device(cfg: RunConfig) -> tuple[bool, torch.dtype | None]:
    """Whether the peer trains on GPUs (as pt-ray would: ``use_gpu=auto`` takes a GPU where the
    host has one), and its autocast dtype (``float32``: none; ``None``: not supported)."""
    gpu = cfg.pipeline.use_gpu is True or (cfg.pipeline.use_gpu == "auto"
                                           and torch.cuda.is_available())
    wanted = cfg.precision if cfg.precision != "auto" else ("bf16" if gpu else "fp32")
    return gpu, {"fp32": torch.float32, "bf16": torch.bfloat16 if gpu else None}.get(wanted)


class _Samples(Dataset):
    """A pt-ray split as a torch dataset of ``(inputs, target)`` pairs, for ``DataLoader``:
    ``inputs`` is the split's tuple (the pixels, or the token ids, mask and types)."""

    def __init__(self, split: SampleDataset) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        _, inputs, target = self.split[index]
        return tuple(inputs), target


def input_names(adapter: Any) -> tuple[str, ...]:
    """How the peer passes a batch's inputs to the plain model: ``()`` positionally (a timm
    ViT takes the pixels), else by these names (a Hugging Face classifier; the token types only
    where its embeddings read them, as pt-ray's cut passes them)."""
    if adapter.family == "timm":
        return ()
    names = tuple(adapter.input_names)
    return names if adapter.spec.token_types else names[:2]


def logits(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
           names: tuple[str, ...]) -> torch.Tensor:
    """``logits[B, C]`` of the plain (or DDP-wrapped) model for a batch's inputs."""
    if not names:
        return model(*inputs)
    return model(**dict(zip(names, inputs))).logits


class PtRayOrder(Sampler[int]):
    """pt-ray's global sample order for one rank of the peer: per step, this rank's contiguous
    share of the samples pt-ray's step covers (``GlobalSampler.replica_indices``), so that a
    ``DataLoader`` with a batch of ``data.batch_size / N`` gives the rank pt-ray's replica
    batches. ``set_epoch`` as a ``DistributedSampler``'s."""

    def __init__(self, cfg: RunConfig, num_samples: int, rank: int, world: int) -> None:
        # Imported here: the headline peer's module stays as light as a user's. The plain
        # order, as pt-ray's without the cache (whose blocks would shape it).
        from pt_ray.data.sampler import GlobalSampler

        self.sampler = GlobalSampler(num_samples, cfg.data.batch_size, cfg.seed)
        self.rank, self.world, self.epoch = rank, world, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch * (self.sampler.batch_size // self.world)

    def __iter__(self):
        for step in range(self.sampler.steps_per_epoch):
            yield from self.sampler.replica_indices(self.epoch, step, self.rank,
                                                    self.world).tolist()


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


CPU = torch.device("cpu")


def _on(inputs: tuple[torch.Tensor, ...], target: torch.Tensor, device: torch.device
        ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    if device.type == "cpu":
        return inputs, target
    return (tuple(t.to(device, non_blocking=True) for t in inputs),
            target.to(device, non_blocking=True))


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@torch.no_grad()
def _correct(model: torch.nn.Module, loader: DataLoader, names: tuple[str, ...],
             device: torch.device = CPU, dtype: torch.dtype = torch.float32
             ) -> int:
    model.eval()
    correct = 0
    for inputs, target in loader:
        inputs, target = _on(inputs, target, device)
        with _autocast(device, dtype):
            correct += int((logits(model, inputs, names).argmax(dim=-1) == target).sum())
    model.train()
    return correct


def train_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                opt_cfg, seen: int, total_samples: int, step_samples: int,
                names: tuple[str, ...] = (), device: torch.device = CPU,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """One epoch of the peer's training loop (also what ``engine_tax.py`` times): the learning
    rate set from the samples seen, forward (under autocast to ``dtype`` unless fp32), backward
    (DDP reduces the gradients), clipping and the step. ``names``: see :func:`input_names`.
    Returns this rank's summed loss (on ``device``) and the samples seen after the epoch."""
    loss_sum = torch.zeros((), device=device)
    for inputs, target in loader:
        inputs, target = _on(inputs, target, device)
        for group in optimizer.param_groups:
            group["lr"] = opt_cfg.lr * lr_factor(seen / total_samples, opt_cfg)
        with _autocast(device, dtype):
            loss = F.cross_entropy(logits(model, inputs, names).float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if opt_cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        optimizer.step()
        loss_sum += loss.detach()
        seen += step_samples
    return loss_sum, seen


def _loaders(cfg: RunConfig, splits, rank: int, world: int, sample_order: str, gpu: bool
             ) -> tuple[Any, DataLoader, DataLoader]:
    """This rank's sampler, training loader (``data.batch_size / N`` per step) and eval loader
    (every N-th eval sample, so the ranks score each sample once)."""
    train = _Samples(splits.train)
    if sample_order == "pt-ray":
        sampler = PtRayOrder(cfg, len(train), rank, world)
    else:
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                     seed=cfg.seed, drop_last=True)
    loader = DataLoader(train, batch_size=cfg.data.batch_size // world, sampler=sampler,
                        drop_last=True, num_workers=cfg.data.num_workers, pin_memory=gpu)
    eval_rows = range(rank, len(splits.eval), world)
    eval_loader = DataLoader(torch.utils.data.Subset(_Samples(splits.eval), eval_rows),
                             batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                             num_workers=cfg.data.num_workers, pin_memory=gpu)
    return sampler, loader, eval_loader


def _epoch_record(epoch: int, num_layers: int, world: int, samples: int, epoch_time: float,
                  train_loss: float, eval_metric: float, eval_time: float) -> dict[str, Any]:
    """An epoch as pt-ray's ``EpochRecord`` has it: nothing frozen, K = 1, R = N, no cache."""
    return {"epoch": epoch, "num_frozen": 0, "num_layers": num_layers, "pipeline_length": 1,
            "num_replicas": world, "num_microbatches": 1,
            "throughput_samples_per_s": samples / max(epoch_time, 1e-9),
            "epoch_time_s": epoch_time, "transition_time_s": 0.0, "cache_hit_rate": 0.0,
            "train_loss": train_loss, "eval_metric": eval_metric, "eval_time_s": eval_time}


def _report(metrics: dict[str, Any], model: torch.nn.Module | None) -> None:
    """``ray.train.report`` (a barrier: every rank reports), with a checkpoint of ``model``'s
    ``state_dict`` when given one (rank 0, on pt-ray's checkpoint cadence)."""
    import ray.train

    if model is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # DDP wraps the model when N > 1; the saved keys are the model's own.
        torch.save(getattr(model, "module", model).state_dict(), Path(tmp) / "model.pt")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function.

    Args:
        config: ``{"run": RunConfig as a dict, "sample_order": one of SAMPLE_ORDERS}``.
    """
    import ray.train
    import ray.train.torch

    entered = time.time()
    cfg = RunConfig.model_validate(config["run"])
    torch.set_num_threads(max(1, int(cfg.pipeline.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    splits = build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
    built_data = time.time()
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    built_model = time.time()
    names = input_names(adapter)
    gpu, dtype = peer_device(cfg)
    device = ray.train.torch.get_device() if gpu else torch.device("cpu")
    model = ray.train.torch.prepare_model(adapter.model)  # on the worker's GPU where it has one

    per_worker = cfg.data.batch_size // world
    sampler, loader, eval_loader = _loaders(cfg, splits, rank, world,
                                            config.get("sample_order", "distributed"), gpu)
    opt_cfg = cfg.optimizer
    optimizer = torch.optim.AdamW(_param_groups(model, opt_cfg.weight_decay), lr=opt_cfg.lr,
                                  betas=opt_cfg.betas)
    total_samples = cfg.epochs * len(loader) * per_worker * world
    # As pt-ray's workers note theirs (rank 0; set-up here is DDP, the loaders and AdamW).
    startup = {"entered_at": entered, "dataset_s": built_data - entered,
               "model_s": built_model - built_data, "setup_s": time.time() - built_model}
    seen = 0
    history: list[dict[str, Any]] = []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        loss_sum, seen = train_epoch(model, loader, optimizer, opt_cfg, seen, total_samples,
                                     per_worker * world, names, device, dtype)
        if gpu:
            torch.cuda.synchronize(device)
        train_time = time.perf_counter() - t0

        t1 = time.perf_counter()
        scored = cfg.evaluates_after(epoch)
        correct = _correct(model, eval_loader, names, device, dtype) if scored else 0
        # On the group's device: NCCL takes CUDA tensors only.
        sums = torch.tensor([float(correct), float(loss_sum)], dtype=torch.float64, device=device)
        times = torch.tensor([train_time], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        eval_time = time.perf_counter() - t1 if scored else 0.0
        steps = len(loader)
        history.append(_epoch_record(
            epoch, adapter.num_layers, world, steps * per_worker * world, float(times[0]),
            float(sums[1]) / world / max(steps, 1),
            float(sums[0]) / max(len(splits.eval), 1) if scored else math.nan, eval_time))
        metrics = {**history[-1], "metric_name": adapter.metric_name, "history": list(history),
                   "startup": startup}
        _report(metrics, model if cfg.checkpoints_after(epoch) and rank == 0 else None)


@dataclass(frozen=True)
class PeerRun:
    """What a peer run returns to the driver.

    Attributes:
        timeline: one record per epoch, with the keys of pt-ray's ``EpochRecord`` that apply
            (nothing frozen, K = 1, R = N, no transitions, no cache).
        metric_name: the eval metric's name.
        final_eval_metric: the eval metric after the last epoch.
        wall_time_s: ``TorchTrainer.fit()`` wall time, s.
        checkpoint: the last checkpoint's directory (``model.pt``: the model's state_dict).
        startup: rank 0's start-up, as pt-ray's ``summary.json`` has it: ``worker_group_s``
            (``TorchTrainer.fit()`` until the worker function began), ``dataset_s``,
            ``model_s``, ``setup_s`` (DDP, the loaders, the optimizer).
    """

    timeline: list[dict[str, Any]]
    metric_name: str
    final_eval_metric: float
    wall_time_s: float
    checkpoint: str | None
    startup: dict[str, float] = field(default_factory=dict)


def run_peer(cfg: RunConfig, run_dir: Path, sample_order: str = "distributed") -> PeerRun:
    """Train ``cfg`` with the peer on the connected Ray cluster.

    Args:
        cfg: the run configuration (``pipeline.num_workers`` and ``cpus_per_worker`` size the
            worker group; freezing, pipeline and cache settings do not apply).
        run_dir: Ray Train's storage goes under ``run_dir/ray``, as pt-ray's does.
        sample_order: ``"distributed"`` (a ``DistributedSampler``, the standard way) or
            ``"pt-ray"`` (pt-ray's order, :class:`PtRayOrder`: a diagnostic).

    Raises:
        ValueError: see :func:`check_config`; or an unknown ``sample_order``.
        ray.train.TrainingFailedError: the run failed.
    """
    import ray.cloudpickle
    from ray.train import CheckpointConfig, LoggingConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    check_config(cfg)
    gpu, _ = peer_device(cfg)
    if sample_order not in SAMPLE_ORDERS:
        raise ValueError(f"sample_order={sample_order!r}: choose one of {', '.join(SAMPLE_ORDERS)}")
    # bench/ is not importable on Ray's workers: ship this module's code with the function.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    p = cfg.pipeline
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"run": cfg.model_dump(mode="json"), "sample_order": sample_order},
        scaling_config=ScalingConfig(num_workers=p.num_workers, use_gpu=gpu,
                                     resources_per_worker={"CPU": p.cpus_per_worker,
                                                           **({"GPU": 1} if gpu else {})}),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=TrainRunConfig(
            name=f"peer-{uuid.uuid4().hex[:8]}",
            storage_path=str((run_dir / "ray").resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=2),  # as pt-ray's
            # As pt-ray's: Ray Train's per-report INFO lines would bury the benchmark's output.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    t0 = time.perf_counter()
    launched = time.time()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    if result.error is not None:
        raise result.error
    # The last epoch always checkpoints; its report carries every epoch's record.
    timeline = [dict(m) for m in (result.metrics or {}).get("history", [])]
    if [m["epoch"] for m in timeline] != list(range(cfg.epochs)):
        raise RuntimeError(f"peer run reported epochs {[m['epoch'] for m in timeline]}, "
                           f"expected 0..{cfg.epochs - 1}")
    metric_name = result.metrics["metric_name"]
    ckpt = result.checkpoint.path if result.checkpoint is not None else None
    startup = dict(result.metrics.get("startup", {}))  # rank 0's report is the result's
    if "entered_at" in startup:
        startup = {"worker_group_s": startup.pop("entered_at") - launched, **startup}
    return PeerRun(timeline, metric_name, timeline[-1]["eval_metric"], wall, ckpt, startup)
