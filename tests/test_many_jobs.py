"""Two pt-ray runs at once on one Ray cluster, each with the activation cache on: their
controllers and cache owners are their own (named by run id), each run ends on its reference
trainer's parameters, and nothing of either run is left alive afterwards."""

from __future__ import annotations

import json
import threading
import time

import pytest

from pt_ray.api import fit
from pt_ray.runtime.reference import build_reference
from pt_ray.cache.owners import cache_name
from pt_ray.service.controller import controller_name
from pt_ray.models.base import iter_layers
from pt_ray.service.settings import run_settings
from test_ray_engine import max_difference, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def reference(cfg) -> dict:
    trainer = build_reference(run_settings(cfg).reference)
    trainer.fit()
    return {name: {k: v.clone() for k, v in m.state_dict().items()}
            for name, m in iter_layers(trainer.adapter)}


def test_two_runs_at_once_with_the_cache_on_each_end_on_their_reference(ray_cluster, tmp_path):
    import ray

    # Different seeds: a run that read the other's cache or controller would not end on its own
    # reference.
    configs = {name: tiny_config(tmp_path / name, name=name, seed=seed,
                                 cache={"mode": "on", "block_size": 16})
               for name, seed in (("job-a", 0), ("job-b", 1))}
    results, errors = {}, {}

    def run(name: str) -> None:
        try:
            results[name] = fit(configs[name])
        except BaseException as err:  # reported below, with the other run's outcome
            errors[name] = err

    threads = [threading.Thread(target=run, args=(name,)) for name in configs]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=540)
    both_s = time.monotonic() - t0
    assert not errors, errors
    assert set(results) == set(configs)

    run_ids = set()
    for name, result in results.items():
        summary = json.loads((result.run_dir / "summary.json").read_text())
        run_ids.add(summary["run_id"])
        # The freeze deepened and the cache served: each run's own cache, not the other's.
        assert [r.num_frozen for r in result.timeline] == [0, 2, 3]
        assert result.timeline[-1].cache_hit_rate == 1.0
        ref = reference(tiny_config(tmp_path / f"{name}-ref", name=name, engine="reference",
                                    seed=configs[name].seed))
        assert max_difference(result.checkpoint, ref) <= 1e-4, name
    assert len(run_ids) == 2
    print(f"two runs at once: {both_s:.1f} s for both; each run's own wall time "
          f"{', '.join(f'{r.wall_time_s:.1f} s' for r in results.values())}")

    # Nothing of either run stays: no controller, no cache owner on any node.
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    for run_id in run_ids:
        for actor in [controller_name(run_id)] + [cache_name(run_id, n) for n in nodes]:
            with pytest.raises(ValueError):
                ray.get_actor(actor)
