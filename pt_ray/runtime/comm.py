"""The one door to ``torch.distributed``: every collective and point-to-point call of a run.

Torch runtime layer. NCCL accepts CUDA tensors only and gloo serves CPU tensors, so a run that
sends a CPU counter through an NCCL group fails at the first epoch's end. :class:`Comm` knows the
communication device of the run's groups (the rank's CUDA device when the backend serves CUDA
tensors, else the CPU) and moves everything it is handed there: gradients, activations,
headers, counters, timings, metrics and optimizer state. Nothing is pickled through a group:
object lists become tensors first (:func:`encode_floats` and friends).

Every subgroup inherits the WORLD group's backend (``new_group`` without ``backend=``), so one
device serves every group of the run. The pipelining schedules of
``torch.distributed.pipelining`` send the stage's own activations, which already live on the
stage's device; they are the only calls that do not pass through here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "backend_devices"]

# Wire codes of the dtypes a header can name (append only: both ends must agree).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def backend_devices(backend: str) -> dict[str, str]:
    """Device type -> backend, from a backend string (``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``)."""
    backend = backend.lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    if backend == "nccl":
        return {"cuda": "nccl"}
    if backend == "gloo":
        # gloo also serves CUDA tensors (through host copies); CPU is where it is fast.
        return {"cpu": "gloo"}
    return {"cpu": backend}


class Comm:
    """Collectives and point-to-point transfers on the run's communication device.

    Args:
        device: this rank's compute device (where the model lives).
        backend: the WORLD group's backend (default: read from the initialised WORLD group).

    Attributes:
        device: the device every tensor handed to a group must be on (every group of a run
            shares WORLD's backend, so this is one device).

    Raises:
        ValueError: the backend cannot serve this rank's device (an NCCL group on a CPU rank).
    """

    def __init__(self, device: torch.device, backend: str | None = None) -> None:
        self.backend = str(backend or dist.get_backend())
        served = backend_devices(self.backend)
        if device.type == "cuda" and "cuda" in served:
            self.device = device
        elif "cpu" in served:
            self.device = torch.device("cpu")
        else:
            raise ValueError(
                f"the process group's backend {self.backend!r} serves only "
                f"{', '.join(sorted(served))} tensors, but this rank computes on {device}; use "
                "gloo for CPU workers, or 'cpu:gloo,cuda:nccl' on GPU workers"
            )

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
        """Reduce ``t`` over ``group`` (None: WORLD). In place when ``t`` is already on the
        communication device; the result is returned either way (on that device)."""
        x = self._on(t)
        dist.all_reduce(x, op=_OPS[op], group=group)
        if x is not t:
            t.copy_(x)
        return x

    def reduce_values(self, values: Sequence[float], op: str = "sum", group=None) -> list[float]:
        """Reduce a few numbers (counters, timings, metrics) and read them back on the host."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=_OPS[op], group=group)
        return t.tolist()

    def gather_values(self, values: Sequence[float], group=None) -> list[list[float]]:
        """Every rank's few numbers, in rank order, read back on the host: one collective
        where sums, maxima and per-rank rows of the same numbers would each need their own
        reduction. Every rank gives as many values."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        return [row.tolist() for row in torch.stack(self.all_gather(t, group)).cpu()]

    def all_gather(self, t: torch.Tensor, group=None) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype everywhere), in rank order."""
        x = self._on(t.contiguous())
        world = dist.get_world_size(group)
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x, group=group)
        return out

    def barrier(self, group=None) -> None:
        """Wait for every rank of ``group``: a one-element all-reduce on the communication
        device (``dist.barrier`` on NCCL guesses a device)."""
        t = torch.zeros(1, device=self.device)
        dist.all_reduce(t, group=group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        """Send a tuple of tensors to global rank ``dst``: a header of dtypes and shapes, then
        the data (each on the communication device)."""
        header = [len(tensors)]
        for t in tensors:
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        head = torch.tensor(header, dtype=torch.int64, device=self.device)
        dist.send(torch.tensor([head.numel()], dtype=torch.int64, device=self.device), dst)
        dist.send(head, dst)
        for t in tensors:
            dist.send(self._on(t.detach()).contiguous(), dst)

    def recv(self, src: int, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """Receive what :meth:`send` sent from global rank ``src``; the tensors end on
        ``device`` (default: the communication device)."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(n, src)
        head = torch.zeros(int(n.item()), dtype=torch.int64, device=self.device)
        dist.recv(head, src)
        values = head.tolist()
        count, i = values[0], 1
        out = []
        for _ in range(count):
            dtype, ndim = _DTYPES[values[i]], values[i + 1]
            shape = values[i + 2:i + 2 + ndim]
            i += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src)
            out.append(t if device is None else t.to(device))
        return tuple(out)
