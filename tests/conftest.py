"""Shared test setup: Ray's environment, one thread per process, and the test tiers
(``tiers.py``: one marker per test, no process in a unit test)."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from tiers import GUARD, check_tiers  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = ["pytester"]  # test_tiers runs small pytest sessions in this process

GUARD.install()


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: every collected test is checked
def pytest_collection_modifyitems(config, items):
    check_tiers(items)
    # PT_RAY_GPU_TESTS_ON_CPU=1: the gpu tests run on the CPU with gloo (their dry run).
    if torch.cuda.is_available() or os.environ.get("PT_RAY_GPU_TESTS_ON_CPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True)  # before the fixtures' set-up (a session cluster's starts there)
def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") is not None:
        GUARD.begin(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    spawned = GUARD.end()  # before the fixtures' teardown (a session cluster's ends there)
    result = yield
    if spawned:
        pytest.fail(f"a unit test started {len(spawned)} process(es): {'; '.join(spawned)}. "
                    "Mark it proc (plain interpreters), dist (forked ranks) or ray instead.",
                    pytrace=False)
    return result


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
