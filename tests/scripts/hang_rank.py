"""The last rank never joins the all-reduce (it sleeps); the others must time out (DIST_TIMEOUT).

With --all every rank sleeps: only the launcher's timeout or an interrupt ends it. HANG_PID_DIR, if
set, receives one <rank>.pid file per rank once it is running, for tests that check it was killed.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from helpers.dist import distributed

sleep_all = "--all" in sys.argv
with distributed() as ctx:
    if os.environ.get("HANG_PID_DIR"):
        with open(os.path.join(os.environ["HANG_PID_DIR"], f"{ctx.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if sleep_all or ctx.rank == ctx.world_size - 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
