"""A rank's memory in an epoch: its stage's parameters, gradients and optimizer state, the
activations autograd keeps for backward, and the peak.

Torch runtime layer. :class:`MemoryMeter` measures; the engine gathers every rank's figures
(:data:`FIELDS`, one row per rank) in the epoch's last reduction and builds the records'
:class:`~pt_ray.reporting.summary.RankMemory` list with :func:`rank_memory`.

What the figures count:

1. parameters, gradients and optimizer state: the bytes of the tensors themselves (numel times
   element size), summed over the stage's layers (``Plan.stage_layers``), at the end of the
   epoch's steps, when the last step's gradients and the optimizer's state are all allocated;
2. activations: the most bytes autograd held for backward at once during the sampled step,
   counted with :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor a forward op
   saves is counted once per storage while the graph holds it (views of one storage count
   once; parameters and their views not at all, being counted in 1). Not counted: tensors kept
   outside autograd's saved tensors (a stage's output waiting in the pipeline schedule for its
   backward, gradients of activations during backward, temporaries, the allocator's caching),
   and what activation checkpointing keeps under its own hooks;
3. the peak: on CUDA the allocator's peak over the epoch's training steps
   (``torch.cuda.max_memory_allocated``, reset at the epoch's start). It is the whole process:
   every layer the rank holds, the cached blocks of the activation cache, temporaries. On the
   CPU there is no such figure for a process's tensors, so the peak is the tracked sum of 1 and
   2: a lower bound of what the stage needs at once.

``held_param_bytes`` counts the parameters that have storage in the process: a rank holds only
the layers its plan gives it (:mod:`pt_ray.runtime.owned`; the others' storage is freed), so
it equals ``param_bytes``, the stage's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from pt_ray.runtime.owned import has_storage, held_param_bytes
from pt_ray.reporting.summary import RankMemory

__all__ = ["FIELDS", "MemoryMeter", "SavedActivations", "rank_memory", "tensor_bytes"]

# One rank's row in the epoch's reduction, in this order (every value exact in float64).
FIELDS = ("stage", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
          "peak_bytes", "held_param_bytes", "cuda")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (numel times element size)."""
    return t.numel() * t.element_size()


class _Saved:
    """What autograd keeps in place of a saved tensor while :class:`SavedActivations` counts:
    the tensor itself, and a release of its storage's count once autograd drops it (the graph
    is freed after its backward, or with its outputs)."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedActivations) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedActivations:
    """Counts the bytes autograd keeps for backward while entered, and their peak.

    Args:
        exclude: tensors not to count (the model's parameters: a saved weight, or a view of
            one, holds no memory of its own).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip: set[int] = set()
        self.exclude(exclude)
        self._live: dict[int, list[int]] = {}  # storage address -> [saves held, bytes]
        self.current = 0
        self.peak = 0

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count saves of these tensors' storages no more (replacing the previous set)."""
        self._skip = {t.untyped_storage().data_ptr() for t in tensors}

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.current

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the tensors saved for backward by forwards run inside."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or key == 0:
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # Detached: a saved output holding its own grad_fn would keep its graph alive in a
        # cycle; autograd restores the autograd metadata on unpacking.
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]


class MemoryMeter:
    """Measures one rank's memory per epoch (see the module docstring for what is counted).

    Args:
        modules: every layer the process holds, by name (``embed``, ``block.i``, ``head``).
        device: the rank's compute device (CUDA: the allocator's peak is read too).
    """

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device) -> None:
        self.modules = modules
        self.device = device
        self.saved = SavedActivations()
        self.generation: int | None = None  # the plan under which activations were counted

    def _params(self) -> list[torch.nn.Parameter]:
        """The parameters with storage here (released layers' have none)."""
        return [p for m in self.modules.values() for p in m.parameters() if has_storage(p)]

    def start_epoch(self) -> None:
        """Reset CUDA's peak (before the epoch's first step)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def due(self, generation: int) -> bool:
        """Whether to count a step's saved activations under plan ``generation``: once per
        plan, since a plan's steps all save the same (counting costs that step tens of
        percent on a small model); the figure carries over to the plan's later epochs."""
        return generation != self.generation

    def step(self, sampled: bool, generation: int = 0):
        """A context for one training step: counting saved activations if ``sampled`` (the
        parameters taken where they are now: a transition or a restore may have moved them)."""
        if not sampled:
            return contextlib.nullcontext()
        self.generation = generation
        self.saved.exclude(self._params())
        self.saved.reset_peak()
        return self.saved.counting()

    def figures(self, layers: Sequence[str], optimizer: torch.optim.Optimizer | None,
                stage: int) -> list[float]:
        """This rank's row of :data:`FIELDS` at the end of the epoch's steps (after the CUDA
        synchronisation that ends them).

        Args:
            layers: the stage's layer names (``Plan.stage_layers``).
            optimizer: the optimizer over the stage's trained layers.
            stage: the rank's stage.
        """
        params = [p for name in layers for p in self.modules[name].parameters()]
        param = sum(tensor_bytes(p) for p in params)
        grad = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        state = optimizer.state if optimizer is not None else {}
        optim = sum(tensor_bytes(v) for p in params for v in state.get(p, {}).values()
                    if torch.is_tensor(v))
        acts = self.saved.peak
        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else param + grad + optim + acts
        held = held_param_bytes(self.modules.values())
        return [float(v) for v in (stage, param, grad, optim, acts, peak, held, cuda)]


def rank_memory(values: Sequence[float], world: int) -> tuple[RankMemory, ...]:
    """Every rank's :class:`RankMemory` from the reduced rows (``world`` rows of
    :data:`FIELDS`, rank-major; the estimate is left to the controller)."""
    width = len(FIELDS)
    out = []
    for rank in range(world):
        row = dict(zip(FIELDS, values[rank * width:(rank + 1) * width]))
        out.append(RankMemory(rank=rank, cuda=bool(row.pop("cuda")),
                              **{k: int(v) for k, v in row.items()}))
    return tuple(out)
