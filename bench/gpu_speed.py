"""Single-GPU speed of the engine: a ViT-B/16 in bf16, eager and compiled, with nothing frozen
and with the paper's freeze timeline, and with freezing plus the activation cache.

Runs the torch runtime directly (one rank, an NCCL group of world size 1; no Ray), so it works on
a machine that has CUDA, torch, timm and pydantic but not Ray. Images are synthetic and made on
the GPU (class templates plus noise), so no input pipeline is measured. Every arm trains the
same steps from the same seed, beside the loop a user would write for one GPU instead (plain
PyTorch: the same model, optimizer, schedule and clipping under autocast), eager and under
``torch.compile``. The table gives samples/s over the training loops after their first epoch
(which holds compilation and autotuning), each arm's ratio to the engine's no-freeze arm and
to both plain loops, the ideal bound of the freeze timeline over the same epochs, and the
share of the GPU's bf16 peak each arm reaches (model FLOPs counted by torch's FlopCounterMode).

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

from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.base import DatasetSplits, TensorSampleDataset
from pt_ray.costs.hwprofile import profile_for_gpu
from pt_ray.runtime.cache import InMemoryStore
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.reporting.summary import ideal_speedup

# The engine's arms: eager and compiled (pipeline.compile=on), with nothing frozen and with the
# paper's freeze timeline, and freezing with the activation cache.
ARMS = ("no freeze", "no freeze compiled", "freeze", "freeze compiled", "freeze + cache")
FULL = {"image": 224, "patch": 16, "depth": 12, "width": 768, "heads": 12, "batch": 128,
        "steps": 25, "epochs": 10, "eval": 512, "classes": 10}
DRY = {"image": 32, "patch": 8, "depth": 4, "width": 64, "heads": 4, "batch": 8,
       "steps": 3, "epochs": 4, "eval": 16, "classes": 10}


def make_splits(shape: dict, device: torch.device) -> DatasetSplits:
    """Train and eval images ``[n, 3, size, size]`` made on ``device``: one smooth template per
    class plus fresh noise per image (both splits share the templates)."""
    size, classes = shape["image"], shape["classes"]
    gen = torch.Generator(device=device).manual_seed(0)
    coarse = torch.randn(classes, 3, 4, 4, generator=gen, device=device)
    templates = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")

    def draw(n: int) -> TensorSampleDataset:
        labels = torch.randperm(n, generator=gen, device=device) % classes
        noise = torch.randn(n, 3, size, size, generator=gen, device=device)
        return TensorSampleDataset((0.5 * templates[labels] + noise,), labels, ("pixel_values",))

    return DatasetSplits(name="synthetic_image", task="classification",
                         train=draw(shape["batch"] * shape["steps"]), eval=draw(shape["eval"]),
                         num_classes=classes, image_size=size, in_chans=3)


def arm_config(shape: dict, arm: str, precision: str):
    """The run configuration of an engine arm (and of the plain loop's optimizer)."""
    freeze = ({"policy": "none"} if arm.startswith("no freeze") else
              {"policy": "schedule", "alpha": 1 / 3, "warmup_epochs": 1})
    cfg = build_config({
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": shape["depth"],
                  "width": shape["width"], "num_heads": shape["heads"],
                  "patch_size": shape["patch"]},
        "data": {"name": "synthetic_image", "image_size": shape["image"],
                 "batch_size": shape["batch"], "num_classes": shape["classes"],
                 "num_samples": shape["batch"] * shape["steps"]},
        "freeze": freeze,
        "pipeline": {"num_workers": 1, "compile": "on" if "compiled" in arm else "off"},
        "cache": {"mode": "on" if "cache" in arm else "off", "worker_memo_bytes": 0},
        "optimizer": {"name": "adamw", "lr": 1e-3, "warmup_fraction": 0.1},
        "epochs": shape["epochs"],
        "precision": precision,
    })
    return cfg


def run_arm(shape: dict, arm: str, device: torch.device, precision: str,
            splits: DatasetSplits) -> dict:
    """Train one engine arm; returns its timeline and timings."""
    cfg = arm_config(shape, arm, precision)
    n = len(splits.train)
    torch.manual_seed(0)
    adapter = build_model_for(cfg, splits)
    control = build_control_state(cfg, adapter.num_layers, 1, shape["steps"])
    comm = Comm(device)
    store = InMemoryStore() if "cache" in arm else None
    worker = ElasticWorker(cfg, adapter=adapter, splits=splits, device=device, comm=comm,
                           controller=LocalController(control, comm), store=store)
    t0 = time.perf_counter()
    timeline = worker.fit()
    wall = time.perf_counter() - t0
    worker.close()
    train_s = sum(r.epoch_time_s for r in timeline)
    return {
        "arm": arm,
        "samples_per_s": steady_rate(n, [r.epoch_time_s for r in timeline]),
        "train_time_s": train_s,
        "wall_time_s": wall,
        "frozen_by_epoch": [r.num_frozen for r in timeline],
        "cache_hit_rate_by_epoch": [round(r.cache_hit_rate, 3) for r in timeline],
        "final_eval_accuracy": timeline[-1].eval_metric,
        "final_train_loss": timeline[-1].train_loss,
        # Over the epochs the rate counts.
        "ideal_bound": ideal_speedup(timeline[1:] or timeline, cached="cache" in arm),
        "epoch_time_s": [round(r.epoch_time_s, 4) for r in timeline],
    }


def run_plain(shape: dict, device: torch.device, precision: str, splits: DatasetSplits,
              compiled: bool = False) -> dict:
    """What a user would write for one GPU instead: the same timm model, AdamW (decay on
    matrices only), the same learning-rate schedule and clipping, autocast in ``precision``,
    a fresh permutation each epoch, and the whole eval set scored after each epoch; with
    ``compiled``, the model under ``torch.compile``."""
    from pt_ray.runtime.optim import lr_factor

    cfg = arm_config(shape, "no freeze", precision)
    torch.manual_seed(0)
    model = build_model_for(cfg, splits).model.to(device)
    if compiled:
        model = torch.compile(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.optimizer.lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    (x,), y = splits.train.inputs, splits.train.target
    (xe,), ye = splits.eval.inputs, splits.eval.target
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
                out = model(x[idx])
            loss = torch.nn.functional.cross_entropy(out.float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
            opt.step()
            step += 1
        _sync(device)
        epoch_times.append(time.perf_counter() - t0)
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            correct = sum(int((model(xe[i:i + b]).argmax(-1) == ye[i:i + b]).sum())
                          for i in range(0, len(ye), b))
        accuracy = correct / len(ye)
    train_s = sum(epoch_times)
    return {
        "arm": "plain compiled" if compiled else "plain PyTorch",
        "samples_per_s": steady_rate(n, epoch_times),
        "train_time_s": train_s,
        "wall_time_s": time.perf_counter() - t_start,
        "frozen_by_epoch": [0] * shape["epochs"],
        "cache_hit_rate_by_epoch": [0.0] * shape["epochs"],
        "final_eval_accuracy": accuracy,
        "final_train_loss": float(loss.detach()),
        "ideal_bound": 1.0,
        "epoch_time_s": [round(t, 4) for t in epoch_times],
    }


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
            splits = make_splits(shape, device)
            # Warm-up (kernel selection, allocator, autotuning): one short run, discarded.
            run_arm({**shape, "epochs": 1}, "no freeze", device, precision, splits)
            rows = [run_arm(shape, arm, device, precision, splits) for arm in ARMS]
            rows += [run_plain(shape, device, precision, splits, compiled=c)
                     for c in (False, True)]
        finally:
            dist.destroy_process_group()
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["ratio_to_no_freeze"] = row["samples_per_s"] / base
        row["of_ideal_bound"] = row["ratio_to_no_freeze"] / row["ideal_bound"]
    plain, plain_compiled = rows[-2]["samples_per_s"], rows[-1]["samples_per_s"]
    for row in rows:
        row["ratio_to_plain"] = row["samples_per_s"] / plain
        row["ratio_to_plain_compiled"] = row["samples_per_s"] / plain_compiled
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
        for row in rows:
            row["share_of_datasheet_peak"] = flops * row["samples_per_s"] / peak
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_speed.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return result


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['precision']}, "
             f"ViT {result['shape']['depth']}x{result['shape']['width']} at "
             f"{result['shape']['image']} px, batch {result['shape']['batch']}, "
             f"{result['shape']['steps']} steps x {result['shape']['epochs']} epochs per arm",
             f"{'arm':<20}{'samples/s':>11}{'ratio':>8}{'ideal':>8}{'of ideal':>10}"
             f"{'vs plain':>9}{'vs comp.':>9}{'train s':>9}{'accuracy':>10}  frozen by epoch"]
    for r in result["rows"]:
        lines.append(f"{r['arm']:<20}{r['samples_per_s']:>11,.0f}{r['ratio_to_no_freeze']:>7.2f}x"
                     f"{r['ideal_bound']:>7.2f}x{r['of_ideal_bound']:>10.0%}"
                     f"{r['ratio_to_plain']:>8.2f}x{r['ratio_to_plain_compiled']:>8.2f}x"
                     f"{r['train_time_s']:>9.2f}{r['final_eval_accuracy']:>10.3f}  "
                     f"{r['frozen_by_epoch']}")
    if "share_of_datasheet_peak" in result:
        lines.append(
            f"no-freeze step: {result['achieved_flops'] / 1e12:.0f} TFLOP/s of model FLOPs = "
            f"{result['share_of_datasheet_peak']:.1%} of the "
            f"{result['datasheet_bf16_peak'] / 1e12:.0f} TFLOP/s bf16 datasheet peak, "
            f"{result['share_of_measured_peak']:.1%} of the "
            f"{result['measured_matmul_peak'] / 1e12:.0f} TFLOP/s measured matmul peak")
    if not all(math.isfinite(r["final_train_loss"]) for r in result["rows"]):
        lines.append("WARNING: a non-finite training loss")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
