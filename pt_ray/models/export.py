"""A trained model in its library's own format, loadable without pt-ray.

timm: ``model.safetensors`` (the state dict) and ``config.json`` in the layout timm itself writes
for the Hugging Face Hub: ``architecture`` (the model name) and ``model_args`` (the keyword
arguments pt-ray passed to ``timm.create_model``), so that
``timm.create_model(architecture, pretrained=False, **model_args)`` then ``load_state_dict``
rebuilds it, and a timm with ``local-dir:`` sources also loads the folder directly.

Hugging Face: pt-ray trains the ``AutoModelFor...`` task model itself (see
:mod:`pt_ray.models.bert`), so its ``save_pretrained`` directory, with the run's tokenizer when
there was one, is the export; ``AutoModelFor....from_pretrained(folder)`` loads it.

Every export gets a ``README.txt`` with the lines of Python that load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from pt_ray.core.config import TIMM_EXPORT_CONFIG
from pt_ray.models.base import ModelAdapter

__all__ = ["README", "TIMM_CONFIG", "TIMM_WEIGHTS", "export_model", "folder_line", "load_exported"]

README = "README.txt"
TIMM_CONFIG = TIMM_EXPORT_CONFIG
TIMM_WEIGHTS = "model.safetensors"

_HF_AUTO = {
    "classification": "AutoModelForSequenceClassification",
    "question_answering": "AutoModelForQuestionAnswering",
}
"""The ``transformers`` auto class of each task's model (as built in :mod:`.registry`)."""

_PRETRAINED_KEYS = ("first_conv", "classifier", "fixed_input_size")
"""Architecture facts kept from the model's ``pretrained_cfg``; the rest (mean, std, crop, URLs,
licence) describes the pretrained weights of the name, not the weights trained here."""


def export_model(adapter: ModelAdapter, out: str | Path, *, tokenizer: Any = None,
                 source: str = "") -> Path:
    """Write ``adapter``'s model into ``out`` in its library's format (see the module docstring).

    Args:
        adapter: the trained model (timm adapters must carry their ``create_kwargs``).
        out: the folder to write (created; files of an earlier export are replaced).
        tokenizer: a Hugging Face tokenizer to save beside the model (Hugging Face only).
        source: what the model is, for the README's first line (e.g. the run folder).

    Returns:
        ``out``.

    Raises:
        ValueError: a timm model built without its ``create_model`` arguments, or arguments
            that JSON cannot hold.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if adapter.family == "timm":
        lines = _export_timm(adapter, out)
    else:
        lines = _export_hf(adapter, out, tokenizer)
    origin = f"Trained by pt-ray ({source})." if source else "Trained by pt-ray."
    # The whole README is Python that runs as it stands (the notes are comments).
    (out / README).write_text(
        f"# {origin} Load it without pt-ray:\n\n{folder_line(out)}\n\n" + "\n".join(lines) + "\n"
    )
    return out


def folder_line(folder: Path) -> str:
    """The README's first line of Python: where the export is (rewritten when it is copied)."""
    return f"folder = {str(Path(folder).resolve())!r}  # this folder"


def _export_timm(adapter: Any, out: Path) -> list[str]:
    from safetensors.torch import save_file

    model = adapter.model
    kwargs = getattr(adapter, "create_kwargs", None)
    name = getattr(adapter, "name", None) or model.pretrained_cfg.get("architecture")
    if kwargs is None or not name:
        raise ValueError(
            f"{type(model).__name__} was built outside pt-ray's model registry, so its "
            "timm.create_model arguments are unknown; build it with build_adapter, or pass "
            "TimmViTAdapter(model, name=..., create_kwargs=...)"
        )
    try:
        json.dumps(kwargs)
    except TypeError as err:
        raise ValueError(
            f"timm.create_model arguments {kwargs} cannot be written as JSON ({err}); give "
            "model.overrides plain values"
        ) from None
    architecture = name.partition(".")[0]  # a pretrained tag names weights, not a model
    pretrained = {k: model.pretrained_cfg[k] for k in _PRETRAINED_KEYS
                  if k in model.pretrained_cfg}
    config = {
        "architecture": architecture,
        "num_classes": model.num_classes,
        "num_features": model.num_features,
        "model_args": kwargs,
        "pretrained_cfg": {**pretrained, "num_classes": model.num_classes,
                           "input_size": _input_size(model, kwargs)},
    }
    (out / TIMM_CONFIG).write_text(json.dumps(config, indent=2))
    # safetensors wants contiguous tensors that share no memory.
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(out / TIMM_WEIGHTS), metadata={"format": "pt"})
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return [
        "import timm",
        "from safetensors.torch import load_file",
        "",
        f"model = timm.create_model({architecture!r}, pretrained=False{args})",
        f'model.load_state_dict(load_file(f"{{folder}}/{TIMM_WEIGHTS}"))',
        "model.eval()",
        "",
        f"# The same arguments are in {TIMM_CONFIG} (architecture, model_args); a timm with",
        "# local-dir: sources also loads",
        '# timm.create_model(f"local-dir:{folder}", pretrained=True).',
        "# Inputs are images preprocessed as the run's data section did (size, normalisation).",
    ]


def _input_size(model: nn.Module, kwargs: dict[str, Any]) -> list[int]:
    """``[channels, height, width]`` of the inputs the model was built for."""
    default = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    size = kwargs.get("img_size", default[1:])
    size = (size, size) if isinstance(size, int) else tuple(size)
    return [int(kwargs.get("in_chans", default[0])), *(int(s) for s in size)]


def _export_hf(adapter: Any, out: Path, tokenizer: Any) -> list[str]:
    auto = _HF_AUTO[adapter.task]
    adapter.model.save_pretrained(str(out))
    if tokenizer is None:
        return [f"from transformers import {auto}", "",
                f"model = {auto}.from_pretrained(folder)", "",
                "# No tokenizer is saved: the run had none (data.tokenizer, or one in "
                "model.weights)."]
    tokenizer.save_pretrained(str(out))
    return [f"from transformers import {auto}, AutoTokenizer", "",
            f"model = {auto}.from_pretrained(folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)"]


def load_exported(folder: str | Path) -> nn.Module:
    """Load an export with timm or transformers alone, in eval mode.

    Raises:
        FileNotFoundError: ``folder`` holds no export (no ``config.json``).
    """
    folder = Path(folder)
    config_path = folder / TIMM_CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found: {folder} is no pt-ray model export; write one with "
            "`pt-ray export RUN_DIR`"
        )
    config = json.loads(config_path.read_text())
    if "architecture" in config:  # timm's layout (transformers writes "architectures")
        import timm
        from safetensors.torch import load_file

        model = timm.create_model(config["architecture"], pretrained=False,
                                  **config.get("model_args", {}))
        model.load_state_dict(load_file(str(folder / TIMM_WEIGHTS)))
        return model.eval()
    import transformers

    arch = (config.get("architectures") or [""])[0]
    auto = next((a for suffix, a in (("ForQuestionAnswering", _HF_AUTO["question_answering"]),
                                     ("ForSequenceClassification", _HF_AUTO["classification"]))
                 if arch.endswith(suffix)), "AutoModel")
    return getattr(transformers, auto).from_pretrained(str(folder)).eval()
