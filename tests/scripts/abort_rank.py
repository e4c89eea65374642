"""Rank 1 dies by SIGABRT, either inside its work ("inside") or while exiting after it ("after")."""
import os
import sys

import torch
import torch.distributed as dist

from helpers.dist import distributed

where = sys.argv[1]
with distributed() as ctx:
    dist.all_reduce(torch.ones(1))
    if where == "inside" and ctx.rank == 1:
        os.abort()
if where == "after" and ctx.rank == 1:
    os.abort()  # like gloo's occasional crash at interpreter exit
