"""The registries: each freeze policy and each dataset is one entry that the config's choices,
the run's per-policy behaviour and the dataset builders derive from; the optional dataset fast
paths are named protocols."""

from __future__ import annotations

import typing
from collections.abc import Sequence

import pytest
import torch

from pt_ray.control.state import decision_interval, policy_for
from pt_ray.core.config import ConfigError, DataConfig, FreezeConfig, load_config
from pt_ray.core.datasets import DATASET_NAMES, DATASETS as ENTRIES
from pt_ray.core.freeze import (
    FREEZE_POLICIES,
    POLICIES,
    FreezeSettings,
    build_freeze_policy,
    policy_traits,
)
from pt_ray.costs.simulate import SIMULATED_POLICIES
from pt_ray.data import (
    DATASETS,
    SubsetDataset,
    TensorSampleDataset,
    build_dataset,
    fast_paths,
    finish_batch,
    gather,
    gather_stored,
    gather_targets,
    set_epoch,
)
from pt_ray.data.synthetic import TEXT_INPUTS
from pt_ray.data.transforms import ImageTransform
from pt_ray.data.vision import ImageArrayDataset
from pt_ray.service.settings import run_settings

pytestmark = pytest.mark.unit


# --- freeze policies ----------------------------------------------------------------------


def test_the_config_offers_exactly_the_registered_policies_and_datasets():
    policy, name = FreezeConfig.model_fields["policy"], DataConfig.model_fields["name"]
    assert typing.get_args(policy.annotation) == POLICIES == tuple(FREEZE_POLICIES)
    assert typing.get_args(name.annotation) == DATASET_NAMES == tuple(ENTRIES)
    assert (FreezeConfig().policy, DataConfig().name) == (POLICIES[0], DATASET_NAMES[0])
    assert POLICIES[0] == "settled" and DATASET_NAMES[0] == "digits"


SETTINGS = dict(num_layers=6, alpha=0.5, max_frozen=4, warmup=2, ratio=0.4, window=3,
                plateau=0.05, tolerance=0.2, threshold=0.03, decisions=11)
COMMON = dict(num_layers=6, alpha=0.5, max_frozen=4, warmup=2)


@pytest.mark.parametrize(("name", "taken"), [
    ("settled", dict(ratio=0.4, window=3, plateau=0.05, tolerance=0.2)),
    ("probe", dict(threshold=0.03, decisions=11, window=3)),
    ("converged", dict(ratio=0.4, window=3)),
    ("paper", {}),
    ("schedule", {}),
    ("none", {}),
])
def test_each_policy_builds_itself_from_the_settings_it_takes(name, taken):
    policy = build_freeze_policy(name, **SETTINGS)
    assert type(policy) is FREEZE_POLICIES[name] and policy.name == name
    for field, value in {**COMMON, **taken}.items():
        assert getattr(policy, field) == value, field


def test_settings_from_the_config_take_the_freeze_section():
    f = FreezeConfig(alpha=0.25, converge_ratio=0.2, converge_window=4, plateau=0.02,
                     settle_tolerance=0.3, probe_threshold=0.05)
    s = FreezeSettings.from_config(f, num_layers=8, warmup=3, decisions=40, max_frozen=5)
    assert s == FreezeSettings(num_layers=8, alpha=0.25, max_frozen=5, warmup=3, ratio=0.2,
                               window=4, plateau=0.02, tolerance=0.3, threshold=0.05,
                               decisions=40)
    assert FreezeSettings(num_layers=8, alpha=0.5).cap == 7
    with pytest.raises(ValueError, match=r"max_frozen=9 exceeds the model's 8 blocks"):
        _ = FreezeSettings(num_layers=8, alpha=0.5, max_frozen=9).cap


def test_an_unknown_policy_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"freeze\.policy='greedy' is not one of \['settled', "
                                         r"'probe', 'converged', 'paper', 'schedule', 'none'\]"):
        build_freeze_policy("greedy", num_layers=4, alpha=0.5)


# 100 steps an epoch: decisions every k steps (None: per epoch) in a 4-, 10- and 20-epoch run.
@pytest.mark.parametrize(("name", "intervals"), [
    ("settled", (25, None, None)),
    ("converged", (25, None, None)),
    ("probe", (25, 50, None)),
    ("paper", (None, None, None)),
    ("schedule", (None, None, None)),
    ("none", (None, None, None)),
])
def test_the_auto_interval_follows_each_policys_traits(name, intervals):
    got = tuple(decision_interval(
        run_settings(load_config(None, [f"freeze.policy={name}", f"epochs={e}"])).control.decisions,
        100) for e in (4, 10, 20))
    assert got == intervals
    assert policy_traits(name).per_epoch == (intervals == (None, None, None))


def test_a_policy_that_never_freezes_is_not_capped_by_a_pinned_pipeline():
    for name in POLICIES:
        cfg = load_config(None, [f"freeze.policy={name}", "freeze.max_frozen=5"])
        policy = policy_for(run_settings(cfg).control.decisions, num_layers=6, steps_per_epoch=10,
                            pinned_length=2)
        assert policy.max_frozen == (4 if policy_traits(name).freezes else 5), name


def test_the_simulator_runs_the_per_epoch_policies_that_freeze():
    assert SIMULATED_POLICIES == ("schedule", "paper")


# --- datasets -----------------------------------------------------------------------------


def test_every_dataset_entry_resolves_to_a_builder_in_pt_ray_data():
    assert tuple(DATASETS) == DATASET_NAMES
    for name, builder in DATASETS.items():
        module, _, function = ENTRIES[name].builder.partition(":")
        assert builder.__module__ == f"pt_ray.data.{module}" and builder.__name__ == function


@pytest.mark.parametrize("name", [n for n, e in ENTRIES.items()
                                  if not e.reads_files and n != "mnist5k"])
def test_a_built_dataset_carries_its_entrys_name_and_kind(name):
    splits = build_dataset(DataConfig(name=name, num_samples=64, seq_len=16), seed=0)
    entry = ENTRIES[name]
    assert splits.name == name
    assert (splits.train.input_names == TEXT_INPUTS) == entry.text
    assert (len(splits.train) == 64) and (splits.task == "question_answering") == (
        entry.question_answering)


@pytest.mark.parametrize("name", [n for n, e in ENTRIES.items() if e.reads_files])
def test_a_dataset_of_files_needs_a_path(name):
    family = ["model.family=hf", "model.name=bert"] if ENTRIES[name].text else []
    with pytest.raises(ConfigError, match=rf"data\.name={name} reads local files; set data\.path"):
        load_config(None, [f"data.name={name}", *family])


# --- fast paths ---------------------------------------------------------------------------


class _Plain:
    """Only the plain protocol: every fast path falls back."""

    input_names = ("x",)
    deterministic_transform = True

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, (self.x[i],), torch.tensor(i % 3)


def _same(a, b) -> bool:
    return (torch.equal(a.indices, b.indices) and torch.equal(a.target, b.target)
            and all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs, strict=True)))


def test_the_fast_paths_are_named_protocols_and_fall_back_to_the_plain_one():
    plain = _Plain(6)
    idx: Sequence[int] = [4, 1, 3]
    assert fast_paths(plain) == ()
    batch = gather(plain, idx)
    assert batch.indices.tolist() == idx and batch.target.tolist() == [1, 1, 0]
    assert torch.equal(gather_targets(plain, idx), batch.target)
    assert _same(finish_batch(plain, gather_stored(plain, idx)), batch)
    set_epoch(plain, 3)  # no augmentation: nothing to tell

    tensors = TensorSampleDataset((plain.x,), torch.arange(6) % 3, ("x",))
    assert fast_paths(tensors) == ("batch", "targets")
    assert _same(gather(tensors, idx), batch)

    images = ImageArrayDataset(torch.randint(0, 255, (6, 1, 4, 4), dtype=torch.uint8),
                               torch.arange(6), ImageTransform((0.5,), (0.5,), augment=True))
    assert fast_paths(images) == ("batch", "targets", "stored", "epoch")
    assert fast_paths(SubsetDataset(plain, [0, 2])) == ("batch", "targets", "stored", "epoch")
