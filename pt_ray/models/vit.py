"""Adapter that cuts a timm Vision Transformer (vit_*, deit_*) into embed | blocks | head."""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pt_ray.core.config import PICKLE_ERRORS, ConfigError, first_line
from pt_ray.models.base import State, Task, check_partition

__all__ = ["TimmViTAdapter", "load_timm_weights", "read_state_dict"]

logger = logging.getLogger(__name__)

# What VisionTransformer.forward_features and forward_head use, in the order they run.
_REQUIRED = ("patch_embed", "_pos_embed", "blocks", "norm", "head", "forward_head")
_EMBED_MODULES = ("patch_embed", "pos_drop", "patch_drop", "norm_pre")
_HEAD_MODULES = ("norm", "attn_pool", "fc_norm", "head_drop", "head", "head_dist")


class _TimmEmbed(nn.Module):
    """patch_embed -> _pos_embed (class/register/distillation tokens, pos embed, pos_drop)
    -> patch_drop -> norm_pre, exactly as ``VisionTransformer.forward_features`` begins."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # A plain list keeps the model unregistered: this module owns only the parts below.
        self._model_ref = [model]
        for name in _EMBED_MODULES:
            module = getattr(model, name, None)
            if isinstance(module, nn.Module):
                self.add_module(name, module)
        # Parameters held directly by the model: cls_token, pos_embed, reg_token, dist_token.
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)

    def forward(self, pixel_values: torch.Tensor) -> State:
        """``pixel_values[B, C, H, W]`` -> ``(tokens[B, T, D],)``."""
        model = self._model_ref[0]
        x = model.patch_embed(pixel_values)
        x = model._pos_embed(x)
        if hasattr(model, "patch_drop"):
            x = model.patch_drop(x)
        if hasattr(model, "norm_pre"):
            x = model.norm_pre(x)
        return (x,)


class _TimmBlock(nn.Module):
    """One timm block; takes and returns the 1-tuple state."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> State:
        """``tokens[B, T, D]`` -> ``(tokens[B, T, D],)``."""
        return (self.block(x),)


class _TimmHead(nn.Module):
    """Final norm, then the model's own ``forward_head`` (pooling, fc_norm, dist head)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model_ref = [model]
        for name in _HEAD_MODULES:
            module = getattr(model, name, None)
            if isinstance(module, nn.Module):
                self.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``tokens[B, T, D]`` -> ``logits[B, C]``."""
        model = self._model_ref[0]
        out = model.forward_head(model.norm(x))
        if isinstance(out, tuple):
            raise TypeError(
                f"{type(model).__name__}.forward_head returned {len(out)} outputs because "
                "distilled training is on; pt-ray trains without a teacher, so call "
                "model.set_distilled_training(False)"
            )
        return out


class TimmViTAdapter:
    """A timm ``VisionTransformer`` (or subclass, e.g. distilled DeiT) cut into layers.

    ``embed`` and ``head`` call the model's own ``_pos_embed`` and ``forward_head``, so class,
    register and distillation tokens, pooling, ``fc_norm`` and the distillation head behave
    exactly as in ``model(x)``. Every parameter stays the model's (no copies).

    Args:
        model: a timm Vision Transformer with ``patch_embed``, ``_pos_embed``, ``blocks``,
            ``norm``, ``head`` and ``forward_head``.
        name: the timm model name it was built from (default: its class name, for messages).
        create_kwargs: the keyword arguments ``timm.create_model`` built it with, kept so that
            the trained model can be exported as ``create_model(name, **create_kwargs)`` plus a
            state dict (None: unknown, and the model cannot be exported).

    Raises:
        ConfigError: the model lacks one of those attributes (it is not a ViT).
        ValueError: it has parameters outside them.
    """

    family = "timm"
    input_names = ("pixel_values",)

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str | None = None,
        create_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        label = name or type(model).__name__
        missing = [attr for attr in _REQUIRED if not hasattr(model, attr)]
        if missing:
            raise ConfigError(
                f"timm model {label!r} is not a VisionTransformer-like model: it lacks "
                f"{', '.join(missing)}; use a vit_* or deit_* model"
            )
        if not isinstance(model.blocks, (nn.Sequential, nn.ModuleList)):
            raise ConfigError(
                f"timm model {label!r}: blocks is a {type(model.blocks).__name__}, expected an "
                "nn.Sequential or nn.ModuleList of transformer blocks; use a vit_* or deit_* model"
            )
        self.task: Task = "classification"
        self.model = model
        self.name = name
        self.create_kwargs = dict(create_kwargs) if create_kwargs is not None else None
        self.embed = _TimmEmbed(model)
        self.blocks = nn.ModuleList(_TimmBlock(block) for block in model.blocks)
        self.head = _TimmHead(model)
        check_partition(model, self.embed, self.blocks, self.head, label=label)

    @property
    def num_layers(self) -> int:
        """``L``: the number of transformer blocks."""
        return len(self.blocks)

    @property
    def metric_name(self) -> str:
        """Top-1 accuracy."""
        return "accuracy"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of ``logits[B, C]`` against class ids ``[B]``, averaged over the batch."""
        return F.cross_entropy(output, target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the top-1 class equals the target."""
        return output.argmax(dim=-1) == target


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a ``torch.save`` file (``.pt/.pth/.bin``).

    A checkpoint that wraps its weights under ``"state_dict"`` or ``"model"`` is unwrapped.

    Raises:
        ConfigError: the file is missing, has an unknown suffix, cannot be read, or holds no
            state dict.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"model.weights={str(path)!r} is not a file; give a timm state-dict file "
            "(.pt, .pth, .bin or .safetensors)"
        )
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise ConfigError(
            f"model.weights={str(path)!r} has suffix {suffix!r}; timm weights must be a "
            "state-dict file ending in .pt, .pth, .bin or .safetensors"
        )
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    # Warnings from a file that then fails to load would print above the one-line error.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if suffix == ".safetensors":
                state = load_file(str(path), device="cpu")
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
        # A damaged or foreign file: safetensors' own error; torch.load's RuntimeError (not a
        # zip archive) or an unpickling error (objects other than tensors, truncated, garbage).
        except (SafetensorError, RuntimeError, *PICKLE_ERRORS) as err:
            why = ("objects other than tensors, or not a torch.save file"
                   if isinstance(err, pickle.UnpicklingError) else first_line(err))
            raise ConfigError(
                f"model.weights={str(path)!r} cannot be read as a {suffix} state dict ({why}); "
                "save one with torch.save(model.state_dict(), path) or "
                "safetensors.torch.save_file"
            ) from None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise ConfigError(
            f"model.weights={str(path)!r} does not hold a state dict of tensors; save one with "
            "torch.save(model.state_dict(), path)"
        )
    return dict(state)


def _classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Key prefixes of the classifier head(s), from timm's pretrained config."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("classifier", "head")
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(f"{n}." for n in names)


def load_timm_weights(model: nn.Module, path: str | Path) -> None:
    """Load a local state dict into ``model`` with strict checking.

    The one tolerated mismatch is the classifier head (other number of classes, or a headless
    checkpoint): everything else loads and the freshly initialised head is kept.

    Raises:
        ConfigError: the file cannot be read (see :func:`read_state_dict`), or a key outside
            the head is missing, unexpected or of another shape.
    """
    state = read_state_dict(path)
    own = model.state_dict()
    heads = _classifier_prefixes(model)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    head_keys = {
        k
        for k in (*missing, *unexpected, *(m.split(" ", 1)[0] for m in mismatched))
        if k.startswith(heads)
    }
    bad_missing = [k for k in missing if k not in head_keys]
    bad_unexpected = [k for k in unexpected if k not in head_keys]
    bad_shapes = [m for m in mismatched if m.split(" ", 1)[0] not in head_keys]
    if bad_missing or bad_unexpected or bad_shapes:
        parts = []
        if bad_missing:
            parts.append(f"missing keys {_first(bad_missing)}")
        if bad_unexpected:
            parts.append(f"unexpected keys {_first(bad_unexpected)}")
        if bad_shapes:
            parts.append(f"shape mismatches (file vs model) {_first(bad_shapes)}")
        raise ConfigError(
            f"model.weights={str(path)!r} does not fit the model: {'; '.join(parts)}; build the "
            "same architecture (model.name, depth, width, num_heads, patch_size, image size) "
            "as the checkpoint"
        )
    if head_keys:
        logger.info(
            "weights %s: classifier head does not match (%s); keeping a fresh head",
            path,
            ", ".join(sorted(head_keys)),
        )
    if any(p.is_meta for p in model.parameters()):
        return  # a preflight's shapes-only model: checked above, nothing to copy into
    model.load_state_dict({k: v for k, v in state.items() if k not in head_keys}, strict=False)


def _first(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more
