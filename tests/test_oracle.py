"""bench/oracle.py: branches forked from a none run share its steps before their freeze, and
the table picks the highest bound within the tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import oracle  # noqa: E402

TINY = ["--workload", "default", "--seeds", "0", "--frozen", "2", "--from", "0.5",
        "--interval", "0.25", "--set", "epochs=2", "--set", "model.depth=3",
        "--set", "model.width=32", "--set", "model.num_heads=2", "--set", "data.num_samples=128"]


def _cell(seed, k, frac, metric, bound):
    return {"seed": seed, "frozen": k, "from_fraction": frac, "metric": metric,
            "bound_cached": bound, "bound": bound}


@pytest.mark.unit
def test_rows_pair_each_seed_with_its_none_run_and_the_best_holds_the_tolerance():
    cells = [_cell(0, 0, 0.0, 0.90, 1.0), _cell(1, 0, 0.0, 0.80, 1.0),
             _cell(0, 4, 0.1, 0.88, 2.5), _cell(1, 4, 0.1, 0.78, 2.5),   # -2 points
             _cell(0, 2, 0.1, 0.899, 1.6), _cell(1, 2, 0.1, 0.797, 1.6),  # -0.2 points
             _cell(0, 2, 0.5, 0.91, 1.2), _cell(1, 2, 0.5, 0.80, 1.2)]    # +0.5 points
    rows = oracle.summarise(cells)
    by = {(r["frozen"], r["from_fraction"]): r for r in rows}
    assert by[(4, 0.1)]["vs_none_points"] == pytest.approx(-2.0)
    assert by[(2, 0.1)]["vs_none_points"] == pytest.approx(-0.2)
    assert by[(2, 0.1)]["mean_pct"] == pytest.approx(84.8)
    assert oracle.best_cell(rows, 0.5) is by[(2, 0.1)]
    assert oracle.best_cell(rows, 3.0) is by[(4, 0.1)]
    assert "**best**" in oracle.table(rows, 0.5).splitlines()[3]


@pytest.mark.proc  # forks one branch from the none run
@pytest.mark.timeout(240)
def test_a_branch_shares_the_none_run_before_its_freeze(tmp_path):
    import accuracy_matrix

    rows = oracle.main([*TINY, "--out", str(tmp_path)])
    cells = {c["frozen"]: c for c in json.loads((tmp_path / "oracle.json").read_text())["cells"]}
    assert set(cells) == {0, 2}
    none, branch = cells[0], cells[2]
    # Epoch 0 is the none run's in both; the branch freezes 2 blocks halfway, for all of epoch 1.
    assert none["frozen_by_epoch"] == [0.0, 0.0]
    assert branch["frozen_by_epoch"] == [0.0, 2.0] and branch["from_fraction"] == 0.5
    # Frozen for the last epoch only: no later epoch reads the rows it caches, so the cache adds
    # nothing to the bound.
    assert branch["bound_cached"] == branch["bound"] > 1.0
    # The none run forked a branch and went on undisturbed: a plain none run ends alike.
    plain = accuracy_matrix.main(["--workloads", "default", "--seeds", "0", "--jobs", "1",
                                  "--policies", "none", "--out", str(tmp_path / "plain"),
                                  *TINY[10:]])
    assert plain["cells"][0]["final_metric"] == none["metric"]
    assert {r["frozen"] for r in rows} == {0, 2}
