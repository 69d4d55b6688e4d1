"""Where the driver's tail goes when ``fit`` starts its own cluster: each step after
``TorchTrainer.fit`` returns, timed in this process.

The run is the default job, shortened (``--epochs``), on an embedded local cluster that ``fit``
starts and shuts down; each repeat is a new cluster. The first repeat also pays the driver's first
imports. Printed per repeat: the whole call, the time from ``TorchTrainer.fit``'s return to
``fit``'s, and when each driver step ended on that clock (the summary read from the controller,
the cache figures, ``summary.json``, the export of the model, the report's start; the cluster's
shutdown runs beside them). Writes ``tail.json`` into ``--out``.

    python bench/tail.py [--repeats 3] [--epochs 2] [--out bench/out/tail]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import ray.train.torch  # noqa: E402

import pt_ray.api as api  # noqa: E402
import pt_ray.service.trainer as trainer  # noqa: E402

STEPS = ((trainer, "_final_summary"), (trainer, "_cache_report"), (api, "write_summary"),
         (api, "_export_model"), (api, "_write_extras"))
"""The driver's steps after training, in the modules that call them."""


def timed(marks: list[tuple[str, float, float]], name: str, fn: Any) -> Any:
    """``fn``, noting ``(name, seconds, when it ended)`` into ``marks`` at each call."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            now = time.perf_counter()
            marks.append((name, now - t0, now))
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/tail"))
    args = parser.parse_args()
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        sys.exit("tail.py measures a cluster fit starts itself: unset RAY_ADDRESS")
    marks: list[tuple[str, float, float]] = []
    for module, name in STEPS:
        setattr(module, name, timed(marks, name, getattr(module, name)))
    trainer_cls = ray.train.torch.TorchTrainer
    trainer_cls.fit = timed(marks, "TorchTrainer.fit", trainer_cls.fit)
    rows = []
    for rep in range(args.repeats):
        marks.clear()
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            api.fit(overrides=[f"epochs={args.epochs}", f"name=tail-{rep}"],
                    output_dir=os.path.join(tmp, "run"))
            end = time.perf_counter()
        trained = next(at for name, _, at in marks if name == "TorchTrainer.fit")
        row = {"call_s": end - t0, "after_train_s": end - trained,
               "steps": [{"step": name, "seconds": s, "ended_at_s": at - trained}
                         for name, s, at in marks if name != "TorchTrainer.fit"]}
        rows.append(row)
        print(f"repeat {rep}: call {row['call_s']:.2f} s, {row['after_train_s']:.3f} s after "
              f"TorchTrainer.fit returned", flush=True)
        for step in row["steps"]:
            print(f"    {step['step']:<16} {step['seconds']:7.3f} s, ended at "
                  f"+{step['ended_at_s']:.3f} s", flush=True)
    later = [r["after_train_s"] for r in rows[1:]] or [rows[0]["after_train_s"]]
    print(f"after TorchTrainer.fit, median of the repeats after the first: "
          f"{statistics.median(later):.3f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tail.json").write_text(json.dumps({"epochs": args.epochs, "repeats": rows},
                                                   indent=2))


if __name__ == "__main__":
    main()
