"""Lab 00: orientation. Every rank reports who it is, where it runs, and joins one all-reduce.

Run:  ./run.sh 00      (or: ./run.sh labs/lab00_orientation.py)
Each rank contributes rank + 1; after a SUM all-reduce every rank holds 1 + 2 + ... + world_size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.dist import DistContext, distributed


def expected_sum(world_size: int) -> float:
    return world_size * (world_size + 1) / 2


def all_reduce_check(ctx: DistContext) -> float:
    value = torch.tensor([ctx.rank + 1.0], device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item()


def main() -> None:
    with distributed() as ctx:
        total = all_reduce_check(ctx)
        print(f"rank {ctx.rank}/{ctx.world_size} (local {ctx.local_rank}) on {ctx.device} "
              f"with {ctx.backend}: all_reduce(rank + 1) = {total:g}", flush=True)
        ctx.report(all_reduce=total)
        if total != expected_sum(ctx.world_size):
            raise RuntimeError(f"all-reduce gave {total}, expected {expected_sum(ctx.world_size)}")
        ctx.print0(f"backend choice: {ctx.reason}")


if __name__ == "__main__":
    main()
