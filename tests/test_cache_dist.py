"""The activation cache on forked gloo processes: the same losses and parameters as without it."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks, written_layers
from pt_ray.core.config import build_config
from pt_ray.control.state import build_control_state
from pt_ray.data.registry import build_dataset
from pt_ray.core.plan import CostTable
from pt_ray.cache.store import InMemoryStore
from pt_ray.runtime.engine import ElasticWorker, LocalController
from pt_ray.runtime.build import build_model_for
from pt_ray.service.settings import run_settings

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# The same tiny models and data as the engine's equivalence tests.
from test_engine_dist import BERT, VIT  # noqa: E402


def config(base, mode, workers=4, **extra):
    # The cache changes no order: both runs train on the same plain permutation, and a step's
    # 16 samples fall in most of the 12 cache blocks.
    return build_config({
        **base,
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": workers, "schedule": "1f1b", "policy": "paper"},
        "optimizer": {"name": "adamw", "lr": 3e-3, "warmup_fraction": 0.2},
        **{"cache": {"mode": mode, "block_size": 8}, "epochs": 4, **extra},
    })


def train_rank(rank, world, cfg, use_store):
    splits = build_dataset(cfg.data, seed=cfg.seed)
    adapter = build_model_for(cfg.model, cfg.seed, splits)
    control = build_control_state(run_settings(cfg).control, adapter.num_layers, world,
                                  len(splits.train) // cfg.data.batch_size)
    # Forked processes share no memory: each stage-0 rank keeps its own store, so replicas
    # miss what the others wrote (the Ray store test covers sharing).
    store = InMemoryStore() if use_store else None
    worker = ElasticWorker(run_settings(cfg).engine, adapter=adapter, splits=splits,
                           controller=LocalController(control),
                           costs=CostTable.from_param_counts(1.0, [1.0] * adapter.num_layers, 1.0),
                           store=store)
    losses = []
    step = worker.stepper.step
    worker.stepper.step = lambda indices: losses.append(step(indices)) or losses[-1]
    timeline = worker.fit()
    counters = worker.prefix.total if worker.prefix is not None else None
    tiers = [t.served for t in worker.prefix.tiers] if worker.prefix is not None else []
    states = written_layers(worker)
    worker.close()
    return {"states": states, "timeline": timeline, "losses": losses, "counters": counters,
            "tiers": tiers}


def step_losses(results):
    return torch.tensor([r["losses"] for r in results]).sum(0)


def merged_states(results):
    out = {}
    for r in results:
        out.update(r["states"])
    return out


@pytest.mark.parametrize("base", [VIT, BERT], ids=["vit", "bert"])
def test_cache_on_gives_the_losses_and_parameters_of_cache_off(base):
    on = run_ranks(train_rank, 4, config(base, "on"), True)
    off = run_ranks(train_rank, 4, config(base, "off"), False)
    layout = [(r.num_frozen, r.pipeline_length, r.num_replicas) for r in on[0]["timeline"]]
    assert layout == [(0, 4, 1), (2, 2, 2), (3, 1, 4), (3, 1, 4)]
    # The paths all ran: misses at depth 2, rows advanced 2 -> 3, hits at depth 3.
    counts = [r["counters"] for r in on if r["counters"] is not None]
    assert sum(c.misses for c in counts) > 0
    assert sum(c.advanced for c in counts) > 0
    assert sum(c.hits for c in counts) > 0
    assert on[0]["timeline"][3].cache_hit_rate > 0
    assert on[0]["timeline"][3].cache_objects > 0
    # Epoch 3 is the last: it serves what epochs 1-2 cached and keeps none of its misses.
    last, before = on[0]["timeline"][3], on[0]["timeline"][2]
    assert last.cache_hit_rate < 1
    assert (last.cache_bytes, last.cache_objects) == (before.cache_bytes, before.cache_objects)
    diff = (step_losses(on) - step_losses(off)).abs().max()
    assert float(diff) <= 1e-5
    a, b = merged_states(on), merged_states(off)
    worst = max(float((a[n][k] - v).abs().max()) for n, sd in b.items() for k, v in sd.items())
    assert worst <= 1e-5, f"max abs parameter difference {worst:.3g}"


@pytest.mark.parametrize("base", [VIT, BERT], ids=["vit", "bert"])
def test_device_and_host_tiers_give_the_losses_and_parameters_of_the_host_path(base):
    # The tiers on the CPU: a device tier of 30 rows per stage-0 worker (the row's bytes times
    # 30) and a host tier for the rest, beside the store. Over five epochs (depth 2 at R 2,
    # then depth 3 at R 4) each replica serves rows from both tiers, and every step's loss
    # and the final parameters stay within 1e-5 of the run without the cache.
    row = 5 * 32 * 4 if base is VIT else 12 * 32 * 4  # tokens x width x fp32 bytes
    tiers = {"mode": "on", "block_size": 8, "device_bytes": 30 * row, "host_bytes": 2**20}
    on = run_ranks(train_rank, 4, config(base, "on", cache=tiers, epochs=5), True)
    off = run_ranks(train_rank, 4, config(base, "off", epochs=5), False)
    counts = [r["counters"] for r in on if r["counters"] is not None]
    served = [r["tiers"] for r in on if r["tiers"]]
    assert served and all(len(s) == 2 for s in served)
    assert sum(s[0] for s in served) > 0 and sum(s[1] for s in served) > 0
    assert sum(c.tier_hits for c in counts) == sum(s[0] + s[1] for s in served)
    assert sum(c.misses for c in counts) > 0
    diff = (step_losses(on) - step_losses(off)).abs().max()
    assert float(diff) <= 1e-5
    a, b = merged_states(on), merged_states(off)
    worst = max(float((a[n][k] - v).abs().max()) for n, sd in b.items() for k, v in sd.items())
    assert worst <= 1e-5, f"max abs parameter difference {worst:.3g}"
