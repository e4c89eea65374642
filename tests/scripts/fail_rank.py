"""Rank 1 raises while rank 0 waits in a collective: the launch must end fast, naming rank 1."""
import torch
import torch.distributed as dist

from helpers.dist import distributed

import time

with distributed() as ctx:
    if ctx.rank == 1:
        ctx.report(raised_at=time.time())  # the launch's end is measured from here, not its start
        raise ValueError("rank one is broken on purpose")
    dist.all_reduce(torch.ones(1))
