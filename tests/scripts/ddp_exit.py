"""BucketedDDP trains 5 steps, then the run ends as every lab's does (barrier, destroy the groups,
exit): what the run leaves behind at exit, reported by every rank.

- `late_defaults`: torch.distributed.nn's functions whose `group=group.WORLD` default holds a
  process group (it does when torch.distributed.nn is first imported after init_process_group:
  building the first optimizer imports torch._dynamo, which imports it);
- `gloo_threads_after`: gloo's threads still alive after the groups were destroyed (none, or the
  group they serve outlives destroy_process_group and is torn down during the interpreter's exit);
- rank 0 also holds a sub-group in a default argument through the teardown, as such a late
  import would, and reports the threads that keeps alive (`held_gloo_threads`: the check sees a
  group that outlives its destruction), then lets it go before exiting.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dist import distributed, new_group
from labs.lab03_ddp import BucketedDDP, global_batch, local_shard, make_mlp


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: /proc/self/task/*/comm)."""
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)


def late_defaults() -> list[str]:
    import inspect

    import torch.distributed.nn.functional as dnn

    return [name for name, f in inspect.getmembers(dnn, inspect.isfunction)
            if any(isinstance(d, dist.ProcessGroup) for d in f.__defaults__ or ())]


held = None
with distributed() as ctx:
    model = make_mlp([10, 50, 5], seed=0)
    ddp = BucketedDDP(model, bucket_cap_mb=0.0016)          # the buckets: several per step
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)   # imports torch._dynamo, after the group
    for step in range(5):
        x, y = global_batch(step, 8 * ctx.world_size, 10, 5)
        optimizer.zero_grad()
        F.mse_loss(ddp(local_shard(x, ctx.rank, ctx.world_size)),
                   local_shard(y, ctx.rank, ctx.world_size)).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    group = new_group(name="held")
    if ctx.rank == 0:
        def held(tensor, group=group):  # what `def all_reduce(..., group=group.WORLD)` does
            return tensor
    del group
    ctx.report(late_defaults=late_defaults(), gloo_threads_during=gloo_threads())
ctx.report(held_gloo_threads=gloo_threads())
held = None  # the held group dies here, with its threads
ctx.report(gloo_threads_after=gloo_threads())
