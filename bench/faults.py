"""What each injected fault costs a run: wall time, restarts, where the run went on from, and
how far its parameters end from a run that never failed.

One local Ray cluster runs the tiny 2-worker ViT job of the fault tests (depth 4, width 32,
128 synthetic 8 px images, 3 epochs, blocks freezing 0 -> 2 -> 3, K 2 -> 1) once without a
fault and once with each fault of ``pt_ray.runtime.faults`` (``PT_RAY_FAULT``), through
``pt_ray.fit(cfg, worker_env=...)``; the reference trainer runs the job once in this process
for the parameters. Rows:

  none        no fault
  step        rank 1 kills its process before step 3 of epoch 1 (``step:1:3:1``)
  migration   rank 1 dies in the transition that opens epoch 2, after its sends and before its
              receives (``migration:2:0:1``)
  checkpoint  rank 1 dies with half its shard after epoch 1 written (``checkpoint:1:0:1``)
  controller  rank 0 kills the controller actor before step 3 of epoch 1 (``controller:1:3:0``)
  hang        rank 1 stops answering before step 3 of epoch 1 while rank 0 waits in a
              collective, with ``pipeline.collective_timeout_s=10`` (``hang:1:3:1``)
  driver      ``pt-ray train`` (its own embedded cluster, in its own session) killed once its
              first complete checkpoint is on disk, then ``fit(resume_from=...)`` on this
              cluster (``--no-driver`` skips it)

The fault-free row and every fault row run with the cache off (``tests/test_ray_engine.py``
kills its step fault's worker with the cache on). Each fault fires after a 4 s wait
(``_FAULT_DELAY_S`` in ``pt_ray/service/worker.py``, so that Ray Train has registered the
previous checkpoint): test scaffolding, shown apart from the extra wall time. The epoch a
restarted run went on after comes from rank 0's "resumed after epoch N" line in the Ray
session's worker logs (the driver row: from the checkpoint ``fit(resume_from=...)`` took).

Writes ``<out>/faults.json`` and ``<out>/faults.md`` and prints the table. Usage (every row is
a whole Ray run, so minutes; ``bench/README.md`` has the latest figures):

    RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 \\
      .venv/bin/python bench/faults.py --out bench/out/faults [--rows none,step,...] \\
          [--no-driver] [--num-cpus 4]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402

from compare import source_info, start_ray  # noqa: E402
from procs import kill_session  # noqa: E402
from pt_ray.api import fit  # noqa: E402
from pt_ray.core.config import build_config  # noqa: E402
from pt_ray.runtime.faults import FAULT_ENV  # noqa: E402
from pt_ray.models.base import iter_layers, layer_names  # noqa: E402
from pt_ray.runtime.resume import resume_point  # noqa: E402
from pt_ray.runtime.checkpoint import damage, load_layers  # noqa: E402
from pt_ray.runtime.reference import build_reference  # noqa: E402
from pt_ray.service.settings import run_settings

ROOT = Path(__file__).resolve().parents[1]

INJECTION_DELAY_S = 4.0
"""``_FAULT_DELAY_S`` of ``pt_ray/service/worker.py``: every fault waits this long first."""

FAULTS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "none": (None, {}),
    "step": ("step:1:3:1", {}),
    "migration": ("migration:2:0:1", {}),
    "checkpoint": ("checkpoint:1:0:1", {}),
    "controller": ("controller:1:3:0", {}),
    "hang": ("hang:1:3:1", {"collective_timeout_s": 10}),
}
"""Row -> (``PT_RAY_FAULT`` without its marker path, extra ``pipeline`` fields)."""


def tiny_config(out: Path, name: str, pipeline: dict[str, Any] | None = None, **extra):
    """The job of ``tests/test_ray_engine.py::tiny_config`` (written out again: bench/ does not
    import tests)."""
    return build_config({
        "name": name,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 128, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "schedule": "1f1b", "policy": "paper",
                     **(pipeline or {})},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        "cache": {"block_size": 16},
        "logging": {"progress": "off"},
        "epochs": 3,
        "output_dir": str(out),
        **extra,
    })


def final_params(checkpoint: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every layer's parameters in a run's final checkpoint."""
    layers, _ = load_layers(Path(checkpoint), layer_names(4))
    return {name: layer["params"] for name, layer in layers.items()}


def max_difference(checkpoint: str | Path, reference: dict[str, dict[str, torch.Tensor]]) -> float:
    """Largest |parameter - reference| over every layer of a run's final checkpoint."""
    layers = final_params(checkpoint)
    return max(float((layers[name][key] - value).abs().max())
               for name, sd in reference.items() for key, value in sd.items())


# -- what a run left in the worker logs -----------------------------------------------------------


def _logs_dir() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def _log_sizes(logs: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in logs.glob("worker-*.out")}


def _new_log_text(logs: Path, before: dict[Path, int]) -> str:
    """What the workers printed since ``before`` (their stdout, where pt-ray's lines go)."""
    text = []
    for path in sorted(logs.glob("worker-*.out")):
        with path.open("rb") as f:
            f.seek(before.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "".join(text)


def _resumed_after(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"resumed after epoch (-?\d+) on \d+ workers", text)]


# -- rows ----------------------------------------------------------------------------------------


def run_fault(row: str, out: Path, reference: dict) -> dict[str, Any]:
    spec, pipeline = FAULTS[row]
    run_dir = out / "runs" / row
    marker = out / "runs" / f"{row}.fired"
    marker.unlink(missing_ok=True)
    env = {FAULT_ENV: f"{spec}:{marker}"} if spec else None
    logs = _logs_dir()
    before = _log_sizes(logs)
    print(f"[faults] {row}: start ({time.strftime('%H:%M:%S')}, load "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    t0 = time.perf_counter()
    result = fit(tiny_config(out, f"fault-{row}", pipeline), output_dir=run_dir,
                 worker_env=env, on_epoch=lambda rec: None)
    wall = time.perf_counter() - t0
    text = _new_log_text(logs, before)
    return {
        "row": row, "fault": spec, "pipeline": pipeline, "wall_s": wall,
        "run_wall_time_s": result.wall_time_s, "fired": marker.exists() if spec else None,
        "restarts": result.restarts, "resumed_after_epoch": _resumed_after(text),
        "injected": re.findall(r"injecting the .* fault at epoch \d+ step \d+", text),
        **_outcome(result, reference),
    }


def _outcome(result, reference: dict) -> dict[str, Any]:
    """What every row records of the finished run: its epochs, its freezes, and how far its
    final parameters are from the fault-free reference."""
    return {
        "epochs": [r.epoch for r in result.timeline],
        "num_frozen": [r.num_frozen for r in result.timeline],
        "max_abs_diff": max_difference(result.checkpoint, reference),
        "checkpoint": str(result.checkpoint),
        "load_after": os.getloadavg()[0],
    }


def run_driver_killed(out: Path, reference: dict) -> dict[str, Any]:
    """``pt-ray train`` killed with its cluster once a complete checkpoint is on disk, then
    resumed by hand on the benchmark's cluster."""
    run_dir = out / "runs" / "driver"
    config_file = out / "runs" / "driver.yaml"
    config_file.write_text(tiny_config(out, "fault-driver").to_yaml())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    print(f"[faults] driver: start ({time.strftime('%H:%M:%S')})", flush=True)
    t0 = time.perf_counter()
    with (out / "runs" / "driver.log").open("w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "pt_ray.cli", "train", "--config", str(config_file),
             "--output", str(run_dir)], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        while not [p for p in (run_dir / "ray").glob("*/checkpoint_*")
                   if p.is_dir() and damage(p) is None]:
            if driver.poll() is not None or time.perf_counter() - t0 > 300:
                raise RuntimeError(f"no checkpoint before the driver ended; see {log.name}")
            time.sleep(0.05)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        killed_s = time.perf_counter() - t0
    finally:
        kill_session(driver.pid)
    if (run_dir / "summary.json").exists():
        raise RuntimeError("the run finished before it was stopped")
    next_epoch = resume_point(run_dir).next_epoch
    t1 = time.perf_counter()
    result = fit(resume_from=run_dir, on_epoch=lambda rec: None)
    resume_s = time.perf_counter() - t1
    return {
        "row": "driver", "fault": "SIGKILL after the first checkpoint",
        "wall_s": killed_s + resume_s, "killed_after_s": killed_s, "resume_call_s": resume_s,
        "run_wall_time_s": result.wall_time_s, "restarts": result.restarts,
        "resumed_after_epoch": [next_epoch - 1],
        **_outcome(result, reference),
    }


# -- output --------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: extra time is over the fault-free row."""
    base = next((r["wall_s"] for r in rows if r["row"] == "none" and "wall_s" in r), None)
    lines = ["| fault | PT_RAY_FAULT | wall s | extra s | extra less 4 s delay | restarts | "
             "resumed after epoch | max abs diff vs reference | vs fault-free run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r.get('fault') or ''} | failed: {r['error']} "
                         "| | | | | | |")
            continue
        extra = r["wall_s"] - base if base is not None and r["row"] != "none" else None
        delay = INJECTION_DELAY_S if r["row"] in FAULTS else 0.0
        resumed = ", ".join(str(e) for e in r["resumed_after_epoch"]) or "-"
        lines.append(
            f"| {r['row']} | {r.get('fault') or '-'} | {r['wall_s']:.1f} | "
            f"{'' if extra is None else f'{extra:+.1f}'} | "
            f"{'' if extra is None else f'{extra - delay:+.1f}'} | {r['restarts']} | "
            f"{resumed} | {r['max_abs_diff']:.2e} | {r.get('vs_fault_free', float('nan')):.2e} |")
    driver = next((r for r in rows if r["row"] == "driver" and "error" not in r), None)
    if driver is not None:
        lines.append(f"\ndriver: killed {driver['killed_after_s']:.1f} s after its start (its "
                     f"own cluster's start included), resumed call {driver['resume_call_s']:.1f} "
                     "s")
    return "\n".join(lines)


# What each figure of faults.json means (saved in it as "definitions").
DEFINITIONS = {
    "wall_s": "the pt_ray.fit call (driver row: driver start to its kill, plus the resumed fit "
              "call)",
    "extra": "wall_s less the fault-free row's",
    "resumed_after_epoch": "rank 0's 'resumed after epoch N' lines in the worker logs (driver "
                           "row: the checkpoint resume_from took)",
    "max_abs_diff": "largest |parameter - reference trainer's| in the final checkpoint",
    "vs_fault_free": "largest |parameter - the fault-free row's| in the final checkpoint",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/faults"),
                        help="folder for faults.json, faults.md and runs/ "
                             "(default: bench/out/faults)")
    parser.add_argument("--rows", default=",".join(FAULTS), metavar="A,B,...",
                        help=f"fault rows to run, of {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--no-driver", action="store_true",
                        help="skip the driver killed and resumed by hand")
    parser.add_argument("--num-cpus", type=int, default=4,
                        help="logical CPUs of the benchmark's Ray cluster (default: 4)")
    parser.add_argument("--object-store-mb", type=int, default=256,
                        help="object store of the benchmark's Ray cluster, MiB (default: 256)")
    return parser


def _reference(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every layer's state after the reference trainer's fault-free run."""
    cfg = tiny_config(out / "runs" / "reference", "fault-reference", engine="reference")
    trainer = build_reference(run_settings(cfg).reference)
    trainer.fit()
    return {name: {k: v.clone() for k, v in m.state_dict().items()}
            for name, m in iter_layers(trainer.adapter)}


def _run_rows(args: argparse.Namespace, rows: list[str], reference: dict) -> list[dict]:
    """Each fault row, then the driver killed and resumed by hand, on one Ray cluster; a row
    that fails keeps its error, not the others' figures."""
    results: list[dict[str, Any]] = []
    start_ray(args.num_cpus, args.object_store_mb, log_to_driver=False)
    try:
        importlib.import_module("pt_ray.service.trainer")  # paid here, not by the first row

        for row in rows:
            try:
                results.append(run_fault(row, args.out, reference))
            except Exception as err:  # one failed row must not lose the others' figures
                results.append({"row": row, "fault": FAULTS[row][0],
                                "error": f"{type(err).__name__}: {err}"[:300]})
            print(f"[faults] {row}: {results[-1]}", flush=True)
        if not args.no_driver:
            try:
                results.append(run_driver_killed(args.out, reference))
            except Exception as err:
                results.append({"row": "driver", "error": f"{type(err).__name__}: {err}"[:300]})
            print(f"[faults] driver: {results[-1]}", flush=True)
    finally:
        import ray

        ray.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if not rows or set(rows) - set(FAULTS):
        parser.error(f"--rows {args.rows}: choose among {', '.join(FAULTS)}")
    torch.set_num_threads(1)
    args.out = args.out.resolve()  # the fault's marker path is read in the workers' own folder
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    reference = _reference(args.out)
    reference_s = time.perf_counter() - t0
    results = _run_rows(args, rows, reference)
    fault_free = next((r for r in results if r["row"] == "none" and "error" not in r), None)
    if fault_free is not None:
        params = final_params(fault_free["checkpoint"])
        for r in results:
            if "checkpoint" in r:
                r["vs_fault_free"] = max_difference(r["checkpoint"], params)
    md = table(results)
    data = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "source": source_info(None),
        "reference_s": reference_s,
        "injection_delay_s": INJECTION_DELAY_S,
        "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S":
                os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")},
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg(),
                    "benchmark_s": time.perf_counter() - t0},
        "definitions": DEFINITIONS,
        "rows": results,
    }
    (args.out / "faults.json").write_text(json.dumps(data, indent=2))
    (args.out / "faults.md").write_text(md + "\n")
    print(md)
    return 0

if __name__ == "__main__":
    sys.exit(main())
