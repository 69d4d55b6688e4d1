"""Mixed precision: the compute dtype, autocast, and one loss scale for a pipelined model.

Torch runtime layer. Master weights and optimizer state stay fp32 in every mode. ``bf16`` and
``fp16`` run every forward (training stages, evaluation, profiling, the frozen prefix) under
``torch.autocast``; the states that leave a stage (to the next stage, or into the activation
cache) are cast to the compute dtype, so bf16 halves the bytes sent and cached. Logits are
returned in fp32 so the loss is computed in fp32.

``fp16`` adds loss scaling with one scale for the whole model (:class:`LossScaler`): every rank
multiplies its loss by the same scale; after the data-parallel reduction the squared gradient
norms are summed over the pipeline, so an inf/nan found on any rank reaches every rank through
the same collectives the clipping already needs, and every rank skips the step and backs the
scale off identically.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pt_ray.core.devices import resolve_precision as resolve_name
from pt_ray.models.base import State

__all__ = ["LossScaler", "Precision", "resolve_precision"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A resolved precision on one device type.

    Attributes:
        name: ``fp32``, ``bf16`` or ``fp16``.
        device_type: ``cpu`` or ``cuda`` (autocast's device type).
    """

    name: str
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations between stages and in the cache)."""
        return _DTYPES[self.name]

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16)."""
        return self.name == "fp16"

    def autocast(self):
        """The forward's autocast context (a no-op in fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def cast_state(self, state: State) -> State:
        """``state`` with its floating tensors in the compute dtype (unchanged in fp32)."""
        if not self.mixed:
            return state
        return tuple(t.to(self.dtype) if t.is_floating_point() else t for t in state)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The model output for the loss: fp32."""
        return out.float() if self.mixed and out.is_floating_point() else out


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The precision a run uses on ``device``: ``auto`` is bf16 on GPUs, fp32 on CPUs.

    Raises:
        ValueError: ``bf16`` asked on a GPU without bf16 support, or an unknown name.
    """
    name = resolve_name(name, device.type)
    if name not in _DTYPES:
        raise ValueError(f"precision={name!r}: choose auto, fp32, bf16 or fp16")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision=bf16: {torch.cuda.get_device_name(device)} does not support bfloat16; "
            "set precision=fp16 (with loss scaling) or fp32"
        )
    return Precision(name, device.type)


class LossScaler:
    """One dynamic loss scale for the whole model (every stage and replica holds the same one).

    The scale starts at ``init``; a step whose gradients hold an inf/nan anywhere is skipped and
    the scale multiplied by ``backoff``; after ``interval`` good steps in a row it is multiplied
    by ``growth`` (torch's ``GradScaler`` rule). Every rank sees the same sequence of found
    infs, so the scales never diverge.
    """

    def __init__(self, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        self.scale = float(init)
        self.growth = growth
        self.backoff = backoff
        self.interval = interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        """After a step: back off (the step was skipped) or count a good step."""
        if found_inf:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
