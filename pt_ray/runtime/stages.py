"""Pipeline stages cut from an adapter at a Plan's boundaries, and their schedules.

Stages are built by slicing the adapter's block list (never by tracing): stage 0 runs the frozen
prefix (embedding plus blocks ``0..n-1``, in eval mode under ``no_grad``) and, when nothing is
frozen, the trainable embedding; every stage runs its active blocks; the last stage runs the
head. The state tuple (hidden states, plus the attention mask for BERT-family models) travels
between stages as the schedule's activations. When the activation cache serves the frozen
prefix, stage 0 takes that state (computed for the whole replica batch before the schedule,
:mod:`pt_ray.runtime.prefix`) instead of the model inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from pt_ray.models.base import ModelAdapter, State
from pt_ray.plan import Plan

__all__ = ["StageModule", "build_schedule"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(nn.Module):
    """One stage of one replica's pipeline under a plan.

    Only the trainable parts are registered as children (so ``parameters()`` is exactly what this
    stage trains); the frozen prefix is held aside and always runs without gradients.

    Args:
        adapter: the model (every rank holds all of it; a stage uses its slice).
        plan: the layout.
        stage: this stage's index in ``[0, K)``.
        state_inputs: stage 0's forward takes the frozen prefix's output (the activation cache
            serves it) instead of the model inputs; only with a frozen prefix.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        plan: Plan,
        stage: int,
        state_inputs: bool = False,
    ) -> None:
        super().__init__()
        self.is_first = stage == 0
        self.is_last = stage == plan.pipeline_length - 1
        n = plan.num_frozen
        if state_inputs and not (self.is_first and n > 0):
            raise ValueError(
                f"state_inputs=True needs stage 0 of a plan with a frozen prefix; got stage "
                f"{stage} with num_frozen={n}"
            )
        self.state_inputs = state_inputs
        self._frozen: list[nn.Module] = []
        if self.is_first:
            if n > 0:
                self._frozen = [adapter.embed, *adapter.blocks[:n]]
            else:
                self.embed = adapter.embed
        self.blocks = nn.ModuleList(adapter.blocks[i] for i in plan.stage_blocks(stage))
        if self.is_last:
            self.head = adapter.head

    def run_prefix(self, *inputs: torch.Tensor) -> State:
        """Stage 0's start: the frozen prefix (no gradients) or the trainable embedding."""
        if self._frozen:
            with torch.no_grad():
                state = self._frozen[0](*inputs)
                for block in self._frozen[1:]:
                    state = block(*state)
            return state
        return self.embed(*inputs)

    def forward(self, *args: torch.Tensor) -> State | torch.Tensor:
        """Stage 0: model inputs (the prefix's output with ``state_inputs``); other stages: the
        previous stage's state. Returns the next state, or the model output on the last
        stage."""
        state = self.run_prefix(*args) if self.is_first and not self.state_inputs else args
        for block in self.blocks:
            state = block(*state)
        if self.is_last:
            return self.head(*state)
        return state


def build_schedule(
    module: StageModule,
    plan: Plan,
    stage: int,
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """A ``torch.distributed.pipelining`` schedule for one stage of a K > 1 pipeline.

    ``scale_grads=True`` divides gradients by M, so with equal micro-batches they equal the mean
    over the replica's batch, as one un-pipelined step would give.
    """
    pipe_stage = PipelineStage(module, stage, plan.pipeline_length, device, group=group)
    cls = _SCHEDULES[plan.schedule]
    return cls(pipe_stage, n_microbatches=plan.num_microbatches, loss_fn=loss_fn, scale_grads=True)
