"""Shared test setup: Ray's environment, one thread per process, and test-tier markers."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # PT_RAY_GPU_TESTS_ON_CPU=1: the gpu tests run on the CPU with gloo (their dry run).
    if torch.cuda.is_available() or os.environ.get("PT_RAY_GPU_TESTS_ON_CPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# The session cluster's arguments (a test that needs another cluster starts this one again).
SESSION_RAY = {"address": "local", "num_cpus": 4, "include_dashboard": False,
               "object_store_memory": 256 * 2**20, "logging_level": "WARNING"}


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole session (never `ray stop`: only this one ends)."""
    import ray

    ray.init(**SESSION_RAY)
    yield
    ray.shutdown()
