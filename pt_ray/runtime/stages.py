"""Pipeline stages cut from an adapter at a Plan's boundaries, and their schedules.

Stages are built by slicing the adapter's block list (never by tracing): stage 0 runs the frozen
prefix (embedding plus blocks ``0..n-1``, in eval mode under ``no_grad``) and, when nothing is
frozen, the trainable embedding; every stage runs its active blocks (with
``plan.activation_checkpointing``, each recomputed in its backward); the last stage runs the
head. The state tuple (hidden states, plus the attention mask for BERT-family models) travels
between stages as the schedule's activations, in the compute dtype (every forward runs under the
run's autocast; :mod:`pt_ray.runtime.precision`). When the activation cache serves the frozen
prefix, stage 0 takes that state (computed for the whole replica batch before the schedule,
:mod:`pt_ray.cache.prefix`) instead of the model inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pt_ray.models.base import ModelAdapter, State, run_blocks
from pt_ray.core.plan import Plan
from pt_ray.runtime.precision import Precision

__all__ = ["Shapes", "StageModule", "build_schedule", "probe_shapes"]

Spec = tuple[tuple[int, ...], torch.dtype]
"""One tensor's shape without the batch dimension, and its dtype."""


@dataclass(frozen=True)
class Shapes:
    """What crosses stage boundaries, per sample: the model inputs, the state between blocks (in
    the compute dtype) and the model output (fp32 logits)."""

    inputs: tuple[Spec, ...]
    state: tuple[Spec, ...]
    output: tuple[Spec, ...]


@torch.no_grad()
def probe_shapes(adapter: ModelAdapter, inputs: State, precision: Precision) -> Shapes:
    """Run one sample through the embedding, the first block and the head to learn the shapes
    and dtypes of a stage's inputs and outputs (so the pipeline schedules need no shape
    inference, which would pickle metadata through the pipeline group).

    Args:
        adapter: the model.
        inputs: model inputs of at least one sample, on the model's device.
        precision: the run's precision.
    """
    one = tuple(t[:1] for t in inputs)
    modes = [m.training for m in (adapter.embed, adapter.blocks[0], adapter.head)]
    for m in (adapter.embed, adapter.blocks[0], adapter.head):
        m.eval()
    try:
        with precision.autocast():
            state = precision.cast_state(adapter.blocks[0](*adapter.embed(*one)))
            out = precision.logits(adapter.head(*state))
    finally:
        for m, mode in zip((adapter.embed, adapter.blocks[0], adapter.head), modes):
            m.train(mode)

    def specs(tensors) -> tuple[Spec, ...]:
        return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors)

    return Shapes(specs(one), specs(state), specs((out,)))

_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


class StageModule(nn.Module):
    """One stage of one replica's pipeline under a plan.

    Only the trainable parts are registered as children (so ``parameters()`` is exactly what this
    stage trains); the frozen prefix is held aside and always runs without gradients.

    Args:
        adapter: the model (a rank holds in storage only its stage's slice, which is all a
            stage uses; :mod:`pt_ray.runtime.owned`).
        plan: the layout.
        stage: this stage's index in ``[0, K)``.
        state_inputs: stage 0's forward takes the frozen prefix's output (the activation cache
            serves it) instead of the model inputs; only with a frozen prefix.
        precision: the run's precision (default: fp32).

    With ``plan.activation_checkpointing`` each trainable block's forward runs under
    non-reentrant ``torch.utils.checkpoint`` (:func:`pt_ray.models.base.run_blocks`), so the
    stage keeps only each block's input for backward and recomputes the rest there; the frozen
    prefix (no gradients, nothing kept), the embedding and the head run as without it.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        plan: Plan,
        stage: int,
        state_inputs: bool = False,
        precision: Precision | None = None,
    ) -> None:
        super().__init__()
        self.precision = precision or Precision("fp32")
        self.is_first = stage == 0
        self.is_last = stage == plan.pipeline_length - 1
        n = plan.num_frozen
        if state_inputs and not (self.is_first and n > 0):
            raise ValueError(
                f"state_inputs=True needs stage 0 of a plan with a frozen prefix; got stage "
                f"{stage} with num_frozen={n}"
            )
        self.state_inputs = state_inputs
        self.recompute = plan.activation_checkpointing
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
        """Stage 0's start: the frozen prefix (no gradients; its output in the compute dtype,
        as the activation cache would hold it) or the trainable embedding."""
        with self.precision.autocast():
            if self._frozen:
                with torch.no_grad():
                    state = self._frozen[0](*inputs)
                    for block in self._frozen[1:]:
                        state = block(*state)
                return self.precision.cast_state(state)
            return self.embed(*inputs)

    def forward(self, *args: torch.Tensor) -> State | torch.Tensor:
        """Stage 0: model inputs (the prefix's output with ``state_inputs``); other stages: the
        previous stage's state. Returns the next state, or the model output on the last
        stage."""
        state = self.run_prefix(*args) if self.is_first and not self.state_inputs else args
        return self.run_from(*state)

    def run_from(self, *state: torch.Tensor) -> State | torch.Tensor:
        """The stage after stage 0's prefix (:meth:`run_prefix`): its trainable blocks, and the
        head on the last stage."""
        with self.precision.autocast():
            state = run_blocks(self.blocks, state, self.recompute)
            if self.is_last:
                return self.precision.logits(self.head(*state))
        return self.precision.cast_state(state)


def build_schedule(
    module: StageModule,
    plan: Plan,
    stage: int,
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shapes: Shapes,
    microbatch: int,
    runner: torch.nn.Module | None = None,
):
    """A ``torch.distributed.pipelining`` schedule for one stage of a K > 1 pipeline; with
    ``runner`` (``module`` under DDP over the stage's replicas) the schedule runs that, and
    torch's stage reduces the gradients with the last micro-batch's backward.

    Each micro-batch's loss is divided by M before its backward, so with equal micro-batches the
    gradients of one ``step`` equal the mean over the replica's batch, as one un-pipelined step
    would give, and the M losses the schedule reports (so divided) sum to that mean. Torch's own
    ``scale_grads=True`` would instead divide every ``.grad`` by M at the end of each ``step``,
    which would also shrink what earlier ``step`` calls accumulated (gradient accumulation runs
    one ``step`` per chunk); ``step`` itself never zeroes parameter gradients. The stage's
    example inputs and outputs (``microbatch`` rows of ``shapes``) are given up front, so the
    schedule infers nothing at run time.
    """
    # Imported here, not at the top: torch.distributed.pipelining pulls in torch._dynamo and
    # DTensor, a heavy import that a run which never pipelines (K = 1) should not pay.
    from torch.distributed import pipelining

    m = plan.num_microbatches

    def per_microbatch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / m

    def examples(specs: tuple[Spec, ...], grad: bool) -> tuple[torch.Tensor, ...]:
        # requires_grad marks what carries a gradient back (what the schedule would infer).
        return tuple(
            torch.empty((microbatch, *shape), dtype=dtype, device=device,
                        requires_grad=grad and dtype.is_floating_point)
            for shape, dtype in specs)

    first_in = shapes.state if module.state_inputs else shapes.inputs
    pipe_stage = pipelining.PipelineStage(
        runner if runner is not None else module, stage, plan.pipeline_length, device,
        input_args=(examples(first_in, False) if module.is_first
                    else examples(shapes.state, True)),
        output_args=examples(shapes.output if module.is_last else shapes.state, True),
        group=group,
    )
    cls = getattr(pipelining, _SCHEDULES[plan.schedule])
    return cls(pipe_stage, n_microbatches=m, loss_fn=per_microbatch_loss, scale_grads=False)
