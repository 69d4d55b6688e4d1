"""The activation cache's tiers: rows by sample in preallocated tensors, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pt_ray.core.config import CacheConfig, build_config
from pt_ray.cache.rows import RowTable, row_tiers

pytestmark = pytest.mark.unit


def rows(ids, width=3):
    """Row ``i`` of sample ``s`` is ``s`` everywhere (a state of two parts)."""
    ids = torch.as_tensor(ids, dtype=torch.float32)
    return (ids[:, None].repeat(1, width), ids[:, None, None].repeat(1, 2, 2).to(torch.float16))


def test_a_table_holds_rows_up_to_its_bytes_and_serves_them_by_sample():
    # One row is 3 fp32 + 4 fp16 = 20 bytes: 100 bytes hold 5 of the 10 samples.
    table = RowTable(10, 100, torch.device("cpu"))
    taken = table.put(np.array([7, 2, 5]), rows([7, 2, 5]), level=2)
    assert taken.tolist() == [0, 1, 2] and table.capacity == 5
    taken = table.put(np.array([1, 9, 3, 0]), rows([1, 9, 3, 0]), level=2)
    assert taken.tolist() == [0, 1]  # two free slots left; 3 and 0 stay out
    assert not table.room_for(np.array([3, 0])) and table.room_for(np.array([3, 9]))
    found, slots = table.find(np.array([0, 9, 5, 7, 3]), level=2)
    assert found.tolist() == [1, 2, 3]
    served = table.take(slots, torch.device("cpu"))
    assert served[0][:, 0].tolist() == [9.0, 5.0, 7.0]
    assert served[1].dtype == torch.float16 and served[1][:, 0, 0].tolist() == [9.0, 5.0, 7.0]
    assert table.served == 3
    assert table.find(np.array([9, 5]), level=3)[0].tolist() == []  # held at depth 2 only


def test_a_deeper_row_replaces_its_sample_in_its_slot_and_invalidation_forgets_it():
    table = RowTable(6, 10**6, torch.device("cpu"))
    table.put(np.array([4, 1]), rows([4, 1]), level=2)
    table.put(np.array([4]), rows([40]), level=3)  # sample 4 at depth 3, same slot
    assert table.used == 2 and table.held(2) == 1 and table.held(3) == 1
    _, slots = table.find(np.array([4]), level=3)
    assert table.take(slots, torch.device("cpu"), serving=False)[0][0, 0] == 40.0
    assert table.served == 0
    table.invalidate_above(2)
    assert table.find(np.array([4, 1]), level=3)[0].tolist() == []
    assert table.find(np.array([4, 1]), level=2)[0].tolist() == [1]


def test_tiers_from_the_config():
    base = {"model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2,
                      "width": 32, "num_heads": 2, "patch_size": 4},
            "data": {"name": "synthetic_image", "image_size": 8}}
    cpu = torch.device("cpu")
    assert row_tiers(build_config(base).cache, 100, cpu) == []  # auto: none on CPUs
    cfg = build_config({**base, "cache": {"device_bytes": 4096, "host_bytes": 8192}})
    device, host = row_tiers(cfg.cache, 100, cpu)
    assert (device.name, device.capacity_bytes, host.name, host.capacity_bytes) == (
        "device", 4096, "host", 8192)
    assert not host.pinned  # page-locked memory only feeds a CUDA device
    with pytest.raises(ValueError, match="cache.host_bytes=-1"):
        CacheConfig(host_bytes=-1)
