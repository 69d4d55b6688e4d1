"""The exported model's card (``model/README.md``): Hugging Face's front matter, the base
model and data, the final metric, the freeze timeline and the speed-up beside its bound, and
the lines that load it, from a summary written out by hand."""

from __future__ import annotations

import pytest
import yaml

from pt_ray.reporting.card import model_card, speedup_estimate

pytestmark = pytest.mark.unit


def record(epoch, frozen, k, r, rate, time_s, metric):
    return {"epoch": epoch, "num_frozen": frozen, "num_layers": 4, "pipeline_length": k,
            "num_replicas": r, "throughput_samples_per_s": rate, "epoch_time_s": time_s,
            "transition_time_s": 0.0, "eval_metric": metric, "cache_hit_rate": 0.0}


SUMMARY = {
    "metric_name": "accuracy", "final_eval_metric": 0.875, "wall_time_s": 42.0,
    "device": "2 CPU workers", "precision": "fp32",
    # 100 samples per epoch: 100/s, then 200/s once half the blocks froze.
    "timeline": [record(0, 0, 2, 1, 100.0, 1.0, 0.5), record(1, 2, 1, 2, 200.0, 0.5, 0.875)],
    "config": {"name": "pets", "model": {"family": "hf", "name": "bert",
                                         "weights": "/models/minilm-l6"},
               "data": {"name": "text_table", "path": "/data/reviews"},
               "freeze": {"policy": "settled", "alpha": 0.3333}},
}


def test_the_speedup_is_the_first_epochs_pace_against_the_time_taken():
    # 200 samples at 100/s would take 2 s; the run took 1.5 s.
    assert speedup_estimate(SUMMARY["timeline"]) == pytest.approx(2.0 / 1.5)
    assert speedup_estimate([]) is None


def test_the_card_has_the_front_matter_the_timeline_and_the_loading_lines():
    card = model_card(SUMMARY, "folder = '/runs/pets/model'\nmodel = load(folder)\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "minilm-l6" and front["library_name"] == "transformers"
    assert front["datasets"] == ["reviews"] and front["metrics"] == ["accuracy"]
    assert front["model-index"][0]["results"][0]["metrics"][0] == {"type": "accuracy",
                                                                   "value": 0.875}
    assert "text-classification" in front["tags"]
    body = card.split("---\n", 2)[2]
    assert "fine-tuned from `/models/minilm-l6`" in body
    # 4 units per block unfrozen vs the second epoch's 2 x 3 + 2 x 1: (12 + 12) / (12 + 8).
    assert "about 1.33x faster than at its first epoch's pace throughout (the freeze " \
           "timeline's ideal bound: 1.20x)" in body
    assert "| 2 | 2 of 4 | 1 | 2 | 200 | 0.8750 |" in body
    assert body.rstrip().endswith("model = load(folder)\n```")


def test_a_model_trained_from_scratch_names_no_base_model():
    summary = {**SUMMARY, "config": {**SUMMARY["config"], "model": {"family": "timm",
                                                                     "name": "vit"}}}
    card = model_card(summary, "")
    front = yaml.safe_load(card.split("---\n")[1])
    assert "base_model" not in front and "image-classification" in front["tags"]
    assert "trained from a random initialisation" in card
