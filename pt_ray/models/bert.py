"""Adapter that cuts a Hugging Face encoder into layers: the named BERT-family types, and any other
encoder type whose BERT pattern :mod:`pt_ray.models.hf_discovery` finds and checks numerically."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask

from pt_ray.core.config import ConfigError
from pt_ray.models.base import State, Task, check_partition

__all__ = [
    "BERT_FIELDS",
    "HF_ENCODERS",
    "HFConfigFields",
    "HFEncoderAdapter",
    "HFEncoderSpec",
    "build_head",
    "layer_list",
]


@dataclass(frozen=True)
class HFConfigFields:
    """What one model type's config calls the fields that ``ModelConfig`` sets."""

    depth: str
    width: str
    num_heads: str
    ffn: str
    dropouts: tuple[str, ...]


@dataclass(frozen=True)
class HFEncoderSpec:
    """Where one Hugging Face model type keeps its parts, and what its config fields are called."""

    base: str
    """Attribute of the task model that holds the encoder (``bert``, ``roberta``, ...)."""
    layers: tuple[str, ...]
    """Path from the encoder to its block list."""
    cls_head: Literal["pooler", "sequence", "distil"]
    """Classification head: BERT's pooler + classifier, RoBERTa's head on the sequence, or
    DistilBERT's pre_classifier/ReLU/classifier on the first token."""
    qa_dropout: bool
    """Whether dropout runs before ``qa_outputs`` (DistilBERT)."""
    token_types: bool
    """Whether the embeddings read ``token_type_ids``."""
    padding_positions: bool
    """Position ids start after ``pad_token_id`` (RoBERTa): the table needs ``pad + 1`` more
    rows."""
    fields: HFConfigFields
    """The config's names for the fields ``ModelConfig`` sets."""


BERT_FIELDS = HFConfigFields(
    depth="num_hidden_layers",
    width="hidden_size",
    num_heads="num_attention_heads",
    ffn="intermediate_size",
    dropouts=("hidden_dropout_prob", "attention_probs_dropout_prob"),
)
_ROBERTA = HFEncoderSpec(
    base="roberta",
    layers=("encoder", "layer"),
    cls_head="sequence",
    qa_dropout=False,
    token_types=True,
    padding_positions=True,
    fields=BERT_FIELDS,
)
HF_ENCODERS: dict[str, HFEncoderSpec] = {
    "bert": HFEncoderSpec(
        base="bert",
        layers=("encoder", "layer"),
        cls_head="pooler",
        qa_dropout=False,
        token_types=True,
        padding_positions=False,
        fields=BERT_FIELDS,
    ),
    "roberta": _ROBERTA,
    "xlm-roberta": _ROBERTA,
    "distilbert": HFEncoderSpec(
        base="distilbert",
        layers=("transformer", "layer"),
        cls_head="distil",
        qa_dropout=True,
        token_types=False,
        padding_positions=False,
        fields=HFConfigFields(
            depth="n_layers",
            width="dim",
            num_heads="n_heads",
            ffn="hidden_dim",
            dropouts=("dropout", "attention_dropout"),
        ),
    ),
}
"""Supported ``config.model_type`` values."""


class _HFEmbed(nn.Module):
    """Token (+ token type) + position embeddings; the raw padding mask joins the state."""

    def __init__(self, embeddings: nn.Module, token_types: bool) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.token_types = token_types

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> State:
        """``input_ids[B, S]``, ``attention_mask[B, S]`` (1 = token, 0 = padding),
        ``token_type_ids[B, S]`` -> ``(hidden[B, S, D], attention_mask[B, S] float)``."""
        if self.token_types:
            hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        else:
            hidden = self.embeddings(input_ids)
        if attention_mask is None:
            mask = hidden.new_ones(hidden.shape[:2])
        else:
            mask = attention_mask.to(hidden.dtype)
        return hidden, mask


class _HFBlock(nn.Module):
    """One encoder layer. Builds the attention mask from the raw ``[B, S]`` mask the same way the
    encoder model does (``create_bidirectional_mask`` for the configured attention
    implementation: additive float for eager, boolean or none for SDPA)."""

    def __init__(self, layer: nn.Module, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer = layer
        self._config = config

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> State:
        """``(hidden[B, S, D], attention_mask[B, S])`` -> the same, after this layer."""
        mask = create_bidirectional_mask(
            config=self._config, inputs_embeds=hidden, attention_mask=attention_mask
        )
        out = self.layer(hidden, mask)
        # transformers 5 layers return the tensor; 4.x returned a tuple.
        if isinstance(out, tuple):
            out = out[0]
        return out, attention_mask


class _PoolerHead(nn.Module):
    """BERT sequence classification: pooler (dense + tanh on [CLS]; DeBERTa's task model holds
    its own) -> dropout -> classifier."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler
        self.dropout = dropout
        self.classifier = classifier

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``hidden[B, S, D]`` -> ``logits[B, C]``."""
        return self.classifier(self.dropout(self.pooler(hidden)))


class _SequenceHead(nn.Module):
    """A head that reads the whole sequence output (RoBERTa's classification head)."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``hidden[B, S, D]`` -> ``logits[B, C]``."""
        return self.classifier(hidden)


class _DistilHead(nn.Module):
    """DistilBERT sequence classification: first token -> pre_classifier -> ReLU -> dropout ->
    classifier."""

    def __init__(self, pre_classifier: nn.Module, dropout: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pre_classifier = pre_classifier
        self.dropout = dropout
        self.classifier = classifier

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``hidden[B, S, D]`` -> ``logits[B, C]``."""
        pooled = torch.relu(self.pre_classifier(hidden[:, 0]))
        return self.classifier(self.dropout(pooled))


class _QAHead(nn.Module):
    """Extractive QA: ``qa_outputs`` on every token (after dropout for DistilBERT)."""

    def __init__(self, qa_outputs: nn.Module, dropout: nn.Module | None) -> None:
        super().__init__()
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.qa_outputs = qa_outputs

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``hidden[B, S, D]`` -> ``logits[B, S, 2]`` (start, end)."""
        return self.qa_outputs(self.dropout(hidden))


def _attr(model: nn.Module, name: str, task: Task) -> nn.Module:
    module = getattr(model, name, None)
    if not isinstance(module, nn.Module):
        wanted = "ForSequenceClassification" if task == "classification" else "ForQuestionAnswering"
        raise ValueError(
            f"{type(model).__name__} has no {name!r} module, needed for task={task!r}; pass an "
            f"AutoModel{wanted} model"
        )
    return module


def build_head(model: nn.Module, base: nn.Module, spec: HFEncoderSpec, task: Task) -> nn.Module:
    """The head module ``spec`` and ``task`` describe, over the task model's own modules."""
    if task == "question_answering":
        qa = _attr(model, "qa_outputs", task)
        if getattr(qa, "out_features", 2) != 2:
            raise ValueError(
                f"{type(model).__name__}.qa_outputs has {qa.out_features} outputs; "
                "question answering needs 2 (start, end): build it with num_labels=2"
            )
        return _QAHead(qa, _attr(model, "dropout", task) if spec.qa_dropout else None)
    if spec.cls_head == "pooler":
        # BERT's encoder holds the pooler; DeBERTa's task model does.
        owner = base if isinstance(getattr(base, "pooler", None), nn.Module) else model
        return _PoolerHead(
            _attr(owner, "pooler", task),
            _attr(model, "dropout", task),
            _attr(model, "classifier", task),
        )
    if spec.cls_head == "distil":
        return _DistilHead(
            _attr(model, "pre_classifier", task),
            _attr(model, "dropout", task),
            _attr(model, "classifier", task),
        )
    return _SequenceHead(_attr(model, "classifier", task))


def layer_list(base: nn.Module, spec: HFEncoderSpec, task: Task) -> nn.Module:
    layers = base
    for part in spec.layers:
        layers = _attr(layers, part, task)
    return layers


class HFEncoderAdapter:
    """A Hugging Face BERT-family task model cut into embed | blocks | head.

    Inputs are ``(input_ids, attention_mask, token_type_ids)`` (models whose embeddings read no
    token types ignore the last). The state between blocks is
    ``(hidden[B, S, D], attention_mask[B, S] float)``: the raw mask travels, and each block
    builds the mask its attention implementation needs.

    Args:
        model: an ``AutoModelForSequenceClassification`` (``task="classification"``) or
            ``AutoModelForQuestionAnswering`` (``task="question_answering"``).
        task: what the head computes.
        spec: where the model keeps its parts; None looks its type up in :data:`HF_ENCODERS`.
            For other types pass :func:`~pt_ray.models.hf_discovery.discover_spec`'s, then
            check the cut with :func:`~pt_ray.models.hf_discovery.check_cut`.

    Raises:
        ConfigError: without ``spec``, the model type is not in :data:`HF_ENCODERS`; or the
            model is a decoder.
        ValueError: it lacks the modules the task needs.
    """

    family = "hf"
    input_names = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(
        self,
        model: PreTrainedModel,
        task: Task = "classification",
        spec: HFEncoderSpec | None = None,
    ) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if spec is None and model_type not in HF_ENCODERS:
            raise ConfigError(
                f"{type(model).__name__} has model_type={model_type!r}, which has no named "
                f"adapter; choose one of {', '.join(sorted(HF_ENCODERS))}, or pass the spec "
                "discover_spec finds"
            )
        if getattr(config, "is_decoder", False):
            raise ConfigError(
                f"{type(model).__name__} is configured as a decoder (is_decoder=True); pt-ray "
                "cuts bidirectional encoders only, so set is_decoder=False"
            )
        if task not in ("classification", "question_answering"):
            raise ValueError(
                f"task={task!r} is not supported; choose 'classification' or 'question_answering'"
            )
        spec = spec or HF_ENCODERS[model_type]
        base = _attr(model, spec.base, task)
        self.task: Task = task
        self.model = model
        self.spec = spec
        self.embed = _HFEmbed(_attr(base, "embeddings", task), spec.token_types)
        self.blocks = nn.ModuleList(
            _HFBlock(layer, config) for layer in layer_list(base, spec, task)
        )
        self.head = build_head(model, base, spec, task)
        check_partition(model, self.embed, self.blocks, self.head, label=type(model).__name__)

    @property
    def num_layers(self) -> int:
        """``L``: the number of encoder layers."""
        return len(self.blocks)

    @property
    def metric_name(self) -> str:
        """``"accuracy"`` for classification, ``"exact_match"`` (start and end) for QA."""
        return "accuracy" if self.task == "classification" else "exact_match"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy.

        Classification: ``logits[B, C]`` against class ids ``[B]``. QA: ``logits[B, S, 2]``
        against ``[B, 2]`` start/end positions; the mean of the start and end losses, with
        positions clamped to ``[0, S]`` and ``S`` ignored, as Hugging Face does for answers
        outside the window.
        """
        if self.task == "classification":
            return F.cross_entropy(output, target)
        seq_len = output.shape[1]
        positions = target.clamp(0, seq_len)
        start = F.cross_entropy(output[..., 0], positions[:, 0], ignore_index=seq_len)
        end = F.cross_entropy(output[..., 1], positions[:, 1], ignore_index=seq_len)
        return (start + end) / 2

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: top-1 class equals the target; for QA both start and end match."""
        if self.task == "classification":
            return output.argmax(dim=-1) == target
        return (output.argmax(dim=1) == target).all(dim=-1)
