"""Lab 03: N ranks with local batch B train exactly like one process with batch N*B, every method.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_equivalence.py)

Every method of labs/lab03_ddp.py (naive, flat, overlapped, BucketedDDP) and torch's
DistributedDataParallel trains the same MLP for a few SGD steps on N ranks, each rank on its own
slice of the global batch, while one process trains on the whole global batch beside it. The
ranks' losses differ (different samples); their gradients and parameters are identical on every
rank and equal the single process's up to float32 rounding. Each method is counted too: how many
collectives per step (torch DDP's first step differs: one bucket, then rebuilt buckets), bytes,
and how many were launched before `loss.backward()` returned. Where the equivalence needs care
(BatchNorm, dropout, token-weighted losses, unused parameters, uneven inputs) is
labs/lab03_caveats.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import ddp_device_ids
from helpers.comm_count import CountingComm
from labs.lab03_ddp import (BucketedDDP, OverlappedDDP, average_gradients, average_gradients_flat,
                            broadcast_parameters, count_ddp_comm, flat_grads, flat_params,
                            global_batch, local_shard, make_mlp)

METHODS = ("naive", "flat", "overlapped", "bucketed", "torch_ddp")


@dataclass
class DataParallel:
    """A model wrapped for one method, with the call that finishes gradient averaging."""

    name: str
    model: nn.Module
    sync: Callable[[], None]   # call after loss.backward(), before optimizer.step()
    comm: CountingComm         # what the method sent


def wrap(method: str, module: nn.Module, device: torch.device, group=None,
         bucket_cap_mb: float | None = 25.0, count_torch_ddp: bool = True) -> DataParallel:
    """`module` (already on `device`) prepared for data-parallel training with `method`.

    `bucket_cap_mb=None` is torch DDP's own default (25 MiB, first bucket 1 MiB); BucketedDDP
    has no first-bucket rule and takes None as 25."""
    if method in ("naive", "flat"):
        comm = CountingComm(group)
        broadcast_parameters(module, group)
        average = average_gradients if method == "naive" else average_gradients_flat
        return DataParallel(method, module, lambda: average(module, comm), comm)
    if method == "overlapped":
        ddp = OverlappedDDP(module, group)
        return DataParallel(method, ddp, ddp.finish_gradient_synchronization, ddp.comm)
    if method == "bucketed":
        ddp = BucketedDDP(module, 25.0 if bucket_cap_mb is None else bucket_cap_mb, group)
        return DataParallel(method, ddp, ddp.finish_gradient_synchronization, ddp.comm)
    if method == "torch_ddp":
        ddp = DDP(module, device_ids=ddp_device_ids(device), process_group=group,
                  bucket_cap_mb=bucket_cap_mb)
        comm = CountingComm(group)
        if count_torch_ddp:
            count_ddp_comm(ddp, comm)
        return DataParallel(method, ddp, lambda: None, comm)
    raise ValueError(f"unknown method {method!r}; pick one of {METHODS}")


def spread_over_ranks(tensor: torch.Tensor, group=None) -> float:
    """max |a_i - b_i| over elements and pairs of ranks: 0.0 means identical on every rank."""
    high, low = tensor.detach().clone(), tensor.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return (high - low).abs().max().item()


def train_and_compare(method: str, ctx: DistContext, sizes: Sequence[int], steps: int,
                      local_batch_size: int, lr: float = 0.05,
                      bucket_cap_mb: float | None = 25.0) -> dict:
    """Train with `method` on N ranks and, on the side, one process on the global batch.

    Every rank initialises its model from a different seed on purpose: the wrappers broadcast
    rank 0's parameters. The reference starts from rank 0's initialisation (seed 0). Collectives
    are counted per step.
    """
    model = make_mlp(sizes, seed=ctx.rank, device=ctx.device)
    dp = wrap(method, model, ctx.device, bucket_cap_mb=bucket_cap_mb)
    reference = make_mlp(sizes, seed=0, device=ctx.device)
    opt = torch.optim.SGD(dp.model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    global_batch_size = local_batch_size * ctx.world_size
    losses, grad_diffs, launched_in_backward, collectives = [], [], [], []
    for step in range(steps):
        x, y = global_batch(step, global_batch_size, sizes[0], sizes[-1], ctx.device)
        # this rank: its own slice, so its loss differs from the other ranks' losses
        opt.zero_grad()
        loss = nn.functional.mse_loss(dp.model(local_shard(x, ctx.rank, ctx.world_size)),
                                      local_shard(y, ctx.rank, ctx.world_size))
        before = dp.comm.collectives
        loss.backward()
        launched_in_backward.append(dp.comm.collectives - before)
        dp.sync()
        collectives.append(dp.comm.collectives - before)
        # the reference: one process, the whole global batch
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        grad_diffs.append((flat_grads(model) - flat_grads(reference)).abs().max().item())
        opt.step()
        ref_opt.step()
        losses.append(loss.item())
    params = flat_params(model)
    return {
        "method": method,
        "losses": losses,                                      # this rank's local losses
        "collectives_per_step": collectives,                   # one count per step
        "bytes_per_step": dp.comm.bytes / steps,
        "launched_in_backward_per_step": launched_in_backward,
        "max_grad_diff_vs_reference": max(grad_diffs),
        "max_param_diff_vs_reference": (params - flat_params(reference)).abs().max().item(),
        "param_spread_over_ranks": spread_over_ranks(params),
        "grad_spread_over_ranks": spread_over_ranks(flat_grads(model)),
        "num_params": len(list(model.parameters())),
    }


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP's widths, the SGD steps each method takes, the local batch, and a bucket cap
    (MiB) that gives several buckets."""
    sizes: tuple[int, ...] = (64, 256, 256, 256, 10)
    steps: int = 5
    local_batch_size: int = 8
    bucket_cap_mb: float = 0.1
    SMOKE = dict(sizes=(16, 32, 32, 4), steps=3, bucket_cap_mb=0.002)


def run(ctx: DistContext, cfg: Run) -> dict:
    sizes, steps = list(cfg.sizes), cfg.steps
    local_batch_size, bucket_cap_mb = cfg.local_batch_size, cfg.bucket_cap_mb
    ctx.print0(f"{ctx.world_size} ranks, local batch {local_batch_size} (global "
               f"{local_batch_size * ctx.world_size}), MLP {sizes}, {steps} SGD steps per method, "
               f"buckets of {bucket_cap_mb} MiB")
    compare = {method: attempt(train_and_compare, method, ctx, sizes, steps, local_batch_size,
                               bucket_cap_mb=bucket_cap_mb) for method in METHODS}
    result = {"compare": compare, "sizes": sizes, "steps": steps,
              "local_batch_size": local_batch_size, "bucket_cap_mb": bucket_cap_mb}
    ctx.report(**result)
    ctx.print0(f"rank 0's local losses (naive): {[round(v, 4) for v in compare['naive']['losses']]}")
    if ctx.rank == 0:
        table([{"method": m, "collectives, step 0": r["collectives_per_step"][0],
                "collectives, later steps": r["collectives_per_step"][-1],
                "KiB/step": r["bytes_per_step"] / 1024,
                "launched in backward": r["launched_in_backward_per_step"][-1],
                "max |param - 1-process|": r["max_param_diff_vs_reference"],
                "param spread over ranks": r["param_spread_over_ranks"]}
               for m, r in compare.items() if "unsolved" not in r],
              title=f"{steps} steps on {ctx.world_size} ranks vs one process with the global batch")
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
