"""Adapter that cuts a Hugging Face encoder into layers: the named BERT-family types, and any other
encoder type whose BERT pattern is found and checked numerically."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask

from pt_ray.config import ConfigError, first_line
from pt_ray.models.base import State, Task, check_partition, run_blocks

__all__ = [
    "HF_ENCODERS",
    "HFConfigFields",
    "HFEncoderAdapter",
    "HFEncoderSpec",
    "check_cut",
    "discover_spec",
    "encoder_fields",
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


_BERT_FIELDS = HFConfigFields(
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
    fields=_BERT_FIELDS,
)
HF_ENCODERS: dict[str, HFEncoderSpec] = {
    "bert": HFEncoderSpec(
        base="bert",
        layers=("encoder", "layer"),
        cls_head="pooler",
        qa_dropout=False,
        token_types=True,
        padding_positions=False,
        fields=_BERT_FIELDS,
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


def _build_head(model: nn.Module, base: nn.Module, spec: HFEncoderSpec, task: Task) -> nn.Module:
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


def _layer_list(base: nn.Module, spec: HFEncoderSpec, task: Task) -> nn.Module:
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
            For other types pass :func:`discover_spec`'s, then check the cut with
            :func:`check_cut`.

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
            _HFBlock(layer, config) for layer in _layer_list(base, spec, task)
        )
        self.head = _build_head(model, base, spec, task)
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


# A model type outside HF_ENCODERS, read from a local directory: its BERT pattern is found by
# structure, then the cut is checked against the model's own forward before it is used.

_CUT_ATOL = 1e-5
"""Largest absolute difference, in eval mode, between the cut's and the model's own last hidden
states and outputs."""


class _Uncuttable(Exception):
    """Why a model does not have the BERT pattern (worded to follow "cannot cut ...: ")."""


def _refusal(config: PretrainedConfig, label: str, why: str) -> ConfigError:
    return ConfigError(
        f"{label} holds a model of type {config.model_type!r}, which pt-ray cannot cut into "
        f"embed | blocks | head: {why}"
    )


def encoder_fields(config: PretrainedConfig, label: str) -> HFConfigFields:
    """Check that a config of a type outside :data:`HF_ENCODERS` is a bidirectional encoder, and
    name its fields.

    transformers maps each type's own names (``n_layers``, ``dim``, ...) onto BERT's, so BERT's
    names are read; only the dropouts this config has are kept.

    Args:
        config: the checkpoint's config.
        label: the field the model comes from, for messages (``model.weights='...'``).

    Raises:
        ConfigError: a decoder, causal language model or encoder-decoder, or a config without
            BERT's shape fields.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise _refusal(config, label, "it is an encoder-decoder model (is_encoder_decoder=True)")
    if getattr(config, "is_decoder", False):
        raise _refusal(
            config, label, "it is configured as a decoder (is_decoder=True), so its attention "
            "is causal; set is_decoder=False for a bidirectional encoder"
        )
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        raise _refusal(
            config, label, "it is a causal (decoder-only) language model, with no bidirectional "
            "encoder"
        )
    shape = (_BERT_FIELDS.depth, _BERT_FIELDS.width, _BERT_FIELDS.num_heads, _BERT_FIELDS.ffn)
    missing = [name for name in shape if getattr(config, name, None) is None]
    if missing:
        raise _refusal(
            config, label, f"its config has no {', '.join(missing)} (BERT's shape fields, which "
            "pt-ray reads)"
        )
    dropouts = tuple(name for name in _BERT_FIELDS.dropouts if hasattr(config, name))
    return HFConfigFields(*shape, dropouts=dropouts)


def discover_spec(model: PreTrainedModel, task: Task, label: str) -> HFEncoderSpec:
    """Find the BERT pattern in a task model whose type is not in :data:`HF_ENCODERS`.

    The pattern: the encoder (``model.base_model_prefix``) holds an ``embeddings`` module and
    one ``ModuleList`` of ``num_hidden_layers`` layers of one class, each with its own
    parameters and called as ``layer(hidden_states, attention_mask)``; the task model's head is
    BERT's (pooler + classifier), DistilBERT's (pre_classifier + classifier) or RoBERTa's (a
    classifier over the sequence), or ``qa_outputs``; and these own every parameter. Check
    the result with :func:`check_cut` before training.

    Args:
        model: the task model, as loaded.
        task: what the head computes.
        label: the field the model comes from, for messages (``model.weights='...'``).

    Raises:
        ConfigError: naming ``label`` and why the model does not have the pattern.
    """
    config = model.config
    fields = encoder_fields(config, label)
    try:
        prefix = model.base_model_prefix
        base = getattr(model, prefix, None)
        if not isinstance(base, nn.Module):
            raise _Uncuttable(f"{type(model).__name__} has no {prefix!r} encoder module")
        embeddings = getattr(base, "embeddings", None)
        if not isinstance(embeddings, nn.Module):
            raise _Uncuttable(f"no embeddings module found ({prefix}.embeddings)")
        # With one token type every token gets row 0 whatever its id; ignoring the ids does the
        # same, and does not fail on a dataset's second segment.
        token_types = "token_type_ids" in inspect.signature(embeddings.forward).parameters and (
            getattr(config, "type_vocab_size", 1) > 1
        )
        path = _find_layers(model, prefix, getattr(config, fields.depth), token_types)
        spec = HFEncoderSpec(
            base=prefix,
            layers=tuple(path.split(".")),
            cls_head=_cls_head(model),
            qa_dropout=isinstance(getattr(model, "dropout", None), nn.Dropout),
            token_types=token_types,
            padding_positions=getattr(embeddings, "padding_idx", None) is not None,
            fields=fields,
        )
        layers = _layer_list(base, spec, task)
        _check_layer_call(layers[0])
        _check_owned(model, [embeddings, layers, _head_or_why(model, base, spec, task)])
    except _Uncuttable as why:
        raise _refusal(config, label, str(why)) from None
    return spec


def _find_layers(model: PreTrainedModel, prefix: str, depth: int, token_types: bool) -> str:
    """The path, below the encoder, of its one list of ``depth`` layers of one class."""
    base = getattr(model, prefix)
    lists = {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and name.split(".")[0] != "embeddings"
    }
    full = [name for name, module in lists.items() if len(module) == depth]
    outer = [name for name in full if not any(name.startswith(f"{o}.") for o in full)]
    if not outer:
        repeated = _repeated_layer(model, [m for m in lists.values() if len(m) < depth],
                                   token_types)
        if repeated:
            name, calls = repeated
            raise _Uncuttable(
                f"its layers share parameters: the config has {depth} layers, but {name} holds "
                f"the weights of several and runs {calls} times in one forward (as ALBERT "
                "repeats one layer), so a per-layer freeze or partition is meaningless"
            )
        raise _Uncuttable(f"no list of its {depth} layers found under {prefix}")
    if len(outer) > 1:
        where = ", ".join(f"{prefix}.{name}" for name in outer)
        raise _Uncuttable(f"its layers are split across {len(outer)} lists ({where}), not one")
    path = outer[0]
    classes = sorted({type(layer).__name__ for layer in lists[path]})
    if len(classes) > 1:
        raise _Uncuttable(f"its layers ({prefix}.{path}) are not all one class: "
                          f"{', '.join(classes)}")
    params = [id(p) for layer in lists[path] for p in layer.parameters()]
    if len(set(params)) < len(params):
        raise _Uncuttable(
            f"its layers ({prefix}.{path}) share parameters, so a per-layer freeze or "
            "partition is meaningless"
        )
    return path


def _repeated_layer(
    model: PreTrainedModel, candidates: list[nn.ModuleList], token_types: bool
) -> tuple[str, int] | None:
    """``(name, calls)`` of a module in ``candidates`` that runs more than once in one forward on
    a sample batch, or None."""
    calls: dict[nn.Module, int] = {}

    def count(module: nn.Module, args: Any, output: Any) -> None:
        calls[module] = calls.get(module, 0) + 1

    hooks = [layer.register_forward_hook(count) for mlist in candidates for layer in mlist]
    try:
        with _eval_mode(model):
            _own_forward(model, _sample_batch(model.config, token_types), token_types)
    except Exception:  # any error of third-party code: no evidence either way
        return None
    finally:
        for hook in hooks:
            hook.remove()
    names = {module: name for name, module in model.named_modules()}
    repeated = sorted((names[m], n) for m, n in calls.items() if n > 1)
    return repeated[0] if repeated else None  # the outermost


def _check_layer_call(layer: nn.Module) -> None:
    """Refuse a layer that cannot be called as ``layer(hidden_states, attention_mask)``."""
    cls = type(layer).__name__
    params = list(inspect.signature(layer.forward).parameters.values())
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [p.name for p in params[1:] if p.kind in named and p.default is p.empty
              and p.name != "attention_mask"]
    if needed:
        raise _Uncuttable(
            f"{cls}.forward needs {', '.join(needed)}, computed outside the layer, which a "
            "block cannot pass on"
        )
    if len(params) < 2 or params[1].name != "attention_mask":
        shown = ", ".join(p.name for p in params)
        raise _Uncuttable(f"{cls}.forward({shown}) takes no attention_mask after the hidden states")


def _cls_head(model: nn.Module) -> Literal["pooler", "sequence", "distil"]:
    """A linear classifier reads one vector (BERT's pooler, or DistilBERT's pre_classifier);
    any other classifier module reads the sequence (RoBERTa's head)."""
    if not isinstance(getattr(model, "classifier", None), nn.Linear):
        return "sequence"
    return "distil" if isinstance(getattr(model, "pre_classifier", None), nn.Module) else "pooler"


def _head_or_why(model: nn.Module, base: nn.Module, spec: HFEncoderSpec, task: Task) -> nn.Module:
    try:
        return _build_head(model, base, spec, task)
    except ValueError as err:
        raise _Uncuttable(f"no head found for task={task!r} ({err})") from None


def _check_owned(model: nn.Module, parts: list[nn.Module]) -> None:
    """Refuse parameters that neither the embeddings, the layers nor the head own."""
    owned = {id(p) for part in parts for p in part.parameters()}
    outside = [name for name, p in model.named_parameters() if id(p) not in owned]
    if outside:
        more = f" and {len(outside) - 4} more" if len(outside) > 4 else ""
        raise _Uncuttable(
            f"parameters outside the embeddings, the layers and the head ({', '.join(outside[:4])}"
            f"{more}): the model computes with them outside its layers (such as a relative "
            "position bias the encoder computes once, as DeBERTa-v2 and MPNet do, a projection "
            "or a final norm), which embed | blocks | head would drop"
        )


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, so no draw from torch's generator) inside, the old mode after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _sample_batch(config: PretrainedConfig, token_types: bool) -> State:
    """``(input_ids, attention_mask, token_type_ids)``, each ``[2, 8]``: no padding ids in the
    ids, the second row padded after 5 tokens, the second half of each row token type 1 where
    the embeddings read token types. A fixed generator leaves torch's global one alone."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        input_ids[input_ids == pad] = (pad + 1) % config.vocab_size
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    token_type_ids = torch.zeros_like(input_ids)
    if token_types:
        token_type_ids[:, 4:] = 1
    return input_ids, attention_mask, token_type_ids


def _own_forward(model: PreTrainedModel, inputs: State, token_types: bool) -> State:
    """The model's own forward without gradients: the last layer's hidden states
    ``[B, S, D]`` and the output in the adapter's layout (``[B, C]`` logits, or ``[B, S, 2]``
    start and end logits)."""
    input_ids, attention_mask, token_type_ids = inputs
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_types:
        kwargs["token_type_ids"] = token_type_ids
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
    if hasattr(out, "start_logits"):
        return out.hidden_states[-1], torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.hidden_states[-1], out.logits


def check_cut(adapter: HFEncoderAdapter, label: str) -> None:
    """Refuse a cut whose forward (embed -> blocks -> head) differs from the model's own.

    Both run in eval mode on :func:`_sample_batch` (padding included, so a block that drops
    the mask fails), and the model returns to the mode it was in. The last layer's hidden
    states are compared as well as the output: a fresh head's small weights shrink a
    difference in the layers below the tolerance, which the hidden states keep.

    Args:
        adapter: the cut, built with :func:`discover_spec`'s spec.
        label: the field the model comes from, for messages (``model.weights='...'``).

    Raises:
        ConfigError: either forward fails, or the hidden states or outputs differ by more than
            ``1e-5``.
    """
    model, spec = adapter.model, adapter.spec
    inputs = _sample_batch(model.config, spec.token_types)
    with _eval_mode(model):
        try:
            theirs = _own_forward(model, inputs, spec.token_types)
        except Exception as err:  # any error of third-party code: quoted in the refusal
            raise _refusal(model.config, label, f"its own forward fails on a sample batch of "
                           f"{', '.join(adapter.input_names)} ({first_line(err)})") from None
        try:
            with torch.no_grad():
                state = run_blocks(adapter.blocks, adapter.embed(*inputs))
                ours = state[0], adapter.head(*state)
        except Exception as err:  # any error of third-party code: quoted in the refusal
            raise _refusal(model.config, label, f"the cut forward fails on a sample batch "
                           f"({type(err).__name__}: {first_line(err)})") from None
    for what, mine, own in zip(("last hidden states", "output"), ours, theirs):
        gap = (mine - own).abs().max().item()
        if not gap <= _CUT_ATOL:  # also refuses nan
            raise _refusal(
                model.config, label, f"the cut forward (embed -> blocks -> head) differs from "
                f"the model's own by {gap:.2g} in its {what} (more than {_CUT_ATOL:g}) on a "
                "sample batch: its layers need something the cut does not pass them"
            )
