"""Every rank finishes its work, then raises after the distributed() block: a real failure."""
import torch
import torch.distributed as dist

from helpers.dist import distributed

with distributed() as ctx:
    dist.all_reduce(torch.ones(1))
raise RuntimeError(f"rank {ctx.rank} fails after its work on purpose")
