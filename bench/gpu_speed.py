"""Single-GPU speed of the engine: a ViT-B/16 in bf16, with nothing frozen, with the paper's
freeze timeline, and with freezing plus the activation cache.

Runs the torch runtime directly (one rank, an NCCL group of world size 1; no Ray), so it works on
a machine that has CUDA, torch, timm and pydantic but not Ray. Images are synthetic and made on
the GPU (class templates plus noise), so no input pipeline is measured. Every arm trains the
same steps from the same seed; the table gives samples/s over the training loops, each arm's
ratio to the no-freeze arm, the ideal bound of the freeze timeline, and the share of the GPU's
bf16 peak the no-freeze step reaches (model FLOPs counted by torch's FlopCounterMode).

    python bench/gpu_speed.py --out bench/out/gpu            # on a CUDA machine
    python bench/gpu_speed.py --dry-run --out /tmp/gpu-dry   # tiny model on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pt_ray.config import build_config
from pt_ray.control import build_control_state
from pt_ray.data.base import DatasetSplits, TensorSampleDataset
from pt_ray.hwprofile import profile_for_gpu
from pt_ray.runtime.cache import InMemoryStore
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.reference import build_model_for
from pt_ray.summary import ideal_speedup

FULL = {"image": 224, "patch": 16, "depth": 12, "width": 768, "heads": 12, "batch": 128,
        "steps": 25, "epochs": 10, "eval": 512, "classes": 10}
DRY = {"image": 32, "patch": 8, "depth": 4, "width": 64, "heads": 4, "batch": 8,
       "steps": 3, "epochs": 4, "eval": 16, "classes": 10}


def synthetic_images(n: int, size: int, classes: int, device: torch.device, seed: int):
    """``n`` images ``[n, 3, size, size]`` of class templates plus noise, made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    coarse = torch.randn(classes, 3, 4, 4, generator=gen, device=device)
    templates = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")
    labels = torch.arange(n, device=device) % classes
    x = 0.5 * templates[labels] + torch.randn(n, 3, size, size, generator=gen, device=device)
    return TensorSampleDataset((x,), labels, ("pixel_values",))


def run_arm(shape: dict, arm: str, device: torch.device, precision: str) -> dict:
    """Train one arm; returns its timeline and timings."""
    freeze = ({"policy": "none"} if arm == "no freeze" else
              {"policy": "schedule", "alpha": 1 / 3, "warmup_epochs": 1})
    cfg = build_config({
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": shape["depth"],
                  "width": shape["width"], "num_heads": shape["heads"],
                  "patch_size": shape["patch"]},
        "data": {"name": "synthetic_image", "image_size": shape["image"],
                 "batch_size": shape["batch"], "num_classes": shape["classes"],
                 "num_samples": shape["batch"] * shape["steps"]},
        "freeze": freeze,
        "pipeline": {"num_workers": 1},
        "cache": {"mode": "on" if arm == "freeze + cache" else "off", "order": "blocks",
                  "worker_memo_bytes": 0},
        "optimizer": {"name": "adamw", "lr": 1e-3, "warmup_fraction": 0.1},
        "epochs": shape["epochs"],
        "precision": precision,
    })
    n = shape["batch"] * shape["steps"]
    splits = DatasetSplits(
        name="synthetic_image", task="classification",
        train=synthetic_images(n, shape["image"], shape["classes"], device, 1),
        eval=synthetic_images(shape["eval"], shape["image"], shape["classes"], device, 2),
        num_classes=shape["classes"], image_size=shape["image"], in_chans=3)
    torch.manual_seed(0)
    adapter = build_model_for(cfg, splits)
    control = build_control_state(cfg, adapter.num_layers, 1, shape["steps"])
    comm = Comm(device)
    store = InMemoryStore() if arm == "freeze + cache" else None
    worker = ElasticWorker(cfg, adapter=adapter, splits=splits, device=device, comm=comm,
                           controller=LocalController(control, comm), store=store)
    t0 = time.perf_counter()
    timeline = worker.fit()
    wall = time.perf_counter() - t0
    worker.close()
    train_s = sum(r.epoch_time_s for r in timeline)
    return {
        "arm": arm,
        "samples_per_s": n * len(timeline) / train_s,
        "train_time_s": train_s,
        "wall_time_s": wall,
        "frozen_by_epoch": [r.num_frozen for r in timeline],
        "cache_hit_rate_by_epoch": [round(r.cache_hit_rate, 3) for r in timeline],
        "final_eval_accuracy": timeline[-1].eval_metric,
        "final_train_loss": timeline[-1].train_loss,
        "ideal_bound": ideal_speedup(timeline, cached=arm == "freeze + cache"),
        "epoch_time_s": [round(r.epoch_time_s, 4) for r in timeline],
    }


def step_flops(shape: dict, device: torch.device, precision: str) -> float:
    """Model FLOPs of one training step per sample (forward and backward, nothing frozen)."""
    from torch.utils.flop_counter import FlopCounterMode

    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False,
                              img_size=shape["image"], patch_size=shape["patch"],
                              depth=shape["depth"], embed_dim=shape["width"],
                              num_heads=shape["heads"], num_classes=shape["classes"]).to(device)
    x = torch.randn(2, 3, shape["image"], shape["image"], device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(x).float().logsumexp(-1).mean()
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model, few steps, on the CPU")
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu"))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = FULL if cuda else DRY
    precision = "bf16"
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rdzv",
                                rank=0, world_size=1, timeout=timedelta(seconds=300))
        try:
            # Warm-up (kernel selection, allocator, autotuning): one short run, discarded.
            run_arm({**shape, "epochs": 1, "steps": min(shape["steps"], 5)}, "no freeze",
                    device, precision)
            rows = [run_arm(shape, arm, device, precision)
                    for arm in ("no freeze", "freeze", "freeze + cache")]
        finally:
            dist.destroy_process_group()
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["ratio_to_no_freeze"] = row["samples_per_s"] / base
        row["of_ideal_bound"] = row["ratio_to_no_freeze"] / row["ideal_bound"]
    flops = step_flops(shape, device, precision)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "precision": precision,
        "shape": shape,
        "model_flops_per_sample": flops,
        "rows": rows,
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        peak = profile_for_gpu(props.name, props.total_memory, 1, precision).device_flops
        measured = matmul_peak(device)
        achieved = flops * base
        result.update(datasheet_bf16_peak=peak, measured_matmul_peak=measured,
                      achieved_flops=achieved, share_of_datasheet_peak=achieved / peak,
                      share_of_measured_peak=achieved / measured)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_speed.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return result


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['precision']}, "
             f"ViT {result['shape']['depth']}x{result['shape']['width']} at "
             f"{result['shape']['image']} px, batch {result['shape']['batch']}, "
             f"{result['shape']['steps']} steps x {result['shape']['epochs']} epochs per arm",
             f"{'arm':<16}{'samples/s':>11}{'ratio':>8}{'ideal':>8}{'of ideal':>10}"
             f"{'train s':>9}{'accuracy':>10}  frozen by epoch"]
    for r in result["rows"]:
        lines.append(f"{r['arm']:<16}{r['samples_per_s']:>11,.0f}{r['ratio_to_no_freeze']:>7.2f}x"
                     f"{r['ideal_bound']:>7.2f}x{r['of_ideal_bound']:>10.0%}"
                     f"{r['train_time_s']:>9.2f}{r['final_eval_accuracy']:>10.3f}  "
                     f"{r['frozen_by_epoch']}")
    if "share_of_datasheet_peak" in result:
        lines.append(
            f"no-freeze step: {result['achieved_flops'] / 1e12:.0f} TFLOP/s of model FLOPs = "
            f"{result['share_of_datasheet_peak']:.1%} of the {result['datasheet_bf16_peak'] / 1e12:.0f}"
            f" TFLOP/s bf16 datasheet peak, {result['share_of_measured_peak']:.1%} of the "
            f"{result['measured_matmul_peak'] / 1e12:.0f} TFLOP/s measured matmul peak")
    if not all(math.isfinite(r["final_train_loss"]) for r in result["rows"]):
        lines.append("WARNING: a non-finite training loss")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
