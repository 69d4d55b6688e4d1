"""Compiled Transformer blocks (``pipeline.compile``).

Each block is compiled in place, once (``nn.Module.compile``): stages are cut from the same
block objects at every plan, so a re-plan never compiles again. Torch keeps one graph per
grad mode (trained blocks, and the frozen prefix under ``no_grad``) and, once a block sees a
second batch size (micro-batch sizes change with R and M), one with a dynamic batch dimension.
"""

from __future__ import annotations

import logging

import torch

from pt_ray.models.base import ModelAdapter

__all__ = ["compile_blocks"]

logger = logging.getLogger(__name__)


def compile_blocks(adapter: ModelAdapter, mode: str, device: torch.device,
                   announce: bool = True) -> bool:
    """Compile every block of ``adapter`` when ``mode`` asks for it (``on``, or ``auto`` on
    CUDA); returns whether it did. ``announce``: log the choice (rank 0)."""
    on = mode == "on" or (mode == "auto" and device.type == "cuda")
    if announce:
        logger.info("pipeline.compile=%s on %s: %s", mode, device.type,
                    f"compiling each of the {len(adapter.blocks)} blocks on first use" if on
                    else "blocks run eagerly")
    if on:
        for block in adapter.blocks:
            block.compile()
    return on
