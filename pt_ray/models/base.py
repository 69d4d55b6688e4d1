"""The ModelAdapter protocol: a Transformer cut into embed | blocks[0..L) | head.

Every part of pt-ray that touches a model (the reference trainer, the profiler, pipeline stages,
state migration) goes through this seam, so the engine never needs to know whether it is running
a timm ViT or a Hugging Face encoder.

Conventions shared by all adapters:

* The model's inputs are a tuple of tensors, in the order of ``adapter.input_names`` (ViT:
  ``(pixel_values,)``; BERT family: ``(input_ids, attention_mask, token_type_ids)``).
* ``embed(*inputs)`` returns the *state*: a tuple of tensors that flows between blocks. ViT:
  ``(hidden[B, T, D],)``; BERT family: ``(hidden[B, S, D], attention_mask[B, S] float)``. The
  attention mask travels with the hidden states through every block (the 2021 code dropped it).
* ``blocks[i](*state)`` returns the next state (same structure).
* ``head(*state)`` returns the output tensor: logits ``[B, C]`` for classification,
  ``[B, S, 2]`` (start, end logits) for question answering.
* Targets are one tensor: class ids ``[B]`` (int64), or ``[B, 2]`` start/end positions for QA.

Layer names used for parameters, optimizer state, checkpoints and costs:
``"embed"``, ``"block.0"`` ... ``"block.{L-1}"``, ``"head"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

State = tuple[torch.Tensor, ...]
Task = Literal["classification", "question_answering"]


@runtime_checkable
class ModelAdapter(Protocol):
    """A model cut into embed | blocks | head, sharing parameters with ``model``."""

    family: str
    """``"timm"`` or ``"hf"``."""
    task: Task
    model: nn.Module
    """The wrapped model; owns every parameter of embed, blocks and head."""
    embed: nn.Module
    """``forward(*inputs) -> State``."""
    blocks: nn.ModuleList
    """``L`` modules, each ``forward(*state) -> State``."""
    head: nn.Module
    """``forward(*state) -> Tensor`` (logits)."""
    input_names: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        """``L``: the number of transformer blocks (embedding and head not counted)."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch (a scalar)."""
        ...

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-sample correctness ``[B]`` (bool) for the eval metric."""
        ...

    @property
    def metric_name(self) -> str:
        """Name of the eval metric that ``correct`` averages to (e.g. ``"accuracy"``)."""
        ...


def layer_names(num_layers: int) -> list[str]:
    """Names of all layers in pipeline order: embed, block.0 .. block.{L-1}, head."""
    return ["embed", *(f"block.{i}" for i in range(num_layers)), "head"]


def layer_module(adapter: ModelAdapter, name: str) -> nn.Module:
    """The module behind a layer name (see :func:`layer_names`)."""
    if name == "embed":
        return adapter.embed
    if name == "head":
        return adapter.head
    if name.startswith("block."):
        return adapter.blocks[int(name.split(".", 1)[1])]
    raise KeyError(f"unknown layer name {name!r}; expected 'embed', 'block.<i>' or 'head'")


def iter_layers(adapter: ModelAdapter) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every layer in pipeline order."""
    for name in layer_names(adapter.num_layers):
        yield name, layer_module(adapter, name)


def frozen_layer_names(num_frozen: int) -> list[str]:
    """Layers in the frozen prefix of length ``num_frozen``: embed + blocks 0..n-1 (none if 0)."""
    if num_frozen <= 0:
        return []
    return ["embed", *(f"block.{i}" for i in range(num_frozen))]


def run_blocks(blocks: Sequence[nn.Module], state: State, recompute: bool = False) -> State:
    """Run ``state`` through ``blocks`` in order.

    Args:
        blocks: the blocks.
        state: the state entering the first block.
        recompute: activation checkpointing: while gradients are enabled, each block keeps only
            its input for backward and runs its forward again there
            (``torch.utils.checkpoint``, non-reentrant, so it works under DDP and in the
            pipeline schedules' backward; the random state is restored for the second forward,
            so dropout draws the same masks and the gradients equal those without it).
    """
    recompute = recompute and torch.is_grad_enabled()
    for block in blocks:
        if recompute:
            state = checkpoint(block, *state, use_reentrant=False)
        else:
            state = block(*state)
    return state


def forward_layers(adapter: ModelAdapter, inputs: State) -> torch.Tensor:
    """``head(blocks(embed(inputs)))``: the whole model through the adapter's cut."""
    return adapter.head(*run_blocks(adapter.blocks, adapter.embed(*inputs)))


def check_partition(
    model: nn.Module,
    embed: nn.Module,
    blocks: Sequence[nn.Module],
    head: nn.Module,
    *,
    label: str = "model",
) -> None:
    """Check that embed, blocks and head together own every parameter of ``model`` exactly once.

    Freezing, migration and gradient sync work layer by layer, so a parameter that no layer owns
    would never train, and one that two layers share could be frozen and trained at once.

    Args:
        model: the wrapped model.
        embed: the adapter's embed module.
        blocks: the adapter's block modules.
        head: the adapter's head module.
        label: the model's name for the error message.

    Raises:
        ValueError: naming the parameters that no layer, or more than one layer, owns, or that
            a layer holds without the model holding them.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, str] = {}
    shared: list[str] = []
    foreign: list[str] = []
    layers = [("embed", embed), *((f"block.{i}", b) for i, b in enumerate(blocks)), ("head", head)]
    for layer, module in layers:
        for pname, param in module.named_parameters():
            if id(param) not in names:
                foreign.append(f"{layer}:{pname}")
            elif id(param) in owner:
                shared.append(f"{names[id(param)]} ({owner[id(param)]} and {layer})")
            else:
                owner[id(param)] = layer
    orphans = [n for pid, n in names.items() if pid not in owner]
    problems = []
    if orphans:
        problems.append(f"parameters in no layer: {', '.join(orphans[:8])}")
    if shared:
        problems.append(f"parameters in two layers: {', '.join(shared[:8])}")
    if foreign:
        problems.append(f"layer parameters the model does not hold: {', '.join(foreign[:8])}")
    if problems:
        raise ValueError(
            f"{label} cannot be cut into embed | blocks | head: {'; '.join(problems)}; this "
            "architecture needs its own adapter"
        )
