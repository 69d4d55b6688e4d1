"""RunConfig: defaults, YAML + overrides, and errors that name the field, value and fix."""

import pytest
from pydantic import ValidationError

from pt_ray.core.config import ConfigError, RunConfig, build_config, load_config
from pt_ray.api import default_config_path

pytestmark = pytest.mark.unit


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = RunConfig()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\nfreeze:\n  alpha: 0.5\npipeline:\n  num_workers: 4\n")
    cfg = load_config(path, ["freeze.alpha=0.25", "pipeline.pipeline_length=2",
                             "model.weights=null", "freeze.policy=none",
                             "optimizer.grad_clip=null"])
    assert cfg.epochs == 3
    assert cfg.freeze.alpha == 0.25
    assert cfg.pipeline.pipeline_length == 2
    assert cfg.optimizer.grad_clip is None
    assert cfg.freeze.policy == "none" and cfg.model.weights is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("freeze.alpha=1.5", r"freeze\.alpha=1\.5: Input should be less than or equal to 1"),
        ("freeze.alfa=0.3", r"freeze\.alfa: unknown field; did you mean freeze\.alpha\?"),
        ("epoch=3", r"epoch: unknown field; did you mean epochs\?"),
        ("pipeline.pipeline_length=3",
         r"pipeline_length=3 does not divide pipeline\.num_workers=2; choose one of \[1, 2\]"),
        ("freeze.policy=greedy",
         r"freeze\.policy='greedy': Input should be 'settled', 'probe', 'converged', 'paper'"),
        ("data.batch_size=7", r"data\.batch_size=7 is not divisible by pipeline\.num_workers=2"),
        ("data.name=cifar10", r"set data\.path"),
        ("model.width=64", None),
        ("pipeline.num_microbatches=1",
         r"pipeline\.num_microbatches=1 is fewer than the 2 pipeline stages"),
        ("freeze", r"not key=value"),
        ("logging.every_steps=-1",
         r"logging\.every_steps=-1: Input should be greater than or equal to 0"),
    ],
)
def test_bad_values_name_field_value_and_fix(override, message):
    if message is None:
        assert load_config(None, [override]).model.width == 64
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # fixed_global: 2 workers x 3 chunks = 6 does not divide 64.
        (["optimizer.accumulation_steps=3"],
         r"data\.batch_size=64 is not divisible by pipeline\.num_workers=2 x "
         r"optimizer\.accumulation_steps=3 = 6; .* choose a batch_size that is a multiple of 6 "
         r"or accumulation_steps among \[1, 2, 4, 8, 16, 32\]"),
        (["batch_policy=per_replica", "optimizer.accumulation_steps=3"],
         r"data\.batch_size=64 is not divisible by optimizer\.accumulation_steps=3; .* "
         r"multiple of 3 or accumulation_steps among \[1, 2, 4, 8, 16, 32, 64\]"),
        # K = 2 of N = 2: one replica; a chunk of 64 / 4 = 16 does not split into 3.
        (["pipeline.pipeline_length=2", "pipeline.num_microbatches=3",
          "pipeline.schedule=gpipe", "optimizer.accumulation_steps=4"],
         r"pipeline\.num_microbatches=3 does not divide the per-replica batch of one chunk "
         r"\(data\.batch_size=64 / 1 replicas / optimizer\.accumulation_steps=4\) 16; "
         r"choose a divisor of 16"),
        (["optimizer.accumulation_steps=0"],
         r"optimizer\.accumulation_steps=0: Input should be greater than or equal to 1"),
    ],
)
def test_accumulation_steps_must_split_the_batch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.timeout(30)
def test_accumulation_steps_that_split_the_batch_validate():
    assert RunConfig().optimizer.accumulation_steps == 1
    assert load_config(None, ["optimizer.accumulation_steps=32"]).optimizer.accumulation_steps == 32
    cfg = load_config(None, ["pipeline.pipeline_length=2", "pipeline.num_microbatches=4",
                             "optimizer.accumulation_steps=4"])
    assert cfg.optimizer.accumulation_steps == 4


def test_width_heads_rule():
    with pytest.raises(ConfigError, match="model.width=64 is not divisible by model.num_heads=5"):
        build_config({"model": {"width": 64, "num_heads": 5}})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_a_removed_field_gets_one_line_saying_what_replaced_it(tmp_path):
    # cache.order chose a block order for the cache; the cache now uses the plain order.
    path = tmp_path / "old.yaml"
    path.write_text("cache:\n  mode: on\n  order: blocks\n")
    for load in (lambda: load_config(path), lambda: load_config(None, ["cache.order=auto"]),
                 lambda: build_config({"cache": {"order": "samples"}})):
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert message.startswith("cache.order: removed: the activation cache now works in the "
                                  "plain sample order")
        assert "delete the field" in message and "\n" not in message
    assert "order" not in RunConfig().cache.model_dump()


def test_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(ValidationError, match="frozen_instance"):
        cfg.epochs = 3  # type: ignore[misc]
    assert cfg.epochs == RunConfig().epochs


def test_eval_and_checkpoint_cadence_rule():
    cfg = build_config({"epochs": 7, "eval_every": 3, "checkpoint_every": 2})
    assert [e for e in range(7) if cfg.evaluates_after(e)] == [2, 5, 6]
    assert [e for e in range(7) if cfg.checkpoints_after(e)] == [1, 3, 5, 6]
    every = build_config({"epochs": 3})
    assert all(every.evaluates_after(e) and every.checkpoints_after(e) for e in range(3))


def test_bare_on_and_off_from_yaml_set_every_switch(tmp_path):
    # YAML reads a bare on/off as true/false; --set cache.mode=off must still mean "off".
    cfg = load_config(None, ["logging.progress=off", "cache.mode=off", "pipeline.compile=off",
                             "optimizer.fused=off"])
    assert (cfg.logging.progress, cfg.cache.mode, cfg.pipeline.compile,
            cfg.optimizer.fused) == ("off",) * 4
    cfg = load_config(None, ["cache.mode=on", "pipeline.compile=on", "optimizer.fused=on"])
    assert (cfg.cache.mode, cfg.pipeline.compile, cfg.optimizer.fused) == ("on",) * 3
    with pytest.raises(ConfigError, match=r"logging\.progress=True: Input should be 'auto'"):
        load_config(None, ["logging.progress=on"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.family=hf", "model.name=bert"],
     r"model\.family=hf is a text model and data\.name=digits holds images; set data\.name to "
     r"one of glue_tsv, squad_json, synthetic_text"),
    (["data.name=synthetic_text"],
     r"data\.name=synthetic_text is text and needs a text model; set model\.family=hf"),
])
def test_a_model_family_and_a_dataset_of_the_other_kind_fail_before_anything_starts(
        overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(default_config_path(), overrides)
