"""The whole service on one GPU: pt-ray on Ray Train against plain Ray Train on the same GPU.

Runs ``bench/compare.py`` with two arms, ``pt-ray`` (``pt_ray.fit``: the controller actor, one
GPU worker, freezing and the activation cache) and ``peer`` (``bench/peer_ddp.py``: a
``TorchTrainer`` with ``prepare_model``, the loop a Ray user writes), on the job of
``bench/gpu_ray.yaml``, inside one embedded cluster, then prints one table: start-up, training
time, the whole call, samples/s, model FLOP utilisation, transitions and accuracy.

MFU is training samples/s times the model's FLOPs per training sample (forward and backward,
counted by torch's ``FlopCounterMode`` on the model as built, nothing frozen) over the GPU's
dense bf16 datasheet peak. Freezing lowers the FLOPs a sample needs, so pt-ray's MFU counts the
work a full step would do: it reads as "the no-freeze utilisation that would give this speed".

    python bench/gpu_ray.py --out bench/out/gpu/ray            # on a CUDA machine, with Ray
    python bench/gpu_ray.py --dry-run --out /tmp/gpu-ray-dry   # a tiny model on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "bench" / "gpu_ray.yaml"
# The dry run: the same job shrunk to seconds on a CPU (gloo, fp32).
DRY = ["pipeline.use_gpu=false", "precision=fp32", "model.depth=4", "model.width=32",
       "model.num_heads=2", "model.mlp_ratio=2.0", "model.patch_size=8", "data.image_size=32",
       "data.num_samples=256", "data.batch_size=32", "epochs=3"]


def flops_per_sample(cfg) -> float:
    """Forward plus backward FLOPs of one training sample on the model ``cfg`` builds."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pt_ray.data.registry import build_dataset
    from pt_ray.runtime.build import build_model_for

    data = cfg.data.model_copy(update={"num_samples": 8})
    splits = build_dataset(data, seed=cfg.seed)
    model = build_model_for(cfg.model, cfg.seed, splits).model
    _, inputs, target = splits.train[0]
    batch = [t.unsqueeze(0).repeat(2, *([1] * t.dim())) for t in inputs]
    with FlopCounterMode(display=False) as counter:
        out = model(*batch)
        torch.nn.functional.cross_entropy(out, torch.stack([target, target])).backward()
    return counter.get_total_flops() / 2


def transitions(timeline: list[dict]) -> int:
    """Epochs after which the plan changed (frozen blocks, K or R)."""
    plans = [(r["num_frozen"], r["pipeline_length"], r["num_replicas"]) for r in timeline]
    return sum(a != b for a, b in zip(plans, plans[1:]))


def rows(data: dict, flops: float, peak: float | None) -> list[dict]:
    out = []
    for arm in data["arms"]:
        rec = data["runs"][arm][0]
        timeline = rec["timeline"]
        samples = sum(r["throughput_samples_per_s"] * r["epoch_time_s"] for r in timeline)
        rate = samples / max(rec["train_time_s"], 1e-9)
        out.append({
            "arm": arm,
            "startup_s": rec["overhead_split"].get("startup_s"),
            "train_time_s": rec["train_time_s"],
            "fit_call_s": rec["fit_call_s"],
            "samples_per_s": rate,
            "mfu": rate * flops / peak if peak else None,
            "transitions": transitions(timeline),
            "frozen_by_epoch": [r["num_frozen"] for r in timeline],
            "accuracy": rec["final_accuracy"],
        })
    return out


def table(result: dict) -> str:
    head = (f"{'arm':<8}{'start-up s':>11}{'training s':>11}{'whole call s':>13}"
            f"{'samples/s':>11}{'MFU':>7}{'transitions':>12}{'accuracy':>10}")
    lines = [head]
    for r in result["rows"]:
        start = f"{r['startup_s']:.1f}" if r["startup_s"] is not None else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(f"{r['arm']:<8}{start:>11}{r['train_time_s']:>11.1f}{r['fit_call_s']:>13.1f}"
                     f"{r['samples_per_s']:>11.0f}{mfu:>7}{r['transitions']:>12}"
                     f"{r['accuracy']:>10.4f}")
    by_arm = {r["arm"]: r for r in result["rows"]}
    if {"pt-ray", "peer"} <= set(by_arm):
        ours, peer = by_arm["pt-ray"], by_arm["peer"]
        lines.append(f"pt-ray over plain Ray Train: training "
                     f"{peer['train_time_s'] / ours['train_time_s']:.2f}x, whole call "
                     f"{peer['fit_call_s'] / ours['fit_call_s']:.2f}x (ideal bound of the "
                     f"timeline {result['ideal_bound']:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu/ray"))
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    from pt_ray.api import resolve_config

    overrides = DRY if args.dry_run else []
    cfg = resolve_config(CONFIG, overrides)
    sets = [a for o in overrides for a in ("--set", o)]
    rc = compare.main(["--config", str(CONFIG), "--arms", "pt-ray,peer", "--repeats", "1",
                       "--warmup", "0", "--out", str(args.out), *sets])
    if rc != 0:
        return rc
    data = json.loads((args.out / "compare.json").read_text())
    peak = None
    if cfg.pipeline.use_gpu is True:
        import torch

        from pt_ray.costs.hwprofile import profile_for_gpu

        props = torch.cuda.get_device_properties(0)
        peak = profile_for_gpu(props.name, props.total_memory, 1, "bf16").device_flops
    pt = data["runs"]["pt-ray"][0]
    result = {"config": str(CONFIG), "overrides": overrides, "datasheet_bf16_peak": peak,
              "flops_per_sample": flops_per_sample(cfg), "ideal_bound": pt.get("ideal_bound", 1.0)}
    result["rows"] = rows(data, result["flops_per_sample"], peak)
    (args.out / "gpu_ray.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
