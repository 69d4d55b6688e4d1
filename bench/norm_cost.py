"""What the freeze policy's per-block gradient norms cost per training step, in one process.

Three ways to end a step of the default job's model on one replica's share of a batch (16
samples, as at R = 2), interleaved in alternating order so machine noise spreads over all:

  no norms        clipping only (what ``freeze.policy=none`` and the peer do)
  block by block  ``block_grad_norms`` (one norm pass per block), then clipping
  one pass        ``clip_grad_norm(..., blocks=ParamBlocks)``: the per-block norms come from the
                  per-parameter norms the clipping computes anyway (what the engine does)

Prints the total seconds of each and the overhead against no norms. Usage:

    python bench/norm_cost.py [--rounds 12] [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from pt_ray.api import default_config_path
from pt_ray.core.config import load_config
from pt_ray.data.base import gather
from pt_ray.runtime.norms import GradNormMeter, block_grad_norms
from pt_ray.runtime.reference import build_reference
from pt_ray.runtime.clipping import ParamBlocks, clip_grad_norm
from pt_ray.service.settings import run_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(default_config_path(), ["engine=reference"])
    trainer = build_reference(run_settings(cfg).reference)
    a = trainer.adapter
    batch = gather(trainer.splits.train, list(range(16)))
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    index = ParamBlocks(params, {i: list(a.blocks[i].parameters()) for i in range(a.num_layers)},
                       0, a.num_layers, torch.device("cpu"))
    meter = GradNormMeter()
    clip = trainer.settings.optimizer.grad_clip

    def step(mode: str) -> None:
        state = a.embed(*batch.inputs)
        for block in a.blocks:
            state = block(*state)
        loss = a.loss(a.head(*state), batch.target)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if mode == "no norms":
            clip_grad_norm(None, params, clip, None)
            meter.add({})
        elif mode == "block by block":
            norms = block_grad_norms(a, range(a.num_layers))
            clip_grad_norm(None, params, clip, None)
            meter.add(norms)
        else:
            _, norms = clip_grad_norm(None, params, clip, None, blocks=index)
            meter.add_vector(0, norms)
        trainer.optimizer.step()

    modes = ["no norms", "block by block", "one pass"]
    for _ in range(10):
        for mode in modes:
            step(mode)
    seconds = dict.fromkeys(modes, 0.0)
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(mode)
            seconds[mode] += time.perf_counter() - t0
    base = seconds["no norms"]
    for mode in modes:
        print(f"{mode:15s} {seconds[mode]:7.3f} s  {100 * (seconds[mode] / base - 1):+5.1f}%")


if __name__ == "__main__":
    main()
