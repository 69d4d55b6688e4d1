"""``pt-ray plan``: predict a run on a cluster, epoch by epoch, before paying for it.

Pure module (argparse and the cost model; no torch, no ray). Builds analytic costs for a known
model shape on a hardware profile, runs :func:`pt_ray.costs.simulate.simulate`, and prints a
per-epoch table, the predicted total against the no-freeze baseline, and the paper's ablations.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pt_ray.costs.costmodel import RUNTIMES, analytic_costs, list_hardware, load_hardware
from pt_ray.core.plan import divisors
from pt_ray.core.shapes import MODEL_SHAPES, model_shape, saved_activation_factor
from pt_ray.costs.simulate import SIMULATED_POLICIES, SimulationResult, simulate

__all__ = ["add_plan_parser", "main", "run_plan"]

# What --as-2021 fills in for options left unset: the 2021 code as the paper ran it.
_AS_2021 = dict(planner="2021", runtime="2021", schedule="gpipe", batch_policy="per_replica",
                max_frozen="all")
_DEFAULTS = dict(planner="cost", runtime="pt-ray", schedule="1f1b", batch_policy="fixed_global",
                 max_frozen=None)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` command to a ``pt-ray`` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "plan",
        help="predict a run (per-epoch K, R, M, cache, throughput) and its speedup, no devices",
        description="Predict a pt-ray run on a cluster before paying for it: the freeze "
        "timeline, the plan the planner makes each epoch, the predicted throughput and epoch "
        "time, the total against the no-freeze baseline, and the paper's ablations. Costs are "
        "analytic (model shape x hardware profile); nothing is built or downloaded. Defaults: "
        "the paper's ImageNet run (ViT-B/16, 16 devices, batch 400, alpha 1/3, 10 epochs).",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="vit_base_patch16_224",
                   help="a timm ViT/DeiT or Hugging Face BERT-family name (see --list)")
    m.add_argument("--depth", type=int, help="override L, the number of blocks")
    m.add_argument("--width", type=int, help="override the hidden size D")
    m.add_argument("--heads", type=int, help="override the attention heads")
    m.add_argument("--mlp-ratio", type=float, help="override the MLP ratio")
    m.add_argument("--tokens", type=int, help="override the sequence length T (ViT: patches+1)")
    m.add_argument("--num-classes", type=int, help="override the classifier outputs")
    c = p.add_argument_group("cluster")
    c.add_argument("--devices", type=int, default=16, help="N, devices in use (default 16)")
    c.add_argument("--hardware", default="paper-rtx5000",
                   help="a shipped profile name or a YAML file (default paper-rtx5000)")
    c.add_argument("--pipeline-length", default=None,
                   help="K0, the initial pipeline length; 'auto': chosen by the cost model "
                   "(default: the largest divisor of N within one node and L)")
    r = p.add_argument_group("run")
    r.add_argument("--epochs", type=int, default=10, help="epochs (default 10)")
    r.add_argument("--dataset-size", type=int, default=1281167,
                   help="training samples per epoch (default 1281167, ImageNet-1k)")
    r.add_argument("--batch-size", type=int, default=400, help="batch size (default 400)")
    r.add_argument("--batch-policy", choices=["fixed_global", "per_replica"],
                   help="fixed_global: the global batch is --batch-size; per_replica: each "
                   "pipeline takes --batch-size (the paper's); default fixed_global")
    f = p.add_argument_group("freezing")
    f.add_argument("--policy", choices=SIMULATED_POLICIES, default=SIMULATED_POLICIES[0],
                   help="schedule: n(e) = ceil(L (1 - (1 - alpha)^e)); paper: gradient-norm "
                   "rule, needs --grad-norms (default schedule)")
    f.add_argument("--alpha", type=float, default=1 / 3, help="freeze threshold (default 1/3)")
    f.add_argument("--grad-norms", type=Path,
                   help="JSON list, per epoch, of {block: gradient norm} for --policy paper")
    f.add_argument("--frozen", help="explicit timeline: frozen blocks per epoch, e.g. 0,4,7,9")
    f.add_argument("--max-frozen",
                   help="most blocks ever frozen: a number or 'all' (default L - 1)")
    s = p.add_argument_group("planning")
    s.add_argument("--planner", choices=["cost", "paper", "2021"],
                   help="cost: K, M and cache by predicted throughput; paper: the paper's "
                   "rule (pipeline.policy=paper); 2021: the 2021 code's rule on parameter "
                   "counts with its M table (default cost)")
    s.add_argument("--schedule", choices=["gpipe", "1f1b"], help="pipeline schedule "
                   "(default 1f1b)")
    s.add_argument("--microbatches", type=int, help="force M for every K > 1")
    s.add_argument("--cache", choices=["auto", "on", "off"], default="auto",
                   help="activation cache (default auto)")
    s.add_argument("--cache-from", type=int, default=3,
                   help="rule planners: cache on from this many frozen blocks (default 3)")
    s.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each trainable block's forward in its backward "
                   "(pipeline.activation_checkpointing): less activation memory, one more "
                   "forward per block and step")
    s.add_argument("--runtime", choices=sorted(RUNTIMES),
                   help="pt-ray (prefix inside the schedule) or 2021 (the 2021 code's "
                   "serial prefix, overheads and cache rate); default pt-ray")
    s.add_argument("--as-2021", action="store_true",
                   help="predict the 2021 code as the paper ran it: planner, runtime 2021, "
                   "gpipe, per_replica, every block may freeze (explicit options win)")
    o = p.add_argument_group("output")
    o.add_argument("--no-ablations", action="store_true", help="skip the ablations")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--list", action="store_true",
                   help="list the known models and hardware profiles and exit")
    p.set_defaults(func=run_plan)
    return p


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{seconds:.1f}s"


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    preset = _AS_2021 if args.as_2021 else _DEFAULTS
    return {k: preset[k] if getattr(args, k) is None else getattr(args, k) for k in preset}


def _build(args: argparse.Namespace) -> tuple[SimulationResult, dict[str, Any]]:
    shape = model_shape(args.model, num_layers=args.depth, width=args.width, heads=args.heads,
                        mlp_ratio=args.mlp_ratio, tokens=args.tokens,
                        num_classes=args.num_classes)
    hw = load_hardware(args.hardware)
    opts = _resolve(args)
    layers, n = shape.num_layers, args.devices
    if n <= 0:
        raise ValueError(f"--devices={n} must be positive")
    if args.pipeline_length in (None, ""):
        k0 = max(d for d in divisors(n) if d <= min(layers, hw.devices_per_node))
    elif args.pipeline_length == "auto":
        if opts["planner"] != "cost":
            raise ValueError("--pipeline-length auto needs --planner cost")
        k0 = None
    else:
        try:
            k0 = int(args.pipeline_length)
        except ValueError:
            raise ValueError(f"--pipeline-length={args.pipeline_length!r} must be a number "
                             f"or 'auto'") from None
    max_frozen = opts["max_frozen"]
    if max_frozen == "all":
        max_frozen = layers
    elif max_frozen is not None:
        max_frozen = int(max_frozen)
    frozen = None
    if args.frozen:
        frozen = [int(x) for x in args.frozen.split(",") if x.strip()]
    norms = []
    if args.grad_norms:
        raw = json.loads(Path(args.grad_norms).read_text())
        norms = [{int(k): float(v) for k, v in epoch.items()} for epoch in raw]
    result = simulate(
        analytic_costs(shape, hw, 1), hw,
        num_devices=n, dataset_size=args.dataset_size, epochs=args.epochs,
        batch_size=args.batch_size, batch_policy=opts["batch_policy"],
        initial_pipeline_length=k0, schedule=opts["schedule"], freeze_policy=args.policy,
        alpha=args.alpha, grad_norms=norms, frozen=frozen, max_frozen=max_frozen,
        planner=opts["planner"], num_microbatches=args.microbatches, cache=args.cache,
        cache_from=args.cache_from, runtime=RUNTIMES[opts["runtime"]],
        activation_memory_factor=saved_activation_factor(shape),
        ablations=not args.no_ablations,
        activation_checkpointing=args.activation_checkpointing,
    )
    return result, {"model": shape, "hardware": hw}


def _table(result: SimulationResult, shape, hw) -> str:
    st = result.settings
    nodes = -(-st["num_devices"] // hw.devices_per_node)
    per = "per replica" if st["batch_policy"] == "per_replica" else "global"
    lines = [
        f"pt-ray plan: {shape.name} (L={shape.num_layers}, D={shape.width}, {shape.heads} heads, "
        f"T={shape.tokens}) on {st['num_devices']} x {hw.name} ({nodes} node"
        f"{'s' if nodes > 1 else ''})",
        f"planner {st['planner']}, runtime {st['runtime']}, schedule {st['schedule']}, batch "
        f"{st['batch_size']} {per}, freeze {st['freeze_policy']} (alpha {st['alpha']:.3g}), "
        f"{st['epochs']} epochs of {st['dataset_size']:,} samples"
        + (", activation checkpointing" if st["activation_checkpointing"] else ""),
        "",
        f"{'epoch':>5} {'frozen':>7} {'K':>3} {'R':>3} {'M':>4} {'cache':>5} "
        f"{'samples/s':>10} {'epoch time':>11}",
    ]
    for e in result.run.epochs:
        lines.append(
            f"{e.epoch:>5} {e.num_frozen:>4}/{shape.num_layers:<2} {e.pipeline_length:>3} "
            f"{e.num_replicas:>3} {e.num_microbatches:>4} {e.cache:>5} {e.throughput:>10,.0f} "
            f"{_hms(e.epoch_time_s + e.transition_time_s):>11}")
    b0 = result.baseline.epochs[0]
    lines += [
        "",
        f"predicted total {_hms(result.run.total_time_s)}; "
        f"baseline {_hms(result.baseline.total_time_s)} "
        f"(K={b0.pipeline_length}, R={b0.num_replicas}, M={b0.num_microbatches}, no freezing, "
        f"{b0.throughput:,.0f} samples/s); speedup {result.speedup:.2f}x",
    ]
    if result.ablations:
        lines += ["", "ablations (speedup over the baseline):"]
        speedups = result.speedups()
        for run in (*result.ablations.values(), result.run):
            lines.append(f"  {run.label:<40} {speedups[run.name]:5.2f}x"
                         f"  {_hms(run.total_time_s):>8}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """Run ``pt-ray plan``; print the prediction; return the exit status (2 on bad input)."""
    if args.list:
        print("models:   " + ", ".join(sorted(MODEL_SHAPES)))
        print("hardware: " + ", ".join(list_hardware()))
        return 0
    try:
        result, meta = _build(args)
    except (ValueError, OSError) as err:
        print(f"pt-ray plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        out["model"] = asdict(meta["model"])
        out["hardware"] = meta["hardware"].to_dict()
        print(json.dumps(out, indent=2, default=str))
    else:
        print(_table(result, meta["model"], meta["hardware"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pt_ray.cli.plan ...``: the ``plan`` command on its own."""
    parser = argparse.ArgumentParser(prog="pt-ray")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    args = parser.parse_args(["plan", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
