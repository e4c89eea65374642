"""The last rank never joins the all-reduce (it sleeps); the others must time out (DIST_TIMEOUT)."""
import sys
import time

import torch
import torch.distributed as dist

from helpers.dist import distributed

sleep_all = "--all" in sys.argv  # every rank sleeps: only the launcher's timeout or Ctrl-C ends it
with distributed() as ctx:
    if sleep_all or ctx.rank == ctx.world_size - 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
