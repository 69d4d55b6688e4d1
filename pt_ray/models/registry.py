"""Build a model adapter from a ``ModelConfig``: timm ViTs and Hugging Face encoders."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

import torch

from pt_ray.core.config import ConfigError, ModelConfig, first_line, timm_export_config
from pt_ray.models.base import ModelAdapter
from pt_ray.models.export import TIMM_WEIGHTS
from pt_ray.models.vit import TimmViTAdapter, load_timm_weights

__all__ = ["build_adapter"]

logger = logging.getLogger(__name__)

_TASKS = ("classification", "question_answering")


def build_adapter(
    cfg: ModelConfig,
    *,
    num_classes: int | None,
    task: str = "classification",
    image_size: int | None = None,
    in_chans: int | None = None,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
) -> ModelAdapter:
    """Build the model ``cfg`` describes, load its local weights, and wrap it in an adapter.

    Seeds torch's global generator with ``seed`` first, so every rank builds identical weights
    (including any fresh head on top of pretrained weights). Nothing is downloaded.

    Args:
        cfg: which model; architecture fields left None keep the named model's defaults.
        num_classes: classes of the classifier head (None: the model's default). Must be None
            or 2 for question answering.
        task: ``"classification"`` or ``"question_answering"`` (Hugging Face only).
        image_size: input side in pixels (timm; None: the model's default).
        in_chans: input channels (timm; None: the model's default).
        vocab_size: tokenizer vocabulary size (Hugging Face; None: the config's default).
        seq_len: longest token sequence; the position table is grown to fit it (Hugging Face).
        seed: seed for the model's random initialisation.

    Returns:
        The adapter, with its model in train mode.

    Raises:
        ConfigError: an unknown model name or type (with the close or supported ones), a task
            the family does not support, conflicting overrides, model fields the architecture
            cannot be built with, weights that are missing, unreadable or do not fit, or a
            Hugging Face model directory of a type that cannot be cut (with the reason).
        ValueError: ``task`` is neither classification nor question answering.
    """
    if task not in _TASKS:
        raise ValueError(f"task={task!r} is not supported; choose one of {', '.join(_TASKS)}")
    torch.manual_seed(seed)
    if cfg.family == "timm":
        adapter: ModelAdapter = _build_timm(cfg, num_classes, task, image_size, in_chans)
    else:
        # Imported only here: transformers takes seconds of CPU to import, which a timm run's
        # driver and every one of its workers would otherwise pay at start-up.
        from pt_ray.models.hf_build import build_hf

        adapter = build_hf(cfg, num_classes, task, vocab_size, seq_len)
    adapter.model.train()
    params = sum(p.numel() for p in adapter.model.parameters())
    logger.info(
        "built %s %s for %s: L=%d blocks, %.2fM parameters%s",
        cfg.family,
        type(adapter.model).__name__,
        task,
        adapter.num_layers,
        params / 1e6,
        f", weights from {cfg.weights}" if cfg.weights else "",
    )
    return adapter


def _merge(kwargs: dict[str, Any], overrides: dict[str, Any], names: dict[str, str]) -> None:
    """Add ``overrides`` to ``kwargs``, refusing keys that a config field already set."""
    for key, value in overrides.items():
        if key in kwargs and kwargs[key] != value:
            field = names.get(key, key)
            raise ConfigError(
                f"model.overrides[{key!r}]={value!r} conflicts with {field}={kwargs[key]!r}; "
                "set it in one place"
            )
        kwargs[key] = value


def _build_timm(
    cfg: ModelConfig,
    num_classes: int | None,
    task: str,
    image_size: int | None,
    in_chans: int | None,
) -> TimmViTAdapter:
    import timm

    if task != "classification":
        raise ConfigError(
            f"task={task!r} is not supported for model.family=timm; timm models classify "
            "images (task='classification'): use model.family=hf for question answering"
        )
    if not timm.is_model(cfg.name):
        close = difflib.get_close_matches(cfg.name, timm.list_models(), n=5, cutoff=0.6)
        if not close:
            close = timm.list_models("vit_tiny*")[:3] + timm.list_models("deit_tiny*")[:2]
        raise ConfigError(
            f"model.name={cfg.name!r} is not a timm model; close names: {', '.join(close)}"
        )
    fields = {
        "num_classes": ("num_classes", num_classes),
        "img_size": ("image size", image_size),
        "in_chans": ("input channels", in_chans),
        "depth": ("model.depth", cfg.depth),
        "embed_dim": ("model.width", cfg.width),
        "num_heads": ("model.num_heads", cfg.num_heads),
        "mlp_ratio": ("model.mlp_ratio", cfg.mlp_ratio),
        "patch_size": ("model.patch_size", cfg.patch_size),
        "drop_rate": ("model.dropout", cfg.dropout),
        "proj_drop_rate": ("model.dropout", cfg.dropout),
        "attn_drop_rate": ("model.dropout", cfg.dropout),
    }
    kwargs = {k: v for k, (_, v) in fields.items() if v is not None}
    _merge(kwargs, dict(cfg.overrides), {k: f for k, (f, _) in fields.items()})
    weights = None if cfg.weights is None else Path(cfg.weights)
    export = None if weights is None else timm_export_config(weights)
    if export is not None:
        kwargs = _with_export_args(cfg, kwargs, export)
        if weights is not None and weights.is_dir():
            weights = weights / TIMM_WEIGHTS
    elif weights is not None and weights.is_dir():
        raise ConfigError(
            f"model.weights={str(weights)!r} is a folder but not a pt-ray timm export (no "
            "config.json with architecture and model_args); give a state-dict file, or the "
            "model/ folder of a pt-ray run (`pt-ray export RUN_DIR` writes one)"
        )
    try:
        model = timm.create_model(cfg.name, pretrained=False, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"timm model {cfg.name!r} rejected the arguments {sorted(kwargs)}: "
            f"{first_line(err)}; use a vit_* or deit_* model, or drop the unsupported model "
            "fields/overrides"
        ) from None
    except (AssertionError, ValueError, RuntimeError, KeyError) as err:
        # timm checks its arguments with asserts (e.g. width divisible by the heads) and looks
        # names up (an unknown activation in model.overrides is a KeyError).
        raise ConfigError(_unbuildable(cfg, kwargs, err)) from None
    if weights is not None:
        load_timm_weights(model, weights)
    return TimmViTAdapter(model, name=cfg.name, create_kwargs=kwargs)


_EXPORT_SHAPE = {"depth": "depth", "embed_dim": "width", "num_heads": "num_heads",
                 "mlp_ratio": "mlp_ratio", "patch_size": "patch_size"}
"""``timm.create_model`` argument -> the ``model`` field that sets it, for the shape fields."""

_EXPORT_INPUT = {"img_size": "set data.image_size={}",
                 "in_chans": "train on images with {} channels"}
"""Input arguments of an export that its position table and patch projection were built for,
and the fix when the dataset's differ."""


def _with_export_args(cfg: ModelConfig, kwargs: dict[str, Any],
                      export: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` completed with a timm export's ``create_model`` arguments: the config's (and
    the dataset's) values win where set; the shape fields and the input must match the export.

    Raises:
        ConfigError: another architecture, a shape field or input that differs from the export.
    """
    label = f"the checkpoint in {str(cfg.weights)!r}"
    arch = export["architecture"]
    if cfg.name.partition(".")[0] != arch:
        raise ConfigError(f"model.name={cfg.name!r} but {label} is a {arch!r} model; set "
                          f"model.name={arch}")
    args = dict(export.get("model_args", {}))
    for key, field in _EXPORT_SHAPE.items():
        asked = getattr(cfg, field)
        if key in args and asked is not None and abs(float(asked) - float(args[key])) > 1e-9:
            raise ConfigError(f"model.{field}={asked} differs from {label} ({args[key]}); leave "
                              f"model.{field} unset to use the checkpoint's")
    for key, fix in _EXPORT_INPUT.items():
        if key in args and key in kwargs and args[key] != kwargs[key]:
            raise ConfigError(f"{label} was built for {key}={args[key]} but the dataset gives "
                              f"{key}={kwargs[key]}; {fix.format(args[key])}")
    # The classifier head follows the dataset (a head of another size is replaced on load).
    args.pop("num_classes", None)
    return {**args, **kwargs}


def _unbuildable(cfg: ModelConfig, kwargs: dict[str, Any], err: BaseException) -> str:
    """The one-line error for model fields the architecture cannot be built with."""
    why = first_line(err)
    if "head" in why:  # the width is not a multiple of the heads (timm's and HF's wording)
        fix = ("set model.num_heads to a divisor of the width" if cfg.num_heads is None else
               f"set model.width to a multiple of model.num_heads={cfg.num_heads}")
    else:
        fix = ("change the model fields (model.depth, width, num_heads, mlp_ratio, "
               "patch_size) or model.overrides")
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
    return (f"model.name={cfg.name!r} cannot be built with {shown or 'its defaults'}: {why}; "
            f"{fix}")
