"""Lab 03: a complete DDP training script with torch only (no course helpers), every line in order.

Run:  torchrun --standalone --nproc-per-node 2 labs/lab03_plain_ddp.py
      (or: ./run.sh labs/lab03_plain_ddp.py, which runs the same torchrun command)

The other labs open their process group with `helpers.dist.distributed()`, which picks the
backend and device in one place; this one spells every step out, as a script of your own would,
so it is also the one lab that picks its backend itself:

1. torchrun sets RANK, LOCAL_RANK and WORLD_SIZE for each process;
2. on GPUs, `torch.cuda.set_device(local_rank)` first: without it every process would use cuda:0;
3. `dist.init_process_group(backend)`: nccl for GPUs, gloo for the CPU;
4. `model.to(device)`, *then* `DDP(model, device_ids=[local_rank])` (None on the CPU): DDP
   broadcasts rank 0's parameters and registers its gradient hooks and buckets on the parameters
   it is given, where they are. The order `DDP(model).to(device)` wraps CPU parameters (with
   nccl, which only moves CUDA tensors, the construction fails) and then changes them after
   wrapping, which the DDP documentation forbids;
5. a `DistributedSampler`, and `sampler.set_epoch(epoch)` at the start of every epoch;
6. the logged loss is the mean over ranks: an all-reduce that *every* rank calls (inside
   `if rank == 0:` the other ranks never make that call: rank 0 hangs until the timeout, or its
   call is paired with the others' next collective and fails);
7. rank 0 saves `model.module.state_dict()` (not the wrapper's: its keys start with "module.");
   a barrier; every rank loads with `map_location`;
8. `dist.destroy_process_group()`.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(size: int = 512) -> TensorDataset:
    """A fixed regression problem, the same on every rank: x (size, 16) -> y (size, 1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, 16, generator=gen)
    return TensorDataset(x, x @ torch.randn(16, 1, generator=gen) + 0.1 * torch.randn(size, 1, generator=gen))


def main(num_epochs: int = 3, local_batch_size: int = 32) -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if use_gpu:
        torch.cuda.set_device(local_rank)                          # 2. before anything touches CUDA
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    dist.init_process_group("nccl" if use_gpu else "gloo",         # 3.
                            timeout=datetime.timedelta(seconds=60))

    torch.manual_seed(0)                                           # DDP broadcasts rank 0's anyway
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)  # 4. move,
    ddp = DDP(model, device_ids=[local_rank] if use_gpu else None)                    #    then wrap
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=local_batch_size, sampler=sampler)        # 5.
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)

    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)                                   # 5. a new shuffle each epoch
        loss_sum, batches = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()                                        # gradients all-reduced here
            optimizer.step()
            loss_sum += loss.detach()
            batches += 1
        mean = loss_sum / batches
        dist.all_reduce(mean)                                      # 6. every rank calls it...
        if rank == 0:                                              #    ...only rank 0 prints
            print(f"epoch {epoch}: loss (mean over {world_size} ranks) {mean.item() / world_size:.4f}",
                  flush=True)

    # a path every rank agrees on (torchrun gives all ranks one run id); on several nodes it must
    # be on a file system they share
    path = os.path.join("runs", "lab03_plain_ddp", f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.pt")
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(ddp.module.state_dict(), path)                  # 7. the module's, not ddp's
    dist.barrier()                                                 #    nobody reads before it exists
    state = torch.load(path, map_location=device, weights_only=True)
    same = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"rank {rank}: parameter checksum {checksum:.10f}, checkpoint loaded back equal: {same}",
          flush=True)
    dist.barrier()
    if rank == 0:
        os.remove(path)
    dist.destroy_process_group()                                   # 8.


if __name__ == "__main__":
    main()
