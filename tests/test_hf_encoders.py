"""Hugging Face encoders outside the named types: cut from a local directory where the BERT
pattern is found and the cut computes the model's own forward, refused with the reason where
it is not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

from pt_ray.api import fit
from pt_ray.core.config import ConfigError, ModelConfig
from pt_ray.models import HF_ENCODERS, build_adapter, forward_layers
from pt_ray.models.hf_discovery import discover_spec
from pt_ray.models.export import export_model, load_exported
from test_export import TRAIN
from test_models import SEQ, VOCAB, text_inputs

pytestmark = pytest.mark.unit

DEPTH = 3
CLASSES = 3
TINY = dict(hidden_size=32, num_hidden_layers=DEPTH, num_attention_heads=2, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=64)

NEW_FAMILIES = ["camembert", "ernie", "data2vec-text"]
"""Encoder types with the BERT pattern that are not in the named table."""


def save_tiny(tmp_path: Path, model_type: str, task: str = "classification", **fields) -> Path:
    """A tiny random ``model_type`` task model, written by ``save_pretrained``."""
    if task == "classification":
        config = AutoConfig.for_model(model_type, **{**TINY, "num_labels": CLASSES, **fields})
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        config = AutoConfig.for_model(model_type, **{**TINY, **fields})
        model = AutoModelForQuestionAnswering.from_config(config)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    return folder


def load(folder: Path, task: str = "classification", name: str = "bert-like"):
    return build_adapter(
        ModelConfig(family="hf", name=name, weights=folder),
        num_classes=CLASSES if task == "classification" else None,
        task=task,
        seq_len=SEQ,
        seed=1,
    )


def own_logits(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    input_ids, attention_mask, token_type_ids = inputs
    out = model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_new_family_is_cut_trains_and_exports(tmp_path: Path, model_type: str) -> None:
    assert model_type not in HF_ENCODERS
    adapter = load(save_tiny(tmp_path, model_type))
    assert adapter.num_layers == DEPTH and adapter.model.training
    assert adapter.spec.token_types
    inputs = text_inputs()

    # The cut computes the model's own forward, and the padding mask reaches every block.
    adapter.model.eval()
    with torch.no_grad():
        ours = forward_layers(adapter, inputs)
        ref = own_logits(adapter.model, inputs)
        no_mask = forward_layers(adapter, (inputs[0], torch.ones_like(inputs[1]), inputs[2]))
    assert ours.shape == (4, CLASSES)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert (no_mask - ref).abs().max() > 5e-5

    # One training step through the adapter: a finite loss, and gradients in every layer.
    adapter.model.train()
    loss = adapter.loss(forward_layers(adapter, inputs), torch.tensor([0, 1, 2, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    modules = {"embed": adapter.embed, "head": adapter.head,
               **{f"block.{i}": b for i, b in enumerate(adapter.blocks)}}
    for name, module in modules.items():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters()), name

    # The export is the model's own save_pretrained folder, loaded by transformers alone.
    adapter.model.eval()
    export_model(adapter, tmp_path / "export")
    loaded = load_exported(tmp_path / "export")
    assert type(loaded) is type(adapter.model)
    with torch.no_grad():
        torch.testing.assert_close(own_logits(loaded, inputs), forward_layers(adapter, inputs),
                                   atol=1e-6, rtol=0)


def test_new_family_question_answering(tmp_path: Path) -> None:
    adapter = load(save_tiny(tmp_path, "ernie", "question_answering"), "question_answering")
    adapter.model.eval()
    inputs = text_inputs()
    with torch.no_grad():
        ours = forward_layers(adapter, inputs)
        torch.testing.assert_close(ours, own_logits(adapter.model, inputs), atol=1e-5, rtol=0)
    assert ours.shape == (4, SEQ, 2)


# (model type, config fields, what the one-line refusal says)
REFUSED = [
    ("albert", {}, r"its layers share parameters: the config has 3 layers, but "
                   r"albert\.encoder\.albert_layer_groups\.0 .* runs 3 times in one forward"),
    ("mpnet", {}, r"parameters outside the embeddings, the layers and the head "
                  r"\(mpnet\.encoder\.relative_attention_bias\.weight\): .*relative position bias"),
    ("deberta-v2", {"relative_attention": True, "pos_att_type": ["p2c", "c2p"]},
     r"parameters outside .*\(deberta\.encoder\.rel_embeddings\.weight"),
    ("roberta-prelayernorm", {}, r"parameters outside .*roberta_prelayernorm\.LayerNorm\.weight"
                                 r".*a final norm"),
    ("deberta", {}, r"the cut forward \(embed -> blocks -> head\) differs from the model's own by "
                    r"\S+ in its last hidden states \(more than 1e-05\)"),
    ("gpt2", {}, r"it is a causal \(decoder-only\) language model"),
    ("bart", {}, r"it is an encoder-decoder model \(is_encoder_decoder=True\)"),
    ("ernie", {"is_decoder": True}, r"configured as a decoder \(is_decoder=True\)"),
    ("fnet", {}, r"FNetLayer\.forward\(hidden_states\) takes no attention_mask"),
    ("xlm", {}, r"its layers are split across 4 lists \(transformer\.attentions, "),
]


@pytest.mark.parametrize(("model_type", "fields", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_uncuttable_encoders_are_refused_with_the_reason(
    tmp_path: Path, model_type: str, fields: dict, reason: str
) -> None:
    folder = save_tiny(tmp_path, model_type, **fields)
    with pytest.raises(ConfigError) as err:
        load(folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model.weights={str(folder)!r} holds a model of type ")
    assert "cannot cut into embed | blocks | head: " in message
    assert re.search(reason, message), message


def test_structural_refusals_name_the_layers(tmp_path: Path) -> None:
    def refusal(model: torch.nn.Module) -> str:
        with pytest.raises(ConfigError) as err:
            discover_spec(model, "classification", "model.weights='x'")
        return str(err.value)

    def fresh() -> torch.nn.Module:
        config = AutoConfig.for_model("camembert", **TINY)
        return AutoModelForSequenceClassification.from_config(config)

    mixed = fresh()
    layers = mixed.roberta.encoder.layer
    layers[1].__class__ = type("OtherLayer", (type(layers[1]),), {})
    assert "its layers (roberta.encoder.layer) are not all one class: CamembertLayer, OtherLayer" \
        in refusal(mixed)
    shared = fresh()
    shared.roberta.encoder.layer[2] = shared.roberta.encoder.layer[0]
    assert "its layers (roberta.encoder.layer) share parameters" in refusal(shared)
    bare = fresh()
    bare.roberta.embeddings = None
    assert "no embeddings module found (roberta.embeddings)" in refusal(bare)


def test_other_types_by_name_point_to_a_local_directory() -> None:
    with pytest.raises(ConfigError, match=r"model.name='camembert' is a transformers model type "
                                          r"that pt-ray builds by name only for bert, distilbert, "
                                          r"roberta, xlm-roberta: .*set model.weights"):
        build_adapter(ModelConfig(family="hf", name="camembert"), num_classes=2)


@pytest.mark.timeout(300)
def test_reference_run_trains_a_new_family_from_its_directory(tmp_path: Path) -> None:
    # synthetic_text: 4 classes over a 1000-token vocabulary.
    folder = save_tiny(tmp_path, "camembert", vocab_size=1000, num_labels=4)
    run = {
        "model": {"family": "hf", "name": "camembert", "weights": str(folder), "dropout": 0.0},
        "data": {"name": "synthetic_text", "num_samples": 192, "seq_len": 12, "batch_size": 16},
    }
    result = fit({**run, **TRAIN, "logging": {"report": False}}, overrides=["engine=reference"],
                 output_dir=tmp_path / "run", on_epoch=lambda rec: None)
    assert result.final_eval_metric > 0.4  # 4 classes
    assert type(result.load_model()).__name__ == "CamembertForSequenceClassification"
