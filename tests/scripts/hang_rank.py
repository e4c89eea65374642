"""The last rank never joins an all-reduce (it sleeps); the others must time out (DIST_TIMEOUT).

Where: the default group (no argument), a sub-group made by `helpers.dist.new_group`
(`--in subgroup`: ranks 0 and the last, named "checksums"), or a mesh dimension made by
`helpers.dist.device_mesh` (`--in mesh`: a dp x tp mesh on 4 ranks; the last rank's tp partner
waits). With --all every rank sleeps: only the launcher's timeout or an interrupt ends it.
HANG_PID_DIR, if set, receives one <rank>.pid file per rank once it is running, for tests that
check it was killed.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from helpers.dist import device_mesh, distributed, new_group

sleep_all = "--all" in sys.argv
where = sys.argv[sys.argv.index("--in") + 1] if "--in" in sys.argv else "world"
with distributed() as ctx:
    last = ctx.world_size - 1
    group = None
    if where == "subgroup":
        group = new_group([0, last], name="checksums")
    elif where == "mesh":
        group = device_mesh("cpu", dp=ctx.world_size // 2, tp=2).get_group("tp")
    if os.environ.get("HANG_PID_DIR"):
        with open(os.path.join(os.environ["HANG_PID_DIR"], f"{ctx.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    dist.all_reduce(torch.ones(1), group=group)  # every member: one collective that completes
    if sleep_all or ctx.rank == last:
        time.sleep(600)
    if group is None or dist.get_rank(group) >= 0:  # members only: a sub-group's others go on
        dist.all_reduce(torch.ones(2), group=group)
