"""The dataset the driver ships to the workers: its estimated size and when it goes through the
object store (``pt_ray.service.shipped``); tests/test_one_pass.py runs it on Ray Train."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pt_ray.core.config import build_config
from pt_ray.data.base import SubsetDataset
from pt_ray.data.registry import build_dataset, cap_train
from pt_ray.service.shipped import SHIP_FRACTION, held_bytes, ship_splits, ships


@pytest.mark.unit
def test_held_bytes_counts_whole_storages_arrays_bytes_and_paths_through_attributes():
    base = torch.zeros(1000, dtype=torch.float32)
    view = base[:10]  # pickling a view writes its whole storage
    holder = type("Holder", (), {})()
    holder.__dict__.update(view=view, arr=np.zeros(50, dtype=np.int64), blobs=[b"abc", b"de"],
                           files=(Path("/data/a.jpg"),), names={"k": "xyz"}, n=7)
    assert held_bytes(holder) == 4000 + 400 + 5 + len("/data/a.jpg") + 3


@pytest.mark.unit
def test_held_bytes_is_about_the_pickled_size_of_real_splits():
    cfg = build_config({"data": {"name": "synthetic_image", "num_samples": 256, "image_size": 8}})
    splits = build_dataset(cfg.data, seed=0)
    pickled = len(pickle.dumps(splits))
    assert 0.8 * pickled <= held_bytes(splits) <= 1.05 * pickled
    # A subset pickles its base whole; its size is the base's, not the kept rows'.
    sub = SubsetDataset(splits.train, [0, 1, 2])
    assert held_bytes(sub) >= held_bytes(splits.train)
    # Also inside the splits (data.num_samples on a dataset of files), two levels deeper.
    capped = cap_train(splits, 16, seed=0)
    pickled = len(pickle.dumps(capped))
    assert 0.8 * pickled <= held_bytes(capped) <= 1.05 * pickled


@pytest.mark.unit
@pytest.mark.parametrize("size, capacities, expected", [
    (100, [1000], True),
    (250, [1000, 4000], True),      # SHIP_FRACTION of the smallest store
    (251, [1000, 4000], False),
    (100, [0, 1000], True),         # a node that reports no store is left out
    (100, [], False),               # no store known: each worker builds
    (100, [0], False),
])
def test_a_dataset_ships_when_it_takes_at_most_a_fraction_of_the_smallest_store(
        size, capacities, expected):
    assert SHIP_FRACTION == 0.25
    assert ships(size, capacities) is expected


@pytest.mark.unit
def test_a_dataset_too_large_for_the_store_is_left_to_the_workers_in_one_line(caplog):
    cfg = build_config({"data": {"name": "synthetic_image", "num_samples": 64, "image_size": 8}})
    splits = build_dataset(cfg.data, seed=0)
    caplog.set_level(logging.INFO, logger="pt_ray.service.shipped")
    # Nothing is put (no Ray here: a put would fail the test).
    assert ship_splits(splits, [held_bytes(splits)]) == (None, 0)
    assert "each worker reads its files" in caplog.text
