"""Lab 06 (sharding): one model cut across two devices in one process; autograd carries the
gradient back across the cut.

Run:  ./run.sh 06      (rank 0 runs the check; the other labs of 06 use every rank)

Model sharding (naive model parallelism): consecutive blocks of the model live on consecutive
devices, and the activation is copied from one to the next with `.to(device)`. That copy is
differentiable, so the backward pass copies dL/d(activation) back: the chain rule across devices,
dL/dw1 = dL/da * da/dw1, with dL/da computed on the next device. With one GPU per shard the shards
sit on cuda:0, cuda:1, ...; otherwise every shard is on the CPU and the very same code runs. Only
one device works at a time: labs/lab06_pipeline.py fixes that with micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.dist import distributed, gpu_count
from labs.lab06_pipeline import PipeConfig, build_full_model, build_stage_module, make_batch


def shard_devices(num_shards: int) -> list[torch.device]:
    """One GPU per shard when there are enough GPUs, else every shard on the CPU (same code)."""
    if gpu_count() >= num_shards:
        return [torch.device("cuda", i) for i in range(num_shards)]
    return [torch.device("cpu")] * num_shards


class ShardedModel(nn.Module):
    """Stages on different devices in one process: `.to(device)` moves the activation forward, and
    autograd moves dL/d(activation) back, because `.to` is differentiable."""

    def __init__(self, stages: list[nn.Module], devices: list[torch.device]):
        super().__init__()
        self.devices = list(devices)
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))   # device i waits for device i-1: only one works at a time
        return x


def sharded_gradient_check(config: PipeConfig, num_shards: int = 2) -> dict:
    """One forward/backward of the sharded model vs the whole model: same loss and gradients."""
    devices = shard_devices(num_shards)
    sharded = ShardedModel([build_stage_module(config, num_shards, s) for s in range(num_shards)],
                           devices)
    whole = build_full_model(config)
    x, y = make_batch(config, 0)
    sharded_loss = F.cross_entropy(sharded(x), y.to(devices[-1]))
    whole_loss = F.cross_entropy(whole(x), y)
    sharded_loss.backward()
    whole_loss.backward()
    sharded_grads = {n.split(".", 2)[2]: p.grad.cpu() for n, p in sharded.named_parameters()}
    return {"devices": [str(d) for d in devices],
            "loss_diff": abs(sharded_loss.item() - whole_loss.item()),
            "max_grad_diff": max((sharded_grads[n] - p.grad).abs().max().item()
                                 for n, p in whole.named_parameters())}


@dataclass(frozen=True)
class Run(runs.Run):
    """The model sharded over the devices: blocks of Linear(width, width)."""
    width: int = 512
    num_blocks: int = 4
    microbatch_size: int = 32
    SMOKE = dict(width=64)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        if ctx.rank == 0:   # one process drives every shard
            config = PipeConfig(width=cfg.width, num_blocks=cfg.num_blocks,
                                microbatch_size=cfg.microbatch_size)
            check = sharded_gradient_check(config)
            print(f"shards on {check['devices']}: |loss(sharded) - loss(whole)| = "
                  f"{check['loss_diff']:.1e}, max |grad(sharded) - grad(whole)| = "
                  f"{check['max_grad_diff']:.1e}", flush=True)
            ctx.report(**check)


if __name__ == "__main__":
    main()
