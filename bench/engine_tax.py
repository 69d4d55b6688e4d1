"""What pt-ray's engine costs per epoch against plain DDP, with nothing frozen at K = 1.

``compare.py`` measures the engine tax (its ``dp`` arm against the peer) across whole Ray
Train runs, where worker start-up, reports and whatever else runs on the host move a single
ratio by more than the tax itself on a small shared machine. This script takes Ray out and
interleaves the two loops in the same processes, epoch by epoch, so that both see the same
machine at the same moment:

- N forked gloo processes (one thread each, ``file://`` rendezvous) build the job's dataset
  and two copies of its model from the seed;
- the engine: an :class:`~pt_ray.runtime.engine.ElasticWorker` with a
  :class:`~pt_ray.runtime.engine.LocalController`, ``freeze.policy=none`` and
  ``pipeline_length=1`` (R = N, DDP over the data-parallel group), running
  :meth:`~pt_ray.runtime.engine.ElasticWorker.train_epoch`;
- the peer: ``peer_ddp.train_epoch``, the loop of ``compare.py``'s peer arm (``DataLoader``
  over a ``DistributedSampler``, DDP, AdamW, clipping, the same schedule);
- each round runs one epoch of each, in ``abba`` order.

It prints, per round and as medians, each loop's training time (the slowest rank's, the
figure ``compare.py`` sums) and CPU time, and engine / peer - 1. Evaluation is off in both.
With ``--profile`` rank 0 also prints the functions that take the most time in one more
epoch of each loop (cProfile, cumulative time).

With ``--policy P`` the second loop is the engine again, with ``freeze.policy=none``, and the
first runs ``freeze.policy=P`` with ``freeze.max_frozen=0``: the policy's decisions (inside
epochs where its interval puts them) and block norms, with nothing ever frozen, so both do the
same work. The ratio is then what the policy's bookkeeping costs a run that freezes nothing.

  .venv/bin/python bench/engine_tax.py [--config FILE] [--set k=v ...] [--rounds 8]
      [--policy P] [--out bench/out/engine_tax] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # dist_utils: the forked gloo ranks the tests use

import peer_ddp  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

from pt_ray.api import resolve_config  # noqa: E402
from pt_ray.control.state import build_control_state  # noqa: E402
from pt_ray.data.registry import build_dataset  # noqa: E402
from pt_ray.core.plan import CostTable  # noqa: E402
from pt_ray.runtime.engine import ElasticWorker, LocalController  # noqa: E402
from pt_ray.runtime.build import build_model_for  # noqa: E402
from pt_ray.service.settings import run_settings  # noqa: E402


def _engine(cfg, splits):
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers,
                                  dist.get_world_size(),
                                  len(splits.train) // cfg.data.batch_size)
    # Fixed costs: the plan is K = 1 whatever they say, and profiling is not what is timed.
    costs = CostTable.from_param_counts(1.0, [1.0] * adapter.num_layers, 1.0)
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control), costs=costs)
    worker.start()
    return worker


class _Peer:
    """``compare.py``'s peer loop over WORLD, built as ``peer_ddp.train_loop_per_worker``
    builds it (``prepare_model`` on CPUs is a plain ``DistributedDataParallel``)."""

    def __init__(self, cfg, splits) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.cfg = cfg
        adapter = build_model_for(cfg.model, cfg.seed, splits)
        self.names = peer_ddp.input_names(adapter)
        self.model = DistributedDataParallel(adapter.model)
        self.per_worker = cfg.data.batch_size // world
        train = peer_ddp._Samples(splits.train)
        self.sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
        self.loader = DataLoader(train, batch_size=self.per_worker, sampler=self.sampler,
                                 drop_last=True, num_workers=cfg.data.num_workers)
        self.optimizer = torch.optim.AdamW(
            peer_ddp._param_groups(self.model, cfg.optimizer.weight_decay),
            lr=cfg.optimizer.lr, betas=cfg.optimizer.betas)
        self.total = cfg.epochs * len(self.loader) * cfg.data.batch_size
        self.seen = 0

    def epoch(self, epoch: int) -> float:
        self.sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        _, self.seen = peer_ddp.train_epoch(self.model, self.loader, self.optimizer,
                                            self.cfg.optimizer, self.seen, self.total,
                                            self.cfg.data.batch_size, self.names)
        return time.perf_counter() - t0


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _profiled(label: str, run) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return f"--- {label} ---\n{out.getvalue()}"


def _label(cfg) -> str:
    """How a loop is named in the output: ``engine`` against the peer, else its policy."""
    return "peer" if cfg is None else f"engine ({cfg.freeze.policy})"


class _Engine:
    """The engine as the second loop (``--policy``): one epoch per call, its training time."""

    def __init__(self, cfg, splits) -> None:
        self.worker = _engine(cfg, splits)

    def epoch(self, epoch: int) -> float:
        return self.worker.train_epoch(epoch).epoch_time_s


def _rank(rank: int, world: int, cfg, other, rounds: int, profile: bool) -> dict:
    """One rank: ``cfg``'s engine against the peer's loop, or (``other``) against the engine
    under ``other``; returns the rounds' times (rank 0's report has the profile)."""
    torch.manual_seed(cfg.seed)
    splits = build_dataset(cfg.data, seed=cfg.seed, tokenizer_dir=cfg.model.weights)
    # "engine" runs ``cfg``; "peer" the peer's loop, or with ``other`` the engine under it.
    engine = _engine(cfg, splits)
    peer = _Peer(cfg, splits) if other is None else _Engine(other, splits)
    rows = []
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        order = ("engine", "peer") if r % 2 == 0 else ("peer", "engine")
        row = {"round": r}
        for arm in order:
            cpu = time.process_time()
            if arm == "engine":
                rec = engine.train_epoch(r)
                train = rec.epoch_time_s  # already the slowest rank's
                row["engine_frozen"] = rec.num_frozen
            else:
                train = _slowest(peer.epoch(r))
            row[arm] = train
            row[f"{arm}_cpu"] = _slowest(time.process_time() - cpu)
        rows.append(row)
        if rank == 0 and r:
            print(f"round {r}: {_label(cfg)} {row['engine']:.3f} s, {_label(other)} "
                  f"{row['peer']:.3f} s, tax {row['engine'] / row['peer'] - 1:+.1%}", flush=True)
    report = ""
    if profile and rank == 0:
        # One more epoch each; the other ranks run theirs unprofiled alongside.
        report += _profiled("engine", lambda: engine.train_epoch(rounds + 1))
        report += _profiled("peer", lambda: peer.epoch(rounds + 1))
    elif profile:
        engine.train_epoch(rounds + 1)
        peer.epoch(rounds + 1)
    engine.close()
    if isinstance(peer, _Engine):
        peer.worker.close()
    # Decisions the first loop took (one opens each epoch; its interval may add more).
    return {"rows": rows[1:], "profile": report, "decisions": engine.decision}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a run config (default: the default job)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=8, help="counted rounds (one epoch each)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "engine_tax")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--policy", help="time the engine under this freeze policy, with "
                    "freeze.max_frozen=0 (its decisions and block norms, nothing frozen), "
                    "against the engine with freeze.policy=none instead of the peer's loop")
    args = ap.parse_args(argv)
    rounds = args.rounds
    common = [*args.set, "pipeline.pipeline_length=1", "cache.mode=off",
              f"epochs={rounds + 3}", "eval_every=1000", "logging.every_steps=0"]
    base = resolve_config(args.config, [*common, "freeze.policy=none"])
    peer_ddp.check_config(base)
    cfg, other = base, None
    if args.policy is not None:
        cfg = resolve_config(args.config, [*common, f"freeze.policy={args.policy}",
                                           "freeze.max_frozen=0"])
        other = base
    second = "peer" if other is None else "the engine with freeze.policy=none"
    world = cfg.pipeline.num_workers
    print(f"{cfg.name}: {world} ranks, {rounds} rounds of one epoch per loop (abba order); "
          f"the engine with freeze.policy={cfg.freeze.policy} against {second}", flush=True)
    results = run_ranks(_rank, world, cfg, other, rounds, args.profile, timeout=7200)
    rows = results[0]["rows"]
    tax = [row["engine"] / row["peer"] - 1 for row in rows]
    cpu_tax = [row["engine_cpu"] / row["peer_cpu"] - 1 for row in rows]
    summary = {
        "config": cfg.name, "ranks": world, "rounds": rounds, "policy": args.policy,
        "engine_s": statistics.median(r["engine"] for r in rows),
        "peer_s": statistics.median(r["peer"] for r in rows),
        "tax_median": statistics.median(tax), "tax_min": min(tax), "tax_max": max(tax),
        "cpu_tax_median": statistics.median(cpu_tax),
        "engine_decisions": results[0]["decisions"],
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_tax.json").write_text(json.dumps(summary, indent=1))
    a, b = _label(cfg), _label(other)
    print(f"\n{a} against {b} at K=1 ({a} / {b} - 1, training time per epoch): "
          f"median {summary['tax_median']:+.1%} (range {summary['tax_min']:+.1%} .. "
          f"{summary['tax_max']:+.1%}); CPU time {summary['cpu_tax_median']:+.1%}\n"
          f"median epoch: {a} {summary['engine_s']:.3f} s, {b} {summary['peer_s']:.3f} s\n"
          f"wrote {args.out / 'engine_tax.json'}")
    if results[0]["profile"]:
        print(results[0]["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
