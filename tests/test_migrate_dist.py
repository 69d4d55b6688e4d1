"""Migration carries a layer's whole state: parameters, buffers that change during training,
and optimizer state, from the rank that held it to the ranks that need it (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from pt_ray.core.plan import Plan
from pt_ray.runtime.comm import Comm
from pt_ray.runtime.migrate import migrate

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


class Tracked(nn.Module):
    """A layer with a buffer its training updates (as running statistics are)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))


def transition(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    modules = {"embed": Tracked(), "block.0": Tracked(), "block.1": Tracked(), "head": Tracked()}
    # K 2 -> K 1, R 2: rank 0 held embed and block 0, rank 1 block 1 and the head; afterwards
    # both hold everything. Each holder's copy has trained (other copies are stale).
    old = Plan(generation=0, num_layers=2, num_frozen=0, pipeline_length=2, num_replicas=1,
               boundaries=(0, 1, 2), num_microbatches=2)
    new = Plan(generation=1, num_layers=2, num_frozen=1, pipeline_length=1, num_replicas=2,
               boundaries=(1, 2), num_microbatches=1)
    held = ["embed", "block.0"] if rank == 0 else ["block.1", "head"]
    optimizer = torch.optim.AdamW([p for n in held for p in modules[n].parameters()], lr=0.1)
    for name in held:
        module = modules[name]
        loss = module.linear(torch.ones(2, 3)).square().sum()
        loss.backward()
        with torch.no_grad():
            module.running.add_(torch.arange(3.0) + 10 * rank + len(name))
            module.seen.add_(5 + rank)
    optimizer.step()
    states = migrate(Comm(torch.device("cpu")), modules, optimizer, old, new, rank)
    return {"state": {n: {k: v.clone() for k, v in m.state_dict().items()}
                      for n, m in modules.items()},
            "held": held, "trained_states": sorted(states)}


def test_a_transition_carries_buffers_parameters_and_optimizer_state():
    results = run_ranks(transition, 2)
    for name in ("embed", "block.0", "block.1", "head"):
        holder = 0 if name in results[0]["held"] else 1
        source = results[holder]["state"][name]
        other = results[1 - holder]["state"][name]
        assert source["seen"].item() == 5 + holder  # the holder's buffer changed ...
        for key, value in source.items():  # ... and every entry reached the other rank
            assert torch.equal(other[key], value), (name, key)
    # The trainable layers' optimizer state arrived too (block 0 is frozen in the new plan).
    assert results[0]["trained_states"] == results[1]["trained_states"] == ["block.1", "head"]
