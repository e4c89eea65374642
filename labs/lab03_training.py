"""Lab 03: the practical parts of a DDP training script: data, checkpoints, logging, accumulation, memory.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_training.py)

- `DistributedSampler` shuffles the indices with the same seed on every rank and deals them out
  round-robin, so the shards are disjoint; `set_epoch(epoch)` makes the shuffle differ each
  epoch (forget it and every epoch repeats the first one's order). When the dataset does not
  divide by the number of ranks, it appends the first indices of the shuffled list again until
  it does (those samples are seen twice; in evaluation they are counted twice), unless
  `drop_last=True`, which trims the end of the shuffled list instead.
- Checkpoints: rank 0 alone saves `model.module.state_dict()` (the wrapper's own state dict
  prefixes every key with "module.", which a plain model refuses to load) and the optimizer
  state, atomically (a temporary file, then `os.replace`); a barrier; then every rank loads with
  `map_location` (without it, tensors saved from cuda:0 would all load onto cuda:0).
- Logging: each rank's loss is computed on its own shard; print the mean over ranks (all-reduce).
- Gradient accumulation: inside `ddp.no_sync()` backward only accumulates locally; the backward
  after it all-reduces once. The forward must run inside the context too: torch DDP decides at
  forward time whether the coming backward synchronises. k micro-batches of B per rank on N ranks
  step exactly like one batch of B*k*N (the global batch).
- Memory: every rank holds the whole model, its gradients and its optimizer state: N copies in
  all (notebook 08 shards them).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.launch import REPO_ROOT
from helpers.show import table
from helpers.tensors import ddp_device_ids, nbytes, seeded
from helpers.comm_count import CountingComm
from labs.lab03_ddp import (count_ddp_comm, flat_grads, flat_params, global_batch, local_shard,
                            make_mlp)


# --- data: one disjoint shard per rank, reshuffled per epoch -------------------------------------

def sampler_orders(dataset_size: int, world_size: int, epochs: int, seed: int = 0,
                   set_epoch: bool = True, drop_last: bool = False) -> list[list[list[int]]]:
    """orders[epoch][rank] = the dataset indices rank `rank` visits in `epoch`, in order.

    Uses DistributedSampler with explicit num_replicas and rank, so no process group is needed:
    this is exactly what each rank's sampler computes on its own (same seed on every rank).
    """
    samplers = [DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                   shuffle=True, seed=seed, drop_last=drop_last)
                for rank in range(world_size)]

    def one_epoch(epoch: int) -> list[list[int]]:
        if set_epoch:
            for sampler in samplers:
                sampler.set_epoch(epoch)  # the shuffle is seeded with seed + epoch
        return [list(sampler) for sampler in samplers]

    return [one_epoch(epoch) for epoch in range(epochs)]


def shards_disjoint_and_complete(orders_of_epoch: list[list[int]], dataset_size: int) -> bool:
    """True when no index appears twice and every index appears somewhere (needs a dataset size
    divisible by the number of ranks: otherwise the sampler pads with repeats)."""
    seen = [i for shard in orders_of_epoch for i in shard]
    return len(seen) == len(set(seen)) and set(seen) == set(range(dataset_size))


def padding(dataset_size: int, world_size: int, seed: int = 0) -> dict:
    """What DistributedSampler does with a dataset that does not divide by the ranks.

    The shuffled list, the indices appended to it (its first ones again), each rank's shard, and
    with drop_last=True the indices left out."""
    generator = torch.Generator().manual_seed(seed)  # the sampler's own shuffle for epoch 0
    shuffled = torch.randperm(dataset_size, generator=generator).tolist()
    padded = sampler_orders(dataset_size, world_size, 1, seed)[0]
    trimmed = sampler_orders(dataset_size, world_size, 1, seed, drop_last=True)[0]
    total = sum(len(shard) for shard in padded)
    return {"dataset_size": dataset_size, "world_size": world_size, "shuffled": shuffled,
            "appended": shuffled[:total - dataset_size],
            "shards": padded, "shards_drop_last": trimmed,
            "dropped": sorted(set(range(dataset_size)) - {i for s in trimmed for i in s})}


def padded_accuracy(correct: list[bool], world_size: int) -> dict:
    """Accuracy over an evaluation set sharded by DistributedSampler (shuffle=False), counted the
    usual way (sum of correct and of samples over ranks), against the true accuracy."""
    shards = [list(DistributedSampler(range(len(correct)), num_replicas=world_size, rank=r,
                                      shuffle=False)) for r in range(world_size)]
    counted = [i for shard in shards for i in shard]
    return {"samples": len(correct), "counted": len(counted),
            "accuracy_counted": sum(correct[i] for i in counted) / len(counted),
            "accuracy_true": sum(correct) / len(correct)}


# --- checkpoints -----------------------------------------------------------------------------

def run_dir(name: str) -> Path:
    """runs/<name>/<torchrun run id>: the same folder for every rank and across restarts."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"local-{os.getpid()}")
    return REPO_ROOT / "runs" / name / run_id


def save_checkpoint(path: Path, state: dict, rank: int, group=None) -> None:
    """Rank 0 writes `state` to `path` atomically; every rank returns once the file is there.

    torch.save into a temporary file, then os.replace: a rename on the same file system is atomic,
    so a reader (or a restart after a crash mid-save) sees the old checkpoint or the new one, never
    a truncated file. The barrier keeps the other ranks from reading before rank 0 has written.
    """
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # only left if the save failed: the old file is intact
    if dist.is_initialized():
        dist.barrier(group=group)


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """Every rank loads the file onto its own device (map_location), whatever device saved it."""
    return torch.load(path, map_location=device, weights_only=True)


# --- logging -----------------------------------------------------------------------------------

def mean_over_ranks(value: torch.Tensor, world_size: int, group=None) -> float:
    """The mean of a scalar over ranks (a collective: every rank must call it)."""
    total = value.detach().clone().reshape(1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.item() / world_size


# --- gradient accumulation with no_sync -----------------------------------------------------------

def accumulate(ddp: DDP, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
               use_no_sync: bool, forward_inside: bool = True) -> None:
    """Backward over `micro_batches` chunks of this rank's batch x (B, in), y (B, out).

    Each chunk's loss is divided by `micro_batches`, so the accumulated gradient is the gradient
    of the mean over the whole local batch. With `use_no_sync` only the last backward all-reduces,
    provided the forward runs inside the context too (`forward_inside=False` is the classic
    mistake: the forward has already told DDP to synchronise the coming backward).
    """
    for i, (x_micro, y_micro) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        last = i == micro_batches - 1
        context = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        if forward_inside:
            with context:
                loss = nn.functional.mse_loss(ddp(x_micro), y_micro) / micro_batches
                loss.backward()
        else:
            loss = nn.functional.mse_loss(ddp(x_micro), y_micro) / micro_batches
            with context:
                loss.backward()


def no_sync_demo(ctx: DistContext, sizes: list[int], micro_batches: int,
                 micro_batch_size: int) -> dict:
    """Accumulated DDP gradients vs one process on the whole global batch, and the all-reduces."""
    out = {"global_batch": micro_batch_size * micro_batches * ctx.world_size}
    x, y = global_batch(0, out["global_batch"], sizes[0], sizes[-1], ctx.device)
    reference = make_mlp(sizes, seed=0, device=ctx.device)
    nn.functional.mse_loss(reference(x), y).backward()
    cases = {"sync every micro-batch": (False, True), "no_sync, forward inside": (True, True),
             "no_sync, forward outside": (True, False)}
    for name, (use_no_sync, forward_inside) in cases.items():
        model = make_mlp(sizes, seed=0, device=ctx.device)
        ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
        comm = CountingComm()
        count_ddp_comm(ddp, comm)
        accumulate(ddp, local_shard(x, ctx.rank, ctx.world_size),
                   local_shard(y, ctx.rank, ctx.world_size), micro_batches, use_no_sync,
                   forward_inside)
        out[name] = {"collectives": comm.collectives, "bytes": comm.bytes,
                     "max_grad_diff_vs_big_batch":
                         (flat_grads(model) - flat_grads(reference)).abs().max().item()}
    return out


def lr_scaling(batch_sizes: tuple[int, ...] = (8, 64), samples: int = 2048, lr: float = 0.01,
               seed: int = 0) -> list[dict]:
    """Linear regression trained with SGD on the same number of samples at each batch size, at the
    base learning rate and at the rate scaled by the batch ratio (Goyal et al. 2017's linear
    scaling rule, arXiv:1706.02677). One process: the global batch is what matters."""
    with seeded(seed):
        x = torch.randn(samples, 32)
        y = x @ torch.randn(32, 1) + 0.1 * torch.randn(samples, 1)
    rows = []
    for batch in batch_sizes:
        for scaled in (False, True) if batch != batch_sizes[0] else (False,):
            rate = lr * batch / batch_sizes[0] if scaled else lr
            w = torch.zeros(32, 1, requires_grad=True)
            for start in range(0, samples, batch):
                loss = nn.functional.mse_loss(x[start:start + batch] @ w, y[start:start + batch])
                (grad,) = torch.autograd.grad(loss, w)
                with torch.no_grad():
                    w -= rate * grad
            rows.append({"global batch": batch, "lr": rate, "optimizer steps": samples // batch,
                         "final loss": nn.functional.mse_loss(x @ w, y).item()})
    return rows


# --- what every rank holds -------------------------------------------------------------------

def memory_per_rank(ctx: DistContext, sizes: list[int]) -> dict:
    """Bytes of parameters, gradients and Adam state on this rank after one DDP step."""
    model = make_mlp(sizes, seed=0, device=ctx.device)
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x, y = global_batch(0, 8, sizes[0], sizes[-1], ctx.device)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"parameters": nbytes(model.parameters()),
            "gradients": nbytes(p.grad for p in model.parameters()),
            "optimizer state": nbytes(state)}


# --- the whole thing ---------------------------------------------------------------------------

def checkpoint_demo(ctx: DistContext, sizes: list[int], steps: int, folder: Path) -> dict:
    """Train a few steps with DDP, save on rank 0, load on every rank into fresh objects."""
    model = make_mlp(sizes, seed=0, device=ctx.device)
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 8 * ctx.world_size, sizes[0], sizes[-1], ctx.device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(local_shard(x, ctx.rank, ctx.world_size)),
                                      local_shard(y, ctx.rank, ctx.world_size))
        loss.backward()
        opt.step()
        losses.append({"rank_loss": loss.item(),
                       "mean_over_ranks": mean_over_ranks(loss, ctx.world_size)})
    path = folder / "checkpoint.pt"
    save_checkpoint(path, {"step": steps, "model": ddp.module.state_dict(),
                           "optimizer": opt.state_dict()}, ctx.rank)
    state = load_checkpoint(path, ctx.device)
    fresh = make_mlp(sizes, seed=123, device=ctx.device)  # different weights until it loads
    try:  # the classic mistake: the wrapper's keys ("module.0.weight") into a plain model
        fresh.load_state_dict(ddp.state_dict())
        wrapper_load_error = ""
    except RuntimeError as err:
        wrapper_load_error = " ".join(line.strip() for line in str(err).splitlines()[:2])[:240]
    fresh.load_state_dict(state["model"])
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(state["optimizer"])
    momentum = [s["momentum_buffer"] for s in opt.state.values()]
    fresh_momentum = [s["momentum_buffer"] for s in fresh_opt.state.values()]
    return {
        "losses": losses,
        "files_after_save": sorted(p.name for p in folder.iterdir()),
        "ddp_state_dict_keys": list(ddp.state_dict())[:2],
        "module_state_dict_keys": list(ddp.module.state_dict())[:2],
        "wrapper_load_error": wrapper_load_error,
        "loaded_step": state["step"],
        "loaded_device": str(next(iter(state["model"].values())).device),
        "max_param_diff_after_load": (flat_params(fresh) - flat_params(model)).abs().max().item(),
        "max_momentum_diff_after_load": max((a - b).abs().max().item()
                                            for a, b in zip(momentum, fresh_momentum)),
    }


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP of the practicalities (its widths), and the one whose memory per rank is counted."""
    sizes: tuple[int, ...] = (32, 128, 128, 4)
    memory_sizes: tuple[int, ...] = (256, 1024, 1024, 10)
    SMOKE = dict(sizes=(16, 32, 4), memory_sizes=(64, 256, 256, 10))


def run(ctx: DistContext, cfg: Run) -> dict:
    sizes = list(cfg.sizes)
    dataset_size, epochs = 8 * ctx.world_size, 3
    with_epoch = sampler_orders(dataset_size, ctx.world_size, epochs, set_epoch=True)
    without_epoch = sampler_orders(dataset_size, ctx.world_size, epochs, set_epoch=False)
    folder = run_dir("lab03_training")
    try:
        ckpt = checkpoint_demo(ctx, sizes, steps=3, folder=folder)
        ctx.barrier()  # everyone has loaded before rank 0 deletes the folder
    finally:
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    accumulation = no_sync_demo(ctx, sizes, micro_batches=4, micro_batch_size=4)
    result = {
        "sampler": {"dataset_size": dataset_size, "with_set_epoch": with_epoch,
                    "without_set_epoch": without_epoch,
                    "disjoint": [shards_disjoint_and_complete(e, dataset_size) for e in with_epoch],
                    "padding": padding(10, 4),
                    "eval": padded_accuracy([i % 3 != 0 for i in range(10)], 4)},
        "checkpoint": ckpt, "accumulation": accumulation,
        "memory": memory_per_rank(ctx, list(cfg.memory_sizes)),
    }
    ctx.report(**result)
    if ctx.rank == 0:
        for name, orders in (("with set_epoch", with_epoch), ("without set_epoch", without_epoch)):
            print(f"DistributedSampler {name}, rank 0's shard per epoch: "
                  f"{[o[0] for o in orders]}", flush=True)
        print(f"checkpoint: files {ckpt['files_after_save']}, loaded on {ckpt['loaded_device']}, "
              f"max |param diff| after load {ckpt['max_param_diff_after_load']:g}", flush=True)
        print(f"step losses, mean over ranks: {[round(l['mean_over_ranks'], 4) for l in ckpt['losses']]}",
              flush=True)
        table([{"accumulation": k, **v} for k, v in accumulation.items() if isinstance(v, dict)],
              title=f"4 micro-batches per rank vs one process on the global batch of "
                    f"{accumulation['global_batch']}")
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
