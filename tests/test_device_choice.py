"""Devices and precision: ``pipeline.use_gpu`` and ``precision`` resolved against the cluster on
the driver, before any worker starts."""

import pytest

from pt_ray.core.config import ConfigError, RunConfig, build_config
from pt_ray.core.devices import CPU_BACKEND, GPU_BACKEND, DeviceChoice, choose_devices

pytestmark = pytest.mark.unit


def cfg(**fields) -> RunConfig:
    """A RunConfig from dotted fields, e.g. ``cfg(**{"pipeline.use_gpu": True})``."""
    data: dict = {}
    for key, value in fields.items():
        *head, last = key.split(".")
        node = data
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return build_config(data)


def choice_for(run: RunConfig, cluster_gpus: float) -> DeviceChoice:
    """The choice for ``run`` from the fields the entry passes (its pipeline, engine and
    precision)."""
    return choose_devices(run.pipeline, cluster_gpus, engine=run.engine, precision=run.precision)


def applied(run: RunConfig, choice: DeviceChoice) -> RunConfig:
    """``run`` with the choice written in, as the entry writes it."""
    return run.model_copy(update=choice.config_update(run.pipeline))


@pytest.mark.parametrize(
    ("use_gpu", "gpus", "device", "precision", "line"),
    [
        ("auto", 0, "cpu", "fp32",
         "devices: 2 CPU workers (gloo), precision fp32; no GPUs in the cluster"),
        ("auto", 1, "cpu", "fp32", "devices: 2 CPU workers (gloo), precision fp32; the cluster "
         "has 1 GPU, 2 needed (one per worker)"),
        ("auto", 2, "cuda", "bf16", "devices: 2 GPU workers (NCCL + gloo), precision bf16"),
        (True, 8, "cuda", "bf16", "devices: 2 GPU workers (NCCL + gloo), precision bf16"),
        (False, 8, "cpu", "fp32",
         "devices: 2 CPU workers (gloo), precision fp32; pipeline.use_gpu=false"),
    ],
)
def test_use_gpu_and_auto_precision_follow_the_cluster(use_gpu, gpus, device, precision, line):
    choice = choice_for(cfg(**{"pipeline.use_gpu": use_gpu}), cluster_gpus=gpus)

    assert (choice.device, choice.precision, choice.describe()) == (device, precision, line)
    assert choice.backend == (GPU_BACKEND if device == "cuda" else CPU_BACKEND)
    assert GPU_BACKEND == "cpu:gloo,cuda:nccl"


def test_explicit_precision_is_kept_on_either_device():
    for gpus, device in ((0, "cpu"), (2, "cuda")):
        choice = choice_for(cfg(precision="bf16"), cluster_gpus=gpus)
        assert (choice.device, choice.precision) == (device, "bf16")
    assert choice_for(cfg(precision="fp32"), cluster_gpus=2).precision == "fp32"


def test_use_gpu_true_without_gpus_is_one_line_naming_the_field_and_fix():
    with pytest.raises(ConfigError) as err:
        choice_for(cfg(**{"pipeline.use_gpu": True}), cluster_gpus=0)

    assert str(err.value) == (
        "pipeline.use_gpu=true needs 2 GPUs (one per worker) but the cluster has 0; "
        "set pipeline.use_gpu=auto or false, or add GPUs")


def test_elastic_runs_need_gpus_for_min_workers_only():
    elastic = cfg(**{"pipeline.use_gpu": True, "pipeline.num_workers": 4,
                     "pipeline.min_workers": 2})

    choice = choice_for(elastic, cluster_gpus=2)

    assert choice.describe() == "devices: 2-4 GPU workers (NCCL + gloo), precision bf16"
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(one per worker, "
                                          r"pipeline.min_workers=2\) but the cluster has 1;"):
        choice_for(elastic, cluster_gpus=1)


def test_reference_engine_is_one_cpu_process_at_fp32():
    choice = choice_for(cfg(engine="reference"), cluster_gpus=8)
    assert (choice.device, choice.precision) == ("cpu", "fp32")
    assert choice.describe() == "devices: 1 CPU process (engine=reference), precision fp32"
    with pytest.raises(ConfigError, match=r"^pipeline.use_gpu=true: engine=reference trains in "
                                          r"one CPU process; set pipeline.use_gpu=auto or false"):
        choice_for(cfg(engine="reference", **{"pipeline.use_gpu": True}), cluster_gpus=8)


def test_the_choice_records_its_concrete_fields_and_round_trips():
    base = cfg(epochs=3)

    resolved = applied(base, choice_for(base, cluster_gpus=4))

    assert (resolved.precision, resolved.pipeline.use_gpu) == ("bf16", True)
    assert (base.precision, base.pipeline.use_gpu) == ("auto", "auto")  # frozen, untouched
    assert resolved.epochs == 3 and resolved.pipeline.num_workers == 2
    assert build_config(resolved.model_dump(mode="json")) == resolved


def test_sweep_reuse_matches_a_recorded_resolution_of_auto():
    from pt_ray.tune import _same_config

    from pt_ray.cache.size import resolve_cache_sizes

    wanted = cfg(epochs=2).model_dump(mode="json")
    resolved = applied(cfg(epochs=2), choice_for(cfg(epochs=2), 0))
    sized = resolved.model_copy(update={"cache": resolve_cache_sizes(resolved.cache, [2**32])})
    recorded = sized.model_dump(mode="json")

    assert recorded["cache"]["worker_memo_bytes"] == 2**31
    assert _same_config(recorded, wanted)
    assert not _same_config(recorded, cfg(epochs=2, **{"cache.worker_memo_bytes": 2**30})
                            .model_dump(mode="json"))
    assert not _same_config(recorded, cfg(epochs=3).model_dump(mode="json"))
    assert not _same_config(recorded, cfg(epochs=2, precision="bf16").model_dump(mode="json"))
