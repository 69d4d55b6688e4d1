"""``pt-ray plan``: the table, JSON, the 2021 preset, --help and errors."""

import argparse
import json
import re

import pytest

from pt_ray.cli.plan import add_plan_parser, main

pytestmark = pytest.mark.unit


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_lists_every_epoch_the_total_and_the_ablations(capsys):
    code, out, _ = run(capsys, "--model", "vit_base_patch16_224", "--devices", "16",
                       "--hardware", "paper-rtx5000", "--alpha", "0.333", "--epochs", "10",
                       "--dataset-size", "1281167", "--batch-size", "400")
    assert code == 0
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+/12 ", line)]
    assert len(rows) == 10
    assert "predicted total" in out and "speedup" in out
    for label in ("freeze only", "freeze + AutoPipe + AutoCache", "freeze + AutoPipe + AutoDP",
                  "freeze + AutoPipe + AutoDP + AutoCache"):
        assert label in out


def test_as_2021_reproduces_the_paper_check(capsys):
    code, out, _ = run(capsys, "--as-2021", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["settings"]["planner"] == "2021" and data["settings"]["runtime"] == "2021"
    assert data["speedup"] == pytest.approx(2.83, rel=0.15)
    assert [e["pipeline_length"] for e in data["run"]["epochs"]] == [8, 8, 4, 2, 2, 1, 1, 1, 1, 1]
    assert data["model"]["num_layers"] == 12 and data["hardware"]["name"] == "paper-rtx5000"
    assert set(data["ablations"]) == {"freeze_only", "freeze_autopipe_autocache",
                                      "freeze_autopipe_autodp"}


def test_shape_overrides_and_other_models(capsys):
    code, out, _ = run(capsys, "--model", "bert-large-uncased", "--depth", "6", "--tokens", "256",
                       "--devices", "8", "--hardware", "a100-80g-nvlink", "--batch-size", "64",
                       "--dataset-size", "88000", "--epochs", "4", "--no-ablations")
    assert code == 0
    assert "L=6" in out and "T=256" in out and "/6 " in out
    assert "ablations" not in out


def test_explicit_options_win_over_the_2021_preset(capsys):
    code, out, _ = run(capsys, "--as-2021", "--schedule", "1f1b", "--frozen", "0,2,4",
                       "--epochs", "3", "--no-ablations", "--json")
    data = json.loads(out)
    assert code == 0 and data["settings"]["schedule"] == "1f1b"
    assert data["settings"]["frozen"] == [0, 2, 4]


@pytest.mark.parametrize("argv,needle", [
    (["--model", "vit_base_patch17_224"], "vit_base_patch16_224"),
    (["--hardware", "tpu-v9"], "paper-rtx5000"),
    (["--pipeline-length", "auto", "--planner", "paper"], "needs --planner cost"),
    (["--pipeline-length", "three"], "must be a number"),
    (["--policy", "paper"], "grad"),
    (["--batch-size", "401"], "divisible"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("pt-ray plan: error:") and needle in err


def test_list_names_models_and_hardware(capsys):
    code, out, _ = run(capsys, "--list")
    assert code == 0
    assert "bert-base-uncased" in out and "deit_small_patch16_224" in out
    assert "h100-nvlink" in out and "local-cpu" in out


def test_help_documents_every_option():
    parser = argparse.ArgumentParser(prog="pt-ray")
    plan = add_plan_parser(parser.add_subparsers(dest="command"))
    text = plan.format_help()
    for action in plan._actions:
        for opt in action.option_strings:
            assert opt in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
    args = parser.parse_args(["plan", "--devices", "8"])
    assert args.command == "plan" and args.devices == 8 and callable(args.func)


def test_activation_checkpointing_is_predicted_slower_and_named(capsys):
    args = ("--epochs", "2", "--no-ablations", "--json")
    runs = {}
    for flag in ((), ("--activation-checkpointing",)):
        code, out, _ = run(capsys, *flag, *args)
        assert code == 0
        runs[bool(flag)] = json.loads(out)
    assert runs[True]["settings"]["activation_checkpointing"] is True
    assert runs[False]["settings"]["activation_checkpointing"] is False
    # One more forward of every trainable block per step: the same layout, fewer samples/s.
    plain, ckpt = runs[False]["baseline"]["epochs"][0], runs[True]["baseline"]["epochs"][0]
    assert (ckpt["pipeline_length"], ckpt["num_microbatches"]) == (
        plain["pipeline_length"], plain["num_microbatches"])
    assert ckpt["throughput"] < 0.9 * plain["throughput"]
    code, out, _ = run(capsys, "--activation-checkpointing", "--epochs", "1", "--no-ablations")
    assert code == 0 and ", activation checkpointing" in out.splitlines()[1]
