"""Single-GPU speed ladder of the engine, without Ray: ViT-B/16 and BERT in bf16, eager and
compiled, beside the loop a user would write for one GPU instead.

Runs the torch runtime directly (one rank, an NCCL group of world size 1), so it works on a
machine that has CUDA, torch, timm, transformers and pydantic but not Ray. Every arm of a rung
trains the same steps from the same seed. Rates are samples/s over the epochs after an arm's
first (which holds compilation and autotuning); MFU is model FLOPs (counted by torch's
FlopCounterMode) against the datasheet bf16 peak and against a large matmul measured in the same
run. The rungs, in the order they run (a rung that would start past ``--budget-s`` is skipped
and says so, so the ladder ends in time on a slower GPU):

1. ``vit-b16``: batch 128, images made on the GPU. Nothing frozen eager and compiled, the
   paper's freeze timeline (alpha 1/3) eager and compiled, the timeline with the activation
   cache's device tier and with the store alone (compiled), and a plain PyTorch loop eager and
   compiled (the same model, AdamW, schedule and clipping under autocast).
2. ``input``: the compiled no-freeze arm fed three ways: images already on the GPU, uint8
   CIFAR-layout files (32 px, resized on the GPU), and a JPEG image folder the script writes
   (decoded in ``data.num_workers`` processes); each as a share of the on-GPU rate.
3. ``vit-b16 b256``: batch 256, nothing frozen, eager and compiled, beside the plain compiled
   loop.
4. ``bert-base`` and 5. ``bert-large``: sequence 128, batch 128, nothing frozen, eager and
   compiled, beside the plain compiled loop (Hugging Face's model called as a user would).

    python bench/gpu_speed.py --out bench/out/gpu            # on a CUDA machine
    python bench/gpu_speed.py --dry-run --out /tmp/gpu-dry   # tiny models on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.base import DatasetSplits, TensorSampleDataset
from pt_ray.data.registry import build_dataset
from pt_ray.costs.hwprofile import profile_for_gpu
from pt_ray.cache.store import InMemoryStore
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.reporting.summary import ideal_speedup
from pt_ray.service.settings import run_settings


@dataclass(frozen=True)
class Arm:
    """One row of a rung: the engine (``plain=False``) or the plain loop, and how it runs."""

    name: str
    freeze: bool = False
    compiled: bool = False
    cache: str | None = None  # "device": the tiers on; "store": the store alone
    plain: bool = False
    feed: str = "device"  # "device", "uint8" files or a "jpeg" folder


VIT_ARMS = (Arm("no freeze"), Arm("no freeze compiled", compiled=True),
            Arm("freeze", freeze=True), Arm("freeze compiled", freeze=True, compiled=True),
            Arm("freeze + cache", freeze=True, compiled=True, cache="device"),
            Arm("freeze + store cache", freeze=True, compiled=True, cache="store"),
            Arm("plain PyTorch", plain=True), Arm("plain compiled", plain=True, compiled=True))
INPUT_ARMS = (Arm("on GPU", compiled=True), Arm("uint8 files", compiled=True, feed="uint8"),
              Arm("JPEG folder", compiled=True, feed="jpeg"))
SIZE_ARMS = (Arm("no freeze"), Arm("no freeze compiled", compiled=True),
             Arm("plain compiled", plain=True, compiled=True))

VIT_B16 = {"model": "vit", "image": 224, "patch": 16, "depth": 12, "width": 768, "heads": 12,
           "batch": 128, "steps": 25, "epochs": 10, "eval": 512, "classes": 10}
BERT_BASE = {"model": "bert", "seq": 128, "vocab": 30522, "depth": 12, "width": 768,
             "heads": 12, "batch": 128, "steps": 20, "epochs": 4, "eval": 256, "classes": 2}
BERT_LARGE = {**BERT_BASE, "depth": 24, "width": 1024, "heads": 16, "steps": 12}
RUNGS = (("vit-b16", VIT_B16, VIT_ARMS),
         ("input", {**VIT_B16, "steps": 25, "epochs": 3, "eval": 256}, INPUT_ARMS),
         ("vit-b16 b256", {**VIT_B16, "batch": 256, "steps": 12, "epochs": 4}, SIZE_ARMS),
         ("bert-base", BERT_BASE, SIZE_ARMS),
         ("bert-large", BERT_LARGE, SIZE_ARMS))
DRY = {"vit": {"image": 32, "patch": 8, "depth": 4, "width": 64, "heads": 4, "batch": 8,
               "steps": 3, "epochs": 4, "eval": 16},
       "bert": {"seq": 16, "vocab": 100, "depth": 2, "width": 32, "heads": 2, "batch": 8,
                "steps": 2, "epochs": 2, "eval": 8}}
"""A dry run's sizes (CPU, gloo): the same rungs and arms on tiny models."""


def make_splits(shape: dict, device: torch.device) -> DatasetSplits:
    """Train and eval sets made on ``device``: for a ViT, one smooth template per class plus
    fresh noise per image; for BERT, random tokens whose class is planted in token 1."""
    gen = torch.Generator(device=device).manual_seed(0)
    classes, n = shape["classes"], shape["batch"] * shape["steps"]
    if shape["model"] == "vit":
        size = shape["image"]
        coarse = torch.randn(classes, 3, 4, 4, generator=gen, device=device)
        templates = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")

    def draw(count: int) -> TensorSampleDataset:
        labels = torch.randperm(count, generator=gen, device=device) % classes
        if shape["model"] == "bert":
            ids = torch.randint(classes, shape["vocab"], (count, shape["seq"]), generator=gen,
                                device=device)
            ids[:, 1] = labels
            inputs = (ids, torch.ones_like(ids), torch.zeros_like(ids))
            return TensorSampleDataset(inputs, labels, ("input_ids", "attention_mask",
                                                        "token_type_ids"))
        noise = torch.randn(count, 3, size, size, generator=gen, device=device)
        return TensorSampleDataset((0.5 * templates[labels] + noise,), labels, ("pixel_values",))

    if shape["model"] == "bert":
        return DatasetSplits(name="synthetic_text", task="classification", train=draw(n),
                             eval=draw(shape["eval"]), num_classes=classes,
                             seq_len=shape["seq"], vocab_size=shape["vocab"])
    return DatasetSplits(name="synthetic_image", task="classification", train=draw(n),
                         eval=draw(shape["eval"]), num_classes=classes,
                         image_size=shape["image"], in_chans=3)


def write_cifar(root: Path, shape: dict) -> Path:
    """CIFAR-10's pickle layout with the rung's training images (uint8, 32 px) and its eval
    set as the test batch."""
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    n = shape["batch"] * shape["steps"]
    per = [len(part) for part in np.array_split(np.arange(n), 5)] + [shape["eval"]]
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, count in zip(names, per):
        labels = (np.arange(count) % shape["classes"]).tolist()
        data = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
        with (folder / name).open("wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f, protocol=2)
    return root


def write_jpegs(root: Path, shape: dict) -> Path:
    """An ImageNet-like folder: ``train/`` and ``val/``, one folder per class, 320 x 240 JPEGs
    (smooth colour fields, quality 90) in parallel threads."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def one(job: tuple[str, int]) -> None:
        split, i = job
        rng = np.random.default_rng(i + (0 if split == "train" else 10**6))
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((320, 240), Image.Resampling.BICUBIC)
        folder = root / split / f"class{i % shape['classes']}"
        img.save(folder / f"{i}.jpg", quality=90)

    jobs = [("train", i) for i in range(shape["batch"] * shape["steps"])]
    jobs += [("val", i) for i in range(shape["eval"])]
    for split in ("train", "val"):
        for c in range(shape["classes"]):
            (root / split / f"class{c}").mkdir(parents=True)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, jobs))
    return root


def arm_config(shape: dict, arm: Arm, precision: str, cuda: bool, data: dict | None = None):
    """The run configuration of an engine arm (and of the plain loop's optimizer)."""
    freeze = ({"policy": "schedule", "alpha": 1 / 3, "warmup_epochs": 1} if arm.freeze else
              {"policy": "none"})
    if shape["model"] == "bert":
        model = {"family": "hf", "name": "bert", "dropout": 0.0}
        data = data or {"name": "synthetic_text", "seq_len": shape["seq"]}
    else:
        model = {"family": "timm", "name": "vit_base_patch16_224", "patch_size": shape["patch"]}
        data = data or {"name": "synthetic_image"}
    # The device tier is auto on CUDA; a dry run gives it bytes so that its path runs too.
    tiers = ({"device_bytes": "auto" if cuda else 2**28} if arm.cache == "device" else
             {"device_bytes": 0, "host_bytes": 0})
    return build_config({
        "model": {**model, "depth": shape["depth"], "width": shape["width"],
                  "num_heads": shape["heads"]},
        "data": {"image_size": shape.get("image"), "batch_size": shape["batch"],
                 "num_classes": shape["classes"], **data},
        "freeze": freeze,
        "pipeline": {"num_workers": 1, "compile": "on" if arm.compiled else "off"},
        "cache": {"mode": "on" if arm.cache else "off", "worker_memo_bytes": 0, **tiers},
        "optimizer": {"name": "adamw", "lr": 1e-3, "warmup_fraction": 0.1},
        "epochs": shape["epochs"],
        "precision": precision,
    })


def fed_splits(shape: dict, arm: Arm, device: torch.device, tmp: Path) -> tuple[DatasetSplits,
                                                                               dict | None]:
    """The arm's data: made on the GPU, or files the loader reads (and the data section that
    reads them, with loader processes)."""
    if arm.feed == "device":
        return make_splits(shape, device), None
    workers = max(2, min(8, (os.cpu_count() or 2) - 2))
    if arm.feed == "uint8":
        data = {"name": "cifar10", "path": str(write_cifar(tmp / "cifar", shape))}
    else:
        data = {"name": "imagefolder", "path": str(write_jpegs(tmp / "jpeg", shape))}
    data = {**data, "image_size": shape["image"], "num_workers": workers}
    cfg = arm_config(shape, arm, "bf16", False, data)
    return build_dataset(cfg.data, seed=cfg.seed), data


def run_arm(shape: dict, arm: Arm, device: torch.device, precision: str,
            splits: DatasetSplits, data: dict | None = None) -> dict:
    """Train one engine arm; returns its timeline and timings."""
    cfg = arm_config(shape, arm, precision, device.type == "cuda", data)
    torch.manual_seed(0)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, 1, shape["steps"])
    comm = Comm(device)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           device=device, comm=comm,
                           controller=LocalController(control, comm),
                           store=InMemoryStore() if arm.cache else None)
    t0 = time.perf_counter()
    timeline = worker.fit()
    wall = time.perf_counter() - t0
    tier_rows = sum(t.served for t in worker.prefix.tiers) if worker.prefix else 0
    worker.close()
    return {
        "arm": arm.name,
        "samples_per_s": steady_rate(shape["batch"] * shape["steps"],
                                     [r.epoch_time_s for r in timeline]),
        "train_time_s": sum(r.epoch_time_s for r in timeline),
        "wall_time_s": wall,
        "frozen_by_epoch": [r.num_frozen for r in timeline],
        "cache_hit_rate_by_epoch": [round(r.cache_hit_rate, 3) for r in timeline],
        "rows_from_tiers": tier_rows,
        "final_eval_accuracy": timeline[-1].eval_metric,
        "final_train_loss": timeline[-1].train_loss,
        # Over the epochs the rate counts.
        "ideal_bound": ideal_speedup(timeline, cached=arm.cache is not None,
                                     from_epoch=1 if len(timeline) > 1 else 0),
        "epoch_time_s": [round(r.epoch_time_s, 4) for r in timeline],
    }


def plain_forward(shape: dict, model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    """The logits as a user calls the model: timm's on pixels, Hugging Face's by keyword."""
    if shape["model"] == "bert":
        ids, mask, types = inputs
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    return model(*inputs)


def run_plain(shape: dict, device: torch.device, precision: str, splits: DatasetSplits,
              compiled: bool = False) -> dict:
    """What a user would write for one GPU instead: the same model, AdamW (decay on matrices
    only), the same learning-rate schedule and clipping, autocast in ``precision``, a fresh
    permutation each epoch, and the whole eval set scored after each epoch; with ``compiled``,
    the model under ``torch.compile`` and, on CUDA, fused AdamW."""
    from pt_ray.runtime.optim import lr_factor

    cfg = arm_config(shape, Arm("plain"), precision, device.type == "cuda")
    torch.manual_seed(0)
    model = build_model_for(cfg.model, cfg.seed, splits).model.to(device)
    if compiled:
        model = torch.compile(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    # The compiled loop is the strongest a user would write: fused AdamW on CUDA as well.
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.optimizer.lr,
                            fused=compiled and device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    x, y = splits.train.inputs, splits.train.target
    xe, ye = splits.eval.inputs, splits.eval.target
    n, b, total = len(y), shape["batch"], shape["steps"] * shape["epochs"]
    epoch_times, accuracy, step = [], 0.0, 0
    t_start = time.perf_counter()
    for _ in range(shape["epochs"]):
        model.train()
        order = torch.randperm(n, device=device)
        _sync(device)
        t0 = time.perf_counter()
        for s in range(shape["steps"]):
            for g in opt.param_groups:
                g["lr"] = cfg.optimizer.lr * lr_factor(step / total, cfg.optimizer)
            idx = order[s * b:(s + 1) * b]
            with torch.autocast(device.type, dtype=dtype):
                out = plain_forward(shape, model, tuple(t[idx] for t in x))
            loss = torch.nn.functional.cross_entropy(out.float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
            opt.step()
            step += 1
        _sync(device)
        epoch_times.append(time.perf_counter() - t0)
        accuracy = plain_accuracy(shape, model, xe, ye, dtype)
    return {
        "arm": "plain compiled" if compiled else "plain PyTorch",
        "samples_per_s": steady_rate(n, epoch_times),
        "train_time_s": sum(epoch_times),
        "wall_time_s": time.perf_counter() - t_start,
        "frozen_by_epoch": [0] * shape["epochs"],
        "cache_hit_rate_by_epoch": [0.0] * shape["epochs"],
        "rows_from_tiers": 0,
        "final_eval_accuracy": accuracy,
        "final_train_loss": float(loss.detach()),
        "ideal_bound": 1.0,
        "epoch_time_s": [round(t, 4) for t in epoch_times],
    }


def plain_accuracy(shape: dict, model: torch.nn.Module, xe: tuple, ye: torch.Tensor,
                   dtype: torch.dtype) -> float:
    """The plain loop's eval: top-1 over the whole eval set, batch by batch."""
    model.eval()
    b, correct = shape["batch"], 0
    with torch.no_grad(), torch.autocast(ye.device.type, dtype=dtype):
        for i in range(0, len(ye), b):
            out = plain_forward(shape, model, tuple(t[i:i + b] for t in xe))
            correct += int((out.argmax(-1) == ye[i:i + b]).sum())
    return correct / len(ye)


def steady_rate(samples_per_epoch: int, epoch_times: list[float]) -> float:
    """Samples/s over the epochs after the first (compilation and autotuning land in the
    first); over the one epoch when there is only one."""
    times = epoch_times[1:] or epoch_times
    return samples_per_epoch * len(times) / sum(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_flops(shape: dict, device: torch.device, precision: str) -> float:
    """Model FLOPs of one training step per sample (forward and backward, nothing frozen)."""
    from torch.utils.flop_counter import FlopCounterMode

    splits = make_splits({**shape, "steps": 1, "batch": 2, "eval": 2}, device)
    cfg = arm_config(shape, Arm("flops"), precision, device.type == "cuda")
    torch.manual_seed(0)
    model = build_model_for(cfg.model, cfg.seed, splits).model.to(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    inputs = tuple(t[:2] for t in splits.train.inputs)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = plain_forward(shape, model, inputs).float().logsumexp(-1).mean()
        loss.backward()
    return counter.get_total_flops() / 2


def matmul_peak(device: torch.device) -> float:
    """Measured bf16 matrix-product rate (FLOP/s): 8192^3 on random data, mean of 10 after 3."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3)


def run_rung(name: str, shape: dict, arms: tuple[Arm, ...], device: torch.device,
             precision: str, tmp: Path) -> dict:
    """Every arm of a rung, with its ratios: to the rung's first arm, to the plain loops, to
    the ideal bound of its freeze timeline; the input rung's shares of the on-GPU feed."""
    rows, base_splits = [], make_splits(shape, device)
    for arm in arms:
        if arm.plain:
            rows.append(run_plain(shape, device, precision, base_splits, compiled=arm.compiled))
        elif arm.feed == "device":
            rows.append(run_arm(shape, arm, device, precision, base_splits))
        else:
            splits, data = fed_splits(shape, arm, device, tmp)
            rows.append(run_arm(shape, arm, device, precision, splits, data))
        rows[-1]["arm"] = arm.name
    base = rows[0]["samples_per_s"]
    plain = {r["arm"]: r["samples_per_s"] for r in rows if r["arm"].startswith("plain")}
    for row in rows:
        row["ratio_to_no_freeze"] = row["samples_per_s"] / base
        row["of_ideal_bound"] = row["ratio_to_no_freeze"] / row["ideal_bound"]
        for label, key in (("plain PyTorch", "ratio_to_plain"),
                           ("plain compiled", "ratio_to_plain_compiled")):
            row[key] = row["samples_per_s"] / plain[label] if label in plain else None
    return {"rung": name, "shape": shape, "rows": rows,
            "model_flops_per_sample": step_flops(shape, device, precision)}


def run_ladder(cuda: bool, device: torch.device, budget_s: float) -> list[dict]:
    """The rungs in order, each with its arms, skipping those that would start past the
    budget."""
    ladder, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape, arms in RUNGS:
            if not cuda:
                shape = {**shape, **DRY[shape["model"]]}
            spent = time.perf_counter() - t0
            if spent > budget_s:
                ladder.append({"rung": name, "shape": shape, "rows": [],
                               "skipped": f"{spent:.0f} s spent of a {budget_s:.0f} s budget"})
                print(f"rung {name}: skipped ({ladder[-1]['skipped']})", flush=True)
                continue
            print(f"rung {name} ...", flush=True)
            ladder.append(run_rung(name, shape, arms, device, "bf16", Path(tmp) / name))
            ladder[-1]["seconds"] = time.perf_counter() - t0 - spent
    return ladder


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny models, few steps, on the CPU")
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu"))
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no rung after this many seconds (the ladder's first rungs are "
                        "the ones its targets read)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rdzv",
                                rank=0, world_size=1, timeout=timedelta(seconds=300))
        try:
            # Warm-up (kernel selection, allocator, autotuning): one short run, discarded.
            warm = {**VIT_B16, **({} if cuda else DRY["vit"]), "epochs": 1}
            run_arm(warm, VIT_ARMS[0], device, "bf16", make_splits(warm, device))
            ladder = run_ladder(cuda, device, args.budget_s)
        finally:
            dist.destroy_process_group()
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
              "torch": torch.__version__, "precision": "bf16", "ladder": ladder,
              "rows": ladder[0]["rows"], "shape": ladder[0]["shape"]}
    if cuda:
        add_mfu(result, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_speed.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return result


def add_mfu(result: dict, device: torch.device) -> None:
    """Each row's share of the datasheet bf16 peak and of the matmul rate measured here."""
    props = torch.cuda.get_device_properties(device)
    peak = profile_for_gpu(props.name, props.total_memory, 1, "bf16").device_flops
    measured = matmul_peak(device)
    result.update(datasheet_bf16_peak=peak, measured_matmul_peak=measured)
    for rung in result["ladder"]:
        for row in rung["rows"]:
            achieved = rung["model_flops_per_sample"] * row["samples_per_s"]
            row["share_of_datasheet_peak"] = achieved / peak
            row["share_of_measured_peak"] = achieved / measured


def _ratio(value: float | None) -> str:
    return f"{value:>8.2f}x" if value is not None else f"{'-':>9}"


def table(result: dict) -> str:
    """The ladder as text: one block per rung, the peaks last."""
    lines = [f"{result['device']}, torch {result['torch']}, {result['precision']}"]
    for rung in result["ladder"]:
        s = rung["shape"]
        what = (f"ViT {s['depth']}x{s['width']} at {s['image']} px" if s["model"] == "vit"
                else f"BERT {s['depth']}x{s['width']} at sequence {s['seq']}")
        lines.append(f"\n{rung['rung']}: {what}, batch {s['batch']}, {s['steps']} steps x "
                     f"{s['epochs']} epochs per arm"
                     + (f": skipped ({rung['skipped']})" if rung.get("skipped") else ""))
        if not rung["rows"]:
            continue
        lines.append(f"{'arm':<22}{'samples/s':>11}{'ratio':>8}{'ideal':>8}{'of ideal':>10}"
                     f"{'vs plain':>9}{'vs comp.':>9}{'MFU':>7}{'train s':>9}{'accuracy':>10}"
                     f"  frozen by epoch")
        for r in rung["rows"]:
            mfu = r.get("share_of_datasheet_peak")
            lines.append(
                f"{r['arm']:<22}{r['samples_per_s']:>11,.0f}{r['ratio_to_no_freeze']:>7.2f}x"
                f"{r['ideal_bound']:>7.2f}x{r['of_ideal_bound']:>10.0%}"
                f"{_ratio(r['ratio_to_plain'])}{_ratio(r['ratio_to_plain_compiled'])}"
                + (f"{mfu:>7.1%}" if mfu is not None else f"{'-':>7}")
                + f"{r['train_time_s']:>9.2f}{r['final_eval_accuracy']:>10.3f}  "
                  f"{r['frozen_by_epoch']}")
    if "datasheet_bf16_peak" in result:
        lines.append(f"\nMFU: model FLOPs per second over the "
                     f"{result['datasheet_bf16_peak'] / 1e12:.0f} TFLOP/s bf16 datasheet peak; "
                     f"a bf16 8192^3 matmul measured here reaches "
                     f"{result['measured_matmul_peak'] / 1e12:.0f} TFLOP/s")
    rows = [r for rung in result["ladder"] for r in rung["rows"]]
    if not all(math.isfinite(r["final_train_loss"]) for r in rows):
        lines.append("WARNING: a non-finite training loss")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
