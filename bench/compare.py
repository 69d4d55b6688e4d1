"""Side-by-side speed benchmark: pt-ray against the peer a Ray user would write instead (plain
Ray Train DDP), against the paper's no-freeze K=2 baseline, without and with the activation
cache, and (``--ablation``) the paper's ablation arms.

Every arm runs the same job (same model, data, seed, optimizer, schedule and epochs) inside one
local Ray cluster started here, so cluster start-up is paid once and excluded from all. Arms
alternate across repeats (in order on even repeats, reversed on odd ones; ``--order abab`` keeps
one order) to spread machine noise over all. The figures are ratios; absolute times on a shared
2-core machine are not.

Arms:
  baseline     the paper's baseline: the config with ``freeze.policy=none`` and
               ``pipeline.pipeline_length=N`` (one pipeline over all N workers, R = 1, for the
               whole run)
  freeze-only  optional (``--ablation``): freezing on, ``pipeline.elastic=false`` and the cache
               off: K and R stay (the frozen prefix moves onto stage 0, at most L - K blocks
               freeze)
  pt-ray       the config as given (AutoFreeze on; K starts where the cost model predicts
               fastest, K = 1 and R = N for a model that fits one device, and only shrinks;
               the default config leaves the cache to the planner, ``cache.mode=auto``)
  cache        the config with ``cache.mode=on``: all four mechanisms (``--no-cache-arm``)
  dp           pt-ray without freezing at K=1: ``freeze.policy=none`` with
               ``pipeline.pipeline_length=1`` (R = N for the whole run); against the peer it
               is the engine's tax (``--no-dp-arm``)
  peer         plain Ray Train DDP (``bench/peer_ddp.py``: ``TorchTrainer``, ``prepare_model``,
               a ``DistributedSampler``) on the same model and data, N workers; the headline
               is pt-ray over it (``--no-peer-arm``; ``--peer-order pt-ray`` trains it on
               pt-ray's sample order instead, to tell the order's draw from the engine's)

``--workload NAME`` runs one of ``accuracy_matrix.py``'s workloads (its overrides on the default
job, before ``--set``; its data written and any pre-trained model made under ``<out>``), e.g.
``topics`` (MiniLM-L6 fine-tuned on Python's documentation topics), ``digits-ft`` (the digits
fine-tuned from a ViT pt-ray pre-trains on MNIST), ``fashion-transfer`` (Fashion-MNIST's
classes 5-9 fine-tuned from a ViT pt-ray pre-trains on classes 0-4) or ``wordnet-senses``
(MiniLM-L6 on WordNet's noun glosses): every arm, the peer included, builds the same model from
the same weights on the same data.

Writes ``<out>/compare.json`` and ``<out>/compare.png`` and prints a table. Usage:

    python bench/compare.py [--config FILE | --workload NAME] [--set k=v ...] [--epochs N]
                            [--repeats R] [--out bench/out] [--ablation] [--no-cache-arm]
                            [--no-dp-arm] [--no-peer-arm] [--arms a,b,...] [--order abba|abab]
                            [--warmup EPOCHS] [--peer-order distributed|pt-ray]
    python bench/compare.py --resummarise bench/out/compare.json --out bench/out
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from accuracy_matrix import WORKLOADS, prepare_workload  # noqa: E402
from compare_output import write_report  # noqa: E402
from compare_report import NO_FREEZE_ARMS, _med, bound_for  # noqa: E402
from peer_ddp import SAMPLE_ORDERS, check_config, run_peer  # noqa: E402
from pt_ray.api import default_config_path, fit, resolve_config  # noqa: E402

ARM_OVERRIDES: dict[str, list[str]] = {
    "baseline": ["freeze.policy=none"],  # and pipeline_length=N, set in run_arm
    "freeze-only": ["pipeline.elastic=false", "cache.mode=off"],
    "pt-ray": [],
    "cache": ["cache.mode=on"],
    "dp": ["freeze.policy=none", "pipeline.pipeline_length=1"],
    "none": ["freeze.policy=none"],
    "peer": [],
}
"""What each arm adds to the config (and ``--set``); the arms run in this order. The peer reads
only the model, data, optimizer, epochs, seed, ``eval_every``, ``checkpoint_every``,
``pipeline.num_workers`` and ``cpus_per_worker``."""


# -- running -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ray(num_cpus: int, object_store_mb: int, log_to_driver: bool) -> None:
    """One local cluster for the whole benchmark (fit() then attaches instead of starting).

    The dashboard port is chosen here and handed to every actor as ``RAY_API_SERVER_ADDRESS``:
    Ray Train's placement-group cleaner queries the state API with address ``auto``, which fails
    ("Found multiple active Ray instances") when another cluster runs on the same host.
    """
    import ray

    port = _free_port()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=True,  # Ray Train's placement-group cleaner polls the state API
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        object_store_memory=object_store_mb * 2**20,
        logging_level=logging.WARNING,
        log_to_driver=log_to_driver,
        runtime_env={"env_vars": {
            "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}",
            # As pt-ray's embedded cluster does: Ray Train collects reports when it polls.
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get(
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25"),
        }},
    )


class CheckpointWatcher:
    """Notes when each epoch's checkpoint appears (its folder name carries Ray Train's
    timestamp). Ray Train keeps only the latest two, so the folder is polled while the run goes.
    With the timeline this splits a run's wall time into start-up, epochs (training + eval) and
    what each epoch costs between them (checkpoint, ``ray.train.report`` barrier, plan)."""

    def __init__(self, root: Path, period_s: float = 0.2) -> None:
        self.root, self.period_s = root, period_s
        self.names: set[str] = set()
        # Ray Train storage of earlier runs under the same name (each run has its own folder).
        self.old = {p.name for p in root.iterdir()} if root.is_dir() else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CheckpointWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _poll(self) -> None:
        if self.root.is_dir():
            self.names.update(p.name for p in self.root.glob("*/checkpoint_*")
                              if p.parent.name not in self.old)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def times(self) -> list[float]:
        """Epoch-end wall-clock times (seconds since the epoch), sorted."""
        out = []
        for name in self.names:
            stamp = name.removeprefix("checkpoint_")
            try:
                out.append(datetime.strptime(stamp, "%Y-%m-%d_%H-%M-%S.%f").timestamp())
            except ValueError:
                continue
        return sorted(out)


def checkpoint_epochs(cfg: Any) -> list[int]:
    """The epochs that end with a checkpoint: every ``checkpoint_every`` epochs and the last."""
    return [e for e in range(cfg.epochs) if cfg.checkpoints_after(e)]


def time_split(start: float, end: float, ends: list[float], timeline: list[dict],
               epochs: list[int] | None = None) -> dict:
    """Where a run's wall time went, from the times of its checkpoints (see
    :class:`CheckpointWatcher`), taken after ``epochs`` (default: every epoch).

    Each checkpoint's time less the work (training, re-plans, evaluation) of the epochs since
    the previous one is what those epochs cost besides (checkpoint, report, plan): one gap per
    checkpoint after the first. Start-up is the first checkpoint less the work before it; with
    checkpoints every k > 1 epochs it also holds the reports of the k - 1 epochs before it.
    """
    epochs = list(range(len(timeline))) if epochs is None else epochs
    if len(ends) != len(epochs):
        return {"checkpoints_seen": len(ends)}
    work = [r["epoch_time_s"] + r["transition_time_s"] + r.get("eval_time_s", 0.0)
            for r in timeline]
    bounds = [-1, *epochs]
    done = [sum(work[bounds[j] + 1:bounds[j + 1] + 1]) for j in range(len(epochs))]
    gaps = [ends[j] - ends[j - 1] - done[j] for j in range(1, len(ends))]
    return {
        "checkpoints_seen": len(ends),
        "checkpoint_epochs": epochs,
        "between_epochs_each_s": gaps,
        "startup_s": ends[0] - start - done[0],
        "between_epochs_s": sum(gaps),
        "between_epochs_median_s": _med(gaps) if gaps else 0.0,
        "teardown_s": end - ends[-1],
    }


def run_arm(arm: str, repeat: int, config: Any, overrides: list[str], out: Path,
            keep_checkpoints: bool, peer_order: str = "distributed") -> dict:
    """Run one arm once; returns its figures (times in seconds, accuracy as a fraction).
    ``peer_order`` is the peer's sample order (``peer_ddp.SAMPLE_ORDERS``).

    ``fit_call_s`` is the whole call as its user waits for it (``pt_ray.fit``, or building and
    fitting the peer's ``TorchTrainer``); ``wall_time_s`` is pt-ray's own run wall time (after
    its driver-side checks, before its summary) or the peer's ``TorchTrainer.fit()``.
    """
    name = f"{arm}-{repeat}" if repeat >= 0 else f"{arm}-warmup"
    ovr = [*overrides, *ARM_OVERRIDES[arm], f"name=bench-{name}"]
    if arm == "baseline":
        # The paper's baseline is one pipeline over all N workers (pt-ray itself starts at the
        # K its cost model predicts fastest, K = 1 for a model that fits one device).
        ovr.append(f"pipeline.pipeline_length={resolve_config(config, ovr).pipeline.num_workers}")
    run_dir = out / "runs" / name
    print(f"[compare] {name}: start ({time.strftime('%H:%M:%S')}, "
          f"load {os.getloadavg()[0]:.2f})", flush=True)
    start = time.time()
    t0 = time.perf_counter()
    with CheckpointWatcher(run_dir / "ray") as watcher:
        if arm == "peer":
            cfg = resolve_config(config, ovr)
            result = run_peer(cfg, run_dir, sample_order=peer_order)
            timeline, restarts, startup, trials = result.timeline, 0, result.startup, []
        else:
            result = fit(config, overrides=ovr, output_dir=run_dir, on_epoch=lambda rec: None)
            timeline = [asdict(r) if not isinstance(r, dict) else dict(r)
                        for r in result.timeline]
            cfg, restarts = result.config, result.restarts
            summary = json.loads((run_dir / "summary.json").read_text())
            startup, trials = summary.get("startup", {}), summary.get("start_trials", [])
    outer = time.perf_counter() - t0
    end = time.time()
    if arm != "peer":  # report.png draws in its own process: off the call, not the next arm
        result.wait_for_report()
    epoch_sum = sum(r["epoch_time_s"] for r in timeline)
    trans_sum = sum(r["transition_time_s"] for r in timeline)
    eval_sum = sum(r.get("eval_time_s", 0.0) for r in timeline)
    rec = {
        "arm": arm,
        "repeat": repeat,
        "overrides": ovr,
        "wall_time_s": result.wall_time_s,
        "fit_call_s": outer,
        "train_time_s": epoch_sum + trans_sum,
        "epoch_time_sum_s": epoch_sum,
        "transition_time_sum_s": trans_sum,
        "eval_time_sum_s": eval_sum,
        "overhead_s": result.wall_time_s - epoch_sum - trans_sum - eval_sum,
        "overhead_split": time_split(start, end, watcher.times(), timeline,
                                     checkpoint_epochs(cfg)),
        "startup": startup,
        "start_trials": trials,
        "metric_name": result.metric_name,
        "final_accuracy": result.final_eval_metric,
        "timeline": timeline,
        "run_dir": str(run_dir),
        "restarts": restarts,
        "load_after": os.getloadavg()[0],
    }
    if arm not in NO_FREEZE_ARMS:
        rec.update(bound_for(timeline))
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "ray", ignore_errors=True)  # Ray Train storage made by this run
    print(f"[compare] {name}: train {rec['train_time_s']:.1f} s, wall {rec['wall_time_s']:.1f} s,"
          f" call {outer:.1f} s, {rec['metric_name']} {rec['final_accuracy']:.4f}", flush=True)
    return rec


def warm_up(arms: list[str], config: Any, overrides: list[str], out: Path,
            peer_order: str = "distributed") -> dict[str, dict]:
    """Run every arm once, short and unmeasured, before the measured repeats.

    The first run in a fresh cluster and driver pays what later runs do not: Ray's first worker
    processes for the job and the driver's first imports (pt-ray's preflight imports timm). With
    abba order the first arm would carry it alone. Returns each arm's start-up parts and
    whole-call time from its warm-up (only the first arm's is a fully cold start).
    """
    cold = {}
    for arm in arms:
        rec = run_arm(arm, -1, config, overrides, out / "warmup", keep_checkpoints=False,
                      peer_order=peer_order)
        cold[arm] = {"fit_call_s": rec["fit_call_s"], "startup": rec["startup"],
                     "startup_s": rec["overhead_split"].get("startup_s")}
    shutil.rmtree(out / "warmup", ignore_errors=True)
    return cold


# -- main --------------------------------------------------------------------------------------


def source_info(label: str | None) -> dict[str, Any]:
    """Which pt_ray was measured: its folder, and its git commit and local changes if any."""
    import pt_ray

    root = Path(pt_ray.__file__).resolve().parent.parent
    info: dict[str, Any] = {"pt_ray_path": str(root), "label": label}
    try:
        git = ["git", "-C", str(root)]
        info["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                                        text=True, check=True).stdout.strip()
        info["uncommitted_changes"] = bool(subprocess.run(
            [*git, "status", "--porcelain", "--", "pt_ray"], capture_output=True, text=True,
            check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


# What each figure of compare.json means (saved in it as "definitions").
DEFINITIONS = {
    "train_time_s": "sum over epochs of epoch_time_s + transition_time_s "
                    "(training steps and re-plans; evaluation excluded); the peer's "
                    "epoch_time_s is its training loop, slowest rank",
    "wall_time_s": "fit() wall time: Ray Train worker start, profiling, training, "
                   "evaluation, checkpoints (the cluster start is excluded); the "
                   "peer's is TorchTrainer.fit()",
    "fit_call_s": "the whole call as its user waits for it: pt_ray.fit (with its "
                  "driver-side checks and summary), or building and fitting the peer's "
                  "TorchTrainer",
    "vs_peer.speedup_vs_peer": "headline: median over repeats of peer train_time_s / "
                               "pt-ray train_time_s (pairs run back to back)",
    "vs_peer.wall_ratio_vs_peer": "peer fit_call_s / pt-ray fit_call_s, median",
    "vs_peer.fraction_of_bound_vs_peer": "speedup_vs_peer / pt-ray's ideal_bound",
    "vs_peer.engine_tax_k1": "dp train_time_s / peer train_time_s - 1, median: what "
                             "the engine costs without freezing at K=1",
    "breakdown": "per arm: startup_s (call to first epoch's training, estimated as the "
                 "first checkpoint's time minus the first epoch's training and eval), "
                 "between_epochs_s (checkpoint, report, plan), teardown_s (last "
                 "checkpoint to the call's return), per_epoch_overhead_s (median over "
                 "epochs after the first of eval + time before the next checkpoint)",
    "speedup": "median over repeats of baseline train_time_s / pt-ray train_time_s "
               "(pairs run back to back)",
    "speedup_best_epochs": "the same ratio with each epoch at its fastest over the "
                           "repeats (least disturbed by other load)",
    "same_plan_ratio": "baseline / pt-ray time over the epochs in which both ran the "
                       "same plan (nothing frozen yet); 1 on a quiet machine",
    "speedup_adjusted_for_same_plan": "speedup / same_plan_ratio per repeat, median: a "
                                      "heuristic that assumes a run-wide slowdown",
    "ideal_bound": "ideal bound: active block 3 units (fwd+bwd), frozen block 1 (fwd), "
                   "0 for cache hits; no-freeze cost / this timeline's cost",
    "fraction_of_bound": "speedup / ideal_bound",
    "accuracy_diff_points": "100 * (pt-ray accuracy - baseline accuracy), medians",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=None,
                        help="run config YAML (default: pt-ray's default job)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default=None,
                        help="accuracy_matrix.py's workload of this name: its overrides on the "
                             "default job, before --set (its data and pre-trained model are "
                             "made under --out)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override applied to every arm (repeatable)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per arm, alternated")
    parser.add_argument("--out", type=Path, default=Path("bench/out"),
                        help="folder for compare.json, compare.png and runs/ (default: bench/out)")
    parser.add_argument("--order", choices=["abba", "abab"], default="abba",
                        help="arm order across repeats: abba reverses it on odd repeats "
                             "(baseline, pt-ray, pt-ray, baseline, ...); abab keeps it")
    parser.add_argument("--ablation", action="store_true",
                        help="also run freeze only (pipeline.elastic=false, no cache): with the "
                             "cache arm this is the paper's ablation table")
    parser.add_argument("--no-cache-arm", action="store_true",
                        help="skip the cache arm (cache.mode=on)")
    parser.add_argument("--no-dp-arm", action="store_true",
                        help="skip pt-ray without freezing at K=1 (the engine-tax arm)")
    parser.add_argument("--dp-arm", action="store_true",
                        help=argparse.SUPPRESS)  # the dp arm's old switch; it runs by default
    parser.add_argument("--no-peer-arm", action="store_true",
                        help="skip the peer (plain Ray Train DDP)")
    parser.add_argument("--peer-order", choices=SAMPLE_ORDERS, default="distributed",
                        help="the peer's training order: a DistributedSampler's (the standard "
                             "way; default) or pt-ray's own (a diagnostic: the same batches as "
                             "pt-ray's, so an accuracy gap is not the draw of the order)")
    parser.add_argument("--arms", default=None, metavar="A,B,...",
                        help=f"run exactly these arms (of {', '.join(ARM_OVERRIDES)}), in the "
                             "order above; overrides the other arm switches")
    parser.add_argument("--warmup", type=int, default=1, metavar="EPOCHS",
                        help="before the measured runs, run every arm once for this many "
                             "epochs, unmeasured (0: none), so that the cluster's first worker "
                             "processes and the driver's first imports (timm's) "
                             "fall on no arm's figures; their start-up parts are printed and "
                             "saved as cold_start (the first arm's is the cluster's first run; "
                             "default: 1)")
    parser.add_argument("--object-store-mb", type=int, default=512,
                        help="object store of the benchmark's Ray cluster, MiB (default: 512)")
    parser.add_argument("--label", default=None,
                        help="free text saved in the JSON (e.g. the commit of a snapshot)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each run's Ray Train storage under <out>/runs/<arm>-<i>/ray")
    parser.add_argument("--verbose", action="store_true",
                        help="show the Ray workers' log lines (one per epoch, and Ray's own)")
    parser.add_argument("--resummarise", type=Path, default=None, metavar="JSON",
                        help="recompute the figures, PNG and table from a compare.json's runs "
                             "(written to --out) without running anything")
    return parser


def _arm_overrides(args: argparse.Namespace, parser: argparse.ArgumentParser
                   ) -> tuple[Path, list[str], Any, list[str], dict[str, Any]]:
    """The config, the overrides every arm shares, the resolved run config, the arms to run
    and the workload's record; a bad value stops here, before Ray starts."""
    overrides = list(args.overrides)
    workload_record: dict[str, Any] = {}
    if args.workload is not None:
        if args.config is not None:
            parser.error("--workload is a set of overrides on the default job; drop --config")
        args.out.mkdir(parents=True, exist_ok=True)
        made = prepare_workload(WORKLOADS[args.workload], args.out)
        if made is None:
            parser.error(f"--workload {args.workload} cannot run here (see above)")
        overrides = [*made.overrides, *overrides]
        workload_record = made.record
    if args.epochs is not None:
        overrides.append(f"epochs={args.epochs}")
    config = args.config if args.config is not None else default_config_path()
    cfg = resolve_config(config, overrides)  # fails here, before Ray, on a bad value
    for arm in ARM_OVERRIDES:
        resolve_config(config, [*overrides, *ARM_OVERRIDES[arm]])
    if args.arms is not None:
        wanted = set(filter(None, args.arms.split(",")))
        if not wanted or wanted - set(ARM_OVERRIDES):
            parser.error(f"--arms {args.arms}: choose among {', '.join(ARM_OVERRIDES)}")
    else:
        wanted = {"baseline", "pt-ray", "freeze-only" if args.ablation else "",
                  "" if args.no_cache_arm else "cache", "" if args.no_dp_arm else "dp",
                  "" if args.no_peer_arm else "peer"}
    arms = [a for a in ARM_OVERRIDES if a in wanted]
    if "peer" in arms:
        try:
            check_config(resolve_config(config, [*overrides, *ARM_OVERRIDES["peer"]]))
        except ValueError as err:
            parser.error(str(err))
    return config, overrides, cfg, arms, workload_record


def _run_arms(args: argparse.Namespace, config: Path, overrides: list[str], cfg: Any,
              arms: list[str]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Start the benchmark's cluster when an arm needs Ray, warm every arm up, then run the
    repeats in ``--order``; returns each arm's runs and its cold start."""
    started = False
    if cfg.engine == "ray" or "peer" in arms:
        need = cfg.pipeline.num_workers * cfg.pipeline.cpus_per_worker
        start_ray(max(int(-(-need // 1)), 1), args.object_store_mb, args.verbose)
        started = True
        import pt_ray.service.trainer  # noqa: F401  (imports paid here, not by the first arm)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    cold: dict[str, dict] = {}
    try:
        if args.warmup:
            cold = warm_up(arms, config, [*overrides, f"epochs={args.warmup}"], args.out,
                           args.peer_order)
        for repeat in range(args.repeats):
            # abba: odd repeats run the arms in reverse, so that drift and whatever a run leaves
            # behind for the next one fall on both arms alike.
            order = arms[::-1] if args.order == "abba" and repeat % 2 else arms
            for arm in order:
                runs[arm].append(run_arm(arm, repeat, config, overrides, args.out,
                                          args.keep_checkpoints, args.peer_order))
    finally:
        if started:
            import ray

            ray.shutdown()
    return runs, cold


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.resummarise is not None:
        write_report(json.loads(args.resummarise.read_text()), args.out)
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 (none) or a number of epochs")
    config, overrides, cfg, arms, workload_record = _arm_overrides(args, parser)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    runs, cold = _run_arms(args, config, overrides, cfg, arms)
    data: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": str(config),
        "workload": args.workload,
        **workload_record,
        "overrides": overrides,
        "engine": cfg.engine,
        "num_workers": cfg.pipeline.num_workers,
        "epochs": cfg.epochs,
        "repeats": args.repeats,
        "order": args.order,
        "warmup_epochs": args.warmup,
        # Each arm's unmeasured warm-up run, in arm order; only the first is the cluster's and
        # the driver's first run.
        "cold_start": cold,
        "arms": arms,
        "arm_overrides": {a: ARM_OVERRIDES[a] for a in arms},
        "peer_order": args.peer_order,
        "cache_mode": cfg.cache.mode,
        "metric_name": runs[arms[0]][0]["metric_name"],
        "source": source_info(args.label),
        # Ray Train's controller collects one report per poll (each rank's result queue holds
        # one), which floors an epoch's wall time when epochs are short. The poll interval the
        # benchmark's cluster ran with (start_ray's default when unset).
        "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S":
                os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_before": load_before, "load_after": os.getloadavg(),
                    "benchmark_s": time.perf_counter() - t0},
        "definitions": DEFINITIONS,
        "runs": runs,
    }
    write_report(data, args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
