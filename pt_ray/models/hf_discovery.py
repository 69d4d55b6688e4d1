"""Find the BERT pattern in a Hugging Face encoder whose type is not in the named table: its
embeddings, its one list of identical layers and its head; refuse with the reason where the
pattern is missing, and check the cut against the model's own forward."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from pt_ray.core.config import ConfigError, first_line
from pt_ray.models.base import State, Task, run_blocks
from pt_ray.models.bert import (
    BERT_FIELDS,
    HFConfigFields,
    HFEncoderAdapter,
    HFEncoderSpec,
    build_head,
    layer_list,
)

__all__ = ["check_cut", "discover_spec", "encoder_fields"]


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
    """Check that a config of a type outside :data:`~pt_ray.models.bert.HF_ENCODERS` is a
    bidirectional encoder, and name its fields.

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
    shape = (BERT_FIELDS.depth, BERT_FIELDS.width, BERT_FIELDS.num_heads, BERT_FIELDS.ffn)
    missing = [name for name in shape if getattr(config, name, None) is None]
    if missing:
        raise _refusal(
            config, label, f"its config has no {', '.join(missing)} (BERT's shape fields, which "
            "pt-ray reads)"
        )
    dropouts = tuple(name for name in BERT_FIELDS.dropouts if hasattr(config, name))
    return HFConfigFields(*shape, dropouts=dropouts)


def discover_spec(model: PreTrainedModel, task: Task, label: str) -> HFEncoderSpec:
    """Find the BERT pattern in a task model whose type is not in
    :data:`~pt_ray.models.bert.HF_ENCODERS`.

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
        layers = layer_list(base, spec, task)
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
        return build_head(model, base, spec, task)
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
