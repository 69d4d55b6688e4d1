"""Build Hugging Face encoders for :func:`pt_ray.models.registry.build_adapter`: by type from a
config, or cut from a local ``save_pretrained`` directory.

Kept apart from the registry so that only runs of ``model.family=hf`` import transformers.
"""

from __future__ import annotations

import difflib
import logging
import pickle
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError, ModelConfig, first_line
from pt_ray.models.bert import HF_ENCODERS, HFConfigFields, HFEncoderAdapter, HFEncoderSpec
from pt_ray.models.hf_discovery import check_cut, discover_spec, encoder_fields
from pt_ray.models.registry import _merge, _unbuildable

__all__ = ["build_hf"]

logger = logging.getLogger(__name__)


def _hf_type(cfg: ModelConfig) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = cfg.name.lower().replace("_", "-")
    if name in HF_ENCODERS:
        return name
    named = ", ".join(sorted(HF_ENCODERS))
    if name in CONFIG_MAPPING_NAMES or cfg.name in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"model.name={cfg.name!r} is a transformers model type that pt-ray builds by name "
            f"only for {named}: other encoders are cut from a local directory, where their "
            "layers are found and checked against the model's own forward; save one with "
            "save_pretrained and set model.weights to it"
        )
    # Hub ids such as "bert-base-uncased" start with their type.
    prefixed = sorted((t for t in HF_ENCODERS if name.startswith(t)), key=len, reverse=True)
    close = prefixed[:1] or difflib.get_close_matches(name, list(HF_ENCODERS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(
        f"model.name={cfg.name!r} is not a supported Hugging Face encoder type; {hint}"
        f"choose one of {named} (or set model.weights to a local model directory)"
    )


def _check_weights_dir(path: Path) -> None:
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(
            f"model.weights={str(path)!r} is not a Hugging Face model directory; it must hold "
            "config.json and the weights (model.safetensors or pytorch_model.bin), as written "
            "by save_pretrained"
        )


def build_hf(
    cfg: ModelConfig,
    num_classes: int | None,
    task: str,
    vocab_size: int | None,
    seq_len: int | None,
) -> HFEncoderAdapter:
    from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

    if task == "question_answering" and num_classes not in (None, 2):
        raise ValueError(
            f"num_classes={num_classes} for task='question_answering'; the QA head always has "
            "2 outputs (start, end), so pass None"
        )
    num_labels = 2 if task == "question_answering" else num_classes
    overrides = dict(cfg.overrides)
    attn = overrides.pop("attn_implementation", None)
    model_kwargs = {"attn_implementation": attn} if attn else {}
    auto = (
        AutoModelForQuestionAnswering
        if task == "question_answering"
        else AutoModelForSequenceClassification
    )
    if cfg.weights is None:
        model = _hf_from_name(cfg, auto, num_labels, vocab_size, seq_len, overrides, model_kwargs)
        return HFEncoderAdapter(model, task)  # type: ignore[arg-type]
    return _hf_from_weights(cfg, auto, task, num_labels, vocab_size, seq_len, overrides,
                            model_kwargs)


def _hf_from_name(
    cfg: ModelConfig,
    auto: Any,
    num_labels: int | None,
    vocab_size: int | None,
    seq_len: int | None,
    overrides: dict[str, Any],
    model_kwargs: dict[str, Any],
) -> Any:
    """A fresh model of a type in ``HF_ENCODERS``, built from its config."""
    from transformers import AutoConfig

    model_type = _hf_type(cfg)
    spec = HF_ENCODERS[model_type]
    kwargs = _arch_kwargs(cfg, spec.fields, AutoConfig.for_model(model_type))
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    _merge(kwargs, overrides, _field_names(spec.fields))
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        _fit_positions(config, spec, seq_len, grow=True)
        return auto.from_config(config, **model_kwargs)
    except (ValueError, TypeError, AssertionError, KeyError) as err:
        raise ConfigError(_unbuildable(cfg, kwargs, err)) from None


def _hf_from_weights(
    cfg: ModelConfig,
    auto: Any,
    task: str,
    num_labels: int | None,
    vocab_size: int | None,
    seq_len: int | None,
    overrides: dict[str, Any],
    model_kwargs: dict[str, Any],
) -> HFEncoderAdapter:
    """The model in the local directory ``cfg.weights``. A type outside ``HF_ENCODERS`` is cut
    where its BERT pattern is found, and only if the cut computes the model's own forward."""
    from transformers import AutoConfig

    path = Path(cfg.weights)  # type: ignore[arg-type]
    label = f"model.weights={str(path)!r}"
    _check_weights_dir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:  # transformers' words for an unreadable config
        raise ConfigError(
            f"{label}: config.json cannot be read ({first_line(err)}); point model.weights at "
            "a directory written by save_pretrained"
        ) from None
    model_type = config.model_type
    asked = cfg.name.lower().replace("_", "-")
    if asked in HF_ENCODERS and asked != model_type:
        raise ConfigError(
            f"model.name={cfg.name!r} but {label} holds a {model_type!r} model; set "
            f"model.name={model_type!r}"
        )
    spec = HF_ENCODERS.get(model_type)
    fields = spec.fields if spec else encoder_fields(config, label)
    _check_auto_class(auto, model_type, label)
    kwargs = _pretrained_kwargs(cfg, fields, config)
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    _merge(kwargs, overrides, _field_names(fields))
    for key, value in kwargs.items():
        setattr(config, key, value)
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ConfigError(
            f"vocab_size={vocab_size} exceeds the checkpoint's vocab_size={config.vocab_size} "
            f"in {str(path)!r}; use the checkpoint's tokenizer"
        )
    if spec is not None:
        _fit_positions(config, spec, seq_len, grow=False)
        model = _from_pretrained(auto, path, config, model_kwargs)
        return HFEncoderAdapter(model, task, spec)  # type: ignore[arg-type]
    model = _from_pretrained(auto, path, config, model_kwargs)
    found = discover_spec(model, task, label)  # type: ignore[arg-type]
    _fit_positions(config, found, seq_len, grow=False)
    adapter = HFEncoderAdapter(model, task, found)  # type: ignore[arg-type]
    check_cut(adapter, label)
    logger.info("%s: %s cut at %s.%s (%d layers), matching its own forward", label, model_type,
                found.base, ".".join(found.layers), adapter.num_layers)
    return adapter


def _check_auto_class(auto: Any, model_type: str, label: str) -> None:
    """Refuse a model type that has no ``auto`` task class in transformers."""
    from transformers.models.auto import modeling_auto

    names = (modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES
             if auto.__name__.endswith("QuestionAnswering")
             else modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    if model_type not in names:
        raise ConfigError(
            f"{label} holds a {model_type!r} model, for which transformers has no "
            f"{auto.__name__}; choose another task or model type"
        )


def _from_pretrained(auto: Any, path: Path, config: Any, model_kwargs: dict[str, Any]) -> Any:
    """``auto.from_pretrained`` of a local directory; a missing or unreadable weights file is a
    ConfigError naming it."""
    from safetensors import SafetensorError

    try:
        return auto.from_pretrained(path, config=config, local_files_only=True, **model_kwargs)
    # transformers reports missing weights as OSError, a damaged safetensors file as
    # SafetensorError, a damaged torch.save file as RuntimeError, UnpicklingError or EOFError.
    except (OSError, RuntimeError, SafetensorError, pickle.UnpicklingError, EOFError) as err:
        raise ConfigError(
            f"model.weights={str(path)!r}: the weights cannot be loaded ({first_line(err)}); it "
            "must hold model.safetensors or pytorch_model.bin as written by save_pretrained"
        ) from None


def _field_names(fields: HFConfigFields) -> dict[str, str]:
    """Hugging Face config field -> the ``ModelConfig`` field that sets it."""
    names = {
        fields.depth: "model.depth",
        fields.width: "model.width",
        fields.num_heads: "model.num_heads",
        fields.ffn: "model.mlp_ratio",
        "num_labels": "num_classes",
        "vocab_size": "vocab_size",
    }
    return names | dict.fromkeys(fields.dropouts, "model.dropout")


def _arch_kwargs(cfg: ModelConfig, fields: HFConfigFields, defaults: Any) -> dict[str, Any]:
    """Config fields for a model built from scratch."""
    kwargs: dict[str, Any] = {}
    if cfg.depth is not None:
        kwargs[fields.depth] = cfg.depth
    if cfg.width is not None:
        kwargs[fields.width] = cfg.width
    if cfg.num_heads is not None:
        kwargs[fields.num_heads] = cfg.num_heads
    if cfg.mlp_ratio is not None:
        width = cfg.width if cfg.width is not None else getattr(defaults, fields.width)
        kwargs[fields.ffn] = round(width * cfg.mlp_ratio)
    if cfg.dropout is not None:
        kwargs.update(dict.fromkeys(fields.dropouts, cfg.dropout))
    return kwargs


def _pretrained_kwargs(cfg: ModelConfig, fields: HFConfigFields, config: Any) -> dict[str, Any]:
    """Config changes allowed on a checkpoint: fewer layers and other dropout; the shape fields
    must match it."""
    width = getattr(config, fields.width)
    fixed = {
        "model.width": (cfg.width, width),
        "model.num_heads": (cfg.num_heads, getattr(config, fields.num_heads)),
        "model.mlp_ratio": (cfg.mlp_ratio, getattr(config, fields.ffn) / width),
    }
    for field, (asked, actual) in fixed.items():
        if asked is not None and abs(asked - actual) > 1e-9:
            raise ConfigError(
                f"{field}={asked} differs from the checkpoint in {str(cfg.weights)!r} "
                f"({actual:g}); leave {field} unset to use the checkpoint's"
            )
    kwargs: dict[str, Any] = {}
    depth = getattr(config, fields.depth)
    if cfg.depth is not None:
        if cfg.depth > depth:
            raise ConfigError(
                f"model.depth={cfg.depth} exceeds the checkpoint's {depth} layers in "
                f"{str(cfg.weights)!r}; choose at most {depth} (the first layers are kept)"
            )
        kwargs[fields.depth] = cfg.depth
    if cfg.dropout is not None:
        if not fields.dropouts:
            raise ConfigError(
                f"model.dropout={cfg.dropout} cannot be set: the config in {str(cfg.weights)!r} "
                "has no hidden_dropout_prob or attention_probs_dropout_prob; leave it unset"
            )
        kwargs.update(dict.fromkeys(fields.dropouts, cfg.dropout))
    return kwargs


def _fit_positions(config: Any, spec: HFEncoderSpec, seq_len: int | None, *, grow: bool) -> None:
    """Make sure the position table covers ``seq_len`` tokens (RoBERTa's starts after padding)."""
    if seq_len is None:
        return
    needed = seq_len + (config.pad_token_id + 1 if spec.padding_positions else 0)
    if config.max_position_embeddings >= needed:
        return
    if not grow:
        raise ConfigError(
            f"seq_len={seq_len} needs {needed} positions but the checkpoint has "
            f"max_position_embeddings={config.max_position_embeddings}; choose "
            f"data.seq_len <= {seq_len - needed + config.max_position_embeddings}"
        )
    config.max_position_embeddings = needed
